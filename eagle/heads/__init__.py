"""Draft heads: one implementation per algorithm (EAGLE-1, EAGLE-3), sized by the target config.

Importing this package is cheap and side-effect free; the public API:
    HeadConfig, DraftHead                       (eagle.heads.base)
    Eagle1Head, Eagle3Head
    head_config_from_target, build_head, save_head, load_head, check_head_fits_target (eagle.heads.io)
"""

from eagle.heads.base import DraftHead, HeadConfig
from eagle.heads.eagle1 import Eagle1Head
from eagle.heads.eagle3 import Eagle3Head
from eagle.heads.io import (
    build_head,
    check_head_fits_target,
    head_config_from_target,
    load_head,
    read_head_config,
    read_head_extra,
    save_head,
)

__all__ = [
    "DraftHead",
    "Eagle1Head",
    "Eagle3Head",
    "HeadConfig",
    "build_head",
    "check_head_fits_target",
    "head_config_from_target",
    "load_head",
    "read_head_config",
    "read_head_extra",
    "save_head",
]
