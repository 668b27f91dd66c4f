"""Draft-head losses, each as a plain reference (loops) and a fast version that must match it.

Alignment (see `eagle.heads.base`): the head's output at sequence index t predicts token x_{t+2}
(and, for EAGLE-1, the feature f_{t+1}). Callers pass targets already aligned to the head's
step-0 output, so index t of every argument below describes the same prediction:

  EAGLE-1: target_feature[:, t] = f_{t+1}; the soft token target is softmax(lm_head(f_{t+1})).
  EAGLE-3: target_logits[:, t] = the target's logits for x_{t+2} (its logits at index t+1).
           At unroll step i the head output at t predicts x_{t+2+i}: the step uses index t+i of
           target_logits / loss_mask (nothing beyond the sequence end).

loss_mask [B, T] is 1 where the predicted token counts (assistant tokens, not padding).

Tokens outside the EAGLE-3 draft vocabulary: the soft target is the target distribution
restricted to the draft vocabulary and renormalised (softmax over the kept logits), i.e. the mass
of tokens the head cannot propose is dropped rather than pushed onto some draft token. The share
of positions whose target top-1 lies in the draft vocabulary is reported as `coverage`; top-1
accuracy counts positions whose target top-1 lies outside as wrong (the head cannot draft them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from eagle.algorithms.objectives import token_losses


def shift_left(x: torch.Tensor, n: int, fill: float | int | bool = 0) -> torch.Tensor:
    """out[:, t] = x[:, t + n] along dim 1, `fill` past the end. x [B, T, ...]."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat((x[:, n:], pad), dim=1)[:, : x.shape[1]]


def add_feature_noise(
    features: torch.Tensor, spread: float, training: bool = True, generator: torch.Generator | None = None
) -> torch.Tensor:
    """EAGLE-1's feature augmentation: add uniform noise in [-spread/2, spread/2) while training.

    The target's features at decode time come from the head's own (imperfect) predictions; noise
    on the training inputs makes the head robust to that error. Returns `features` unchanged when
    not training or spread == 0.
    """
    if not training or spread <= 0:
        return features
    noise = torch.rand(features.shape, generator=generator, device=features.device, dtype=torch.float32)
    return features + ((noise - 0.5) * spread).to(features.dtype)


# --------------------------------------------------------------------------------------- EAGLE-1
@dataclass
class Eagle1Loss:
    loss: torch.Tensor  # scalar: feature_weight * feature_loss + token_weight * token_loss
    feature_loss: torch.Tensor  # masked mean smooth-L1 (mean over the hidden dim)
    token_loss: torch.Tensor  # masked mean soft cross-entropy
    accuracy: torch.Tensor  # share of masked positions where head top-1 == target top-1
    count: int  # masked positions


def eagle1_loss_reference(
    pred_feature: torch.Tensor,  # [B, T, H] head output
    target_feature: torch.Tensor,  # [B, T, H] f_{t+1}
    lm_head_weight: torch.Tensor,  # [V, H] the target's LM head
    loss_mask: torch.Tensor,  # [B, T]
    feature_weight: float = 1.0,
    token_weight: float = 0.1,
) -> Eagle1Loss:
    """Plain per-position loop; the definition `eagle1_loss` must match."""
    feat_sum = pred_feature.new_zeros((), dtype=torch.float32)
    tok_sum = pred_feature.new_zeros((), dtype=torch.float32)
    correct, count = 0, 0
    w = lm_head_weight.float()
    for b in range(pred_feature.shape[0]):
        for t in range(pred_feature.shape[1]):
            if not loss_mask[b, t]:
                continue
            p, f = pred_feature[b, t].float(), target_feature[b, t].float()
            diff = (p - f).abs()
            feat_sum = feat_sum + torch.where(diff < 1.0, 0.5 * diff**2, diff - 0.5).mean()
            head_logits, target_logits = w @ p, w @ f  # [V]
            target_p = torch.softmax(target_logits, -1)
            tok_sum = tok_sum - (target_p * torch.log_softmax(head_logits, -1)).sum()
            correct += int(head_logits.argmax() == target_logits.argmax())
            count += 1
    n = max(count, 1)
    feature_loss, token_loss = feat_sum / n, tok_sum / n
    return Eagle1Loss(
        feature_weight * feature_loss + token_weight * token_loss,
        feature_loss,
        token_loss,
        torch.tensor(correct / n),
        count,
    )


