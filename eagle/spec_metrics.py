"""Speculative-decoding statistics as plain functions over per-step acceptance lengths.

Convention: an *acceptance length* is the number of tokens one target forward (a verify pass)
emits, i.e. accepted draft tokens plus the bonus token the target produces itself, so it is >= 1.
Depth d (1-based) is the d-th drafted token along the accepted path.

A leaf of the package (no torch, no eagle imports): `eagle-eval`'s report and the trainer's decoding
evaluation (`train.eval_decode_every`) compute tau and acceptance by depth with the same functions.
"""

from __future__ import annotations

from collections.abc import Sequence


def tau(accept_lengths: Sequence[int], target_forwards: int) -> float:
    """Mean tokens emitted per target forward (bonus token included); 0.0 when nothing ran."""
    if target_forwards <= 0:
        return 0.0
    return float(sum(accept_lengths)) / float(target_forwards)


def accepted_drafts(accept_lengths: Sequence[int]) -> list[int]:
    """Accepted draft tokens per step: the acceptance length minus the bonus token."""
    return [max(0, int(n) - 1) for n in accept_lengths]


def accept_rate_by_depth(accept_lengths: Sequence[int], max_depth: int | None = None) -> list[float]:
    """Conditional acceptance rate at each draft depth (the EAGLE papers' n-alpha).

    Entry d-1 is P(draft d accepted | drafts 1..d-1 accepted) over all verify steps:
    #steps with >= d accepted / #steps with >= d-1 accepted. Depths that no step reached
    (denominator 0) are left out, so the list stops where the data stops.
    """
    drafts = accepted_drafts(accept_lengths)
    if not drafts:
        return []
    depth = max_depth if max_depth is not None else max(drafts)
    rates: list[float] = []
    for d in range(1, depth + 1):
        reached = sum(1 for a in drafts if a >= d - 1)
        if reached == 0:
            break
        rates.append(sum(1 for a in drafts if a >= d) / reached)
    return rates


def accept_fraction_by_depth(accept_lengths: Sequence[int], max_depth: int | None = None) -> list[float]:
    """Unconditional share of verify steps that accepted at least d draft tokens, d = 1..max_depth."""
    drafts = accepted_drafts(accept_lengths)
    if not drafts:
        return []
    depth = max_depth if max_depth is not None else max(drafts)
    return [sum(1 for a in drafts if a >= d) / len(drafts) for d in range(1, depth + 1)]


def histogram(values: Sequence[int]) -> dict[int, int]:
    """Counts of each integer value, sorted by value."""
    out: dict[int, int] = {}
    for v in values:
        out[int(v)] = out.get(int(v), 0) + 1
    return dict(sorted(out.items()))


def throughput(tokens: int, seconds: float) -> float:
    """Tokens per second; 0.0 for an empty or zero-length measurement."""
    return float(tokens) / seconds if seconds > 0 else 0.0


def speedup(baseline_seconds: float, seconds: float) -> float | None:
    """Baseline time / measured time (None when either is unmeasured)."""
    if seconds <= 0 or baseline_seconds <= 0:
        return None
    return baseline_seconds / seconds


# Context buckets of `by_context` (tokens of prompt plus generated text before a verify step): upper edges.
CONTEXT_EDGES = (1024, 2048, 4096, 8192)


def context_bucket(context: int, edges: Sequence[int] = CONTEXT_EDGES) -> str:
    """'<1K', '1-2K', '2-4K', '4-8K' or '>=8K' for the default edges (K = 1024 tokens)."""

    def k(n: int) -> str:
        return f"{n // 1024}K" if n % 1024 == 0 else str(n)

    if context < edges[0]:
        return f"<{k(edges[0])}"
    for low, high in zip(edges, edges[1:], strict=False):
        if context < high:
            return f"{k(low).removesuffix('K')}-{k(high)}" if low % 1024 == 0 else f"{low}-{k(high)}"
    return f">={k(edges[-1])}"


def by_context(
    accept_lengths: Sequence[int], context_lengths: Sequence[int], edges: Sequence[int] = CONTEXT_EDGES
) -> list[dict[str, object]]:
    """tau and acceptance per context bucket, in bucket order, buckets with no step left out.

    accept_lengths[i] and context_lengths[i] belong to the same verify step (the context is what the
    target had read before it: prompt plus the text generated so far)."""
    if len(accept_lengths) != len(context_lengths):
        raise ValueError(f"{len(accept_lengths)} acceptance lengths but {len(context_lengths)} context lengths")
    order = [context_bucket(0, edges)] + [context_bucket(e, edges) for e in edges]
    steps: dict[str, list[int]] = {}
    for n, ctx in zip(accept_lengths, context_lengths, strict=True):
        steps.setdefault(context_bucket(int(ctx), edges), []).append(int(n))
    return [
        {
            "context": b,
            "steps": len(steps[b]),
            "tau": tau(steps[b], len(steps[b])),
            "accept_rate_by_depth": accept_rate_by_depth(steps[b]),
        }
        for b in order
        if b in steps
    ]
