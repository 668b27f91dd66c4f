"""Trainer tests on tiny random targets: maths, overfitting, batches, resume, faults, tracking, CLI.

Every training run here is a few steps on ~20 short conversations (seconds on 2 CPU cores).
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch

from eagle.cli.app import compose
from eagle.errors import CaptureError, CheckpointError
from eagle.train.batches import warn_cut_sequences
from eagle.train.metrics import MetricSums, simulated_tau
from eagle.train.schedule import lr_factor
from tests.support.train import (
    SGD_STEP,
    Workspace,
    assert_same_optimizer_state,
    assert_same_update,
    assert_same_weights,
    base_overrides,
    final_head,
    head_weights,
    train_overrides,
)
from tests.tiny_models import _CORPUS, FAMILIES, make_model, save_model

# Tiny models are latency-bound: one torch thread (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ws3 (tiny Llama, EAGLE-3 capture) is shared with other modules: tests/conftest.py.
@pytest.fixture(scope="module")
def ws1(tmp_path_factory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("ws1"), "qwen2", "eagle1")


# --------------------------------------------------------------------------------------- maths
def test_lr_factor_warmup_and_decay_shapes():
    # Warmup: linear from 1/W to 1.
    assert lr_factor(0, 4, 100, "cosine", 0.1) == pytest.approx(0.25)
    assert lr_factor(3, 4, 100, "cosine", 0.1) == pytest.approx(1.0)
    # Cosine: 1 right after warmup, (1 + min)/2 half-way, min at the end and beyond.
    assert lr_factor(4, 4, 104, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(54, 4, 104, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_factor(104, 4, 104, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(500, 4, 104, "cosine", 0.1) == pytest.approx(0.1)
    # Linear: straight line to min.
    assert lr_factor(54, 4, 104, "linear", 0.2) == pytest.approx(0.6)
    assert lr_factor(104, 4, 104, "linear", 0.2) == pytest.approx(0.2)
    assert lr_factor(60, 4, 104, "constant", 0.2) == 1.0
    assert lr_factor(0, 0, 10, "constant", 0.2) == 1.0
    # A time budget (train.schedule_over=minutes): the decay follows the share spent, not the step;
    # warm-up still counts steps.
    assert lr_factor(2, 4, 104, "cosine", 0.1, progress=0.9) == pytest.approx(0.75)
    assert lr_factor(7, 4, 104, "cosine", 0.1, progress=0.5) == pytest.approx(0.55)
    assert lr_factor(7, 4, 104, "cosine", 0.1, progress=1.3) == pytest.approx(0.1)
    assert lr_factor(7, 4, 104, "linear", 0.2, progress=0.25) == pytest.approx(0.8)


def test_simulated_tau_is_chain_acceptance():
    assert simulated_tau([]) == 1.0
    assert simulated_tau([1.0, 1.0, 1.0]) == 4.0
    assert simulated_tau([0.0, 1.0]) == 1.0
    assert simulated_tau([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert simulated_tau([0.8, 0.5, 0.25]) == pytest.approx(1 + 0.8 + 0.4 + 0.1)


def test_metric_sums_are_token_weighted():
    s = MetricSums()
    s.add([2.0, 3.0], [1, 0], [2, 1], {"coverage": 2.0}, tokens=10)
    s.add([4.0, 3.0], [3, 1], [2, 3], {"coverage": 1.0}, tokens=6)
    out = s.summary([1.0, 0.5])
    assert out["loss_0"] == pytest.approx(6 / 4) and out["loss_1"] == pytest.approx(6 / 4)
    assert out["acc_0"] == pytest.approx(1.0) and out["acc_1"] == pytest.approx(0.25)
    assert out["loss"] == pytest.approx(1.5 + 0.75)
    assert out["coverage"] == pytest.approx(3 / 4)
    assert out["tau_sim"] == pytest.approx(1 + 1 + 0.25)
    assert s.tokens == 16


# --------------------------------------------------------------------------------------- overfit


def _soft_ce_floor(batch, lm_head, steps, decay, token_weight, algorithm, pad_id) -> float:
    """The objective of a perfect head: the target distributions' entropies (CE = H + KL, KL >= 0)."""
    from eagle.algorithms.base import aligned_inputs, step_masks
    from eagle.algorithms.losses import shift_left

    a = aligned_inputs(batch, pad_id)
    with torch.no_grad():
        logp = torch.log_softmax(lm_head(shift_left(batch["final_hidden"], 1)).float(), -1)  # [B, T, V]
        ent = -(logp.exp() * logp).sum(-1)  # [B, T]
    floor = 0.0
    for i, m in enumerate(step_masks(a["loss_mask"], a["valid"], steps)):
        h = float((shift_left(ent, i) * m).sum() / m.sum().clamp(min=1))
        floor += (token_weight if algorithm == "eagle1" else decay**i) * h
    return floor


