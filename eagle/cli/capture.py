"""`eagle-capture`: run the target over the data splits and store its features for offline training.

    eagle-capture target.path=... data=local data.path=FILE data.max_conversations=N \
        capture.shard_size=N output_dir=PATH draft.algorithm=eagle1|eagle3

Several processes: `accelerate launch --num_processes N -m eagle.cli.capture ...` on GPUs, or
`torchrun --nproc_per_node N -m eagle.cli.capture ...` (GPUs or CPU); shard k goes to rank k % N.
Re-running the same command (any N) resumes at the first missing shard.
"""

from __future__ import annotations

from typing import Any

from eagle.cli.app import run_app
from eagle.config import RootConfig


def _stage(cfg: RootConfig) -> dict[str, Any]:
    from eagle.capture.runner import run_capture  # startup: loads torch; the config is checked first

    return run_capture(cfg)


def main() -> None:
    run_app("capture", _stage)


if __name__ == "__main__":
    main()
