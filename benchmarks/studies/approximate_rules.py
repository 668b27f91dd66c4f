"""Approximate acceptance rules side by side, exactly: transformers' `assistant_ensemble_weight` against our
`decode.acceptance` rules (typical, lenient) at the same tau, with the total-variation distance of what
each emits from the target's law. Laws, not timings: every number is a sum over outcomes, no sampling.

The setting (docs/acceptance.md, "Approximate rules side by side"): a vocab-8 target whose next-token
logits depend on the last two tokens (a seeded table, N(0, sigma^2) entries), and a draft whose logits are
the target's plus a fixed seeded noise table (the draft's law q is fixed given the context). One verify
pass checks a chain of `--gamma` drafts, so every rule pays the same draft cost:
    * ensemble (transformers): drafts sampled from q, accepted against w * p + (1 - w) * q
      (`eagle.decode.approximate.ensemble_accept`; w = 1 is exact speculative sampling);
    * ensemble on the top-1 chain: the same rule with one-hot q (drafts = argmax q);
    * typical / lenient (ours): the top-1 chain, the target's draw tried first, the rule's test where it
      misses (`accepted_tokens_reference`, as `walk_tree_approx` applies it at a one-child node);
    * exact: both chains at w = 1 / no rule.
For each of the 64 two-token prompts the study enumerates one pass (every draft and every accept /
reject outcome) and composes passes until `gamma + 1` tokens are out, giving the exact joint law of the
first gamma + 1 emitted tokens; the target's is the product of its conditionals. Reported, as means over
the prompts: tau (tokens emitted by the first verify pass), TV of the first emitted token's law (what
`report.json`'s `distribution_shift` measures per verified position) and TV of the joint law of the first
gamma + 1 tokens. Our rules' knobs are swept (typical: epsilon x delta; lenient: top_k x margin); at each
`--levels` value the row takes the rule's setting of least joint TV among those whose tau reaches the
level, and sets transformers' ensemble rule (sampled chain, then top-1 chain) at exactly that setting's
tau: w by bisection, its tau being continuous in w (w = 1, exact, where exact already goes further).

    python -m benchmarks approximate_rules [--gamma 2] [--seed 0] [--sigma 2.0] [--noise 1.5]
        [--levels 1.8,2.0,2.2,2.4,2.6,2.8] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle.decode.approximate import AcceptanceRule, accepted_tokens_reference

V = 8


@dataclass(frozen=True)
class Setup:
    """Target and draft logits by context (the last two tokens): [V, V, V] each, and their laws at T = 1
    (kept as nested lists: the enumeration is plain float arithmetic)."""

    target_logits: torch.Tensor
    draft_logits: torch.Tensor

    @classmethod
    def seeded(cls, seed: int = 0, sigma: float = 2.0, noise: float = 1.5) -> Setup:
        g = torch.Generator().manual_seed(seed)
        target = torch.randn(V, V, V, generator=g, dtype=torch.float64) * sigma
        draft = target + torch.randn(V, V, V, generator=g, dtype=torch.float64) * noise
        return cls(target, draft)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_p", self.target_logits.softmax(-1).tolist())
        object.__setattr__(self, "_q", self.draft_logits.softmax(-1).tolist())
        object.__setattr__(self, "_logits", self.target_logits.tolist())

    def p(self, ctx: tuple[int, int]) -> list[float]:
        return self._p[ctx[0]][ctx[1]]  # type: ignore[attr-defined]

    def q(self, ctx: tuple[int, int]) -> list[float]:
        return self._q[ctx[0]][ctx[1]]  # type: ignore[attr-defined]

    def logits(self, ctx: tuple[int, int]) -> list[float]:
        return self._logits[ctx[0]][ctx[1]]  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Rule:
    """One rule at one setting: `kind` in exact | ensemble | typical | lenient; `sampled`: drafts drawn from
    q (else the top-1 chain)."""

    kind: str
    sampled: bool = False
    weight: float = 1.0
    approx: AcceptanceRule = AcceptanceRule()

    def label(self) -> str:
        chain = "sampled chain" if self.sampled else "top-1 chain"
        if self.kind == "ensemble":
            return f"ensemble w={self.weight:.3f} ({chain})"
        if self.kind == "typical":
            return f"typical epsilon={self.approx.typical_epsilon:.3g} delta={self.approx.typical_delta:g}"
        if self.kind == "lenient":
            return f"lenient top_k={self.approx.lenient_top_k} margin={self.approx.lenient_margin:g}"
        return f"exact ({chain})"


def _normalised(xs: list[float]) -> list[float]:
    total = math.fsum(xs)
    return [x / total for x in xs]


def _position(setup: Setup, rule: Rule, ctx: tuple[int, int], x: int) -> tuple[float, list[float]]:
    """At a position reached with draft x: (probability x is accepted, the law of the token emitted when
    it is not)."""
    p = setup.p(ctx)
    if rule.sampled:  # speculative sampling against v = w p + (1 - w) q (`ensemble_accept`)
        q = setup.q(ctx)
        w = rule.weight if rule.kind == "ensemble" else 1.0
        accept = min(1.0, (1.0 - w) + w * p[x] / q[x])
        residual = [max(a - b, 0.0) for a, b in zip(p, q, strict=True)]
        return accept, _normalised(residual if math.fsum(residual) > 1e-300 else p)
    # One-hot draft: the target's draw y ~ p hits x with p(x); a miss is p without x, unless the rule
    # takes x there (typical / lenient: when x passes; ensemble: with probability 1 - w).
    miss = [0.0 if t == x else pt for t, pt in enumerate(p)]
    miss = _normalised(miss) if math.fsum(miss) > 0 else p
    if rule.kind == "ensemble":
        return p[x] + (1.0 - p[x]) * (1.0 - rule.weight), miss
    if rule.kind in ("typical", "lenient"):
        passes = accepted_tokens_reference(rule.approx, setup.logits(ctx), p, 1.0)[x]
        return (1.0 if passes else p[x]), miss
    return p[x], miss


def pass_law(setup: Setup, rule: Rule, ctx: tuple[int, int], gamma: int) -> dict[tuple[int, ...], float]:
    """Exact law of what one verify pass emits at context ctx (accepted drafts + the bonus token)."""
    out: dict[tuple[int, ...], float] = {}

    def walk(c: tuple[int, int], left: int, mass: float, prefix: tuple[int, ...]) -> None:
        if mass <= 0.0:
            return
        if left == 0:  # every draft accepted: the bonus comes from p
            for t, pt in enumerate(setup.p(c)):
                if pt > 0:
                    out[prefix + (t,)] = out.get(prefix + (t,), 0.0) + mass * pt
            return
        q = setup.q(c)
        drafts = (
            [(x, qx) for x, qx in enumerate(q) if qx > 0] if rule.sampled else [(max(range(V), key=q.__getitem__), 1.0)]
        )
        for x, qx in drafts:
            accept, residual = _position(setup, rule, c, x)
            rejected = mass * qx * (1.0 - accept)
            if rejected > 0:
                for t, rt in enumerate(residual):
                    if rt > 0:
                        out[prefix + (t,)] = out.get(prefix + (t,), 0.0) + rejected * rt
            walk((c[1], x), left - 1, mass * qx * accept, prefix + (x,))

    walk(ctx, gamma, 1.0, ())
    return out


def _index(seq: Sequence[int]) -> int:
    i = 0
    for t in seq:
        i = i * V + t
    return i


Memo = dict[Any, Any]


def joint_law(
    setup: Setup, rule: Rule, ctx: tuple[int, int], n: int, gamma: int, memo: Memo | None = None
) -> list[float]:
    """Exact law of the first n tokens emitted from ctx (flat, V ** n: index = the tokens in base V),
    passes composed until n are out."""
    memo = {} if memo is None else memo
    if (ctx, n) in memo:
        return memo[(ctx, n)]
    if ("pass", ctx) not in memo:
        memo[("pass", ctx)] = pass_law(setup, rule, ctx, gamma)
    law = [0.0] * V**n
    for seq, mass in memo[("pass", ctx)].items():
        if len(seq) >= n:
            law[_index(seq[:n])] += mass
        else:
            c = (ctx[1], seq[0]) if len(seq) == 1 else (seq[-2], seq[-1])
            rest = joint_law(setup, rule, c, n - len(seq), gamma, memo)
            base = _index(seq) * V ** (n - len(seq))
            for j, val in enumerate(rest):
                law[base + j] += mass * val
    memo[(ctx, n)] = law
    return law


def target_joint_law(setup: Setup, ctx: tuple[int, int], n: int) -> list[float]:
    """The target's own law of its next n tokens (flat, as `joint_law`)."""
    if n == 0:
        return [1.0]
    out: list[float] = []
    for t, pt in enumerate(setup.p(ctx)):
        out.extend(pt * x for x in target_joint_law(setup, (ctx[1], t), n - 1))
    return out


