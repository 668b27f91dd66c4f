"""Approximate acceptance rules (`decode.acceptance=typical|lenient`) and the exact law of what they emit.

The exact rule (`eagle.decode.accept`) draws y from the target's processed law p at a node and walks
to the child whose token is y, so the emitted token follows p. The approximate rules keep that draw
and only act where it misses every drafted child, i.e. where the exact rule would stop:
  * typical (Medusa's typical acceptance): child x passes when p(x) > min(epsilon, delta * exp(-H(p))),
    H the entropy of p (Medusa: posterior_threshold = epsilon = 0.09, posterior_alpha = delta = 0.3);
  * lenient: child x passes when it is among the target's `top_k` logits and within `margin` logits
    of the top-1 (raw logits, before temperature; when sampling it must also be in p's support).
On a miss the walk takes the passing child with the highest target logit; with none passing, y is the
bonus token, as in the exact rule. Trying the draw first costs nothing in acceptance (the same event
accepts) and shifts the law less than a rule that ignores it (the shift is the mass of the
non-drafted tokens, not all of 1 - p(x)).

The law of the token emitted at a node, given p, the drafted children C (in the order the walk tries
them) and the set A of children that pass, is therefore exact and cheap:
    q(x) = p(x) + [x = a] * m   for x in C,     q(x) = [A empty] * p(x)   for x not in C,
with a the first passing child and m = p(not C). So TV(p, q) = m and KL(q || p) = (p(a) + m) log(1 + m / p(a))
wherever A is non-empty, and both are 0 elsewhere (and always for exact). KL is taken in the
direction q || p: it is finite wherever the rule only emits tokens the target could emit, whereas
KL(p || q) is infinite at every node where a rule fires (it removes all mass of the non-drafted tokens).
`emitted_law` computes q for many nodes at once; `emitted_law_reference` enumerates the target's draw.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from eagle.config import ACCEPTANCE_RULES, DecodeConfig
from eagle.decode.accept import Acceptance, process_logits, sample_index

APPROXIMATE_RULES = tuple(r for r in ACCEPTANCE_RULES if r != "exact")


@dataclass(frozen=True)
class AcceptanceRule:
    """`decode.acceptance` and the thresholds that apply to it."""

    name: str = "exact"
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3
    lenient_top_k: int = 2
    lenient_margin: float = 1.0

    @classmethod
    def from_config(cls, decode: DecodeConfig) -> AcceptanceRule:
        return cls(
            decode.acceptance, decode.typical_epsilon, decode.typical_delta, decode.lenient_top_k, decode.lenient_margin
        )

    @property
    def lossless(self) -> bool:
        return self.name == "exact"

    def settings(self) -> dict[str, Any]:
        """The rule and the thresholds it reads (what a report records)."""
        if self.name == "typical":
            return {"rule": "typical", "typical_epsilon": self.typical_epsilon, "typical_delta": self.typical_delta}
        if self.name == "lenient":
            return {"rule": "lenient", "lenient_top_k": self.lenient_top_k, "lenient_margin": self.lenient_margin}
        return {"rule": self.name}


def acceptance_label(settings: Mapping[str, Any] | str | None) -> str:
    """'' for exact (or a report without the field: only exact existed before); otherwise the label every
    report line, plot title and model-card row made with an approximate rule carries."""
    if settings is None:
        return ""
    if isinstance(settings, str):
        settings = {"rule": settings}
    rule = settings.get("rule", "exact")
    if rule == "exact":
        return ""
    thresholds = ", ".join(f"{k.split('_', 1)[1]}={v}" for k, v in settings.items() if k != "rule")
    return f"APPROXIMATE acceptance: {rule}{f' ({thresholds})' if thresholds else ''}, not lossless"


# --- which tokens a rule accepts ------------------------------------------------------------------------


def accepted_tokens(rule: AcceptanceRule, logits: torch.Tensor, p: torch.Tensor, temperature: float) -> torch.Tensor:
    """[N, V] raw target logits and [N, V] processed law -> [N, V] bool: tokens the rule accepts as a draft
    where the target's draw missed every child (all False for exact)."""
    if rule.name == "typical":
        entropy = -torch.xlogy(p, p).sum(-1, keepdim=True).double()  # [N, 1] nats (0 log 0 = 0; float32 sum: fast)
        threshold = torch.clamp(rule.typical_delta * torch.exp(-entropy), max=rule.typical_epsilon)  # [N, 1]
        return p.double() > threshold
    if rule.name == "lenient":
        scores = logits.float()
        k = min(rule.lenient_top_k, scores.shape[-1])
        kth = scores.topk(k, dim=-1).values[..., -1:]  # [N, 1] k-th largest logit (ties at it pass too)
        top = scores.max(-1, keepdim=True).values  # [N, 1]
        ok = (scores >= kth) & (scores >= top - rule.lenient_margin)
        if temperature > 0:  # never emit a token top-k / top-p sampling could not emit
            ok &= p > 0
        return ok
    return torch.zeros(p.shape, dtype=torch.bool, device=p.device)


