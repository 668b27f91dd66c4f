"""The regenerated file and its record: resumable appends (a restart skips ids already written and cuts a
torn last line), and `<output>.meta.json`, the settings that produced it: a resume under settings that change
the answers is refused, naming each key; a changed selection is allowed and noted.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from eagle.artifacts import regeneration_meta
from eagle.config import DataConfig, RegenerateConfig
from eagle.errors import DataError


def default_output(output_dir: str | Path, cfg: RegenerateConfig) -> Path:
    return Path(cfg.output) if cfg.output else Path(output_dir) / "regenerated.jsonl"


def recover_output(path: Path) -> set[str]:
    """Ids already written to `path`.

    Records are written as whole lines, so text after the last newline is a torn write from a hard
    kill: it is cut off the file (that conversation is simply regenerated). A line before it that is
    not a record means the file is corrupt (or not ours) and raises `DataError`.
    """
    if not path.exists():
        return set()
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1  # 0 when there is no complete line at all
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    done: set[str] = set()
    for lineno, raw in enumerate(data[:keep].split(b"\n")[:-1], start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("id"), str):
            raise DataError(
                f"{path}: line {lineno} is not a regenerated record; the file is corrupt. "
                "Delete it (or set regenerate.output to a new file) and run again"
            )
        done.add(record["id"])
    return done


# Data settings that decide which conversations are regenerated and what their prompts are.
DATA_IDENTITY = (
    "source",
    "path",
    "hub_split",
    "hub_subset",
    "format",
    "system_prompt",
    "max_conversations",
    "dedup_against",
)


# Settings that may change on resume: they select more or fewer conversations, not other answers
# (ids already written are skipped either way). The serving engine of one served model is like the
# local engine (continuous / generate): it changes how answers are computed, not which.
_FREE = frozenset({"data.max_conversations", "data.dedup_against", "server_engine"})


# Settings left out of the meta file: how the work is spread (slots, engine, server list, concurrency,
# timeouts) does not change the answers; the backend records what does (`RegenerationBackend.start`).
_NOT_RECORDED = frozenset(
    {
        "output",
        "batch_size",
        "engine",
        "backend",
        "servers",
        "model",
        "requests_per_server",
        "request_timeout",
        "server_engine",
    }
)


def data_identity(data: DataConfig) -> dict[str, Any]:
    """The data settings a regenerated file records (local paths made absolute)."""
    out = {k: v for k, v in asdict(data).items() if k in DATA_IDENTITY}
    if isinstance(out.get("path"), str) and os.path.exists(out["path"]):
        out["path"] = os.path.realpath(out["path"])
    return out


def settings_record(
    cfg: RegenerateConfig, target_fingerprint: str, data: dict[str, Any] | None = None, dtype: str | None = None
) -> dict[str, Any]:
    # Slots and engine change how answers are computed, not which (up to low-precision numerics).
    keep = {k: v for k, v in asdict(cfg).items() if k not in _NOT_RECORDED}
    return {
        "target": target_fingerprint,
        **({"dtype": dtype} if dtype else {}),
        **keep,
        **({"data": data} if data is not None else {}),
    }


def _flat(settings: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in settings.items() if k != "data"}
    out.update({f"data.{k}": v for k, v in (settings.get("data") or {}).items()})
    return out


def check_meta(path: Path, settings: dict[str, Any]) -> None:
    """Refuse to append to `path` under settings that change the answers (naming each key, old and
    new value); allow and note a changed selection; record the settings in `<path>.meta.json`."""
    meta = regeneration_meta(path)
    if meta.exists():
        # A file from before backends existed was written by the local one.
        old = {"backend": "local", **json.loads(meta.read_text())}
        if old == settings:
            return
        a, b = _flat(old), _flat(settings)
        # A key one side lacks (an older eagle wrote the meta file) cannot be compared.
        diff = [k for k in sorted(set(a) & set(b)) if a[k] != b[k]]
        refused = [k for k in diff if k not in _FREE]
        if refused:
            lines = "\n".join(f"  {k}: {a[k]!r} -> {b[k]!r}" for k in refused)
            raise DataError(
                f"{path} was written with different settings (file -> this run):\n{lines}\n"
                "resuming would mix answers of both in one file. Either write to a new file (another "
                f"regenerate.output or output_dir), or move {path} away to regenerate from scratch there"
            )
        if diff:
            print(
                f"eagle-regenerate: resuming {path} with another selection: "
                + "; ".join(f"{k}: {a[k]!r} -> {b[k]!r}" for k in diff),
                file=sys.stderr,
            )
    tmp = meta.with_name(meta.name + ".tmp")
    tmp.write_text(json.dumps(settings, indent=2, sort_keys=True))
    os.replace(tmp, meta)
