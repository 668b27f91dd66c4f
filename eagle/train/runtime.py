"""What a training process needs around the loop: the Accelerator, the output folder's resume
decision, signal handling and phase timers. Nothing here knows about heads or losses."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedDataParallelKwargs, DistributedType
from torch import nn

from eagle.config import ConfigError, RootConfig
from eagle.errors import CheckpointError
from eagle.target.precision import resolve_mixed_precision
from eagle.train import checkpoint as ckpt
from eagle.train.resume import check_resume

log = logging.getLogger(__name__)


def make_accelerator(cfg: RootConfig) -> Any:
    """An `accelerate.Accelerator` for `cfg`: mixed precision resolved for the device, DDP only.

    Gradient accumulation is the trainer's own (micro-batches under `no_sync`, one optimizer step),
    so accelerate is told 1 and never rescales the loss.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1 or (
        torch.distributed.is_available() and torch.distributed.is_initialized()
    )
    if not launched:
        # accelerate keeps process-wide state; a second train() in the same process (a notebook,
        # tests) with another mixed precision would be refused or silently keep the first run's
        # settings. Single-process state is safe to rebuild.
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    mixed = resolve_mixed_precision(cfg.train.mixed_precision, device)
    if cfg.train.mixed_precision == "auto":
        log.info("train.mixed_precision=auto -> %s on %s", mixed, device)
    accelerator = Accelerator(
        mixed_precision=mixed,
        gradient_accumulation_steps=1,
        # Without an accelerator say so explicitly: a multi-process launch on CPU then uses gloo.
        cpu=cfg.device == "cpu" or (cfg.device is None and not torch.cuda.is_available()),
        # Unused parameters never occur (every head weight is in every step's graph); saying so
        # spares DDP a graph walk per step.
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=False)],
    )
    # Checked after creating the Accelerator: a bare PartialState() first would settle the process
    # group without the cpu flag and turn a multi-process CPU launch into N single processes.
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ConfigError(
            f"eagle-train runs the draft head data-parallel (DDP) only; the accelerate config asks for "
            f"{accelerator.distributed_type.value}. Re-run `accelerate config` choosing multi-GPU without "
            "FSDP/DeepSpeed (the head is one layer: it needs no sharding); to shard a target too large for "
            "one device, set target.shard=fsdp (FSDP2 over the same processes)"
        )
    return accelerator


def checkpoint_to_resume(cfg: RootConfig, log: Callable[[str], None] | None = print) -> Path | None:
    """The checkpoint to resume from per train.resume (auto | true | false), or None.

    A checkpoint written under settings that change the training trajectory is refused; allowed
    changes (max_steps, cadences, logger) are logged (`eagle.train.resume.check_resume`)."""
    out = Path(cfg.output_dir)
    mode = str(cfg.train.resume).lower()
    latest = ckpt.find_latest_checkpoint(out)
    if mode == "false" and latest is not None:
        raise CheckpointError(
            f"{out} already holds training checkpoints ({latest.name}) and train.resume=false; use another "
            "output_dir, delete its checkpoints/, or set train.resume=auto to continue"
        )
    if mode == "true" and latest is None:
        raise CheckpointError(f"train.resume=true but {out} has no complete checkpoint under {ckpt.CHECKPOINTS}/")
    if mode == "false" or latest is None:
        return None
    check_resume(cfg, latest, log)
    return latest


class StopFlag:
    """SIGINT/SIGTERM set a flag; the loop finishes the step, saves and returns."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handlers, the run just cannot be interrupted cleanly
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C aborts at once
        self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class PhaseTimer:
    """Wall seconds per phase (data, forward_backward, optimizer, logging, eval, checkpoint)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def total(self, names: tuple[str, ...]) -> float:
        return sum(self.seconds.get(k, 0.0) for k in names)


def grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the gradients (what clipping would measure), without clipping."""
    grads = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    return torch.stack(grads).norm() if grads else torch.zeros(())