@pytest.mark.parametrize("algorithm", ["eagle1", "eagle3"])
@pytest.mark.parametrize("fam", FAMILIES)
def test_loss_falls_on_a_fixed_batch(fam, algorithm):
    """Overfit one batch for 60 AdamW steps: the loss above its floor (the target's entropy) must
    halve, and the head's top-1 must agree with the target's on most positions."""
    from eagle.algorithms import LossSettings, get_algorithm
    from eagle.algorithms.head_io import build_head, head_config_from_target
    from eagle.capture.features import extract_features
    from eagle.config import DraftConfig

    model, tok = make_model(fam)
    texts = [_CORPUS[1], _CORPUS[3] + _CORPUS[0]]
    rows = [tok(t)["input_ids"][:40] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.full((2, width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros((2, width), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)], attn[i, : len(r)] = torch.tensor(r), True
    head_cfg = head_config_from_target(
        model.config, DraftConfig(algorithm=algorithm, draft_vocab_size=None, aux_layer_ids=None)
    )
    torch.manual_seed(0)
    head = build_head(head_cfg, target_model=model)
    feats = extract_features(model, ids, attn.long(), head_cfg.aux_layer_ids or None)
    batch = {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": attn.clone(),
        **{k: v.clone() for k, v in feats.items()},
    }
    lm_head = model.get_output_embeddings()
    steps = 1 if algorithm == "eagle1" else 3
    floor = _soft_ce_floor(batch, lm_head, steps, 0.8, 0.1, algorithm, tok.pad_token_id)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    settings = LossSettings(
        steps=steps, decay=0.8, feature_weight=1.0, token_weight=0.1, noise_std=0.0, pad_id=tok.pad_token_id
    )
    losses, accs = [], []
    for _ in range(60):
        parts = get_algorithm(algorithm).forward_loss(head, lm_head, batch, settings, norms=None)
        opt.zero_grad()
        parts.objective.backward()
        opt.step()
        losses.append(float(parts.objective.detach()))
        accs.append(parts.step_correct[0] / parts.step_tokens[0])
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] > floor and losses[-1] > floor - 1e-4  # sanity of the floor itself
    assert losses[-1] - floor < 0.5 * (losses[0] - floor), (floor, losses[::10])
    assert accs[-1] >= 0.5 and accs[-1] > accs[0] + 0.3, accs[::10]


# --------------------------------------------------------------------------------------- batches
def test_offline_and_online_batches_are_the_same(ws3, tmp_path):
    from eagle.data.dataset import build_splits
    from eagle.target.loading import load_target
    from eagle.train.batches import BatchStream, OfflineSplit, OnlineSplit

    cfg = ws3.cfg(tmp_path / "x")
    target, tok, info = load_target(cfg.target)
    splits = build_splits(cfg.data, tok, progress=False)
    aux = [1, 2, 3]  # default_aux_layer_ids for the 4-layer tiny target
    offline = BatchStream(OfflineSplit(ws3.capture, "train", seed=0), 0, 4, 2, 48, tok.pad_token_id)
    online = BatchStream(OnlineSplit(splits.train, cfg.capture.shard_size, target, aux), 0, 4, 2, 48, tok.pad_token_id)
    for _ in range(7):  # crosses an epoch boundary (18 items / 4 per step)
        mo, io = offline.next_step()
        mn, in_ = online.next_step()
        assert io == in_ and len(mo) == len(mn) == 2
        for bo, bn in zip(mo, mn, strict=True):
            bo = offline.data.featurize(bo, torch.device("cpu"))
            bn = online.data.featurize(bn, torch.device("cpu"))
            for k in ("input_ids", "loss_mask", "attention_mask"):
                assert torch.equal(bo[k], bn[k]), k
            m = bo["attention_mask"]
            for k in ("final_hidden", "aux_hidden"):
                torch.testing.assert_close(bo[k][m], bn[k][m], atol=1e-5, rtol=1e-4)
    assert offline.position == online.position
    counts_off = OfflineSplit(ws3.capture, "train").token_counts(info.vocab_size)
    counts_on = OnlineSplit(splits.train, 4, target, aux).token_counts(info.vocab_size)
    assert torch.equal(counts_off, counts_on) and counts_off.sum() > 0


def test_batch_stream_resumes_from_a_position(ws3):
    from eagle.train.batches import BatchStream, DataPosition, OfflineSplit

    split = OfflineSplit(ws3.capture, "train", seed=3)
    full = BatchStream(split, 3, 4, 1, 64, 0)
    seq = [full.next_indices() for _ in range(9)]
    again = BatchStream(split, 3, 4, 1, 64, 0, position=DataPosition(0, 0))
    for _ in range(4):
        again.next_indices()
    resumed = BatchStream(split, 3, 4, 1, 64, 0, position=again.position)
    assert [resumed.next_indices() for _ in range(5)] == seq[4:]
    # Every epoch is a permutation: no item repeats within an epoch.
    per_epoch = len(split) // 4
    first = [i for s in seq[:per_epoch] for i in s]
    assert len(set(first)) == len(first)
    assert seq[:per_epoch] != seq[per_epoch : 2 * per_epoch]


def test_group_by_length_keeps_the_epoch_and_cuts_padding():
    from eagle.train.batches import GROUP_WINDOW_BATCHES, group_by_length

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 700, (1000,), generator=g).tolist()
    order = torch.randperm(1000, generator=g).tolist()
    grouped = group_by_length(order, lengths, 4, 512, torch.Generator().manual_seed(1))
    assert sorted(grouped) == list(range(1000))  # the same items, each once
    window = GROUP_WINDOW_BATCHES * 4
    for lo in range(0, 1000, window):  # nobody leaves its window of the shuffled order
        assert sorted(grouped[lo : lo + window]) == sorted(order[lo : lo + window])

    def padding(o: list[int]) -> float:
        batches = [[min(lengths[i], 512) for i in o[j : j + 4]] for j in range(0, 1000, 4)]
        return 1 - sum(map(sum, batches)) / sum(4 * max(b) for b in batches)

    assert padding(order) > 0.2 and padding(grouped) < 0.03
    # Batches of a window are shuffled: lengths do not just rise through the window.
    firsts = [min(lengths[grouped[j]], 512) for j in range(0, window, 4)]
    assert firsts != sorted(firsts)


