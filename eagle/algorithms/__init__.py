"""Draft algorithms by name: `get_algorithm("eagle3")` -> the `Algorithm` that owns its feature spec,
loss and export names (`eagle.algorithms.base`); one module per algorithm (eagle1.py, eagle3.py).

Adding a variant: a head class in `eagle.heads` (registered with `register_head`), an `Algorithm`
subclass here, and a line in ALGORITHMS.
"""

from __future__ import annotations

from eagle.algorithms.base import Algorithm, LossParts, LossSettings
from eagle.algorithms.dflash import DFlash
from eagle.algorithms.eagle1 import Eagle1
from eagle.algorithms.eagle3 import Eagle3
from eagle.config import ConfigError

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (Eagle1(), Eagle3(), DFlash())}


def get_algorithm(name: str) -> Algorithm:
    """The registered algorithm `name` (draft.algorithm / HeadConfig.algorithm)."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"draft.algorithm={name!r} is not one of {', '.join(ALGORITHMS)}") from None


__all__ = ["ALGORITHMS", "Algorithm", "LossParts", "LossSettings", "get_algorithm"]