def accepted_among(
    rule: AcceptanceRule, row: torch.Tensor, p: torch.Tensor | None, temperature: float, tokens: torch.Tensor
) -> torch.Tensor:
    """`accepted_tokens` at one node for the K drafted `tokens` only: what the walk needs, one pass over V.

    row: [V] raw logits; p: [V] processed law, or None at temperature 0 (one-hot at the argmax, not built).
    Returns [K] bool.
    """
    if rule.name == "typical":
        if p is None:  # one-hot law: entropy 0, so only the argmax (p = 1) can pass
            return (tokens == row.argmax()) & (1.0 > min(rule.typical_epsilon, rule.typical_delta))
        entropy = -torch.xlogy(p, p).sum().double()  # as in `accepted_tokens`
        threshold = torch.clamp(rule.typical_delta * torch.exp(-entropy), max=rule.typical_epsilon)
        return p[tokens].double() > threshold
    if rule.name == "lenient":
        scores = row.float()
        values = scores.topk(min(rule.lenient_top_k, scores.shape[-1])).values  # [k], highest first
        mine = scores[tokens]  # [K]
        ok = (mine >= values[-1]) & (mine >= values[0] - rule.lenient_margin)
        if temperature > 0 and p is not None:
            ok &= p[tokens] > 0
        return ok
    return torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)


def accepted_tokens_reference(
    rule: AcceptanceRule, logits: list[float], p: list[float], temperature: float
) -> list[bool]:
    """Loop version of `accepted_tokens` at one node."""
    if rule.name == "typical":
        entropy = -sum(x * math.log(x) for x in p if x > 0)
        threshold = min(rule.typical_epsilon, rule.typical_delta * math.exp(-entropy))
        return [x > threshold for x in p]
    if rule.name == "lenient":
        top = max(logits)
        out = []
        for v, x in zip(logits, p, strict=True):
            above = sum(1 for w in logits if w > v)  # tokens strictly better: rank of v
            out.append(above < rule.lenient_top_k and v >= top - rule.lenient_margin and (temperature <= 0 or x > 0))
        return out
    return [False] * len(p)


# --- the law of the emitted token ------------------------------------------------------------------------