def test_grouped_stream_is_deterministic_and_resumes(ws3):
    from eagle.train.batches import BatchStream, DataPosition, OfflineSplit

    split = OfflineSplit(ws3.capture, "train", seed=3)
    full = BatchStream(split, 3, 4, 1, 64, 0, group_lengths=True)
    seq = [full.next_indices() for _ in range(9)]
    twin = BatchStream(split, 3, 4, 1, 64, 0, group_lengths=True)
    assert [twin.next_indices() for _ in range(9)] == seq
    part = BatchStream(split, 3, 4, 1, 64, 0, group_lengths=True)
    for _ in range(4):
        part.next_indices()
    resumed = BatchStream(split, 3, 4, 1, 64, 0, position=DataPosition(**vars(part.position)), group_lengths=True)
    assert [resumed.next_indices() for _ in range(5)] == seq[4:]
    per_epoch = len(split) // 4
    first = [i for s in seq[:per_epoch] for i in s]
    assert len(set(first)) == len(first)


def test_micro_slices_partition_the_global_batch():
    from eagle.config import ConfigError
    from eagle.train.batches import micro_slices

    covered = sorted(i for r in range(2) for s in micro_slices(8, 2, 2, r) for i in range(8)[s])
    assert covered == list(range(8))
    with pytest.raises(ConfigError, match="divisible"):
        micro_slices(6, 2, 2, 0)


# --------------------------------------------------------------------------------------- training runs
def test_offline_training_writes_a_loadable_best_head(ws3, tmp_path):
    from eagle.algorithms.head_io import load_head, read_head_extra
    from eagle.artifacts import resolve_draft_path as resolve_head_dir
    from eagle.target.loading import load_target
    from eagle.train.trainer import format_result, train

    out = tmp_path / "out"
    result = train(ws3.cfg(out, steps=6))
    assert result.stopped == "max_steps" and result.step == 6
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step-{s:07d}" for s in (2, 4, 6)]
    assert (out / "latest").read_text().strip() == "checkpoints/step-0000006"
    m = result.eval_metrics
    assert m["tau_sim"] == pytest.approx(simulated_tau([m[f"acc_{i}"] for i in range(3)])) and "acc_3" not in m
    assert m["loss"] < result.initial_eval_metrics["loss"]  # 6 steps at lr 3e-3 already learn something
    assert result.best_metric == max(
        r["tau_sim"] for r in map(json.loads, (out / "metrics.jsonl").open()) if r["split"] == "eval"
    )
    target, _, _ = load_target(ws3.cfg(out).target)
    head = load_head(resolve_head_dir(out), target_model=target, algorithm="eagle3")
    assert head.config.draft_vocab_size == 128 and int(head.t2d.sum()) == 128
    assert read_head_extra(out / "best")["step"] == result.best_step
    text = format_result(result)
    assert "acc@0=" in text and "tau_sim=" in text
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if x["split"] == "train"]
    assert [x["step"] for x in train_lines] == list(range(1, 7))
    assert {"loss", "loss_0", "loss_2", "acc_0", "acc_2", "lr", "tokens_per_s"} <= train_lines[0].keys()


def _bf16_native() -> bool:
    from eagle.target.precision import native_dtype_support

    return native_dtype_support("bfloat16", "cpu")[0]


