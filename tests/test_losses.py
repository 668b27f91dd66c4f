"""Losses: the fast versions equal the plain references, in values and gradients."""

from __future__ import annotations

import pytest
import torch

from eagle.algorithms.losses import (
    add_feature_noise,
    eagle1_loss,
    eagle1_loss_reference,
    eagle3_loss,
    eagle3_loss_reference,
    shift_left,
)
from eagle.heads.vocab import build_vocab_maps


def _grads(fn, *leaves):
    for x in leaves:
        x.grad = None
    out = fn()
    out.loss.backward()
    return out, [x.grad.clone() for x in leaves]


@pytest.mark.parametrize("chunk_size", [3, 1024])
def test_eagle1_fast_matches_reference(chunk_size):
    g = torch.Generator().manual_seed(0)
    b, t, h, v = 2, 6, 8, 23
    pred = torch.randn(b, t, h, generator=g).requires_grad_()
    target = pred.detach() + 0.7 * torch.randn(b, t, h, generator=g)  # mixes the L1 and L2 regimes
    w = 2.0 * torch.randn(v, h, generator=g)
    mask = torch.tensor([[1, 1, 0, 1, 1, 0], [0, 1, 1, 1, 1, 1]])
    ref, (g_ref,) = _grads(lambda: eagle1_loss_reference(pred, target, w, mask, 1.0, 0.3), pred)
    fast, (g_fast,) = _grads(lambda: eagle1_loss(pred, target, w, mask, 1.0, 0.3, chunk_size=chunk_size), pred)
    for name in ("loss", "feature_loss", "token_loss", "accuracy"):
        torch.testing.assert_close(getattr(fast, name), getattr(ref, name), atol=1e-5, rtol=1e-5)
    assert fast.count == ref.count == 9
    torch.testing.assert_close(g_fast, g_ref, atol=1e-6, rtol=1e-5)
    assert g_fast[0, 2].abs().sum() == 0  # masked positions get no gradient


def test_eagle1_perfect_prediction():
    w = torch.randn(11, 4)
    f = torch.randn(1, 5, 4)
    out = eagle1_loss(f.clone(), f, w, torch.ones(1, 5))
    assert out.feature_loss == 0 and out.accuracy == 1.0
    probs = torch.softmax(f @ w.t(), -1)
    entropy = -(probs * probs.log()).sum(-1).mean()  # soft CE of a perfect head = target entropy
    torch.testing.assert_close(out.token_loss, entropy)


def _eagle3_case(seed=0, steps=3):
    g = torch.Generator().manual_seed(seed)
    b, t, v = 2, 7, 30
    draft_ids = torch.tensor([0, 2, 3, 5, 8, 11, 12, 19, 25, 29])
    d2t, t2d = build_vocab_maps(draft_ids, v)
    target_logits = 3 * torch.randn(b, t, v, generator=g)
    target_logits[0, 1, 4] = 50.0  # a target top-1 outside the draft vocab
    step_logits = [torch.randn(b, t, draft_ids.numel(), generator=g).requires_grad_() for _ in range(steps)]
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    return step_logits, target_logits, loss_mask, t2d, d2t, attention_mask


def test_eagle3_fast_matches_reference():
    step_logits, target_logits, loss_mask, t2d, d2t, am = _eagle3_case()
    ref, g_ref = _grads(
        lambda: eagle3_loss_reference(step_logits, target_logits, loss_mask, t2d, d2t, 0.8, am), *step_logits
    )
    fast, g_fast = _grads(lambda: eagle3_loss(step_logits, target_logits, loss_mask, t2d, d2t, 0.8, am), *step_logits)
    torch.testing.assert_close(fast.loss, ref.loss)
    for i in range(3):
        torch.testing.assert_close(fast.step_losses[i], ref.step_losses[i])
        torch.testing.assert_close(fast.step_accuracy[i], ref.step_accuracy[i])
        torch.testing.assert_close(g_fast[i], g_ref[i])
    assert fast.step_counts == ref.step_counts == [10, 10, 9]
    torch.testing.assert_close(fast.coverage, ref.coverage)
    assert fast.coverage < 1.0  # the planted out-of-vocab top-1 is counted as not covered


def test_eagle3_perfect_head_and_decay():
    _, target_logits, loss_mask, t2d, d2t, _ = _eagle3_case(seed=1)
    target_logits[0, 1, 4] = 0.0
    # A head that outputs the target logits restricted to the draft vocab, for every step.
    steps = [shift_left(target_logits[..., t2d], i) for i in range(2)]
    out = eagle3_loss(steps, target_logits, loss_mask, t2d, d2t, decay=0.5)
    in_vocab = t2d[target_logits.argmax(-1)]
    expected_acc0 = (in_vocab & loss_mask.bool()).sum() / loss_mask.sum()
    torch.testing.assert_close(out.step_accuracy[0], expected_acc0.float())
    torch.testing.assert_close(out.loss, out.step_losses[0] + 0.5 * out.step_losses[1])
    # Soft CE of a perfect head is the entropy of the renormalised target.
    p = torch.softmax(target_logits[..., t2d], -1)
    ent = -(p * p.log()).sum(-1)
    torch.testing.assert_close(out.step_losses[0], (ent * loss_mask).sum() / loss_mask.sum())


