"""The command line the training studies share (capture_dtype, recipe): which capture, seeds, the held-out
batches, the recipe, where runs go, the report they resume from, and Hydra overrides for every run. Not a
benchmark itself (`python -m benchmarks` lists no `_` module)."""

from __future__ import annotations

import argparse
from pathlib import Path


def study_parser(doc: str, capture_help: str, overrides_help: str) -> argparse.ArgumentParser:
    """A parser with the shared arguments; the study adds its own."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--capture", type=Path, required=True, help=capture_help)
    p.add_argument("--seeds", default="0", help="comma-separated training seeds, a run each")
    p.add_argument("--eval-batches", type=int, default=24)
    p.add_argument("--recipe", default="smollm2-135m-instruct")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None, help="the report; runs of the same settings in it are kept")
    p.add_argument("overrides", nargs="*", help=overrides_help)
    return p