BF16_GROUPED = {"train__mixed_precision": "bf16", "train__group_by_length": True}
needs_bf16 = pytest.mark.skipif(not _bf16_native(), reason="this CPU has no native bf16")


@pytest.mark.parametrize(
    "which, online, extra",
    [
        ("ws1", False, {"draft__feature_noise_std": 0.2}),
        ("ws3", False, {}),
        # The CPU recipe's settings: bf16 autocast and length-grouped batches, offline and online.
        pytest.param("ws3", False, BF16_GROUPED, marks=needs_bf16, id="ws3-bf16-grouped"),
        pytest.param("ws3", True, BF16_GROUPED, marks=needs_bf16, id="ws3-bf16-grouped-online"),
    ],
)
def test_interrupt_and_resume_is_bit_exact(which, online, extra, request, tmp_path):
    """Run 7 steps straight vs crash after step 5 (last checkpoint at 4), resume: same weights."""
    from eagle.train.trainer import TrainHooks, train

    ws = request.getfixturevalue(which)
    extra = {**extra, "online": online}
    straight = train(ws.cfg(tmp_path / "a", steps=7, **extra))

    def crash(step: int) -> None:
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(ws.cfg(tmp_path / "b", steps=7, **extra), TrainHooks(on_step_end=crash))
    resumed = train(ws.cfg(tmp_path / "b", steps=7, **extra))
    assert resumed.step == straight.step == 7
    # metrics.jsonl holds every step once: lines of the redone step 5 were dropped on resume.
    logged = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in logged if x["split"] == "train"] == list(range(1, 8))
    assert_same_weights(final_head(tmp_path / "a", 7), final_head(tmp_path / "b", 7))
    # Optimizer state too: Adam moments are part of "the same run".
    assert_same_optimizer_state(tmp_path / "a", tmp_path / "b", 7)


def test_grad_accum_matches_one_big_batch(ws3, tmp_path):
    """batch 4 as 2 micro-batches of 2 gives the gradient of one batch of 4 (global token mean)."""
    from eagle.train.trainer import train

    train(ws3.cfg(tmp_path / "a", steps=1, **SGD_STEP))
    train(ws3.cfg(tmp_path / "b", steps=1, train__grad_accum=2, **SGD_STEP))
    assert_same_update(head_weights(final_head(tmp_path / "a", 1)), head_weights(final_head(tmp_path / "b", 1)))


def test_grad_accum_check_catches_local_normalisation(ws3, tmp_path, monkeypatch):
    """The comparison above fails on the classic bug: each micro-batch normalised by its own tokens."""
    from eagle.train import trainer

    train = trainer.train
    train(ws3.cfg(tmp_path / "a", steps=1, **SGD_STEP))
    forward = trainer.TrainStep.forward
    monkeypatch.setattr(trainer.TrainStep, "forward", lambda self, batch, norms: forward(self, batch, None))
    train(ws3.cfg(tmp_path / "b", steps=1, train__grad_accum=2, **SGD_STEP))
    with pytest.raises(AssertionError):
        assert_same_update(head_weights(final_head(tmp_path / "a", 1)), head_weights(final_head(tmp_path / "b", 1)))


def test_bf16_mixed_precision_trains(ws3, tmp_path, bf16_anywhere):
    from eagle.train.trainer import train

    result = train(ws3.cfg(tmp_path / "o", steps=2, train__mixed_precision="bf16", train__eval_every=2))
    assert result.step == 2 and not result.skipped_steps
    assert math.isfinite(result.train_metrics["loss"]) and math.isfinite(result.eval_metrics["loss"])
    assert result.eval_metrics["loss"] != result.initial_eval_metrics["loss"]  # the head moved


def test_bf16_and_fp32_training_reach_the_same_loss(ws3, tmp_path, bf16_anywhere):
    """bf16 autocast changes rounding, not what is learnt: after 8 steps on the tiny model the held-out
    loss is within 1% of float32's (measured: 0.01%) and both improve on the untrained head."""
    from eagle.train.trainer import train

    runs = {
        mp: train(ws3.cfg(tmp_path / mp, steps=8, train__mixed_precision=mp, train__eval_every=8, train__lr=3e-3))
        for mp in ("no", "bf16")
    }
    fp32, bf16 = runs["no"].eval_metrics["loss"], runs["bf16"].eval_metrics["loss"]
    assert abs(bf16 - fp32) <= 0.01 * fp32
    for r in runs.values():
        assert r.eval_metrics["loss"] < r.initial_eval_metrics["loss"]
    assert fp32 != bf16  # bf16 really ran (autocast on): the two differ in rounding