def test_feature_noise():
    x = torch.zeros(4, 100, 8)
    noisy = add_feature_noise(x, 0.2, generator=torch.Generator().manual_seed(0))
    assert noisy.abs().max() <= 0.1 and noisy.abs().max() > 0.05 and noisy.mean().abs() < 0.01
    assert add_feature_noise(x, 0.2, training=False) is x
    assert add_feature_noise(x, 0.0) is x


def test_draft_vocab_label_rows_give_the_full_vocab_loss():
    """Training's soft labels from the draft vocabulary's LM-head rows only: the same loss (and
    gradients) as the full-vocabulary target logits restricted to the draft columns."""
    torch.manual_seed(0)
    b, t, h, v, vd = 2, 7, 16, 50, 12
    draft_ids = torch.sort(torch.randperm(v)[:vd]).values
    d2t, t2d = build_vocab_maps(draft_ids, v)
    lm = torch.nn.Linear(h, v, bias=False)
    feat = torch.randn(b, t, h)
    full = lm(feat)  # [B, T, V]
    rows = lm.weight[torch.arange(vd) + d2t]  # [Vd, H]
    step_logits = [torch.randn(b, t, vd, requires_grad=True) for _ in range(3)]
    mask = torch.rand(b, t) > 0.3
    ref = eagle3_loss(step_logits, full, mask, t2d, d2t, 0.8)
    ones, zeros = torch.ones(vd, dtype=torch.bool), torch.zeros(vd, dtype=torch.long)
    got = eagle3_loss(step_logits, feat @ rows.T, mask, ones, zeros, 0.8)
    torch.testing.assert_close(got.loss, ref.loss)
    g_ref = torch.autograd.grad(ref.loss, step_logits, retain_graph=True)
    g_got = torch.autograd.grad(got.loss, step_logits)
    for a, c in zip(g_ref, g_got, strict=True):
        torch.testing.assert_close(a, c)


@pytest.mark.parametrize("algorithm", ["eagle3", "eagle1"])
def test_forward_loss_on_loss_positions_equals_the_dense_reference(algorithm):
    """forward_loss computes the head's and the target's logits only where a step's loss reads them;
    the objective, per-step sums and gradients equal the plain reference over dense [B, T, V] logits."""
    from eagle.algorithms import get_algorithm
    from eagle.algorithms.base import LossSettings, aligned_inputs
    from eagle.algorithms.head_io import build_head, head_config_from_target
    from eagle.algorithms.ttt import ttt_forward
    from eagle.config import DraftConfig
    from tests.tiny_models import make_model

    model, _ = make_model("llama")
    cfg = head_config_from_target(model.config, DraftConfig(algorithm=algorithm, draft_vocab_size=None))
    torch.manual_seed(0)
    head = build_head(cfg, model)
    alg, lm_head = get_algorithm(algorithm), model.get_output_embeddings()
    g = torch.Generator().manual_seed(5)
    b, t, h, k = 2, 9, cfg.target_hidden_size, max(1, len(cfg.aux_layer_ids))
    attention_mask = torch.ones(b, t, dtype=torch.long)
    attention_mask[1, 7:] = 0  # right padding
    loss_mask = torch.zeros(b, t, dtype=torch.uint8)
    loss_mask[0, 3:] = 1  # a prompt of 3 tokens, then the answer
    loss_mask[1, 2:7] = 1
    batch = {
        "input_ids": torch.randint(0, cfg.vocab_size, (b, t), generator=g),
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "aux_hidden": torch.randn(b, t, k, h, generator=g),
        "final_hidden": 3 * torch.randn(b, t, h, generator=g),
    }
    settings = LossSettings(steps=3, decay=0.8, feature_weight=1.0, token_weight=0.1, noise_std=0.0, pad_id=0)
    params = [p for p in head.parameters() if p.requires_grad]
    parts = alg.forward_loss(head, lm_head, batch, settings, None)
    got = torch.autograd.grad(parts.objective, params)

    a = aligned_inputs(batch, 0)
    feats = batch["aux_hidden"] if algorithm == "eagle3" else batch["final_hidden"][:, :, None]
    outs = ttt_forward(head, a["input_ids"], head.project_features(feats), a["valid"], 3)
    with torch.no_grad():
        target_logits = lm_head(shift_left(batch["final_hidden"], 1))  # [B, T, V]
    v = cfg.vocab_size  # EAGLE-1 drafts from the full vocabulary: identity maps
    t2d, d2t = (
        (head.t2d, head.d2t)
        if algorithm == "eagle3"
        else (torch.ones(v, dtype=torch.bool), torch.zeros(v, dtype=torch.long))
    )
    ref = eagle3_loss_reference(
        [head.logits(o) for o in outs], target_logits, a["loss_mask"], t2d, d2t, 0.8, a["valid"]
    )
    expected = torch.autograd.grad(ref.loss, params)
    torch.testing.assert_close(parts.objective, ref.loss)
    for i in range(3):
        assert int(parts.step_tokens[i]) == ref.step_counts[i] > 0
        torch.testing.assert_close(parts.step_loss[i] / parts.step_tokens[i], ref.step_losses[i])
        torch.testing.assert_close(parts.step_correct[i] / parts.step_tokens[i], ref.step_accuracy[i])
    for x, y in zip(got, expected, strict=True):
        torch.testing.assert_close(x, y)
