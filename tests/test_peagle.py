"""P-EAGLE, the parallel-drafting EAGLE-3 head: its training mask and slot subsampling, that the training pass
computes what the decoder's one pass computes, its loss against a per-slot reference, lossless decoding
(greedy identical to HF `generate` on every tiny family, sampled output with the target's law), training
through the trainer offline and online, and the vLLM parallel-drafting export."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from eagle.algorithms import get_algorithm
from eagle.algorithms.peagle.algorithm import (
    choose_slots,
    keep_thresholds,
    parallel_attention_mask,
    reference_parallel_mask,
)
from eagle.algorithms.peagle.drafting import parallel_log_probs
from eagle.algorithms.peagle.head import PEagleHead
from eagle.cli.app import compose
from eagle.config import ConfigError, DraftConfig, TrainConfig
from eagle.errors import ExportError
from eagle.export import check_folder, export_head, load_exported_head
from eagle.export.exporter import served_chain_length
from eagle.export.formats import detect_algorithm
from eagle.export.publish import model_card
from tests.support.block_drafters import (
    OracleDrafts,
    assert_decodes_the_same,
    assert_greedy_is_the_targets_own,
    assert_long_runs_stay_identical,
    assert_training_works,
    loss_batch,
)
from tests.support.decode import random_head
from tests.support.heads import randomise
from tests.support.train import Workspace
from tests.test_accept import _sampled_law_check
from tests.tiny_models import FAMILIES, make_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def qwen3():
    model, tok = make_model("qwen3")
    return model.eval(), tok


def _head(model, seed: int = 0, **options) -> PEagleHead:
    head = random_head(model, "peagle", seed=seed, **{"parallel_tokens": 4, **options})
    randomise(head, seed)  # norms and all: a fresh head's unit norms would hide a misplaced one
    return head.eval()


# --- the training mask and the slots -----------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 1000), st.integers(1, 4), st.integers(1, 4))
def test_parallel_mask_matches_the_reference(seed, anchors, slots):
    g = torch.Generator().manual_seed(seed)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 6:] = False
    anchor, depth = choose_slots(torch.rand(2, 9, generator=g) < 0.6, anchors, slots, 0.6, 0.3, g)
    expected = reference_parallel_mask(valid.tolist(), anchor.tolist(), depth.tolist())
    assert torch.equal(parallel_attention_mask(valid, anchor, depth), expected)


def test_kept_slots_are_prefixes_of_real_anchors_at_the_papers_rates():
    g = torch.Generator().manual_seed(0)
    ok = torch.rand(4, 200, generator=g) < 0.5
    anchor, depth = choose_slots(ok, 150, 5, 0.7, 0.2, g)
    kept = {}
    for r in range(4):
        for a, j in zip(anchor[r].tolist(), depth[r].tolist(), strict=True):
            if a >= 0:
                assert ok[r, a]
                kept.setdefault((r, a), []).append(j)
    assert all(sorted(js) == list(range(1, len(js) + 1)) for js in kept.values())  # 1..L_a, no gaps
    anchors = sum(min(150, int(ok[r].sum())) for r in range(4))  # the anchors drawn
    share = [sum(len(js) >= j for js in kept.values()) / anchors for j in range(1, 6)]
    expected = keep_thresholds(5, 0.7, 0.2).tolist()  # [0.7, 0.49, 0.343, 0.24, 0.2]
    assert all(abs(s - e) < 0.06 for s, e in zip(share, expected, strict=True)), share


# --- training pass == decoding pass, and the loss ------------------------------------------------------


def test_training_pass_equals_the_decoders_one_pass(qwen3):
    """An anchor's slots in the training pass (one forward over the sequence and every slot under the mask)
    give the same laws as the decoder's commit of the context and its one parallel pass."""
    model, _ = qwen3
    head = _head(model)
    batch = loss_batch(model, head)
    algo = get_algorithm("peagle")
    s = algo.loss_settings(DraftConfig(algorithm="peagle", parallel_tokens=4), TrainConfig(), 0, True)
    anchor = torch.tensor([[9, 9, 9, 4, 4, 4], [6, 6, 6, -1, -1, -1]])
    depth = torch.tensor([[1, 2, 3, 1, 2, 3], [1, 2, 3, 0, 0, 0]])
    batch.update(slot_anchor=anchor, slot_depth=depth)
    captured = {}
    handle = head.register_forward_hook(lambda m, i, o: captured.setdefault("out", o))
    algo.forward_loss(head, model.get_output_embeddings(), batch, s, None)
    handle.remove()
    out, t = captured["out"], batch["input_ids"].shape[1]
    ids, feats = batch["input_ids"], batch["aux_hidden"]
    for b, a, cols in ((0, 9, slice(0, 3)), (0, 4, slice(3, 6)), (1, 6, slice(0, 3))):
        trained = torch.log_softmax(head.logits(torch.cat([out[b, a][None], out[b, t:][cols]])[None])[0].float(), -1)
        cache = head.new_draft_cache()
        with torch.inference_mode():
            root_hidden = head.commit(cache, ids[b, 1 : a + 2], feats[b, : a + 1], torch.arange(a + 1))
            decoded = parallel_log_probs(head, cache, root_hidden, a + 1)  # [4, V]
        torch.testing.assert_close(decoded, trained, atol=2e-5, rtol=1e-5)
        assert head.new_draft_cache() is not cache and cache.get_seq_length() == a + 1  # slots cropped


