"""What each drafted position is trained against (`train.loss`) and how positions are weighted
(`train.position_weights`), for every draft algorithm; plain references beside the fast versions.

Per drafted token, with p the target's law over the draft's vocabulary and q the head's:
  ce         KL(p || q) up to p's entropy: -sum_x p(x) log q(x) (soft cross-entropy, the EAGLE loss)
  lk_tv      total variation 1/2 sum_x |p(x) - q(x)| = 1 - alpha, where alpha = sum_x min(p, q)(x) is the
             chance that speculative sampling accepts a token drawn from q (the LK losses, arXiv 2602.23881)
  lk_nla     -log alpha (negative log acceptance): the same optimum, steeper far from it
  lk_hybrid  (1 - w) * ce + w * (-log alpha): the cross-entropy's dense gradient while q is far from p,
             the acceptance itself once it is close (w = train.lk_hybrid_weight)

Position weights over the n drafted positions j = 1..n of one pass:
  uniform    1
  decay      exp(-(j - 1) / gamma) (DFlash's; EAGLE-3's ttt_decay^(j-1) is the same rule with
             gamma = -1 / log(ttt_decay))
  dpace      the chance the chain reaches position j, prod_{i < j} alpha_i, from the head's own mean
             acceptance per position on the batch (detached): positions the chain rarely reaches stop
             pulling on the shared weights (D-PACE, arXiv 2605.18810)
Weights are normalised to mean 1, so a change of rule does not change the learning rate's scale.
"""

from __future__ import annotations

import math

import torch

LOSSES = ("ce", "lk_tv", "lk_nla", "lk_hybrid")
_EPS = 1e-12  # alpha floor inside -log alpha: a head that puts no mass where p does gets a finite loss


def acceptance(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """[N, V] target law p and head log-law -> [N] alpha = sum_x min(p, q)(x)."""
    return torch.minimum(p, logq.exp()).sum(-1)


def token_losses(kind: str, logq: torch.Tensor, p: torch.Tensor, hybrid_weight: float = 0.5) -> torch.Tensor:
    """Per-row loss [N] of head log-probabilities logq [N, V] (float32) against the target law p [N, V]."""
    if kind == "ce":
        return -(p * logq).sum(-1)
    if kind == "lk_tv":
        return 0.5 * (p - logq.exp()).abs().sum(-1)
    if kind == "lk_nla":
        return -acceptance(p, logq).clamp(min=_EPS).log()
    if kind == "lk_hybrid":
        ce = -(p * logq).sum(-1)
        return (1.0 - hybrid_weight) * ce - hybrid_weight * acceptance(p, logq).clamp(min=_EPS).log()
    raise ValueError(f"train.loss={kind!r} is not one of {', '.join(LOSSES)}")


def token_loss_reference(kind: str, logq: list[float], p: list[float], hybrid_weight: float = 0.5) -> float:
    """One row, in plain Python floats: the definition `token_losses` must match."""
    q = [math.exp(x) for x in logq]
    ce = -math.fsum(pi * lq for pi, lq in zip(p, logq, strict=True) if pi > 0)
    alpha = math.fsum(min(pi, qi) for pi, qi in zip(p, q, strict=True))
    nla = -math.log(max(alpha, _EPS))
    if kind == "ce":
        return ce
    if kind == "lk_tv":
        return 0.5 * math.fsum(abs(pi - qi) for pi, qi in zip(p, q, strict=True))
    if kind == "lk_nla":
        return nla
    if kind == "lk_hybrid":
        return (1.0 - hybrid_weight) * ce + hybrid_weight * nla
    raise ValueError(kind)


def position_weights(rule: str, n: int, gamma: float, alphas: torch.Tensor | None = None) -> torch.Tensor:
    """[n] weights of drafted positions 1..n, mean 1. `alphas` [n]: the head's mean acceptance per
    position (dpace only)."""
    j = torch.arange(n, dtype=torch.float64)
    if rule == "uniform":
        w = torch.ones(n, dtype=torch.float64)
    elif rule == "decay":
        w = torch.exp(-j / gamma)
    elif rule == "dpace":
        if alphas is None:
            raise ValueError("position_weights=dpace needs the head's acceptance per position")
        a = alphas.detach().double().cpu().clamp(0.0, 1.0)
        w = torch.cat([torch.ones(1, dtype=torch.float64), torch.cumprod(a, 0)[:-1]])  # chance to reach j
        w = w.clamp(min=1e-3)  # a position the chain never reaches keeps a little signal
    else:
        raise ValueError(f"position weights {rule!r} are not one of uniform, decay, dpace")
    return (w / w.mean()).float()


def position_weights_reference(rule: str, n: int, gamma: float, alphas: list[float] | None = None) -> list[float]:
    """Loops over positions: the definition `position_weights` must match."""
    w = []
    for j in range(n):
        if rule == "uniform":
            w.append(1.0)
        elif rule == "decay":
            w.append(math.exp(-j / gamma))
        else:
            assert alphas is not None
            reach = 1.0
            for i in range(j):
                reach *= min(max(alphas[i], 0.0), 1.0)
            w.append(max(reach, 1e-3))
    mean = math.fsum(w) / n
    return [x / mean for x in w]