@pytest.mark.parametrize("capture_dtype", ["float16", "bfloat16"])
def test_bf16_mixed_precision_trains_on_half_precision_captures(ws3, tmp_path, bf16_anywhere, capture_dtype):
    """float16 features inside CPU bf16 autocast used to crash (`at::autocast::prioritize`)."""
    from eagle.capture.runner import run_capture
    from eagle.train.trainer import train

    base = [o for o in ws3.base if not o.startswith("capture.dtype=")] + [f"capture.dtype={capture_dtype}"]
    run_capture(compose(base + [f"output_dir={tmp_path / 'cap'}"]))
    result = train(
        compose(
            base
            + train_overrides(tmp_path / "o", tmp_path / "cap", steps=2)
            + ["train.mixed_precision=bf16", "train.eval_every=2"]
        )
    )
    assert result.step == 2 and not result.skipped_steps
    assert math.isfinite(result.eval_metrics["loss"])


def test_sigterm_finishes_the_step_saves_and_resumes(ws3, tmp_path):
    from eagle.train.trainer import TrainHooks, train

    def term(step: int) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    stopped = train(ws3.cfg(tmp_path / "b", steps=6), TrainHooks(on_step_end=term))
    assert signal.getsignal(signal.SIGTERM) is previous  # handler restored
    # The signal arrived after step 3's hook: step 4 is finished, saved, and the run stops.
    assert stopped.stopped == "signal" and stopped.step == 4
    assert stopped.last_checkpoint.name == "step-0000004"
    resumed = train(ws3.cfg(tmp_path / "b", steps=6))
    train(ws3.cfg(tmp_path / "a", steps=6))
    assert resumed.stopped == "max_steps"
    assert_same_weights(final_head(tmp_path / "a", 6), final_head(tmp_path / "b", 6))


def _inject_nan(monkeypatch, conversation_id: str) -> None:
    from eagle.train import batches

    original = batches.OfflineSplit.item

    def item(self, index):
        it = original(self, index)
        if it["id"] == conversation_id and self.split == "train":
            it = dict(it)
            it["aux_hidden"] = torch.full_like(it["aux_hidden"], float("nan"))
        return it

    monkeypatch.setattr(batches.OfflineSplit, "item", item)


def _ids_of_step(ws: Workspace, step: int) -> list[str]:
    from eagle.train.batches import BatchStream, OfflineSplit

    split = OfflineSplit(ws.capture, "train", seed=0)
    stream = BatchStream(split, 0, 4, 1, 64, 0)
    for _ in range(step - 1):
        stream.next_indices()
    return [split.item(i)["id"] for i in stream.next_indices()]


def test_nonfinite_skip_logs_and_skips_the_step(ws3, tmp_path, monkeypatch, capsys):
    from eagle.train.trainer import train

    bad = _ids_of_step(ws3, 3)[0]
    _inject_nan(monkeypatch, bad)
    result = train(ws3.cfg(tmp_path / "o", steps=4, train__nonfinite="skip"))
    assert result.skipped_steps == [3] and result.step == 4
    captured = capsys.readouterr()
    assert "non-finite loss or gradient at step 3" in captured.out + captured.err
    assert bad in captured.out + captured.err
    for folder in (final_head(tmp_path / "o", 4), tmp_path / "o" / "best"):
        assert all(torch.isfinite(v).all() for v in head_weights(folder).values() if v.is_floating_point())
    state = json.loads((tmp_path / "o" / "checkpoints" / "step-0000004" / "state.json").read_text())
    assert state["skipped_steps"] == [3]


def test_nonfinite_stop_saves_last_good_state(ws3, tmp_path, monkeypatch):
    from eagle.train.trainer import train

    _inject_nan(monkeypatch, _ids_of_step(ws3, 3)[0])
    result = train(ws3.cfg(tmp_path / "o", steps=6, train__nonfinite="stop", train__save_every=100))
    assert result.stopped == "nonfinite" and result.step == 2
    assert result.last_checkpoint.name == "step-0000002"
    state = json.loads((result.last_checkpoint / "state.json").read_text())
    assert (state["epoch"], state["index"]) == (0, 8)  # resuming retries the bad batch
    monkeypatch.undo()
    train(ws3.cfg(tmp_path / "clean", steps=2))
    assert_same_weights(result.last_checkpoint / "head", final_head(tmp_path / "clean", 2))


# --------------------------------------------------------------------------------------- refusals
def test_refuses_capture_of_another_target(ws3, tmp_path):
    from eagle.train.trainer import train

    other = save_model("llama", tmp_path / "other-target", seed=1)
    cfg = compose(base_overrides(other, ws3.conversations, "eagle3") + train_overrides(tmp_path / "o", ws3.capture))
    with pytest.raises(CaptureError, match="fingerprint"):
        train(cfg)


def test_refuses_capture_with_other_layers(ws3, tmp_path):
    from eagle.train.trainer import train

    with pytest.raises(CaptureError, match="aux layers"):
        train(ws3.cfg(tmp_path / "o", draft__aux_layer_ids="[0,1,2]"))


