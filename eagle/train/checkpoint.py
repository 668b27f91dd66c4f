"""Training checkpoints: atomic, resumable, pruned; plus the `best/` head and the `latest` pointer.

Layout of a training output dir:

    <output_dir>/checkpoints/step-0000100/
        head/             save_head() folder (safetensors weights + head_config.json), loadable alone
        optimizer.pt      AdamW state            (torch.save; read with weights_only=True)
        scheduler.pt      LambdaLR state         (plain numbers)
        rng/rank-00000.pt torch / python / numpy (/ cuda) RNG states of each rank, as tensors and tuples
        state.json        step, data position (epoch, index), best-so-far, metrics, identity
        run_config.json   the run's resolved config: a resume with other trajectory settings is refused
    <output_dir>/latest   text: "checkpoints/step-0000100", rewritten after each save
    <output_dir>/best/    save_head() folder of the best held-out tau_sim so far (what later stages load)

A checkpoint is written into `checkpoints/.tmp-step-XXXXXXX/`, every file fsynced, then renamed to
its final name: a folder named `step-*` is always complete. `latest` is only a hint; resume falls
back to the highest complete `step-*` if the pointer is missing or stale (killed between rename and
pointer update).
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from eagle.algorithms.head_io import save_head
from eagle.artifacts import (
    BEST,
    CHECKPOINTS,
    LATEST,
    RUN_CONFIG,
    STATE,
    checkpoint_name,
    list_checkpoints,
)
from eagle.artifacts import checkpoint_step as _step_of
from eagle.errors import CheckpointError
from eagle.fileio import atomic_dir, atomic_write_text, publish_dir
from eagle.heads.base import DraftHead

FORMAT_VERSION = 1


@dataclass
class TrainState:
    """Everything besides tensors that a resumed run needs, saved as `state.json`."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # data position: epoch of the next batch ...
    index: int = 0  # ... and its offset in that epoch's (deterministic) order
    best_metric: float | None = None  # best train.select_by figure so far (held-out tau_sim, or tau_real)
    best_step: int | None = None
    algorithm: str = ""
    target_fingerprint: str = ""
    aux_layer_ids: list[int] = field(default_factory=list)
    world_size: int = 1
    skipped_steps: list[int] = field(default_factory=list)  # non-finite steps skipped so far
    metrics: dict[str, float] = field(default_factory=dict)  # last logged train/eval metrics
    wall_seconds: float = 0.0  # the run's wall time up to this state: train.schedule_over=minutes' clock
    format_version: int = FORMAT_VERSION

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: Path) -> TrainState:
        try:
            return cls(**data)
        except TypeError as e:
            raise CheckpointError(f"{source} is not a checkpoint state of this eagle version ({e})") from e


