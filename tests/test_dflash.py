"""DFlash, the block drafter: its block-sparse training mask, that the training pass computes what the
decoder computes, its loss against a per-anchor reference, the objectives, lossless decoding (greedy
identical to HF `generate` on every tiny family, sampled output with the target's law) and training
through the trainer offline and online."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle.algorithms import get_algorithm
from eagle.algorithms.dflash.algorithm import (
    block_attention_mask,
    block_inputs,
    choose_anchors,
    reference_block_mask,
)
from eagle.algorithms.dflash.drafting import block_log_probs
from eagle.algorithms.dflash.head import DFlashHead
from eagle.algorithms.objectives import (
    dpace_weights,
    dpace_weights_reference,
    position_weights,
    position_weights_reference,
    token_loss_reference,
    token_losses,
)
from eagle.capture.features import extract_features
from eagle.cli.app import compose
from eagle.config import ConfigError, DraftConfig, TrainConfig
from eagle.decode.block import block_pool
from eagle.decode.generator import SpeculativeGenerator
from tests.support.block_drafters import (
    OracleDrafts,
    assert_decodes_the_same,
    assert_greedy_is_the_targets_own,
    assert_long_runs_stay_identical,
    assert_training_works,
    loss_batch,
)
from tests.support.decode import decode_cfg, random_head
from tests.support.heads import randomise
from tests.support.train import Workspace
from tests.test_accept import _sampled_law_check
from tests.tiny_models import FAMILIES, make_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def qwen3():
    model, tok = make_model("qwen3")
    return model.eval(), tok


def _head(model, seed: int = 0, **options) -> DFlashHead:
    head = random_head(model, "dflash", seed=seed, **{"block_size": 5, "num_layers": 2, **options})
    randomise(head, seed)  # norms and all: a fresh head's unit norms would hide a misplaced one
    return head.eval()


# --- the training mask ------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 1000), st.integers(1, 4), st.integers(2, 5))
def test_block_mask_matches_the_reference(seed, anchors, block):
    g = torch.Generator().manual_seed(seed)
    t = 12
    valid = torch.rand(2, t, generator=g) < 0.9
    loss = torch.rand(2, t, generator=g) < 0.6
    chosen = choose_anchors(loss, valid, anchors, generator=g)  # [2, A], -1 padded
    fast = block_attention_mask(chosen, valid, block)
    ref = reference_block_mask(chosen.tolist(), valid.tolist(), block)
    assert torch.equal(fast, ref)


def test_anchors_are_distinct_real_and_followed_by_a_loss_token():
    g = torch.Generator().manual_seed(0)
    valid = torch.ones(3, 20, dtype=torch.bool)
    valid[2, 15:] = False
    loss = torch.zeros(3, 20, dtype=torch.bool)
    loss[:, 8:] = True
    loss[1] = False  # no loss token: no anchor
    anchors = choose_anchors(loss, valid, 6, generator=g)
    assert anchors.shape == (3, 6)
    assert (anchors[1] == -1).all()
    for row in (0, 2):
        real = [a for a in anchors[row].tolist() if a >= 0]
        assert len(real) == len(set(real)) == 6
        assert all(a >= 1 and valid[row, a] and loss[row, a + 1] for a in real)


# --- training computes what decoding computes ---------------------------------------------------------


def test_training_pass_equals_the_decoders_block_pass(qwen3):
    """The multi-anchor training pass (context keys of the whole sequence under the block-sparse mask) gives
    each anchor's block exactly the laws the decoder gets from its cached context and a lone block."""
    model, _ = qwen3
    head = _head(model)
    ids = torch.randint(0, model.config.vocab_size - 1, (1, 14), generator=torch.Generator().manual_seed(1))
    feats = {
        k: v.clone() for k, v in extract_features(model, ids, torch.ones_like(ids), head.feature_layer_ids()).items()
    }
    q = head.config.block_size
    anchors = torch.tensor([[9, 4, 1]])
    ctx = head.project_features(feats["aux_hidden"])
    kv = head.context_kv(ctx, torch.arange(14)[None])
    block_ids, pos = block_inputs(ids, anchors, q, head.config.mask_token_id)
    out = head(block_ids, None, pos, block_attention_mask(anchors, torch.ones_like(ids, dtype=torch.bool), q), kv)
    trained = torch.log_softmax(head.logits(out.view(1, 3, q, -1)[:, :, 1:]).float(), -1)[0]  # [A, Q-1, V]
    for i, a in enumerate(anchors[0].tolist()):
        cache = head.new_draft_cache()
        head.commit(cache, ids[0, 1 : a + 1], feats["aux_hidden"][0, :a], torch.arange(a))
        decoded = block_log_probs(head, cache, int(ids[0, a]), a)  # [Q-1, V]
        torch.testing.assert_close(decoded, trained[i], atol=2e-5, rtol=1e-5)