def test_refuses_checkpoint_of_another_algorithm(ws3, tmp_path):
    from eagle.train.trainer import train

    out = tmp_path / "o"
    train(ws3.cfg(out, steps=2))
    cfg = compose(ws3.base + train_overrides(out, ws3.capture, steps=4) + ["draft.algorithm=eagle1"])
    with pytest.raises(CheckpointError, match="eagle3"):
        train(cfg)
    with pytest.raises(CheckpointError, match="resume=false"):
        train(ws3.cfg(out, steps=4, train__resume="false"))


# --------------------------------------------------------------------------------------- online + wandb
def test_online_training_matches_offline(ws3, tmp_path):
    """Same data and seed: the online run (target in the loop) trains the same head as offline."""
    from eagle.train.trainer import train

    off = train(ws3.cfg(tmp_path / "off", steps=1, **SGD_STEP))
    on = train(ws3.cfg(tmp_path / "on", online=True, steps=1, **SGD_STEP))
    assert_same_update(head_weights(final_head(tmp_path / "off", 1)), head_weights(final_head(tmp_path / "on", 1)))
    assert on.eval_metrics["acc_0"] == pytest.approx(off.eval_metrics["acc_0"], abs=1e-6)


@pytest.mark.slow  # wandb starts its service process
def test_wandb_offline_run_holds_the_metrics(ws3, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from eagle.train.trainer import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "o"
    train(ws3.cfg(out, steps=3, logger__name="wandb", logger__project="eagle-test", logger__run_name="tiny"))
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    records = _read_wandb_history(next(runs[0].glob("*.wandb")))
    steps = {int(r["_step"]) for r in records if "train/loss" in r}
    assert steps == {1, 2, 3}
    assert any("eval/tau_sim" in r for r in records)
    assert (out / "wandb_run_id").read_text().strip() in runs[0].name


def _wandb_log_records(path: Path) -> list[bytes]:
    """Raw records of a `.wandb` transaction log: a 7-byte file header (":W&B", magic, version),
    then LevelDB-log style 32 KiB blocks of records [crc32 u32][length u16][type u8][payload],
    type 1 = full, 2/3/4 = first/middle/last piece of a record spanning blocks."""
    import struct

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    block, pos, pieces, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer too small for a header: zero padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            break
        if kind == 1:
            out.append(payload)
        elif kind == 2:
            pieces = payload
        elif kind == 3:
            pieces += payload
        elif kind == 4:
            out.append(pieces + payload)
    return out


def _read_wandb_history(path: Path) -> list[dict]:
    """History rows (metric name -> value) from a wandb run's local transaction log."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for raw in _wandb_log_records(path):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            )
    return rows


def test_publish_dir_swaps_folders_under_the_name_resolution_knows(tmp_path):
    """save_best's swap leaves `.best.old` if killed between its renames; draft.path resolution looks there."""
    from eagle.artifacts import BEST, BEST_OLD
    from eagle.fileio import atomic_dir

    best = tmp_path / BEST
    with atomic_dir(best) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError), atomic_dir(best) as tmp:
        (tmp / "a").write_text("2")
        raise RuntimeError("killed while writing")
    assert (best / "a").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == [BEST]
    with atomic_dir(best) as tmp:
        (tmp / "a").write_text("3")
        (tmp_path / BEST_OLD).mkdir()  # a leftover of an earlier kill is cleared
    assert (best / "a").read_text() == "3" and sorted(p.name for p in tmp_path.iterdir()) == [BEST]


def test_max_minutes_stops_saves_and_the_same_command_continues(ws3, tmp_path, monkeypatch):
    """A time budget ends the run like max_steps (eval, checkpoint, best/); re-running continues it."""
    from eagle.train import trainer

    clock = iter(range(0, 10_000, 30))  # every perf_counter() call advances 30 s
    monkeypatch.setattr(trainer.time, "perf_counter", lambda: float(next(clock)))
    out = tmp_path / "o"
    first = trainer.train(ws3.cfg(out, steps=50, train__max_minutes=1.0, train__eval_every=1000))
    assert first.stopped == "max_minutes" and 0 < first.step < 50
    assert first.last_checkpoint is not None and first.last_checkpoint.name == f"step-{first.step:07d}"
    assert first.eval_metrics and first.best_dir is not None  # evaluated at the stop, as at max_steps
    monkeypatch.undo()
    rest = trainer.train(ws3.cfg(out, steps=first.step + 2, train__max_minutes=60.0, train__eval_every=1000))
    assert rest.stopped == "max_steps" and rest.step == first.step + 2


