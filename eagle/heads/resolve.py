"""`draft.path` -> the folder holding a trained head, and the head loaded onto a target.

Three kinds of folder are accepted:
  * a training output dir (`eagle-train`'s `output_dir`): its `best/` head is used;
  * a head folder, e.g. `best/` or a checkpoint `checkpoints/step-N/` (with `head_config.json`,
    directly or in a `head/` subfolder);
  * an exported folder (any folder with a `config.json`: vLLM / SGLang / speculators / hf layouts,
    ours or third-party), validated and loaded through `eagle.export.load_exported_head`, so the
    evaluation measures exactly the weights a runtime would serve.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle.errors import CheckpointError

HEAD_CONFIG = "head_config.json"


@dataclass(frozen=True)
class ResolvedDraft:
    folder: Path  # the folder the head is loaded from
    kind: str  # head | exported
    source: str  # what the user gave in draft.path
    via: str  # training_dir | checkpoint | head | exported: how `source` was read
    training_dir: Path | None = None  # the eagle-train output dir it came from, when known (provenance)


def _training_dir_of(folder: Path) -> Path | None:
    """The eagle-train output dir above a head folder (best/, checkpoints/step-N[/head]), if any."""
    for candidate in (folder, *folder.parents[:3]):
        if (candidate / "train_config.yaml").is_file():
            return candidate
    return None


def _head_folder(path: Path) -> Path | None:
    for candidate in (path, path / "head"):
        if (candidate / HEAD_CONFIG).is_file():
            return candidate
    return None


def _latest_checkpoint(path: Path) -> Path | None:
    steps = []
    for child in (path / "checkpoints").glob("step-*"):
        suffix = child.name.removeprefix("step-")
        if child.is_dir() and suffix.isdigit():
            steps.append((int(suffix), child))
    return max(steps)[1] if steps else None


def resolve_draft(path: str | Path | None) -> ResolvedDraft:
    """Classify `draft.path` and find the folder to load; `CheckpointError` says what is wrong."""
    if path is None or str(path) == "":
        raise CheckpointError("draft.path is not set: give a training output dir, a checkpoint dir or an exported head")
    source = str(path)
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"draft.path={source!r} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"draft.path={source!r} is a file; give the folder that holds the head")
    if (p / "best").is_dir():
        best = _head_folder(p / "best")
        if best is None:
            raise CheckpointError(f"draft.path={source!r}: {p / 'best'} has no {HEAD_CONFIG}; the best head was not "
                                  "fully written (re-run eagle-train to resume, or point draft.path at a checkpoint)")
        return ResolvedDraft(best, "head", source, "training_dir", p)
    if (p / "config.json").is_file():  # checked first: an hf export also carries head_config.json
        return ResolvedDraft(p, "exported", source, "exported", _training_dir_of(p))
    head = _head_folder(p)
    if head is not None:
        via = "checkpoint" if p.name.startswith("step-") else "head"
        return ResolvedDraft(head, "head", source, via, _training_dir_of(head))
    old_best = _head_folder(p / ".best.old")  # training was killed between the two renames of save_best
    if old_best is not None:
        return ResolvedDraft(old_best, "head", source, "training_dir", p)
    latest = _latest_checkpoint(p)
    if latest is not None:
        raise CheckpointError(f"draft.path={source!r} is a training output dir without a best/ head (training has not "
                              f"evaluated yet); use a checkpoint explicitly, e.g. draft.path={latest}")
    raise CheckpointError(f"draft.path={source!r} holds no draft head: expected best/ (training output dir), "
                          f"{HEAD_CONFIG} (head or checkpoint dir) or config.json (exported folder)")


def resolve_draft_path(path: str | Path | None) -> Path:
    """The head folder for `draft.path` (training output dir -> its best head; checkpoint; exported folder)."""
    return resolve_draft(path).folder


def load_draft(path: str | Path | None, target: Any, device: Any = "cpu") -> tuple[Any, ResolvedDraft]:
    """Load the head named by `draft.path` onto `device`, attached to `target`, in eval mode."""
    resolved = resolve_draft(path)
    if resolved.kind == "head":
        from eagle.heads.io import load_head

        head = load_head(resolved.folder, target_model=target, map_location=device)
    else:
        from eagle.export import load_exported_head

        head = load_exported_head(resolved.folder, target, map_location=device)
    head.eval().requires_grad_(False)
    return head, resolved
