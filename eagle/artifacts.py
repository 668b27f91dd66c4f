"""Every on-disk name eagle writes or reads, and what a `draft.path` points at.

A training output dir (`eagle-train output_dir=...`):

    train_config.yaml            the run's resolved config (`stage_config("train")`; other stages
                                 write eval_config.yaml, capture_config.yaml, ...)
    checkpoints/step-0000100/    complete checkpoints (state.json marks one complete)
        head/                    a head folder, loadable alone
        state.json, run_config.json, optimizer / scheduler / RNG state
    latest                       text: "checkpoints/step-0000100" (a hint; resume checks it)
    best/                        the head with the best held-out tau_sim (a head folder)

A head folder holds `model.safetensors` + `head_config.json`. A capture dir holds shards and a
`manifest.json` (and `capture_config.yaml`); a regenerated data file `<name>.jsonl` has its
settings beside it in `<name>.jsonl.meta.json`; an evaluation dir a `report.json`. An exported folder (vLLM / SGLang /
speculators / hf layouts) is recognised by its `config.json`.

This module imports nothing heavier than `eagle.errors`, so any layer may use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle.errors import CheckpointError

HEAD_CONFIG = "head_config.json"
HEAD_WEIGHTS = "model.safetensors"
HEAD_SUBDIR = "head"  # inside a checkpoint
EXPORT_CONFIG = "config.json"  # marks an exported folder
CHECKPOINTS = "checkpoints"
LATEST = "latest"
BEST = "best"
BEST_OLD = ".best.old"  # the previous best while save_best swaps folders (eagle.fileio.publish_dir's name)
STATE = "state.json"
RUN_CONFIG = "run_config.json"  # the resolved config of the run (eagle.train.resume)
MANIFEST = "manifest.json"
REPORT = "report.json"


def stage_config(stage: str) -> str:
    """File name of a stage's resolved config, e.g. `train_config.yaml`."""
    return f"{stage}_config.yaml"


TRAIN_CONFIG = stage_config("train")
CAPTURE_CONFIG = stage_config("capture")


def regeneration_meta(path: str | Path) -> Path:
    """The settings file `eagle-regenerate` writes beside its output `path` (`<path>.meta.json`)."""
    p = Path(path)
    return p.with_name(p.name + ".meta.json")


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a `step-N` checkpoint folder name (None for any other name)."""
    name = path.name
    if not name.startswith("step-") or not name[5:].isdigit():
        return None
    return int(name[5:])


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (final name + state.json) of a training output dir, oldest first."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if (s := checkpoint_step(p)) is not None and (p / STATE).is_file()]
    return [p for _, p in sorted(found)]


def training_dir_of(folder: Path) -> Path | None:
    """The eagle-train output dir above a head folder (best/, checkpoints/step-N[/head]), if any."""
    for candidate in (folder, *folder.parents[:3]):
        if (candidate / TRAIN_CONFIG).is_file():
            return candidate
    return None


@dataclass(frozen=True)
class ResolvedDraft:
    folder: Path  # the folder the head is loaded from
    kind: str  # head | exported
    source: str  # what the user gave in draft.path
    via: str  # training_dir | checkpoint | head | exported: how `source` was read
    training_dir: Path | None = None  # the eagle-train output dir it came from, when known (provenance)


def _head_folder(path: Path) -> Path | None:
    for candidate in (path, path / HEAD_SUBDIR):
        if (candidate / HEAD_CONFIG).is_file():
            return candidate
    return None


def resolve_draft(path: str | Path | None) -> ResolvedDraft:
    """Classify `draft.path` and find the folder to load; `CheckpointError` says what is wrong.

    Accepted: a training output dir (its `best/` head), a head folder (`best/`, a checkpoint, with
    `head_config.json` directly or in `head/`), or an exported folder (any folder with a
    `config.json`: ours or third-party, loaded through `eagle.export.load_exported_head`, so an
    evaluation measures exactly the weights a runtime would serve).
    """
    if path is None or str(path) == "":
        raise CheckpointError("draft.path is not set: give a training output dir, a checkpoint dir or an exported head")
    source = str(path)
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"draft.path={source!r} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"draft.path={source!r} is a file; give the folder that holds the head")
    if (p / BEST).is_dir():
        best = _head_folder(p / BEST)
        if best is None:
            raise CheckpointError(
                f"draft.path={source!r}: {p / BEST} has no {HEAD_CONFIG}; the best head was not "
                "fully written (re-run eagle-train to resume, or point draft.path at a checkpoint)"
            )
        return ResolvedDraft(best, "head", source, "training_dir", p)
    if (p / EXPORT_CONFIG).is_file():  # checked first: an hf export also carries head_config.json
        return ResolvedDraft(p, "exported", source, "exported", training_dir_of(p))
    head = _head_folder(p)
    if head is not None:
        via = "checkpoint" if checkpoint_step(p) is not None else "head"
        return ResolvedDraft(head, "head", source, via, training_dir_of(head))
    old_best = _head_folder(p / BEST_OLD)  # training was killed between the two renames of save_best
    if old_best is not None:
        return ResolvedDraft(old_best, "head", source, "training_dir", p)
    # Any step-N folder, complete or not, tells that this is a training dir: name the newest.
    steps = [(s, c) for c in (p / CHECKPOINTS).glob("step-*") if c.is_dir() and (s := checkpoint_step(c)) is not None]
    if steps:
        raise CheckpointError(
            f"draft.path={source!r} is a training output dir without a best/ head (training has not "
            f"evaluated yet); use a checkpoint explicitly, e.g. draft.path={max(steps)[1]}"
        )
    raise CheckpointError(
        f"draft.path={source!r} holds no draft head: expected best/ (training output dir), "
        f"{HEAD_CONFIG} (head or checkpoint dir) or {EXPORT_CONFIG} (exported folder)"
    )


def resolve_draft_path(path: str | Path | None) -> Path:
    """The head folder for `draft.path` (training output dir -> its best head; checkpoint; exported folder)."""
    return resolve_draft(path).folder