def test_schedule_over_minutes_decays_by_the_clock_and_resumes_it(ws3, tmp_path, monkeypatch):
    """train.schedule_over=minutes: the lr reaches min_lr_ratio when max_minutes runs out, however few
    steps fit (a step schedule over max_steps=1000 would have barely moved); the checkpoint keeps the
    clock, so a resumed run with a larger budget continues the decay instead of starting it again."""
    from eagle.train import trainer
    from eagle.train.schedule import lr_factor

    clock = iter(range(0, 100_000, 30))  # every perf_counter() call advances 30 s
    monkeypatch.setattr(trainer.time, "perf_counter", lambda: float(next(clock)))
    seen: list[tuple[float, float]] = []  # (share of the budget spent, lr of the next update)
    hooks = trainer.TrainHooks(
        on_step_end=lambda step: seen.append((run.budget_spent(), run.scheduler.get_last_lr()[0]))
    )
    out = tmp_path / "o"
    extra = {
        "train__schedule_over": "minutes",
        "train__warmup_steps": 0,
        "train__eval_every": 1000,
        "train__lr": 1e-3,
        "train__min_lr_ratio": 0.1,
    }
    run = trainer.TrainRecipe(ws3.cfg(out, steps=1000, train__max_minutes=30.0, **extra), hooks)
    first = run.train()
    assert first.stopped == "max_minutes" and 2 < first.step < 100
    lrs = [lr for _, lr in seen]
    assert lrs == sorted(lrs, reverse=True) and lrs[0] > 0.9e-3
    assert lrs[-1] < 1e-3 * lr_factor(first.step, 0, 1000, "cosine", 0.1) - 1e-4  # far below the step schedule
    assert lrs[-1] == pytest.approx(1e-3 * lr_factor(0, 0, 1, "cosine", 0.1, progress=seen[-1][0]), rel=0.2)
    saved = json.loads((first.last_checkpoint / "state.json").read_text())
    assert saved["wall_seconds"] >= 0.9 * 30 * 60

    seen.clear()
    run = trainer.TrainRecipe(ws3.cfg(out, steps=1000, train__max_minutes=60.0, **extra), hooks)
    rest = run.train()
    assert rest.stopped == "max_minutes" and rest.step > first.step
    assert seen[0][0] > 0.45 and seen[0][1] < 0.7e-3  # the clock went on from the checkpoint (half of 60 min)


def test_schedule_over_minutes_needs_a_budget(ws3, tmp_path):
    from eagle.config import ConfigError

    with pytest.raises(ConfigError, match="schedule_over=minutes decays the lr over train.max_minutes"):
        ws3.cfg(tmp_path / "o", train__schedule_over="minutes")


def test_eagle31_head_trains_and_its_checkpoint_loads_with_the_options(ws3, tmp_path):
    from eagle.algorithms.head_io import load_head
    from eagle.train.trainer import train

    result = train(ws3.cfg(tmp_path / "o", steps=6, draft__fc_norm=True, draft__norm_output=True))
    assert result.eval_metrics["loss"] < result.initial_eval_metrics["loss"]
    head = load_head(final_head(tmp_path / "o", 6))
    assert head.config.fc_norm and head.config.norm_output and hasattr(head, "fc_norm")


def test_init_from_starts_where_the_given_head_ended_and_refuses_another_shape(ws3, tmp_path):
    """train.init_from (saved head, or an exported folder through the CLI's loader) sets the initial
    weights: the new run's step-0 held-out eval equals the source's last eval; a resumed run keeps its
    checkpoint; a head of another shape is refused naming the field."""
    from eagle.algorithms.head_io import load_head
    from eagle.config import ConfigError
    from eagle.export.exporter import export_head
    from eagle.export.loader import load_draft
    from eagle.train.trainer import TrainHooks, train

    first = train(ws3.cfg(tmp_path / "a", steps=6))
    src = final_head(tmp_path / "a", 6)
    warm = train(ws3.cfg(tmp_path / "b", steps=2, train__init_from=src))
    assert warm.initial_eval_metrics["loss"] == pytest.approx(first.eval_metrics["loss"], rel=1e-5)
    assert warm.initial_eval_metrics["loss"] < first.initial_eval_metrics["loss"]
    assert torch.equal(load_head(final_head(tmp_path / "b", 2)).t2d, load_head(src).t2d)

    exported = tmp_path / "vllm"
    export_head(load_head(src), exported, "vllm", dtype="float32")
    hooks = TrainHooks(load_init=lambda path, target: load_draft(path, target)[0])
    via_export = train(ws3.cfg(tmp_path / "c", steps=2, train__init_from=exported), hooks)
    assert via_export.initial_eval_metrics["loss"] == pytest.approx(first.eval_metrics["loss"], rel=1e-5)
    with pytest.raises(ConfigError, match="exported folder"):  # the trainer alone reads saved heads only
        train(ws3.cfg(tmp_path / "d", steps=2, train__init_from=exported))

    # Resuming "b" with a different init_from is another trajectory: refused, as any changed setting.
    with pytest.raises(CheckpointError, match="train.init_from"):
        train(ws3.cfg(tmp_path / "b", steps=4, train__init_from=final_head(tmp_path / "a", 4)))
    with pytest.raises(ConfigError, match="draft_vocab_size: 128 there, 64 here"):
        train(ws3.cfg(tmp_path / "e", steps=2, train__init_from=src, draft__draft_vocab_size=64))