def tv(a: Sequence[float], b: Sequence[float]) -> float:
    return 0.5 * math.fsum(abs(x - y) for x, y in zip(a, b, strict=True))


def first_token(law: Sequence[float], n: int) -> list[float]:
    """The marginal law of the first token of a flat joint law of n tokens."""
    block = V ** (n - 1)
    return [math.fsum(law[t * block : (t + 1) * block]) for t in range(V)]


PROMPTS = list(itertools.product(range(V), range(V)))


def measure(setup: Setup, rule: Rule, gamma: int, prompts: Sequence[tuple[int, int]] = PROMPTS) -> dict[str, float]:
    """Means over the prompts: tau of the first pass, TV of the first token's law, TV of the joint law of the
    first gamma + 1 tokens."""
    n = gamma + 1
    taus, tv1, tvn = [], [], []
    memo: Memo = {}
    for ctx in prompts:
        law = joint_law(setup, rule, ctx, n, gamma, memo)
        taus.append(math.fsum(len(s) * m for s, m in memo[("pass", ctx)].items()))
        target = target_joint_law(setup, ctx, n)
        tvn.append(tv(law, target))
        tv1.append(tv(first_token(law, n), first_token(target, n)))
    k = len(prompts)
    return {"tau": math.fsum(taus) / k, "tv_first": math.fsum(tv1) / k, "tv_joint": math.fsum(tvn) / k}


