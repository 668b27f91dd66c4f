"""Resume only the same run: compare a checkpoint's recorded settings with the new run's.

Every training checkpoint holds `run_config.json`, the resolved config of the run that wrote it
(`run_record`). Before `train.resume=auto|true` continues a checkpoint, `check_resume` compares it
with the new config, key by key:

  trajectory  keys that change what the next update computes: optimizer, lr, schedule, warmup,
              batch, accumulation, lengths, TTT, loss weights, precision, head options, data,
              target, seeds. Any difference refuses the resume with a `CheckpointError` naming
              each key with its old and new value and the two ways out.
  free        keys that do not: `train.max_steps` (train longer or stop earlier), eval / save /
              log cadence, checkpoints kept, the non-finite policy, the logger, `target.shard` (whole
              or sharded target: the same features, like another number of processes), and settings
              the run's mode never reads (data.* offline, train.data_dir online). Allowed and logged.
  ignored     other stages' settings (decode, eval, export, publish, regenerate) and places
              (output_dir, device, draft.path, target.cache_dir).

Keys are classified by rule, not listed one by one, so a key added to the train, draft, data,
target or capture sections later is treated as part of the trajectory until it is named free.

`train.max_steps`: the cosine and linear schedules decay to `max_steps`, so changing it changes the
learning rate of the steps still to come (never of the steps already taken). `follow_schedule`
applies the new schedule from the first resumed update on; with an unchanged `max_steps` it
changes nothing, so a plain resume stays bit for bit.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eagle.config import RootConfig
from eagle.errors import CheckpointError, TargetError
from eagle.target.precision import resolve_dtype, resolve_mixed_precision
from eagle.train.checkpoint import RUN_CONFIG, read_state

# Keys that may change between a checkpoint and its resumption: what is logged, evaluated or kept.
FREE_KEYS = frozenset(
    {
        "train.max_steps",
        "train.max_minutes",
        "train.eval_every",
        "train.eval_batches",
        "train.save_every",
        "train.keep_checkpoints",
        "train.log_every",
        "train.resume",
        "train.nonfinite",
        # Decoding evaluations restore the RNG states they touch: what they measure never moves the trajectory.
        "train.eval_decode_every",
        "train.eval_decode_prompts",
        "train.eval_decode_max_new_tokens",
        # Where the target's weights live (whole or sharded over the processes), like the number of processes:
        # the same features either way.
        "target.shard",
    }
)
# Settings training never reads, or that only say where things are.
IGNORED_SECTIONS = ("regenerate", "decode", "eval", "export", "publish", "logger")
IGNORED_KEYS = frozenset(
    {
        "output_dir",
        "device",
        "format",
        "draft.path",
        "target.cache_dir",
        "target.trust_remote_code",
        "capture.batch_tokens",
        "capture.free_space_margin",
    }
)
# Keys whose values are local paths: compared as resolved absolute paths.
PATH_KEYS = ("target.path", "data.path", "train.data_dir", "train.init_from")


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    kind: str  # trajectory | free
    note: str = ""

    def describe(self) -> str:
        text = f"{self.key}: {_show(self.old)} -> {_show(self.new)}"
        return f"{text} ({self.note})" if self.note else text


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) or value is None else str(value)


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def _resolved(value: Any) -> Any:
    if isinstance(value, str) and value and os.path.exists(value):
        return os.path.realpath(value)
    return value


def _effective_dtype(cfg: RootConfig) -> str:
    """target.dtype as training runs it: `auto` resolved for this device (eagle.target.precision), so that
    `auto` and the dtype it stands for compare equal."""
    name = cfg.target.dtype
    if name != "auto":
        return name
    try:
        device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
        return str(resolve_dtype(name, device, stage="train")).removeprefix("torch.")
    except Exception:  # a device the resolver refuses: compare the name itself
        return name


def _effective_mixed_precision(cfg: RootConfig) -> str:
    """train.mixed_precision as training runs it (`auto` resolved for this device)."""
    name = cfg.train.mixed_precision
    if name != "auto":
        return name
    try:
        return resolve_mixed_precision(name, cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except TargetError:  # recorded as asked; training itself reports why it cannot run
        return name


def run_record(cfg: RootConfig) -> dict[str, Any]:
    """What a checkpoint records of its run: the resolved config, local paths made absolute and
    `target.dtype=auto` resolved."""
    flat = _flatten(json.loads(json.dumps(asdict(cfg), default=str)))
    for key in PATH_KEYS:
        if key in flat:
            flat[key] = _resolved(flat[key])
    if "target.dtype" in flat:
        flat["target.dtype"] = _effective_dtype(cfg)
    if "train.mixed_precision" in flat:
        flat["train.mixed_precision"] = _effective_mixed_precision(cfg)
    return {"format_version": 1, "config": flat}


def classify(key: str, mode: str) -> tuple[str, str]:
    """(kind, note) of a config key for a run in train.mode=`mode`: trajectory | free | ignored."""
    section = key.split(".", 1)[0]
    if key in IGNORED_KEYS or section in IGNORED_SECTIONS:
        return "ignored", ""
    if key in FREE_KEYS:
        return "free", ""
    if mode == "offline" and (section == "data" or section == "capture"):
        return "free", "not read by train.mode=offline: the data come from train.data_dir"
    if mode in ("online", "stream") and key in ("train.data_dir", "capture.dtype"):
        return "free", f"not read by train.mode={mode}"
    if key.startswith("train.stream."):
        return "free", "which servers compute the features, not what they are (each is checked against the recipe)"
    return "trajectory", ""


def compare(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """Differences between two `run_record`s that matter (trajectory or free), in key order.

    A key the old record lacks was added to eagle after the checkpoint was written: the older run
    behaved as the key's default, so that is what the new value is compared with (a run resumed
    with a new option switched on is refused like any other change). A key only the old record has
    (an option since removed) cannot be compared and is skipped. `train.mode` decides with the new
    run's mode (a changed mode is itself refused)."""
    a, b = old.get("config", {}), new.get("config", {})
    mode = str(b.get("train.mode", a.get("train.mode", "offline")))
    defaults = _defaults()
    changes = []
    for key in sorted(set(b) & (set(a) | set(defaults))):
        before = a[key] if key in a else defaults[key]
        if before == b[key]:
            continue
        kind, note = classify(key, mode)
        if kind != "ignored":
            if key not in a:
                note = "not recorded by the older eagle that wrote the checkpoint; it ran with the default"
            changes.append(Change(key, before, b[key], kind, note))
    return changes


