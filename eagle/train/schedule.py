"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay to `min_lr_ratio`.

`lr_factor` is the plain formula (tested directly); `build_scheduler` wraps it in a `LambdaLR` whose
state dict holds only plain numbers, so it round-trips through `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from eagle.config import ConfigError, TrainConfig


def lr_factor(
    step: int, warmup_steps: int, max_steps: int, schedule: str, min_lr_ratio: float, progress: float | None = None
) -> float:
    """Multiplier of the base lr for optimizer step `step` (0-based: the first update uses step 0).

    Warmup ramps linearly from 1/warmup to 1 over `warmup_steps` updates (never 0, so the first
    update is not wasted); afterwards the factor decays from 1 to `min_lr_ratio` at `max_steps`, or,
    given `progress` (the share of a time budget spent, `train.schedule_over=minutes`), at progress 1.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if progress is None:
        progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    progress = min(1.0, max(0.0, progress))
    if schedule == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
    raise ValueError(f"unknown schedule {schedule!r} (cosine | linear | constant)")


def _budget_factor(step: int, clock: Callable[[], float], **kwargs: Any) -> float:
    return lr_factor(step, progress=clock(), **kwargs)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, clock: Callable[[], float] | None = None
) -> LambdaLR:
    """A `LambdaLR` following `lr_factor` for `cfg` (stepped once per optimizer step). With
    `train.schedule_over=minutes`, `clock()` gives the share of the time budget spent so far."""
    kwargs: dict[str, Any] = {
        "warmup_steps": cfg.warmup_steps,
        "max_steps": cfg.max_steps,
        "schedule": cfg.schedule,
        "min_lr_ratio": cfg.min_lr_ratio,
    }
    if cfg.schedule_over == "minutes":
        if clock is None:
            raise ValueError("train.schedule_over=minutes needs the trainer's budget clock")
        return LambdaLR(optimizer, functools.partial(_budget_factor, clock=clock, **kwargs))
    return LambdaLR(optimizer, functools.partial(lr_factor, **kwargs))


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (default) or plain SGD over the head's trainable parameters, per `cfg.optimizer`.

    SGD without momentum makes one update exactly `-lr x gradient`, so two ways of computing the same
    gradient (accumulation, processes) can be compared after a step within float32 summation error;
    after AdamW a near-zero gradient moves a weight by about lr x sign(g), which turns summation-order
    noise into lr-sized differences.
    """
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.0, weight_decay=cfg.weight_decay)
    if len(cfg.betas) != 2:
        raise ConfigError(f"train.betas={cfg.betas} must be two numbers [beta1, beta2]")
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), weight_decay=cfg.weight_decay)