def sweep(setup: Setup, gamma: int) -> dict[str, list[tuple[Rule, dict[str, float]]]]:
    """Every rule over its knobs (the ensemble's w at a coarse grid; `match_weight` refines it)."""
    rules: dict[str, list[Rule]] = {
        "typical": [
            Rule("typical", approx=AcceptanceRule("typical", typical_epsilon=e, typical_delta=d))
            for d in (0.1, 0.3, 1.0)
            for e in [0.01 * 1.2**i for i in range(26)]
            if e < 1.0
        ],
        "lenient": [
            Rule("lenient", approx=AcceptanceRule("lenient", lenient_top_k=k, lenient_margin=m))
            for k in range(2, V + 1)
            for m in [0.25 * i for i in range(1, 25)]
        ]
        + [Rule("lenient", approx=AcceptanceRule("lenient", lenient_top_k=1, lenient_margin=0.0))],
    }
    return {name: [(r, measure(setup, r, gamma)) for r in rs] for name, rs in rules.items()}


def match_weight(setup: Setup, sampled: bool, level: float, gamma: int) -> tuple[Rule, dict[str, float]]:
    """The ensemble's w whose tau equals `level` (bisection: tau falls as w rises; w = 0 gives gamma + 1),
    or w = 1 (exact) where exact already reaches it."""
    lo, hi = 0.0, 1.0  # tau(lo) = gamma + 1 >= level; tau(hi) = exact's
    exact = measure(setup, Rule("ensemble", sampled, 1.0), gamma)
    if exact["tau"] >= level:
        return Rule("ensemble", sampled, 1.0), exact
    for _ in range(24):
        mid = 0.5 * (lo + hi)
        if measure(setup, Rule("ensemble", sampled, mid), gamma)["tau"] >= level:
            lo = mid
        else:
            hi = mid
    rule = Rule("ensemble", sampled, lo)
    return rule, measure(setup, rule, gamma)