def _soft_ce_chunk(p: torch.Tensor, f: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of soft CE, #top-1 matches) over rows p, f [N, H] through LM head w [V, H]."""
    head_logits = (p @ w.t()).float()  # [N, V]
    with torch.no_grad():
        target_logits = (f @ w.t()).float()  # [N, V]
        target_p = torch.softmax(target_logits, -1)
        correct = (head_logits.argmax(-1) == target_logits.argmax(-1)).sum()
    ce = -(target_p * torch.log_softmax(head_logits, -1)).sum()
    return ce, correct


def eagle1_loss(
    pred_feature: torch.Tensor,  # [B, T, H]
    target_feature: torch.Tensor,  # [B, T, H]
    lm_head_weight: torch.Tensor,  # [V, H]
    loss_mask: torch.Tensor,  # [B, T]
    feature_weight: float = 1.0,
    token_weight: float = 0.1,
    chunk_size: int = 1024,
) -> Eagle1Loss:
    """EAGLE-1 loss: feature regression (smooth-L1) + soft CE against the target's next-token distribution.

    Only masked positions are computed, and full-vocabulary logits are built `chunk_size` rows at a
    time under activation checkpointing, so peak memory is O(chunk_size x V) instead of O(B x T x V).
    """
    mask = loss_mask.to(torch.bool)
    count = int(mask.sum())
    n = max(count, 1)
    p = pred_feature[mask]  # [N, H]
    f = target_feature[mask].to(p.dtype).detach()  # [N, H]
    feature_loss = F.smooth_l1_loss(p.float(), f.float(), reduction="none").mean(-1).sum() / n
    w = lm_head_weight.to(p.dtype)
    token_sum = p.new_zeros((), dtype=torch.float32)
    correct = torch.zeros((), dtype=torch.long, device=p.device)
    for start in range(0, count, chunk_size):
        pc, fc = p[start : start + chunk_size], f[start : start + chunk_size]
        if torch.is_grad_enabled() and (pc.requires_grad or w.requires_grad):
            ce, ok = checkpoint(_soft_ce_chunk, pc, fc, w, use_reentrant=False)
        else:
            ce, ok = _soft_ce_chunk(pc, fc, w)
        token_sum = token_sum + ce
        correct = correct + ok
    token_loss = token_sum / n
    loss = feature_weight * feature_loss + token_weight * token_loss
    return Eagle1Loss(loss, feature_loss, token_loss, correct.float() / n, count)


# --------------------------------------------------------------------------------------- EAGLE-3
@dataclass
class Eagle3Loss:
    loss: torch.Tensor  # scalar: sum_i decay^i * step_losses[i]
    step_losses: list[torch.Tensor] = field(default_factory=list)  # masked mean soft CE per step
    step_accuracy: list[torch.Tensor] = field(default_factory=list)  # top-1 accuracy per step
    step_counts: list[torch.Tensor | int] = field(default_factory=list)  # masked positions per step (0-d)
    coverage: torch.Tensor | None = None  # step 0: share of positions whose target top-1 is in the draft vocab


def step_loss_mask(loss_mask: torch.Tensor, attention_mask: torch.Tensor | None, i: int) -> torch.Tensor:
    """[B, T] bool: step i at index t counts if x_{t+2+i} is a loss token and the chain start t is real."""
    m = shift_left(loss_mask.to(torch.bool), i, False)
    if attention_mask is not None:
        m = m & attention_mask.to(torch.bool)
    return m


def eagle3_loss_reference(
    step_logits: list[torch.Tensor],  # per step [B, T, Vd]
    target_logits: torch.Tensor,  # [B, T, V] aligned to step 0
    loss_mask: torch.Tensor,  # [B, T] aligned to step 0
    t2d: torch.Tensor,  # bool [V]
    d2t: torch.Tensor,  # int64 [Vd]
    decay: float = 0.8,
    attention_mask: torch.Tensor | None = None,  # [B, T] validity of the step-0 inputs
) -> Eagle3Loss:
    """Plain loop over steps and positions; the definition `eagle3_loss` must match."""
    b_size, t_size = loss_mask.shape
    total = target_logits.new_zeros((), dtype=torch.float32)
    out = Eagle3Loss(loss=total)
    covered = 0
    for i, logits in enumerate(step_logits):
        ce_sum = logits.new_zeros((), dtype=torch.float32)
        correct, count = 0, 0
        for b in range(b_size):
            for t in range(t_size - i):
                if not loss_mask[b, t + i] or (attention_mask is not None and not attention_mask[b, t]):
                    continue
                full = target_logits[b, t + i].float()  # [V]
                target_p = torch.softmax(full[t2d], -1)  # renormalised over the draft vocab, [Vd]
                ce_sum = ce_sum - (target_p * torch.log_softmax(logits[b, t].float(), -1)).sum()
                d = int(logits[b, t].argmax())
                correct += int(d + int(d2t[d]) == int(full.argmax()))
                if i == 0:
                    covered += int(bool(t2d[full.argmax()]))
                count += 1
        n = max(count, 1)
        step_loss = ce_sum / n
        total = total + decay**i * step_loss
        out.step_losses.append(step_loss)
        out.step_accuracy.append(torch.tensor(correct / n))
        out.step_counts.append(count)
        if i == 0:
            out.coverage = torch.tensor(covered / n)
    out.loss = total
    return out


@torch.no_grad()
def eagle3_targets(target_logits: torch.Tensor, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(draft-vocab target probs [B, T, Vd] float32, target top-1 ids [B, T], top-1-in-draft-vocab [B, T]).

    Computed once and shifted per unroll step, instead of a full-vocabulary softmax per step.
    """
    probs = torch.softmax(target_logits[..., t2d].float(), dim=-1)  # [B, T, Vd]
    top1 = target_logits.argmax(-1)  # [B, T]
    return probs, top1, t2d[top1]


def packed_positions(
    loss_mask: torch.Tensor,  # [B, T] aligned to step 0
    attention_mask: torch.Tensor | None,  # [B, T] validity of the step-0 inputs
    steps: int,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Where the unrolled loss reads: (label mask [B, T]: the positions whose target logits are needed,
    per step the mask [B, T] of the positions that count, per step the label row [N_i] each of those
    positions predicts, as an index into the label positions taken in row-major order).

    Step i at index t predicts the label at t + i; it counts only where that label is a loss token, so
    every label row a step reads is a loss position: the labels are computed there and nowhere else.
    """
    labels = loss_mask.to(torch.bool)
    row = labels.flatten().cumsum(0).view_as(labels) - 1  # [B, T] label row of each loss position
    masks = [step_loss_mask(labels, attention_mask, i) for i in range(steps)]
    return labels, masks, [shift_left(row, i, -1)[m] for i, m in enumerate(masks)]


def eagle3_loss_packed(
    step_logits: list[torch.Tensor],  # per step [N_i, Vd]: the head's logits where step i counts
    target_logits: torch.Tensor,  # [N, V]: the target's logits at the label positions
    step_rows: list[torch.Tensor],  # per step [N_i]: the label row each step-i logit predicts
    t2d: torch.Tensor,  # bool [V]
    d2t: torch.Tensor,  # int64 [Vd]
    decay: float = 0.8,
    loss: str = "ce",
) -> Eagle3Loss:
    """`eagle3_loss` on the positions that count only (`packed_positions`): the LM heads, softmaxes and
    argmaxes run on N_i rows instead of B x T (prompts and padding are no loss tokens). `loss` other than
    ce: the LK objectives of `eagle.algorithms.objectives` against the same renormalised target law."""
    probs, top1, in_vocab = eagle3_targets(target_logits, t2d.to(target_logits.device))  # [N, Vd], [N], [N]
    total = target_logits.new_zeros((), dtype=torch.float32)
    out = Eagle3Loss(loss=total)
    for i, (logits, rows) in enumerate(zip(step_logits, step_rows, strict=True)):
        count = torch.tensor(rows.numel(), device=logits.device)
        n = count.clamp(min=1)
        logp = torch.log_softmax(logits.float(), dim=-1)  # [N_i, Vd]
        step_loss = token_losses(loss, logp, probs[rows]).sum() / n
        with torch.no_grad():
            drafted = logits.argmax(-1)  # [N_i] draft ids
            drafted = drafted + d2t.to(drafted.device)[drafted]  # -> target ids
            correct = (drafted == top1[rows]).sum()
        total = total + decay**i * step_loss
        out.step_losses.append(step_loss)
        out.step_accuracy.append(correct.float() / n)
        out.step_counts.append(count)
        if i == 0:
            out.coverage = in_vocab[rows].sum().float() / n
    out.loss = total
    return out


def eagle3_loss(
    step_logits: list[torch.Tensor],  # per step [B, T, Vd]
    target_logits: torch.Tensor,  # [B, T, V] aligned to step 0
    loss_mask: torch.Tensor,  # [B, T]
    t2d: torch.Tensor,  # bool [V]
    d2t: torch.Tensor,  # int64 [Vd]
    decay: float = 0.8,
    attention_mask: torch.Tensor | None = None,
) -> Eagle3Loss:
    """EAGLE-3 training-time-test loss: sum_i decay^i * masked-mean soft CE of step i, from dense
    [B, T, ...] logits (packed to the positions that count, `eagle3_loss_packed`)."""
    labels, masks, rows = packed_positions(loss_mask, attention_mask, len(step_logits))
    return eagle3_loss_packed(
        [x[m] for x, m in zip(step_logits, masks, strict=True)], target_logits[labels], rows, t2d, d2t, decay
    )
