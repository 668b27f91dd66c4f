"""What the engine check scripts (check_vllm.py, check_llamacpp.py) share: standard library only, since
parts of them run in an engine's own venv."""

from __future__ import annotations


def first_difference(base: dict[str, list[int]], other: dict[str, list[int]]) -> tuple[str, int] | None:
    """The first prompt (in `base`'s order) whose output token ids differ between the two runs, and the index
    of the first differing new token there (the shorter length when one output is a prefix of the other);
    None when every output is equal."""
    for pid, x in base.items():
        y = other[pid]
        if x != y:
            at = next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))
            return pid, at
    return None