def best_at(points: list[tuple[Rule, dict[str, float]]], level: float) -> tuple[Rule, dict[str, float]] | None:
    """The setting of least joint TV among those whose tau reaches `level`."""
    ok = [pt for pt in points if pt[1]["tau"] >= level - 1e-12]
    return min(ok, key=lambda pt: (pt[1]["tv_joint"], -pt[1]["tau"])) if ok else None


def table(setup: Setup, gamma: int, levels: Sequence[float]) -> list[dict[str, Any]]:
    """One row per (our rule, tau level): the rule's setting of least joint TV whose tau reaches the level,
    and transformers' ensemble rule at exactly that setting's tau, on the sampled chain and on the top-1
    chain (w by bisection; w = 1, exact, where exact already reaches it)."""
    swept = sweep(setup, gamma)
    rows: list[dict[str, Any]] = []
    for name in ("typical", "lenient"):
        seen = set()
        for level in levels:
            found = best_at(swept[name], level)
            if found is None or found[0] in seen:
                continue
            seen.add(found[0])
            rule, m = found
            row: dict[str, Any] = {"level": level, "rule": rule.label(), **m}
            for chain, sampled in (("sampled", True), ("top1", False)):
                ens, em = match_weight(setup, sampled, m["tau"], gamma)
                row[f"ensemble_{chain}"] = {"weight": ens.weight, **em}
            rows.append(row)
    return rows


def markdown(setup: Setup, gamma: int, rows: list[dict[str, Any]]) -> str:
    exact = {sampled: measure(setup, Rule("exact", sampled), gamma) for sampled in (True, False)}
    lines = [
        f"exact, top-1 chain: tau {exact[False]['tau']:.3f}; exact, sampled chain (= ensemble w=1): tau "
        f"{exact[True]['tau']:.3f}; TV 0 for both.",
        "",
        f"| our rule, setting | tau | TV first token | TV first {gamma + 1} tokens | ensemble w, sampled chain | "
        f"TV first | TV first {gamma + 1} | ensemble w, top-1 chain | TV first | TV first {gamma + 1} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def num(x: float) -> str:
        return "0" if abs(x) < 1e-12 else f"{x:.3f}"

    for r in rows:
        cells = [r["rule"], f"{r['tau']:.3f}", num(r["tv_first"]), num(r["tv_joint"])]
        for chain in ("sampled", "top1"):
            e = r[f"ensemble_{chain}"]
            w = f"1 (exact, tau {e['tau']:.3f})" if e["weight"] == 1.0 else f"{e['weight']:.3f}"
            cells += [w, num(e["tv_first"]), num(e["tv_joint"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    doc = (__doc__ or "").strip()
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--gamma", type=int, default=2, help="drafts per verify pass (a chain)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sigma", type=float, default=2.0, help="scale of the target's logits")
    ap.add_argument("--noise", type=float, default=1.5, help="scale of the draft's logit noise")
    ap.add_argument("--levels", default="1.8,2.0,2.2,2.4,2.6,2.8", help="tau levels to match the rules at")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.gamma < 1:
        ap.error("--gamma must be >= 1")
    setup = Setup.seeded(a.seed, a.sigma, a.noise)
    levels = [float(x) for x in a.levels.split(",") if x.strip()]
    rows = table(setup, a.gamma, levels)
    print(f"vocab {V}, gamma {a.gamma}, seed {a.seed}, sigma {a.sigma}, noise {a.noise}, {len(PROMPTS)} prompts")
    print(markdown(setup, a.gamma, rows))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"settings": vars(a) | {"json": str(a.json)}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["Rule", "Setup", "joint_law", "main", "measure", "pass_law", "target_joint_law", "tv"]
