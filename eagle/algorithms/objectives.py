"""What each drafted position is trained against (`train.loss`) and how positions are weighted
(`train.position_weights`); plain references beside the fast versions.

Per drafted token, with p the target's law over the draft's vocabulary, q the head's and
alpha = sum_x min(p, q)(x), the chance that speculative sampling accepts a token drawn from q:
  ce         -sum_x p(x) log q(x): soft cross-entropy, KL(p || q) up to p's entropy (the EAGLE loss)
  lk_tv      1 - alpha, the total variation 1/2 sum_x |p(x) - q(x)| (LK losses, arXiv 2602.23881)
  lk_nla     -log max(alpha, 1e-5): the same optimum with the gradient of tv scaled by 1 / alpha
  lk_hybrid  lam * KL(p || q) + (1 - lam) * (1 - alpha), lam = exp(-3 alpha) from the detached alpha
             of that token: KL's dense gradient while the head is far from the target, the acceptance
             itself once it is close (the setting speculators ships as the paper's best)

Position weights over the n drafted positions j = 1..n of one pass (block drafters: the block's
positions; EAGLE: the unroll steps):
  uniform    1
  decay      exp(-(j - 1) / gamma) (DFlash's; gamma 7 for blocks of 16, 5 for 10, 4 for 8)
  dpace      D-PACE (arXiv 2605.18810), per token of each block: q_i = exp(-CE_i) (the head's
             probability of the label, here the geometric mean of q under p), smoothed
             s_i = a + (1 - a) q_i with a = 0.5, C_j = prod_{i <= j} s_i (how likely the chain reaches
             j), w_j = sum_{m >= j} C_m (what getting j right is worth, its continuation included);
             detached, as Model-Optimizer's DFlash default
Static weights are normalised to mean 1, so a change of rule keeps the learning rate's scale.
"""

from __future__ import annotations

import math

import torch

from eagle.config import LOSSES

_NLA_EPS = 1e-5  # alpha floor inside -log alpha: a head that puts no mass where p does gets a finite loss
_HYBRID_ETA = 3.0  # lk_hybrid: lam = exp(-eta * alpha)
DPACE_SMOOTHING = 0.5  # D-PACE's a: the floor under each position's confidence (stable in [0.3, 0.7])


def acceptance(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """[N, V] target law p and head log-law -> [N] alpha = sum_x min(p, q)(x)."""
    return torch.minimum(p, logq.exp()).sum(-1)


def token_losses(kind: str, logq: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Per-row loss [N] of head log-probabilities logq [N, V] (float32) against the target law p [N, V]."""
    if kind == "ce":
        return -(p * logq).sum(-1)
    alpha = acceptance(p, logq)  # [N]
    if kind == "lk_tv":
        return 1.0 - alpha
    if kind == "lk_nla":
        return -alpha.clamp(min=_NLA_EPS).log()
    if kind == "lk_hybrid":
        kl = (p * (p.clamp(min=1e-30).log() - logq)).sum(-1)  # 0 log 0 = 0
        lam = torch.exp(-_HYBRID_ETA * alpha.detach())
        return lam * kl + (1.0 - lam) * (1.0 - alpha)
    raise ValueError(f"train.loss={kind!r} is not one of {', '.join(LOSSES)}")


def token_loss_reference(kind: str, logq: list[float], p: list[float]) -> float:
    """One row, in plain Python floats: the definition `token_losses` must match."""
    pairs = list(zip(p, logq, strict=True))
    alpha = math.fsum(min(pi, math.exp(lq)) for pi, lq in pairs)
    if kind == "ce":
        return -math.fsum(pi * lq for pi, lq in pairs if pi > 0)
    if kind == "lk_tv":
        return 1.0 - alpha
    if kind == "lk_nla":
        return -math.log(max(alpha, _NLA_EPS))
    if kind == "lk_hybrid":
        kl = math.fsum(pi * (math.log(pi) - lq) for pi, lq in pairs if pi > 0)
        lam = math.exp(-_HYBRID_ETA * alpha)
        return lam * kl + (1.0 - lam) * (1.0 - alpha)
    raise ValueError(kind)


def position_weights(rule: str, n: int, gamma: float) -> torch.Tensor:
    """[n] static weights of drafted positions 1..n (uniform | decay), mean 1."""
    j = torch.arange(n, dtype=torch.float64)
    if rule == "uniform":
        w = torch.ones(n, dtype=torch.float64)
    elif rule == "decay":
        w = torch.exp(-j / gamma)
    else:
        raise ValueError(f"static position weights {rule!r} are uniform or decay (dpace weighs each token)")
    return (w / w.mean()).float()


def dpace_weights(confidence: torch.Tensor, valid: torch.Tensor, smoothing: float = DPACE_SMOOTHING) -> torch.Tensor:
    """D-PACE weights [..., n] of the drafted positions of each block from the head's confidence
    q_i = exp(-CE_i) [..., n] where `valid` [..., n] (other positions act as a factor 1 and get weight 0)."""
    s = torch.where(valid, smoothing + (1.0 - smoothing) * confidence.detach().float(), torch.ones_like(confidence))
    c = torch.cumprod(s, dim=-1) * valid  # [..., n] C_j, zero where invalid
    return (c.sum(-1, keepdim=True) - c.cumsum(-1) + c) * valid  # suffix sums w_j = sum_{m >= j} C_m


def position_weights_reference(rule: str, n: int, gamma: float) -> list[float]:
    """Loops over positions: the definition `position_weights` must match."""
    w = [1.0 if rule == "uniform" else math.exp(-j / gamma) for j in range(n)]
    mean = math.fsum(w) / n
    return [x / mean for x in w]


def dpace_weights_reference(
    confidence: list[float], valid: list[bool], smoothing: float = DPACE_SMOOTHING
) -> list[float]:
    """One block, with loops: the definition `dpace_weights` must match."""
    n, c, reach = len(confidence), [], 1.0
    for i in range(n):
        if valid[i]:
            reach *= smoothing + (1.0 - smoothing) * confidence[i]
        c.append(reach if valid[i] else 0.0)
    return [math.fsum(c[j:]) if valid[j] else 0.0 for j in range(n)]