def test_init_layer_from_target_is_the_head_training_starts_from(ws3, tmp_path, capsys):
    """train.init_layer_from_target: the head the loop trains starts with the target layer's weights
    (a 1-step run at a vanishing learning rate keeps them), and it cannot be combined with init_from."""
    from eagle.algorithms.head_io import load_head
    from eagle.config import ConfigError
    from eagle.target.loading import load_target
    from eagle.train.trainer import train

    run = train(ws3.cfg(tmp_path / "l", steps=1, train__init_layer_from_target=-1, train__lr=1e-12))
    assert "decoder layer initialised from the target's layer 3" in capsys.readouterr().out
    random_init = train(ws3.cfg(tmp_path / "r", steps=1, train__lr=1e-12))
    assert run.initial_eval_metrics["loss"] != pytest.approx(random_init.initial_eval_metrics["loss"], rel=1e-6)
    head = load_head(final_head(tmp_path / "l", 1))
    target = load_target(ws3.cfg(tmp_path / "x").target)[0]
    layer = target.model.layers[-1]
    torch.testing.assert_close(head.midlayer.mlp.down_proj.weight, layer.mlp.down_proj.weight, rtol=0, atol=1e-9)
    h = head.config.hidden_size
    torch.testing.assert_close(
        head.midlayer.self_attn.q_proj.weight[:, h:], layer.self_attn.q_proj.weight, rtol=0, atol=1e-9
    )
    with pytest.raises(ConfigError, match="init_layer_from_target=-1 starts a fresh head.*set one of them"):
        ws3.cfg(tmp_path / "y", train__init_layer_from_target=-1, train__init_from=final_head(tmp_path / "l", 1))


def test_freeze_lm_head_trains_everything_but_the_lm_head(ws3, tmp_path):
    """train.freeze_lm_head: after real updates the head's lm_head is still the target's LM-head rows
    of the draft vocabulary while the rest moved; flipping the option on resume is another trajectory
    (refused); EAGLE-1, which has no LM head of its own, is refused at config time."""
    from eagle.algorithms.head_io import load_head
    from eagle.config import ConfigError
    from eagle.target.loading import load_target
    from eagle.train.trainer import train

    train(ws3.cfg(tmp_path / "f", steps=3, train__freeze_lm_head=True))
    train(ws3.cfg(tmp_path / "u", steps=3))
    frozen, free = load_head(final_head(tmp_path / "f", 3)), load_head(final_head(tmp_path / "u", 3))
    target = load_target(ws3.cfg(tmp_path / "x").target)[0]
    ids = torch.arange(frozen.config.draft_vocab_size) + frozen.d2t  # [Vd] target ids of the draft vocab
    rows = target.get_output_embeddings().weight[ids]  # [Vd, H]
    torch.testing.assert_close(frozen.lm_head.weight, rows, rtol=0, atol=0)
    assert not torch.allclose(free.lm_head.weight, rows)  # the default trains it
    train(ws3.cfg(tmp_path / "s", steps=3, train__freeze_lm_head=True, train__lr=1e-12))  # ~ the initial head
    still = load_head(final_head(tmp_path / "s", 3))
    for name in ("fc.weight", "midlayer.mlp.down_proj.weight", "norm.weight"):  # the rest did train
        assert not torch.allclose(frozen.state_dict()[name], still.state_dict()[name]), name

    with pytest.raises(CheckpointError, match="train.freeze_lm_head"):
        train(ws3.cfg(tmp_path / "f", steps=5, train__freeze_lm_head=False))
    with pytest.raises(ConfigError, match="freeze_lm_head=true: draft.algorithm=eagle1"):
        ws3.cfg(tmp_path / "e", train__freeze_lm_head=True, draft__algorithm="eagle1")


def test_sequences_longer_than_train_max_length_are_named(capsys):
    """A packed long-context capture trained at a short train.max_length would be cut silently."""
    warn_cut_sequences([4096, 300, 3900], 768)
    err = capsys.readouterr().err
    assert "2 of 3 training sequences are longer than train.max_length=768 (longest 4096)" in err
    warn_cut_sequences([4096], 768, rank=1)  # said once, by rank 0
    warn_cut_sequences([300, 700], 768)
    assert capsys.readouterr().err == ""


def test_a_run_stopped_by_a_signal_says_it_was_not_evaluated_not_that_there_is_no_held_out_split():
    from eagle.train.trainer import TrainResult, format_result

    def result(stopped):
        return TrainResult(Path("out"), 238, stopped, None, None, None, None)

    assert "not evaluated (stopped by a signal); the same command resumes" in format_result(result("signal"))
    assert "no held-out split" in format_result(result("max_steps"))
