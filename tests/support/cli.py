"""Running the console scripts in a subprocess the way users do."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root
BIN = Path(sys.executable).parent  # where the venv's console scripts (eagle-train, accelerate) live


def cli_env() -> dict[str, str]:
    """The environment for a child process: one thread, offline, the repo importable (for `tests.*`)."""
    env = dict(
        os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return env
