"""Draft algorithms, one package each, registered here by name.

`eagle/algorithms/<name>/` holds everything one algorithm is: its head module (`head.py`), its
`Algorithm` (`algorithm.py`: the target features it reads, how a batch becomes its loss, how its
head is named and described in each export format, the config it refuses), and, for a head that
drafts a block in one pass, its drafting step (`drafting.py`, reached by the decoder through
`DraftHead.draft_block`). The shared pieces sit beside them: `base` (the `Algorithm` interface),
`losses` / `objectives` / `ttt` (training maths), `head_io` (build, save, load a head by name).

Adding an algorithm: its folder, and one line in `ALGORITHMS` below. Nothing else compares
algorithm names: the config, the trainer, the decoder and the exporters ask the registered object.
"""

from __future__ import annotations

from eagle.algorithms.base import Algorithm, LossParts, LossSettings
from eagle.algorithms.dflash.algorithm import DFlash
from eagle.algorithms.eagle1.algorithm import Eagle1
from eagle.algorithms.eagle3.algorithm import Eagle3
from eagle.algorithms.peagle.algorithm import PEagle
from eagle.config import ConfigError, RootConfig

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (Eagle1(), Eagle3(), DFlash(), PEagle())}


def get_algorithm(name: str) -> Algorithm:
    """The registered algorithm `name` (draft.algorithm / HeadConfig.algorithm)."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"draft.algorithm={name!r} is not one of {', '.join(ALGORITHMS)}") from None


def check_config(cfg: RootConfig) -> RootConfig:
    """Refuse, at start, a run whose settings the chosen algorithm cannot honour (naming the key)."""
    get_algorithm(cfg.draft.algorithm).check_config(cfg)
    # Keyed by the exported head's algorithm, not draft.algorithm: a misspelt key would never match one.
    unknown = sorted(set(cfg.export.speculative_tokens_by_algorithm) - set(ALGORITHMS))
    if unknown:
        raise ConfigError(
            f"export.speculative_tokens_by_algorithm: {', '.join(unknown)} is not an algorithm "
            f"(one of {', '.join(ALGORITHMS)})"
        )
    return cfg


__all__ = ["ALGORITHMS", "Algorithm", "LossParts", "LossSettings", "check_config", "get_algorithm"]