def test_loss_matches_a_per_anchor_reference(qwen3):
    """forward_loss (all anchors in one pass, position weights, global token counts) against a loop that runs
    each anchor's block alone over its own context and sums soft cross-entropies by hand."""
    model, _ = qwen3
    head = _head(model, block_size=4)
    algo = get_algorithm("dflash")
    batch = loss_batch(model, head)
    t, ids, loss_mask, feats = 16, batch["input_ids"], batch["loss_mask"], batch
    cfg = TrainConfig(position_weights="decay", position_gamma=2.0, anchors_per_sequence=3)
    s = algo.loss_settings(DraftConfig(algorithm="dflash", block_size=4), cfg, pad_id=0, training=True)
    torch.manual_seed(5)
    counts = algo.step_token_counts(batch, s)
    parts = algo.forward_loss(head, model.get_output_embeddings(), batch, s, torch.tensor(counts))
    w = [math.exp(-j / 2.0) for j in range(3)]
    w = [x / (sum(w) / 3) for x in w]
    sums, tokens = [0.0] * 3, [0] * 3
    lm = model.get_output_embeddings()
    for b in range(2):
        for a in batch["anchors"][b].tolist():
            if a < 0:
                continue
            cache = head.new_draft_cache()
            head.commit(cache, ids[b, 1 : a + 1], feats["aux_hidden"][b, :a], torch.arange(a))
            logq = block_log_probs(head, cache, int(ids[b, a]), a)  # [3, V]
            for j in range(1, 4):
                if a + j >= t or not loss_mask[b, a + j]:
                    continue
                with torch.no_grad():
                    p = torch.softmax(lm(feats["final_hidden"][b, a + j - 1]).float(), -1)
                    sums[j - 1] += float(-(p * logq[j - 1]).sum())
                tokens[j - 1] += 1
    assert tokens == counts and sum(tokens) > 6
    expected = sum(w[j] * sums[j] / tokens[j] for j in range(3))
    assert float(parts.objective.detach()) == pytest.approx(expected, rel=1e-4)
    assert [float(x) for x in parts.step_tokens] == tokens


# --- the objectives -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ce", "lk_tv", "lk_nla", "lk_hybrid"])
def test_objectives_match_their_references(kind):
    g = torch.Generator().manual_seed(0)
    logq = torch.log_softmax(torch.randn(5, 9, generator=g) * 2, -1)
    p = torch.softmax(torch.randn(5, 9, generator=g) * 2, -1)
    p[0, 3] = 0.0  # a token the target never draws
    p[0] /= p[0].sum()
    fast = token_losses(kind, logq, p)
    for i in range(5):
        ref = token_loss_reference(kind, logq[i].tolist(), p[i].tolist())
        assert float(fast[i]) == pytest.approx(ref, rel=1e-5, abs=1e-6)
    if kind != "ce":  # the LK objectives are 0 exactly where the head's law is the target's (alpha = 1)
        q_is_p = torch.log_softmax(torch.randn(5, 9, generator=g), -1)
        assert token_losses(kind, q_is_p, q_is_p.exp()).abs().max() < 1e-5


@pytest.mark.parametrize("rule", ["uniform", "decay"])
def test_position_weights_match_their_references(rule):
    fast = position_weights(rule, 5, 3.0)
    torch.testing.assert_close(fast, torch.tensor(position_weights_reference(rule, 5, 3.0)), atol=1e-6, rtol=1e-6)
    assert float(fast.mean()) == pytest.approx(1.0)


def test_dpace_weights_match_the_reference():
    g = torch.Generator().manual_seed(0)
    conf = torch.rand(3, 4, 6, generator=g)
    valid = torch.rand(3, 4, 6, generator=g) < 0.8
    fast = dpace_weights(conf, valid)
    for b in range(3):
        for a in range(4):
            ref = dpace_weights_reference(conf[b, a].tolist(), valid[b, a].tolist())
            torch.testing.assert_close(fast[b, a], torch.tensor(ref), atol=1e-6, rtol=1e-6)
    # By hand: confidences 1, 0 -> smoothed 1, .5 -> C = (1, .5) -> w = (1.5, .5).
    torch.testing.assert_close(
        dpace_weights(torch.tensor([1.0, 0.0]), torch.tensor([True, True])), torch.tensor([1.5, 0.5])
    )


# --- lossless decoding -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_is_the_targets_own_for_every_family(family):
    assert_greedy_is_the_targets_own(family, lambda model: _head(model, block_size=6))


class BlockOracle(OracleDrafts, DFlashHead):
    """A DFlash head whose block position j drafts reference[root_position + j] (the token that truly comes
    there); commits run the real context path."""

    algorithm: ClassVar[str] = "dflash"


def test_long_accepted_runs_stay_identical(qwen3):
    model, tok = qwen3
    _, tree = assert_long_runs_stay_identical(model, tok, BlockOracle, _head(model, block_size=8))
    # rank-1 drafts were accepted through the tree's second branches
    assert sum(tree.accept_lengths) / len(tree.accept_lengths) > 2.0