# --- RNG ------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors / tuples of ints (loadable with weights_only=True)."""
    np_state = cast(tuple[Any, ...], np.random.get_state(legacy=True))  # (name, keys, pos, has_gauss, gauss)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        # numpy's key array becomes a tensor; the other fields are plain numbers.
        "numpy": (
            np_state[0],
            torch.from_numpy(np_state[1].astype(np.int64)),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- save -----------------------------------------------------------------------------------------


def _no_barrier() -> None:
    return None


def save_checkpoint(
    output_dir: str | Path,
    state: TrainState,
    head: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    keep: int,
    rank: int = 0,
    barrier: Callable[[], None] = _no_barrier,
    rng: dict[str, Any] | None = None,
    head_extra: dict[str, Any] | None = None,
    run_config: dict[str, Any] | None = None,
) -> Path:
    """Write `checkpoints/step-<state.step>/` atomically, point `latest` at it, keep the newest `keep`.

    Call on every rank (each writes its own RNG file); rank 0 writes the rest. `head` is the unwrapped
    head; `rng` defaults to the current RNG state of this process. Refuses non-finite weights.
    `run_config` (`eagle.train.resume.run_record`) is stored as `run_config.json`: what a resume
    compares its own settings with.
    """
    root = Path(output_dir) / CHECKPOINTS
    final = root / checkpoint_name(state.step)
    tmp = root / f".tmp-{checkpoint_name(state.step)}"
    bad = [k for k, v in head.state_dict().items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        # Never publish NaN weights; the caller treats this like a non-finite step.
        raise CheckpointError(f"refusing to save step {state.step}: non-finite head weights in {bad[:5]}")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a run killed while saving
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
    barrier()
    torch.save(rng if rng is not None else rng_state(), tmp / "rng" / f"rank-{rank:05d}.pt")
    barrier()
    if rank == 0:
        save_head(cast(DraftHead, head), tmp / "head", extra={"step": state.step, **(head_extra or {})})
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / STATE).write_text(json.dumps(asdict(state), indent=2, sort_keys=True) + "\n")
        if run_config is not None:
            (tmp / RUN_CONFIG).write_text(json.dumps(run_config, indent=2, sort_keys=True, default=str) + "\n")
        publish_dir(tmp, final)  # replaces the same step saved earlier (a final save right after a periodic one)
        atomic_write_text(Path(output_dir) / LATEST, f"{CHECKPOINTS}/{final.name}\n")
        prune_checkpoints(Path(output_dir), keep)
    barrier()
    return final


def prune_checkpoints(output_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints (and stale temporary folders)."""
    ckpts = list_checkpoints(output_dir)
    for old in ckpts[: max(0, len(ckpts) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
    # Called right after a save completed, so any temporary folder left is from a killed run.
    for torn in (Path(output_dir) / CHECKPOINTS).glob(".tmp-step-*"):
        shutil.rmtree(torn, ignore_errors=True)


def find_latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint `latest` points at if it is complete, else the highest complete one, else None."""
    out = Path(output_dir)
    pointer = out / LATEST
    if pointer.is_file():
        target = out / pointer.read_text().strip()
        if (target / STATE).is_file() and target.parent == out / CHECKPOINTS:
            # A later complete checkpoint than the pointer means the pointer write was lost.
            ckpts = list_checkpoints(out)
            if ckpts and _step_of(ckpts[-1]) > _step_of(target):  # type: ignore[operator]
                return ckpts[-1]
            return target
    ckpts = list_checkpoints(out)
    return ckpts[-1] if ckpts else None


# --- load -----------------------------------------------------------------------------------------


def read_state(ckpt: str | Path) -> TrainState:
    path = Path(ckpt) / STATE
    if not path.is_file():
        raise CheckpointError(f"{ckpt} is not a complete training checkpoint (no {STATE}); delete it")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is unreadable ({e}); delete {ckpt} to resume from an earlier one") from e
    return TrainState.from_dict(data, path)


def check_resumable(
    state: TrainState, ckpt: Path, algorithm: str, target_fingerprint: str, aux_layer_ids: list[int]
) -> None:
    """Refuse a checkpoint of another algorithm, target or layer set (CheckpointError naming both)."""
    if state.algorithm != algorithm:
        raise CheckpointError(
            f"{ckpt} holds a draft.algorithm={state.algorithm} head but this run trains {algorithm}; "
            "use another output_dir, or train.resume=false with a fresh output_dir"
        )
    if state.target_fingerprint != target_fingerprint:
        raise CheckpointError(
            f"{ckpt} was trained on another target (fingerprint {state.target_fingerprint[:24]}, this target "
            f"{target_fingerprint[:24]}); use another output_dir for a different target"
        )
    if list(state.aux_layer_ids) != list(aux_layer_ids):
        raise CheckpointError(
            f"{ckpt} was trained with draft.aux_layer_ids={state.aux_layer_ids}, this run uses "
            f"{aux_layer_ids}; use the same layers or another output_dir"
        )


def load_torch(path: Path) -> Any:
    """`torch.load(weights_only=True)` with a CheckpointError naming the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle/zip errors of truncated or foreign files
        raise CheckpointError(
            f"cannot read {path} ({e}); delete its checkpoint folder to resume from an earlier one"
        ) from e


def load_rng(ckpt: Path, rank: int) -> dict[str, Any] | None:
    """This rank's saved RNG state, or None if the checkpoint came from a smaller world."""
    path = ckpt / "rng" / f"rank-{rank:05d}.pt"
    return load_torch(path) if path.is_file() else None


# --- best head ------------------------------------------------------------------------------------


def save_best(output_dir: str | Path, head: torch.nn.Module, extra: dict[str, Any]) -> Path:
    """Replace `<output_dir>/best/` with `head` (rank 0 only); a crash leaves the old or the new one."""
    best = Path(output_dir) / BEST
    with atomic_dir(best) as tmp:
        save_head(cast(DraftHead, head), tmp, extra=extra)
    return best