def emitted_law(p: torch.Tensor, children: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """Exact law of the token emitted at each node.

    p: [N, V] the target's processed law; children: [N, K] drafted child tokens in the order the walk
    tries them (distinct per row, -1 padded); accepted: [N, V] bool from `accepted_tokens`. Returns q [N, V]
    (q == p for exact, where `accepted` is all False), normalised in float64.
    """
    # p comes from a float32 softmax and sums to 1 only within ~V * 2^-24; a draw (`sample_index`)
    # inverts the CDF scaled by its total, so the law it samples is p over its sum, taken here in float64.
    q = p.double()
    q = q / q.sum(-1, keepdim=True)
    valid = children >= 0  # [N, K]
    safe = children.clamp(min=0)
    passing = accepted.gather(1, safe) & valid  # [N, K]
    fires = passing.any(1)  # [N] some child passes: a missed draw lands on the first passing child
    first = passing.long().argmax(1)  # [N] first True (0 where none: masked by `fires`)
    best = safe.gather(1, first[:, None]).squeeze(1)  # [N] its token
    n, v = q.shape
    # Padding points at an extra column, so it can never clear a real child's mark.
    drafted = torch.zeros(n, v + 1, dtype=torch.bool, device=q.device)
    drafted = drafted.scatter_(1, torch.where(valid, children, v), True)[:, :v]  # [N, V]
    missed = (q * ~drafted).sum(1)  # [N] p(not C): the draws that miss every child
    keep = torch.where(fires[:, None], drafted, torch.ones_like(drafted))  # [N, V]
    q = q * keep
    q[torch.arange(n), best] += torch.where(fires, missed, torch.zeros_like(missed))
    return q


def emitted_law_reference(p: list[float], children: list[int], accepted: list[bool]) -> list[float]:
    """Enumerate the target's draw y at one node: y on a child is emitted; a miss emits the first passing
    child, or y itself when none passes."""
    passing = [c for c in children if accepted[c]]
    total = math.fsum(p)  # a draw samples p over its total (`sample_index`)
    q = [0.0] * len(p)
    for y, py in enumerate(p):
        emitted = y if y in children or not passing else passing[0]
        q[emitted] += py / total
    return q


def shift(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, V] target law and emitted law -> ([N] total variation, [N] KL(q || p)); KL is inf where q puts
    mass on a token p gives 0."""
    p, q = p.double(), q.double()
    p = p / p.sum(-1, keepdim=True)  # the law a draw samples (see `emitted_law`)
    tv = 0.5 * (p - q).abs().sum(-1)
    ratio = torch.where(q > 0, q / p, torch.ones_like(q))  # 0 log 0 = 0; q > 0 = p -> inf
    kl = (q * torch.log(ratio)).sum(-1)
    return tv, kl


def node_shift(p_children: list[float], best: int | None) -> tuple[float, float]:
    """(TV, KL(q || p)) at one node in closed form: p_children = p at the drafted children, best = the
    index among them the rule would take on a miss (None: no child passes, q = p)."""
    if best is None:
        return 0.0, 0.0
    m = max(0.0, 1.0 - math.fsum(p_children))  # p(not C)
    pb = p_children[best]
    if m == 0.0:
        return 0.0, 0.0
    return m, (math.inf if pb == 0.0 else (pb + m) * math.log1p(m / pb))


@dataclass
class ShiftStats:
    """Sums over verified positions (every node a walk emitted a token at)."""

    positions: int = 0
    tv: float = 0.0  # sum of TV(p, q)
    kl: float = 0.0  # sum of the finite KL(q || p)
    kl_infinite: int = 0  # positions where q gives mass to a token p gives 0 (lenient at temperature 0)

    def add(self, other: ShiftStats) -> None:
        self.positions += other.positions
        self.tv += other.tv
        self.kl += other.kl
        self.kl_infinite += other.kl_infinite


def walk_tree_approx(
    tree_tokens: torch.Tensor,  # [N + 1] node tokens (root included)
    parents: torch.Tensor,  # [N + 1] parent index, -1 for the root
    logits: torch.Tensor,  # [N + 1, V] target logits at every tree node
    rule: AcceptanceRule,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[Acceptance, ShiftStats]:
    """`walk_tree` with the rule's fallback where the draw misses: same draws, same randomness (a rule that
    never fires walks exactly as `walk_tree`), plus the shift of the emitted law at every reached node."""
    tokens, parent_of = tree_tokens.tolist(), parents.tolist()
    kids: dict[int, list[int]] = {}
    for c, par in enumerate(parent_of):
        if par >= 0:
            kids.setdefault(par, []).append(c)
    stats = ShiftStats()
    node, nodes = 0, [0]
    while True:
        row = logits[node].float()  # [V]
        if temperature <= 0:  # as `sample_token` draws; the one-hot law is never built
            y, p = int(row.argmax()), None
        else:
            p = process_logits(row[None], temperature, top_k, top_p)[0]  # [V]
            y = sample_index(p, generator)
        stats.positions += 1
        children = kids.get(node, [])
        child = next((c for c in children if tokens[c] == y), None)
        if children:
            idx = torch.tensor([tokens[c] for c in children], device=row.device)  # [K]
            scores = row[idx].tolist()
            probs = [float(t == y) for t in idx.tolist()] if p is None else p[idx].tolist()
            ok = accepted_among(rule, row, p, temperature, idx).tolist()
            # Try order: the target's logit, highest first (ties: tree order), so a miss takes the passing
            # child the target likes best (for lenient at T = 0, its own top-1 is always the draw).
            order = sorted(range(len(children)), key=lambda i: (-scores[i], i))
            best = next((j for j, i in enumerate(order) if ok[i]), None)
            tv, kl = node_shift([probs[i] for i in order], best)
            stats.tv += tv
            if math.isinf(kl):
                stats.kl_infinite += 1
            else:
                stats.kl += kl
            if child is None and best is not None:
                child = children[order[best]]
        if child is None:
            break
        node = child
        nodes.append(node)
    acc = Acceptance(nodes=torch.tensor(nodes, device=tree_tokens.device), tokens=[tokens[n] for n in nodes[1:]] + [y])
    return acc, stats


# --- transformers' assistant_ensemble_weight, side by side with ours (docs/acceptance.md) ------------------


def ensemble_accept(
    draft_tokens: torch.Tensor,  # [K] a chain of drafted tokens
    draft_probs: torch.Tensor,  # [K, V] the law each was drafted from (one-hot rows: deterministic drafts)
    target_probs: torch.Tensor,  # [K + 1, V] the target's processed law after 0..K accepted drafts
    uniforms: torch.Tensor,  # [K + 1] U(0, 1): one per acceptance test, the last for the emitted draw
    weight: float,  # w in [0, 1]; 1 = speculative sampling (lossless), 0 = every draft accepted
) -> tuple[list[int], int]:
    """transformers' `assistant_ensemble_weight` rule (`generation/utils.py: _speculative_sampling`,
    DIVERSE's static ensemble verification) on one chain: (accepted drafts, bonus token).

    Speculative sampling against v = w * p + (1 - w) * q instead of p: draft i (token x, drafted from q)
    is accepted when u_i <= v(x) / q(x) = 1 - w + w * p(x) / q(x); at the first rejection the token is
    drawn from norm(max(v - q, 0)) = norm(max(p - q, 0)) (falling back to p where that residual is 0, as
    transformers does); after K acceptances the bonus is drawn from p. So the token emitted at each
    position follows v, and TV(p, v) = (1 - w) * TV(p, q); the acceptance at a position is
    sum min(q, v) = 1 - w * TV(p, q). Draws invert the float64 CDF with the last uniform (`sample_index`).
    Not a `decode.acceptance` value: it needs each draft's law q (sampled chains), while the approximate
    rules act on top-k trees (docs/acceptance.md)."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"ensemble weight {weight} must be in [0, 1]")
    k = int(draft_tokens.numel())
    tokens = draft_tokens.tolist()
    for i in range(k):
        x = tokens[i]
        p, q = target_probs[i].double(), draft_probs[i].double()
        p, q = p / p.sum(), q / q.sum()
        ratio = (1.0 - weight) + weight * float(p[x]) / float(q[x])  # q(x) > 0: x was drafted from q
        if float(uniforms[i]) <= ratio:
            continue
        residual = (p - q).clamp(min=0.0)
        if float(residual.sum()) <= torch.finfo(torch.float64).tiny:
            residual = p
        return tokens[:i], _invert(residual, float(uniforms[k]))
    return tokens, _invert(target_probs[k].double(), float(uniforms[k]))


def _invert(probs: torch.Tensor, u: float) -> int:
    """The token whose CDF step holds u * total (as `sample_index` draws)."""
    cdf = probs.double().cumsum(0)
    return int(
        torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True).clamp(
            max=cdf.numel() - 1
        )
    )


def ensemble_law(p: torch.Tensor, q: torch.Tensor, weight: float) -> torch.Tensor:
    """[..., V] target and draft laws -> [..., V] the law `ensemble_accept` emits at a position it reaches:
    v = w * p + (1 - w) * q (p itself where p == q)."""
    p, q = p.double(), q.double()
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    return weight * p + (1.0 - weight) * q


__all__ = [
    "APPROXIMATE_RULES",
    "AcceptanceRule",
    "ShiftStats",
    "acceptance_label",
    "accepted_among",
    "accepted_tokens",
    "accepted_tokens_reference",
    "emitted_law",
    "emitted_law_reference",
    "ensemble_accept",
    "ensemble_law",
    "node_shift",
    "shift",
    "walk_tree_approx",
]