def test_loss_matches_a_per_slot_reference(qwen3):
    """forward_loss (depth 0 at every loss index, the kept slots, decay^j, global token counts) against the
    decoder's pass run per anchor and soft cross-entropies summed by hand."""
    model, _ = qwen3
    head = _head(model)
    batch = loss_batch(model, head)
    algo = get_algorithm("peagle")
    train_cfg = TrainConfig(anchors_per_sequence=3, ttt_decay=0.8, cod_ratio=0.6, cod_floor=0.3)
    s = algo.loss_settings(DraftConfig(algorithm="peagle", parallel_tokens=4), train_cfg, 0, True)
    torch.manual_seed(3)
    counts = algo.step_token_counts(batch, s)
    parts = algo.forward_loss(head, model.get_output_embeddings(), batch, s, torch.tensor(counts))
    ids, feats, final = batch["input_ids"], batch["aux_hidden"], batch["final_hidden"]
    lm = model.get_output_embeddings()
    loss_at = batch["loss_mask"]  # raw: x_i is a loss token
    sums, tokens = [0.0] * 4, [0] * 4

    def add(j: int, logq: torch.Tensor, b: int, label: int) -> None:  # head law of x_{label+2}
        with torch.no_grad():
            p = torch.softmax(lm(final[b, label + 1]).float(), -1)
            sums[j] += float(-(p * logq).sum())
        tokens[j] += 1

    t = ids.shape[1]
    for b in range(2):
        real = int(batch["attention_mask"][b].sum())
        for a in range(real - 1):  # depth 0: index a reads x_{a+1}
            if a + 2 < t and loss_at[b, a + 2]:
                cache = head.new_draft_cache()
                with torch.inference_mode():
                    root = head.commit(cache, ids[b, 1 : a + 2], feats[b, : a + 1], torch.arange(a + 1))
                add(0, torch.log_softmax(head.logits(root[None, None])[0, 0].float(), -1), b, a)
        for a, j in zip(batch["slot_anchor"][b].tolist(), batch["slot_depth"][b].tolist(), strict=True):
            if a < 0 or a + j + 2 >= t or not loss_at[b, a + j + 2]:
                continue
            cache = head.new_draft_cache()
            with torch.inference_mode():
                root = head.commit(cache, ids[b, 1 : a + 2], feats[b, : a + 1], torch.arange(a + 1))
                logq = parallel_log_probs(head, cache, root, a + 1)
            add(j, logq[j], b, a + j)
    assert tokens == counts and min(tokens) > 0
    expected = sum(0.8**j * sums[j] / tokens[j] for j in range(4))
    assert float(parts.objective.detach()) == pytest.approx(expected, rel=1e-4)


def test_a_reduced_draft_vocabulary_drafts_target_ids(qwen3):
    model, _ = qwen3
    head = random_head(model, "peagle", draft_vocab_size=20, parallel_tokens=3)
    cache = head.new_draft_cache()
    feats = torch.randn(5, 3, head.config.target_hidden_size)
    with torch.inference_mode():
        root = head.commit(cache, torch.arange(1, 6), feats, torch.arange(5))
        logp = parallel_log_probs(head, cache, root, 5)  # [3, V]
    assert logp.shape == (3, head.config.vocab_size)
    finite = torch.isfinite(logp)
    assert torch.equal(finite[0], head.t2d) and torch.allclose(logp.exp().sum(-1), torch.ones(3))


