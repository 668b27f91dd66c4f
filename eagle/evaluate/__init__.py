"""`eagle-eval`: speculative decoding measured against plain decoding baselines, with a report.

Public API: `evaluate(cfg) -> dict` (writes report.json / report.md / plots to cfg.output_dir),
`resolve_draft_path(path) -> Path`, and `load_draft(path, target, device)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from eagle.config import RootConfig


def evaluate(cfg: RootConfig) -> dict[str, Any]:
    """See `eagle.evaluate.runner.evaluate` (imported lazily: importing the package loads no models)."""
    from eagle.evaluate.runner import evaluate as _evaluate

    return _evaluate(cfg)


def resolve_draft_path(path: str | Path | None) -> Path:
    """See `eagle.heads.resolve.resolve_draft_path`."""
    from eagle.heads.resolve import resolve_draft_path as _resolve

    return _resolve(path)


__all__ = ["evaluate", "resolve_draft_path"]