def test_block_pool_keeps_the_best_paths():
    log_probs = torch.log_softmax(torch.tensor([[3.0, 2.0, 0.0, -1.0], [0.0, 4.0, 1.0, -2.0]]), -1)
    pool = block_pool(log_probs, 2)
    assert pool.tokens[:2].tolist() == [0, 1] and pool.parents[:2].tolist() == [-1, -1]
    assert pool.tokens[2:].tolist() == [1, 2, 1, 2] and pool.parents[2:].tolist() == [0, 0, 1, 1]
    torch.testing.assert_close(pool.scores[2], log_probs[0, 0] + log_probs[1, 1])


@pytest.mark.parametrize("choice", ["sample", "topk"])
def test_sampled_decoding_follows_the_target_law(choice):
    """Tokens 2-3 of sampled decoding with a block drafter have the target's exact law (chi-square)."""
    _sampled_law_check(
        400, head_options={"algorithm": "dflash", "block_size": 3, "aux_layer_ids": [0, 1, 1]}, draft_choice=choice
    )


# --- training ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return Workspace(tmp_path_factory.mktemp("dflash"), family="qwen3", algorithm="dflash")


@pytest.mark.parametrize("online", [False, True])
def test_training_lowers_the_loss_and_the_head_decodes_losslessly(ws, tmp_path, online):
    assert_training_works(ws, tmp_path, online, "dflash", 4, draft__block_size=4, train__position_weights="dpace")


def test_config_refuses_bad_block_settings():
    with pytest.raises(ConfigError, match="draft.block_size=1"):
        compose(["draft=dflash", "draft.block_size=1"])
    with pytest.raises(ConfigError, match="train.loss"):
        compose(["train.loss=kl"])
    with pytest.raises(ConfigError, match="train.position_weights"):
        compose(["train.position_weights=linear"])


def test_static_trees_are_refused_for_a_block_drafter(qwen3):
    model, tok = qwen3
    cfg = decode_cfg(tree="static", static_paths=[[0], [0, 0]])
    with pytest.raises(Exception, match="tree=static"):
        SpeculativeGenerator(model, _head(model), SimpleNamespace(eos_token_id=None), cfg)


@pytest.mark.parametrize("kind", ["lk_tv", "lk_nla", "lk_hybrid"])
def test_eagle3_unrolled_loss_takes_the_lk_objectives(kind):
    """EAGLE-3's packed unrolled loss with an LK objective is that objective's mean per step against the
    target law renormalised over the draft vocabulary."""
    from eagle.algorithms.losses import eagle3_loss_packed

    g = torch.Generator().manual_seed(0)
    v, vd = 10, 6
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[[0, 2, 3, 5, 7, 9]] = True
    d2t = torch.tensor([0, 2, 3, 5, 7, 9]) - torch.arange(vd)
    target = torch.randn(7, v, generator=g)
    logits = [torch.randn(5, vd, generator=g), torch.randn(3, vd, generator=g)]
    rows = [torch.tensor([0, 1, 2, 4, 6]), torch.tensor([1, 3, 5])]
    r = eagle3_loss_packed(logits, target, rows, t2d, d2t, decay=0.5, loss=kind)
    for i in range(2):
        p = torch.softmax(target[rows[i]][:, t2d], -1)
        logq = torch.log_softmax(logits[i], -1)
        ref = sum(token_loss_reference(kind, logq[k].tolist(), p[k].tolist()) for k in range(len(rows[i])))
        assert float(r.step_losses[i]) == pytest.approx(ref / len(rows[i]), rel=1e-5)


# --- export --------------------------------------------------------------------------------------------


def test_vllm_export_has_the_dflash_layout_passes_check_and_decodes_the_same(qwen3, tmp_path):
    """format=vllm writes the layout vLLM's DFlashDraftModel and llama.cpp's converter read (top-level names,
    no embeddings or LM head, dflash_config with layer *outputs*); our loader reads it back to the same head."""

    from safetensors import safe_open

    from eagle.export import check_folder, export_head, load_exported_head

    model, tok = qwen3
    head = _head(model, block_size=6, aux_layer_ids=[1, 2, 3])
    out = tmp_path / "vllm"
    export_head(head, out, "vllm", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 6 and config["num_hidden_layers"] == 2
    assert config["dflash_config"] == {"mask_token_id": head.config.mask_token_id, "target_layer_ids": [0, 1, 2]}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert not any(n.startswith(("embed_tokens", "lm_head", "model.")) for n in names)
    check_folder(out, expect_format="vllm")
    assert_decodes_the_same(model, tok, head, load_exported_head(out, model))
    with pytest.raises(Exception, match="id 0"):
        export_head(_head(model, aux_layer_ids=[0, 1, 2]), tmp_path / "bad", "vllm")
    assert not (tmp_path / "bad").exists()
    # format=llamacpp: the same folder (llama.cpp's converter reads DFlashDraftModel) and the commands that
    # convert it and serve it with --spec-type draft-dflash, drafting the whole block.
    export_head(head, tmp_path / "llamacpp", "llamacpp", dtype="float32", speculative_tokens=5)
    guide = (tmp_path / "llamacpp" / "LLAMACPP.md").read_text()
    assert "--spec-type draft-dflash --spec-draft-n-max 5" in guide and "--target-model-dir" in guide
    check_folder(tmp_path / "llamacpp", expect_format="llamacpp")