def _defaults() -> dict[str, Any]:
    """Every key's default value, flattened like a `run_record`."""
    return _flatten(json.loads(json.dumps(asdict(RootConfig()), default=str)))


def _max_steps_note(change: Change, cfg: RootConfig, done: int) -> str:
    t = cfg.train
    if int(change.new) <= done:
        return f"the checkpoint is at step {done} already: nothing left to train"
    if t.schedule == "constant":
        return "train.schedule=constant: the lr after warmup does not depend on it"
    return (
        f"the {t.schedule} schedule now decays to step {change.new}: updates {done + 1}.. follow it, "
        f"updates 1..{done} ran under the old one"
    )


def check_resume(cfg: RootConfig, checkpoint: Path, log: Callable[[str], None] | None = print) -> list[Change]:
    """Refuse (CheckpointError) to resume `checkpoint` under trajectory-changing settings; log the
    allowed changes. Returns the allowed changes."""
    out = Path(cfg.output_dir)
    path = checkpoint / RUN_CONFIG
    if not path.is_file():
        if log is not None:
            log(
                f"eagle-train: {checkpoint} records no {RUN_CONFIG} (written by an older eagle); "
                "resuming without comparing its settings with this run's"
            )
        return []
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is unreadable ({e}); delete {checkpoint} to resume from an earlier one") from e
    changes = compare(old, run_record(cfg))
    refused = [c for c in changes if c.kind == "trajectory"]
    if refused:
        lines = "\n".join(f"  {c.describe()}" for c in refused)
        raise CheckpointError(
            f"{out} holds a training run with other settings (checkpoint {checkpoint.name}); resuming it would "
            f"continue that run under this run's name. Settings that change the training trajectory:\n{lines}\n"
            f"Either train into a new output_dir (e.g. output_dir={out}-2), or move {out} away and start over "
            "there with train.resume=false (the old checkpoints, best/ and metrics.jsonl would otherwise be "
            "mixed with the new run's)"
        )
    allowed = [c for c in changes if c.kind == "free"]
    if allowed and log is not None:
        done = read_state(checkpoint).step
        described = [
            Change(c.key, c.old, c.new, c.kind, _max_steps_note(c, cfg, done)).describe()
            if c.key == "train.max_steps"
            else c.describe()
            for c in allowed
        ]
        log(
            f"eagle-train: resuming {checkpoint} (step {done}) with changed settings that keep the run's "
            "trajectory: " + "; ".join(described)
        )
    return allowed


def follow_schedule(optimizer: Any, scheduler: Any) -> None:
    """After loading a scheduler state: set the next update's lr from the current schedule.

    The saved optimizer holds the lr the OLD schedule chose for the next update; LambdaLR keeps no
    copy of max_steps, so from the second resumed update on the new one applies anyway. This makes
    the first resumed update follow it too. Unchanged schedule: the same float, nothing is written."""
    for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        lr = base * fn(scheduler.last_epoch)
        if lr != group["lr"]:
            group["lr"] = lr


__all__ = ["RUN_CONFIG", "Change", "check_resume", "classify", "compare", "follow_schedule", "run_record"]
