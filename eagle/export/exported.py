"""`ExportedHead`: a head folder in canonical form, what `validate.read_folder` returns and what the
formats in `registry` check and describe. Its own module so that registry and validate need not import
each other (validate asks the registry about formats; the registry's formats take an ExportedHead)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle.heads.base import HeadConfig


@dataclass
class ExportedHead:
    """A head folder in canonical form."""

    folder: Path
    format: str  # vllm | sglang | speculators | hf | llamacpp | third-party
    config: HeadConfig
    tensors: dict[str, torch.Tensor]  # our parameter names
    borrowed: dict[str, torch.Tensor] = field(default_factory=dict)  # stored target-owned tensors
    raw_config: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
