"""Training-time test (TTT) for EAGLE-3: unroll the head on its own outputs, as in decoding.

At decode time the head runs step 0 on the prefix (target features), then feeds each output back
as the next step's hidden state. TTT reproduces that in one batched pass per step:

  step 0: index t reads (x_{t+1}, h_t = fc(features_t)) at position t+1, causal over the sequence.
  step i: index t reads (x_{t+1+i}, out_{i-1}[t]) at position t+1+i and attends to
          - step-0 keys at indices s <= t (causal, real tokens only), and
          - its own chain's keys of steps 1..i, all at index t (the "diagonal").

That is exactly what a decoder sees when it drafts i tokens after the prefix ending at t, so the
unrolled step-i output at index t equals an explicit decoding loop (tested in tests/test_ttt.py).
Keys of all steps are concatenated in a `transformers.DynamicCache`: at step i it holds
(i + 1) x T keys ordered [step 0 | step 1 | ... | step i]. The head sees that pattern as an
`UnrolledChainMask` (prefix block + chain keys), not as the dense `ttt_mask`, which would make step i
cost (i + 1)x step 0 in attention although each query has only i keys beyond the prefix.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from eagle.algorithms.losses import shift_left
from eagle.heads.base import DraftHead
from eagle.heads.layers import UnrolledChainMask


def reference_ttt_mask(T: int, steps: int, i: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [B, 1, T, (i + 1) * T] for unroll step i, built with plain loops (the definition).

    attention_mask [B, T] (1 = real) marks valid step-0 inputs; None = all real. `steps` is the
    total unroll length (only checked: i < steps). A padding query may still attend to its own
    step-0 key so that no row is empty (its output is never used).
    """
    if not 0 <= i < steps:
        raise ValueError(f"step {i} outside [0, {steps})")
    valid = torch.ones(1, T, dtype=torch.bool) if attention_mask is None else attention_mask.to(torch.bool)
    mask = torch.zeros(valid.shape[0], 1, T, (i + 1) * T, dtype=torch.bool)
    for b in range(valid.shape[0]):
        for t in range(T):
            for s in range(t + 1):
                mask[b, 0, t, s] = bool(valid[b, s]) or s == t
            for j in range(1, i + 1):
                mask[b, 0, t, j * T + t] = True
    return mask


def ttt_chain_mask(attention_mask: torch.Tensor, i: int) -> UnrolledChainMask:
    """Step i's mask as the head's attention takes it: attention_mask [B, T] -> step-0 prefix block
    [B, 1, T, T] (causal over real tokens, plus each query's own key) and i chain keys."""
    valid = attention_mask.to(torch.bool)
    t = valid.shape[1]
    eye = torch.eye(t, dtype=torch.bool, device=valid.device)  # [T, T]
    causal = torch.ones(t, t, dtype=torch.bool, device=valid.device).tril()  # [T(q), T(k)]
    return UnrolledChainMask(prefix=((causal[None] & valid[:, None, :]) | eye[None])[:, None], depth=i)


def ttt_mask(attention_mask: torch.Tensor, i: int) -> torch.Tensor:
    """Vectorised `reference_ttt_mask`: attention_mask [B, T] -> bool [B, 1, T, (i + 1) * T]."""
    return ttt_chain_mask(attention_mask, i).dense()


def ttt_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Step-0 position ids [B, T]: index t holds x_{t+1}, whose position is #real tokens up to it - 1.

    Works for right and left padding: with no padding this is t + 1.
    """
    return attention_mask.long().cumsum(-1)  # [B, T]


def ttt_forward(
    head: DraftHead,
    input_ids: torch.Tensor,  # [B, T] step-0 input tokens: index t holds x_{t+1}
    hidden0: torch.Tensor,  # [B, T, H] step-0 hidden states (head.project_features of the target's)
    attention_mask: torch.Tensor,  # [B, T] 1 = real step-0 input
    steps: int,
    position_ids: torch.Tensor | None = None,  # [B, T] or [3, B, T] step-0 positions; default ttt_position_ids
    pad_token_id: int = 0,
    dense_mask: bool = False,
) -> list[torch.Tensor]:
    """Unroll `steps` head steps; returns the output hidden [B, T, H] of each step.

    Step i's input token at index t is x_{t+1+i} (`input_ids` shifted left by i, `pad_token_id`
    past the end; those positions must be masked out of the loss, see `eagle.algorithms.losses`).
    dense_mask=True attends through SDPA with the dense `ttt_mask` (the plain definition, which
    `benchmarks/studies/ttt.py` times against the default structured attention; the results are equal).
    """
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    base_pos = ttt_position_ids(attention_mask) if position_ids is None else position_ids
    cache = DynamicCache()
    hidden, outs = hidden0, []
    prefix = ttt_chain_mask(attention_mask, 0).prefix  # [B, 1, T, T], the same at every step
    for i in range(steps):
        ids = shift_left(input_ids, i, pad_token_id)  # [B, T]
        chain = UnrolledChainMask(prefix, depth=i)  # the keys of ttt_mask(attention_mask, i)
        mask = chain.dense() if dense_mask else chain  # dense: [B, 1, T, (i+1)T]
        hidden = head(ids, hidden, base_pos + i, attention_mask=mask, past_key_values=cache)  # [B, T, H]
        outs.append(hidden)
    return outs
