"""Training-time test: masks match the reference, and the unroll equals real decoding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from eagle.algorithms.head_io import build_head, head_config_from_target
from eagle.algorithms.ttt import reference_ttt_mask, ttt_forward, ttt_mask, ttt_position_ids
from eagle.config import DraftConfig
from tests.tiny_models import make_model


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 7), st.integers(1, 4), st.data())
def test_fast_mask_matches_reference(T, steps, data):
    rows = data.draw(st.lists(st.lists(st.integers(0, 1), min_size=T, max_size=T), min_size=1, max_size=3))
    am = torch.tensor(rows)
    for i in range(steps):
        assert torch.equal(ttt_mask(am, i), reference_ttt_mask(T, steps, i, am))


def test_mask_pattern_explicit():
    m = reference_ttt_mask(3, 3, 2)[0, 0].int()
    expected = torch.tensor(
        [
            [1, 0, 0, 1, 0, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0, 0, 1, 0],
            [1, 1, 1, 0, 0, 1, 0, 0, 1],
        ]
    )
    assert torch.equal(m, expected)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def head_and_target(request):
    model, _ = make_model(request.param)
    cfg = head_config_from_target(model.config, DraftConfig(algorithm="eagle3", draft_vocab_size=None))
    torch.manual_seed(0)
    head = build_head(cfg, model)
    with torch.no_grad():  # larger weights than init so that each step changes the state visibly
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head, model


def test_unroll_equals_explicit_decoding(head_and_target):
    head, _ = head_and_target
    T, steps = 9, 4
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, head.config.vocab_size, (1, T), generator=g)  # index t holds x_{t+1}
    hidden0 = torch.randn(1, T, head.config.hidden_size, generator=g)
    with torch.no_grad():
        outs = ttt_forward(head, ids, hidden0, torch.ones(1, T), steps)
        for t0 in range(T - steps + 1):
            # Decode: prefill the prefix ending at t0, then draft `steps - 1` tokens on the head's
            # own outputs, each attending to the cache (prefix + earlier drafts) and itself.
            cache = DynamicCache()
            pos = torch.arange(1, t0 + 2)[None]
            h = head(ids[:, : t0 + 1], hidden0[:, : t0 + 1], pos, past_key_values=cache)[:, -1:]
            torch.testing.assert_close(h[:, 0], outs[0][:, t0], atol=1e-5, rtol=1e-5)
            for i in range(1, steps):
                tok = ids[:, t0 + i : t0 + i + 1]  # x_{t0+1+i}
                h = head(tok, h, torch.tensor([[t0 + 1 + i]]), past_key_values=cache)
                torch.testing.assert_close(h[:, 0], outs[i][:, t0], atol=1e-5, rtol=1e-5)


def test_structured_and_dense_unrolls_agree(head_and_target):
    head, _ = head_and_target
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, head.config.vocab_size, (2, 7), generator=g)
    hidden = torch.randn(2, 7, head.config.hidden_size, generator=g)
    am = torch.ones(2, 7, dtype=torch.long)
    am[1, 5:] = 0
    with torch.no_grad():
        fast = ttt_forward(head, ids, hidden, am, 4)
        dense = ttt_forward(head, ids, hidden, am, 4, dense_mask=True)
    for a, b in zip(fast, dense, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_padding_does_not_change_real_positions(head_and_target):
    head, _ = head_and_target
    T, steps = 6, 3
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, head.config.vocab_size, (2, T + 2), generator=g)
    hidden = torch.randn(2, T + 2, head.config.hidden_size, generator=g)
    am = torch.ones(2, T + 2, dtype=torch.long)
    am[0, T:] = 0  # row 0: right padding after T
    with torch.no_grad():
        batched = ttt_forward(head, ids, hidden, am, steps)
        alone = ttt_forward(head, ids[:1, :T], hidden[:1, :T], am[:1, :T], steps)
    for i in range(steps):
        # Only positions whose step-i token is real are comparable (the rest are masked in the loss).
        torch.testing.assert_close(batched[i][0, : T - i], alone[i][0, : T - i], atol=1e-5, rtol=1e-5)
    assert torch.equal(ttt_position_ids(am[:1]), torch.tensor([[1, 2, 3, 4, 5, 6, 6, 6]]))


def test_left_padding_positions_and_outputs(head_and_target):
    head, _ = head_and_target
    T, steps, pad = 5, 2, 2
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, head.config.vocab_size, (1, T), generator=g)
    hidden = torch.randn(1, T, head.config.hidden_size, generator=g)
    ids_p = torch.cat((torch.zeros(1, pad, dtype=torch.long), ids), 1)
    hidden_p = torch.cat((torch.randn(1, pad, head.config.hidden_size, generator=g), hidden), 1)
    am_p = torch.cat((torch.zeros(1, pad), torch.ones(1, T)), 1)
    with torch.no_grad():
        plain = ttt_forward(head, ids, hidden, torch.ones(1, T), steps)
        padded = ttt_forward(head, ids_p, hidden_p, am_p, steps)
    for i in range(steps):
        assert torch.isfinite(padded[i]).all()
        torch.testing.assert_close(padded[i][:, pad:], plain[i], atol=1e-5, rtol=1e-5)


def test_gradients_flow_through_all_steps(head_and_target):
    head, _ = head_and_target
    feats = torch.randn(1, 5, 3, head.config.target_hidden_size)
    ids = torch.randint(0, head.config.vocab_size, (1, 5))
    head.zero_grad()
    outs = ttt_forward(head, ids, head.project_features(feats), torch.ones(1, 5), 3)
    head.logits(outs[-1]).sum().backward()  # only the last step: its gradient reaches fc via the chain
    assert head.fc.weight.grad is not None and head.fc.weight.grad.abs().sum() > 0
    head.zero_grad()


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(0, 4), st.sampled_from([(2, 2), (4, 2), (6, 3)]), st.data())
def test_chain_attention_equals_dense_masked_attention(T, depth, heads, data):
    """The structured TTT attention (prefix block + chain keys) against SDPA over the dense mask it
    stands for: outputs and gradients of q, k, v, with padding, GQA and every depth."""
    import torch.nn.functional as F

    from eagle.algorithms.ttt import ttt_chain_mask
    from eagle.heads.layers import chain_attention

    nh, nkv = heads
    rows = data.draw(st.lists(st.lists(st.integers(0, 1), min_size=T, max_size=T), min_size=1, max_size=3))
    am = torch.tensor(rows)
    g = torch.Generator().manual_seed(T * 100 + depth)
    b, d = am.shape[0], 8
    q = torch.randn(b, nh, T, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, nkv, (depth + 1) * T, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, nkv, (depth + 1) * T, d, generator=g, dtype=torch.float64, requires_grad=True)
    mask = ttt_chain_mask(am, depth)
    assert torch.equal(mask.dense(), reference_ttt_mask(T, depth + 1, depth, am))
    out = chain_attention(q, k, v, mask)
    rep = nh // nkv
    dense = mask.dense() | ~mask.dense().any(-1, keepdim=True)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=dense)
    torch.testing.assert_close(out, ref)
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, r)


def test_chain_attention_refuses_a_cache_of_another_depth():
    from eagle.algorithms.ttt import ttt_chain_mask
    from eagle.heads.layers import chain_attention

    q, kv = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 8, 8)  # 2 x T keys: depth 1, not 2
    with pytest.raises(ValueError, match="depth 2 needs 12 keys, got 8"):
        chain_attention(q, kv, kv, ttt_chain_mask(torch.ones(1, 4), 2))
