"""Speculative-decoding statistics as plain functions over per-step acceptance lengths.

Convention: an *acceptance length* is the number of tokens one target forward (a verify pass)
emits, i.e. accepted draft tokens plus the bonus token the target produces itself, so it is >= 1.
Depth d (1-based) is the d-th drafted token along the accepted path.
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
