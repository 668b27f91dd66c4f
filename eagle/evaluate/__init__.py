"""`eagle-eval`: speculative decoding measured against plain decoding baselines, with a report.

Public API: `evaluate(cfg) -> dict` (writes report.json / report.md / plots to cfg.output_dir).
`draft.path` is resolved by `eagle.artifacts.resolve_draft` and loaded by `eagle.export.load_draft`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagle.config import RootConfig


def evaluate(cfg: RootConfig) -> dict[str, Any]:
    """See `eagle.evaluate.runner.evaluate`."""
    # startup: eagle.sweep imports eagle.evaluate.plots at CLI start; the runner would load torch
    from eagle.evaluate.runner import evaluate as _evaluate

    return _evaluate(cfg)


__all__ = ["evaluate"]
