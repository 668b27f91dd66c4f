"""Hidden-state capture: features, batching, shard store, manifest identity, resume, reader."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch

from eagle.capture.features import extract_features
from eagle.capture.reader import CaptureDataset, ShardShuffleSampler, check_compatible, collate
from eagle.capture.runner import estimate_bytes, length_sorted_batches, pad_batch
from eagle.capture.store import MANIFEST, read_manifest, shard_file
from eagle.errors import CaptureError
from tests.support.capture import capture, info_for, make_convs
from tests.tiny_models import make_model


@pytest.fixture(scope="module")
def llama():
    model, _ = make_model("llama")
    return model


@pytest.fixture(scope="module")
def splits():
    return {"train": make_convs(11, seed=1), "heldout": make_convs(3, seed=2, prefix="h")}


# --- features -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fam", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_features_match_full_forward_and_are_padding_invariant(fam):
    model, _ = make_model(fam)
    seqs = [c.input_ids for c in make_convs(4, seed=3)]
    aux = [1, 2, 3]
    ids, mask = pad_batch(seqs)
    batched = extract_features(model, ids, mask, aux)
    assert batched["final_hidden"].shape == (4, ids.shape[1], 64)
    assert batched["aux_hidden"].shape == (4, ids.shape[1], 3, 64)
    for row, seq in enumerate(seqs):
        one = torch.tensor([seq])
        ref = model(input_ids=one, output_hidden_states=True, use_cache=False)
        n = len(seq)
        torch.testing.assert_close(batched["final_hidden"][row, :n], ref.hidden_states[-1][0], atol=1e-5, rtol=1e-4)
        want_aux = torch.stack([ref.hidden_states[i][0] for i in aux], 1)  # [T, 3, H]
        torch.testing.assert_close(batched["aux_hidden"][row, :n], want_aux, atol=1e-5, rtol=1e-4)
        # The final state gives the target's own next-token logits through its LM head.
        with torch.no_grad():
            logits = model.get_output_embeddings()(batched["final_hidden"][row, :n])
        torch.testing.assert_close(logits, ref.logits[0], atol=1e-4, rtol=1e-4)


def test_features_eagle1_final_only_and_bad_layers(llama):
    ids, mask = pad_batch([[1, 2, 3]])
    assert set(extract_features(llama, ids, mask, None)) == {"final_hidden"}
    with pytest.raises(CaptureError, match="aux_layer_ids"):
        extract_features(llama, ids, mask, [1, 2, 9])


def test_length_sorted_batches_cover_everything_within_budget():
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 100) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(1, 300)
        batches = length_sorted_batches(lengths, budget)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for b in batches:
            assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= budget


# --- store, round trip ----------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["eagle1", "eagle3"])
def test_round_trip(tmp_path, llama, splits, algorithm):
    manifest = capture(llama, splits, tmp_path, algorithm=algorithm)
    assert manifest["complete"] and manifest["algorithm"] == algorithm
    assert [(e["split"], e["index"]) for e in manifest["shards"]] == [
        ("train", 0),
        ("train", 1),
        ("train", 2),
        ("heldout", 0),
    ]
    assert manifest["aux_layer_ids"] == ([1, 2, 3] if algorithm == "eagle3" else None)
    total = sum(len(c.input_ids) for s in splits.values() for c in s)
    assert manifest["totals"]["tokens"] == total
    # bytes/token ~ rows x hidden x 2 (fp16) + ids + mask, plus headers
    rows = 4 if algorithm == "eagle3" else 1
    assert estimate_bytes(total, algorithm, 64, "float16") == total * (rows * 64 * 2 + 5)
    assert total * (rows * 128 + 5) < manifest["totals"]["bytes"] < total * (rows * 128 + 5) + 4 * 4096
    for split, convs in splits.items():
        ds = CaptureDataset(tmp_path, split=split)
        assert len(ds) == len(convs)
        assert ds.ids() == [c.id for c in convs]  # from the shard indexes, in item order
        # Reference: one padded batch in data order (padding invariance is tested above).
        ref = extract_features(
            llama, *pad_batch([c.input_ids for c in convs]), [1, 2, 3] if algorithm == "eagle3" else None
        )
        for i, conv in enumerate(convs):
            item = ds[i]
            n = len(conv.input_ids)
            assert item["id"] == conv.id
            assert item["input_ids"].tolist() == conv.input_ids
            assert item["loss_mask"].tolist() == [bool(m) for m in conv.loss_mask]
            assert item["final_hidden"].dtype == torch.bfloat16  # capture.dtype's default
            # bfloat16 keeps 8 mantissa bits: one rounding step is 2^-8 of the value, so a batched forward's
            # float32 differences may move an element by a step.
            bf16 = torch.bfloat16
            torch.testing.assert_close(item["final_hidden"], ref["final_hidden"][i, :n].to(bf16), atol=1e-2, rtol=8e-3)
            if algorithm == "eagle3":
                torch.testing.assert_close(item["aux_hidden"], ref["aux_hidden"][i, :n].to(bf16), atol=1e-2, rtol=8e-3)
            else:
                assert "aux_hidden" not in item
    batch = collate([ds[0], ds[1]], pad_id=7)
    n0, n1 = len(splits["heldout"][0].input_ids), len(splits["heldout"][1].input_ids)
    width = max(n0, n1)
    assert batch["input_ids"].shape == (2, width) and batch["attention_mask"].dtype == torch.bool
    assert batch["attention_mask"].sum(1).tolist() == [n0, n1]
    assert batch["final_hidden"].shape == (2, width, 64)
    short = 0 if n0 < n1 else 1
    assert (batch["input_ids"][short, min(n0, n1) :] == 7).all()
    assert not batch["loss_mask"][short, min(n0, n1) :].any()


def test_rerun_is_noop_and_resume_fills_missing_shards(tmp_path, llama, splits):
    full = capture(llama, splits, tmp_path / "full")
    part = tmp_path / "part"
    capture(llama, splits, part)
    # Simulate a kill after shard 1 of train: drop later shards from the manifest (one stays on disk
    # without an entry, one is gone) and leave a half-written temporary file behind.
    m = json.loads((part / MANIFEST).read_text())
    m["shards"] = m["shards"][:2]
    m["complete"] = False
    (part / MANIFEST).write_text(json.dumps(m))
    (part / shard_file("heldout", 0)).unlink()
    (part / "train" / ".shard-00002.safetensors.abc.tmp").write_bytes(b"half a shard")
    with pytest.raises(CaptureError, match="incomplete"):
        CaptureDataset(part)
    resumed = capture(llama, splits, part)
    assert [e["sha256"] for e in resumed["shards"]] == [e["sha256"] for e in full["shards"]]
    assert not list(part.glob("**/*.tmp"))
    before = {p: p.stat().st_mtime_ns for p in part.glob("*/*.safetensors")}
    capture(llama, splits, part)  # nothing to do
    assert {p: p.stat().st_mtime_ns for p in part.glob("*/*.safetensors")} == before


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(fingerprint="other-target"), "target.fingerprint"),
        (dict(data={"fingerprint": "data-1", "config": {}}), "data.fingerprint"),
        (dict(aux=[0, 1, 2]), "aux_layer_ids"),
        (dict(algorithm="eagle1"), "algorithm"),
        (dict(shard_size=5), "shard_size"),
        (dict(dtype="float16"), "dtype"),
    ],
)
def test_other_capture_in_same_dir_is_refused(tmp_path, llama, change, field):
    small = {"train": make_convs(3), "heldout": []}
    capture(llama, small, tmp_path)
    before = (tmp_path / MANIFEST).read_text()
    with pytest.raises(CaptureError, match=field.replace(".", r"\.")) as e:
        capture(llama, small, tmp_path, **change)
    assert "output_dir" in str(e.value)
    assert (tmp_path / MANIFEST).read_text() == before


def test_corrupt_truncated_and_escaping_shards_are_refused(tmp_path, llama):
    capture(llama, {"train": make_convs(6), "heldout": []}, tmp_path, shard_size=3)
    path = tmp_path / shard_file("train", 1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    path.write_bytes(bytes(data))
    ds = CaptureDataset(tmp_path)  # size check passes; sha256 is checked on first use
    ds[0]
    with pytest.raises(CaptureError, match="sha256"):
        ds[3]
    path.write_bytes(bytes(data[:-10]))
    with pytest.raises(CaptureError, match="bytes"):
        CaptureDataset(tmp_path)
    m = json.loads((tmp_path / MANIFEST).read_text())
    for bad in ("../outside.safetensors", "/etc/passwd", "train/../../x.safetensors"):
        m["shards"][0]["file"] = bad
        (tmp_path / MANIFEST).write_text(json.dumps(m))
        with pytest.raises(CaptureError, match="inside the capture folder"):
            read_manifest(tmp_path)


def test_free_space_is_checked_before_writing(tmp_path, llama):
    with pytest.raises(CaptureError, match="free"):
        capture(llama, {"train": make_convs(3), "heldout": []}, tmp_path, free_space_margin=1e15)
    assert not list(tmp_path.iterdir())  # refused before writing anything


def test_check_compatible(tmp_path, llama):
    manifest = capture(llama, {"train": make_convs(3), "heldout": []}, tmp_path)
    info = info_for(llama)
    check_compatible(manifest, info, "eagle3", None)  # default layers for 4 layers: [1, 2, 3]
    check_compatible(manifest, info, "eagle1")  # EAGLE-1 uses the final state every capture has
    with pytest.raises(CaptureError, match="aux_layer_ids"):
        check_compatible(manifest, info, "eagle3", [0, 1, 2])
    with pytest.raises(CaptureError, match="fingerprint"):
        check_compatible(manifest, replace(info, fingerprint="x"), "eagle1")
    eagle1 = capture(llama, {"train": make_convs(3), "heldout": []}, tmp_path / "e1", algorithm="eagle1")
    with pytest.raises(CaptureError, match="EAGLE-3"):
        check_compatible(eagle1, info, "eagle3")


# --- sampler --------------------------------------------------------------------------------------


def test_sampler_is_deterministic_and_shard_local():
    sizes = [4, 4, 3, 1]
    s = ShardShuffleSampler(sizes, seed=5)
    first = list(s)
    assert sorted(first) == list(range(12)) and list(ShardShuffleSampler(sizes, seed=5)) == first
    s.set_epoch(1)
    assert list(s) != first and sorted(s) == list(range(12))
    starts = [0, 4, 8, 11, 12]
    shard_of = [next(k for k in range(4) if starts[k] <= i < starts[k + 1]) for i in first]
    # contiguous runs: each shard's items come together
    runs = [shard_of[0]] + [b for a, b in zip(shard_of, shard_of[1:], strict=False) if a != b]
    assert sorted(runs) == [0, 1, 2, 3]
    ranks = [list(ShardShuffleSampler(sizes, seed=5, rank=r, world_size=5)) for r in range(5)]
    assert all(len(r) == 3 for r in ranks) and set().union(*map(set, ranks)) == set(range(12))
    assert list(ShardShuffleSampler(sizes, shuffle=False)) == list(range(12))