# --- decoding -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_is_the_targets_own_for_every_family(family):
    assert_greedy_is_the_targets_own(family, lambda model: _head(model, parallel_tokens=5))


class ParallelOracle(OracleDrafts, PEagleHead):
    """A P-EAGLE head whose output at position p drafts reference[p + 1] (the root's output and every slot);
    the cache runs the real path."""

    OFFSET = 1
    algorithm: ClassVar[str] = "peagle"


def test_long_accepted_runs_stay_identical(qwen3):
    model, tok = qwen3
    assert_long_runs_stay_identical(model, tok, ParallelOracle, _head(model, parallel_tokens=6))


@pytest.mark.parametrize("choice", ["sample", "topk"])
def test_sampled_decoding_follows_the_target_law(choice):
    """Tokens 2-3 of sampled decoding with a parallel drafter have the target's exact law (chi-square)."""
    _sampled_law_check(
        400, head_options={"algorithm": "peagle", "parallel_tokens": 3, "aux_layer_ids": [0, 1, 1]}, draft_choice=choice
    )


# --- training, config, export --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return Workspace(tmp_path_factory.mktemp("peagle"), family="qwen3", algorithm="peagle")


@pytest.mark.parametrize("online", [False, True])
def test_training_lowers_the_loss_and_the_head_decodes_losslessly(ws, tmp_path, online):
    assert_training_works(ws, tmp_path, online, "peagle", 4, draft__parallel_tokens=4)


def test_config_refuses_what_p_eagle_cannot_train():
    with pytest.raises(ConfigError, match="draft.parallel_tokens=1"):
        compose(["draft=peagle", "draft.parallel_tokens=1"])
    with pytest.raises(ConfigError, match="position_weights=dpace"):
        compose(["draft=peagle", "train.position_weights=dpace"])
    with pytest.raises(ConfigError, match="train.cod_floor=0"):
        compose(["draft=peagle", "train.cod_floor=0"])
    assert compose(["draft=peagle"]).draft.parallel_tokens == 8


def test_vllm_export_is_eagle3_with_mask_hidden_and_decodes_the_same(qwen3, tmp_path):
    """format=vllm writes vLLM's EAGLE-3 folder plus what its parallel drafting reads (mask_hidden [1, 3Ht],
    a top-level mask_token_id); a folder without our eagle block is still recognised as P-EAGLE."""
    model, tok = qwen3
    head = _head(model, parallel_tokens=5, fc_norm=True)
    out = tmp_path / "vllm"
    export_head(head, out, "vllm", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert (
        config["architectures"] == ["LlamaForCausalLMEagle3"] and config["mask_token_id"] == head.config.mask_token_id
    )
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("mask_hidden").shape == (1, 3 * head.config.target_hidden_size)
        assert "midlayer.self_attn.q_proj.weight" in set(f.keys())
    check_folder(out, expect_format="vllm")
    foreign = {k: v for k, v in config.items() if k != "eagle_export"}
    assert detect_algorithm(foreign, "x") == "peagle"
    assert detect_algorithm({k: v for k, v in foreign.items() if k != "mask_token_id"}, "x") == "eagle3"
    assert_decodes_the_same(model, tok, head, load_exported_head(out, model))
    with pytest.raises(Exception, match="speculators"):
        export_head(head, tmp_path / "bad", "speculators")
    assert not (tmp_path / "bad").exists()


def test_a_block_drafter_advertises_its_own_block_to_the_engines(qwen3, tmp_path):
    """num_speculative_tokens of a block drafter's export is what one pass drafts (P-EAGLE: K; DFlash: B - 1);
    another export.speculative_tokens is refused by name. The card's vLLM line turns parallel drafting on."""
    model, _ = qwen3
    head = _head(model, parallel_tokens=5)
    assert served_chain_length(compose([]), head.config) == 5
    dflash = random_head(model, "dflash", block_size=6).config
    assert served_chain_length(compose([]), dflash) == 5
    with pytest.raises(ExportError, match="export.speculative_tokens=3"):
        served_chain_length(compose(["export.speculative_tokens=3"]), head.config)
    exported = export_head(head, tmp_path / "vllm", "vllm", dtype="float32", speculative_tokens=5)
    card = model_card(exported, "vllm", "t", "apache-2.0", [], {}, None, speculative_tokens=5)
    assert '"num_speculative_tokens": 5, "parallel_drafting": true' in card
