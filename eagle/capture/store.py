"""On-disk layout of a capture: sharded safetensors plus one `manifest.json`.

    <output_dir>/manifest.json                    identity + per-shard file, counts, bytes, sha256
    <output_dir>/manifest.rank<r>.json            per-rank progress while a multi-process run is going
    <output_dir>/<split>/shard-00000.safetensors  `shard_size` conversations, concatenated:
        input_ids [N] int32, loss_mask [N] uint8, offsets [n + 1] int64 (conversation boundaries),
        final_hidden [N, H], aux_hidden [N, 3, H] (EAGLE-3 only), features in `capture.dtype`;
        positions [N, 3] int32 (an M-RoPE target's rotary rows: time, height, width);
        safetensors metadata "eagle_capture": JSON {format, split, index, ids (conversation ids)}.

Shard k of a split always holds conversations [k * shard_size, (k + 1) * shard_size) of that split,
so a capture is resumable shard by shard and several processes can fill disjoint shards. Every write
goes to a temporary name in the same folder, is fsynced and then renamed, so a killed run leaves
either a whole shard or no shard under the final name; temporary files are never listed in the
manifest and never read.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagle.artifacts import MANIFEST
from eagle.errors import CaptureError
from eagle.fileio import file_sha256, fsync_dir, temp_path
from eagle.target.precision import DTYPES as STORAGE_DTYPES

FORMAT = "eagle-capture"
FORMAT_VERSION = 1
SHARD_METADATA_KEY = "eagle_capture"
RANK_MANIFEST = "manifest.rank{rank}.json"
SPLITS = ("train", "heldout")

# Fields of the manifest that make two captures the same capture; any difference refuses a resume.
IDENTITY_FIELDS = (
    ("format_version",),
    ("target", "fingerprint"),
    ("data", "fingerprint"),
    ("algorithm",),
    ("aux_layer_ids",),
    ("dtype",),
    ("shard_size",),
    ("backend",),
    ("engine", "version"),
)
# Which backends' engine version is part of a capture's identity: vLLM computes the features itself
# (its kernels and its extraction method may change between versions). transformers' version is not
# (an upgrade resumes an hf capture, as before backends were recorded).
VERSIONED_ENGINES = ("vllm",)


# --- atomic files ---------------------------------------------------------------------------------


def remove_stale_tmp(root: Path) -> int:
    """Delete temporary files a killed writer left in the capture folder (they are never read).

    Only safe while no other process writes into `root`: capture calls it on rank 0 before the
    start barrier."""
    removed = 0
    for folder in (root, *(root / s for s in SPLITS)):
        if folder.is_dir():
            for p in folder.glob(".*.tmp"):
                p.unlink(missing_ok=True)
                removed += 1
    return removed


# --- paths ----------------------------------------------------------------------------------------


def shard_file(split: str, index: int) -> str:
    """Manifest name of shard `index` of `split`, relative to the capture folder."""
    return f"{split}/shard-{index:05d}.safetensors"


def member_path(root: Path, name: str) -> Path:
    """Resolve a manifest file name inside `root`; refuse names that could point elsewhere."""
    bad = (
        not isinstance(name, str)
        or not name
        or name.startswith(("/", "\\"))
        or re.match(r"^[A-Za-z]:", name) is not None
        or any(part in ("..", "") for part in re.split(r"[\\/]", name))
    )
    root_resolved = root.resolve()
    path = (root_resolved / name).resolve() if not bad else None
    if bad or path is None or root_resolved not in path.parents:
        raise CaptureError(
            f"{root / MANIFEST}: shard name {name!r} is not a plain path inside the capture folder; "
            "the manifest is corrupt or was edited, re-run eagle-capture into a fresh output_dir"
        )
    return path


# --- shards ---------------------------------------------------------------------------------------


def write_shard(
    root: Path,
    split: str,
    index: int,
    ids: list[str],
    input_ids: list[list[int]],
    loss_mask: list[list[int]],
    features: dict[str, list[torch.Tensor]],  # name -> per conversation [T_i, ...] tensors
    dtype: str,
) -> dict[str, Any]:
    """Write one shard atomically and return its manifest entry."""
    lengths = [len(x) for x in input_ids]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    tensors: dict[str, torch.Tensor] = {
        "input_ids": torch.tensor([t for x in input_ids for t in x], dtype=torch.int32),  # [N]
        "loss_mask": torch.tensor([m for x in loss_mask for m in x], dtype=torch.uint8),  # [N]
        "offsets": offsets,  # [n + 1]
    }
    for name, parts in features.items():
        joined = torch.cat(parts, 0)  # [N, ...]
        # Features in the storage dtype; integer rows (M-RoPE positions) as they are.
        tensors[name] = (joined.to(STORAGE_DTYPES[dtype]) if joined.is_floating_point() else joined).contiguous()
        if tensors[name].shape[0] != offsets[-1]:
            raise AssertionError(f"{name} has {tensors[name].shape[0]} rows for {int(offsets[-1])} tokens")
    name = shard_file(split, index)
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    # One metadata key: safetensors writes its metadata map in hash order, and a single entry keeps
    # the file bytes (and so the sha256) a deterministic function of the shard's contents.
    metadata = {SHARD_METADATA_KEY: json.dumps({"format": FORMAT, "split": split, "index": index, "ids": ids})}
    tmp = temp_path(path)
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        sha = file_sha256(tmp)
        size = tmp.stat().st_size
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()
    _mark_verified(path, sha)
    return {
        "split": split,
        "index": index,
        "file": name,
        "conversations": len(ids),
        "tokens": int(offsets[-1]),
        "bytes": size,
        "sha256": sha,
    }


# sha256 checks already done in this process: (resolved path, size, mtime_ns, sha256).
_VERIFIED: set[tuple[str, int, int, str]] = set()


def _stat_key(path: Path, sha: str) -> tuple[str, int, int, str]:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, sha)


def _mark_verified(path: Path, sha: str) -> None:
    _VERIFIED.add(_stat_key(path, sha))


def verify_shard(root: Path, entry: dict[str, Any], check_sha: bool = True) -> Path:
    """Check a shard against its manifest entry (existence, size, sha256 once per process)."""
    path = member_path(root, entry["file"])
    if not path.is_file():
        raise CaptureError(
            f"{root / MANIFEST} lists {entry['file']} but the file is missing; "
            "re-run eagle-capture with the same settings to recreate it"
        )
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CaptureError(
            f"{path}: {size} bytes, the manifest says {entry['bytes']}; the shard is truncated or was "
            f"replaced. Delete it and re-run eagle-capture with the same settings to recreate it"
        )
    if check_sha and _stat_key(path, entry["sha256"]) not in _VERIFIED:
        actual = file_sha256(path)
        if actual != entry["sha256"]:
            raise CaptureError(
                f"{path}: sha256 {actual[:16]}… differs from the manifest's {entry['sha256'][:16]}…; "
                "the shard is corrupt. Delete it and re-run eagle-capture with the same settings"
            )
        _mark_verified(path, entry["sha256"])
    return path


# --- manifest -------------------------------------------------------------------------------------


def _get(d: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


# The config keys behind each identity field, named in the refusal.
_IDENTITY_KEYS = {
    ("target", "fingerprint"): "target.path/revision",
    ("algorithm",): "draft.algorithm",
    ("aux_layer_ids",): "draft.aux_layer_ids",
    ("dtype",): "capture.dtype",
    ("shard_size",): "capture.shard_size",
    ("backend",): "capture.backend",
    ("engine", "version"): "the vLLM install of capture.vllm_python",
}


def _short(value: Any) -> str:
    """repr, with long identity hashes cut to 16 characters."""
    if isinstance(value, str) and len(value) > 24:
        return repr(value[:16] + "…")
    return repr(value)


def _identity(manifest: dict[str, Any], keys: tuple[str, ...]) -> Any:
    """One identity field of a manifest or header (captures made before backends were recorded ran hf)."""
    backend = manifest.get("backend", "hf")
    if keys == ("backend",):
        return backend
    if keys == ("engine", "version") and backend not in VERSIONED_ENGINES:
        return None
    return _get(manifest, keys)


def check_same_capture(existing: dict[str, Any], header: dict[str, Any], root: Path) -> None:
    """Refuse to add shards to a capture made with another target, data, algorithm or layer set,
    naming every differing field (and, for the data, the data.* settings that differ)."""
    diffs = []
    for keys in IDENTITY_FIELDS:
        old, new = _identity(existing, keys), _identity(header, keys)
        if old == new or (
            keys == ("engine", "version") and existing.get("backend", "hf") != header.get("backend", "hf")
        ):
            continue  # another backend is named as such, not also as another engine version
        name = ".".join(keys)
        via = f" ({_IDENTITY_KEYS[keys]})" if keys in _IDENTITY_KEYS else ""
        if keys == ("data", "fingerprint"):
            a, b = _get(existing, ("data", "config")) or {}, _get(header, ("data", "config")) or {}
            changed = [
                f"data.{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
            ]
            via = f" ({'; '.join(changed)})" if changed else " (same data.* settings, other conversations or tokenizer)"
        diffs.append(f"  {name}{via}: {_short(old)} -> {_short(new)}")
    if diffs:
        raise CaptureError(
            f"{root / MANIFEST} was captured with other settings; shards of different captures cannot be mixed "
            "(manifest -> this run):\n" + "\n".join(diffs) + "\n"
            f"Either capture into a new output_dir, or move {root} away (or delete it) to capture again there"
        )


def read_manifest(data_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and sanity-check `<data_dir>/manifest.json`."""
    root = Path(data_dir)
    path = root / MANIFEST
    if not path.is_file():
        raise CaptureError(f"{path} does not exist; run eagle-capture with output_dir={root} first")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CaptureError(f"{path} is not readable JSON ({e}); re-run eagle-capture into a fresh output_dir") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CaptureError(f"{path} is not an eagle capture manifest (format={manifest.get('format')!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CaptureError(
            f"{path} has format_version={manifest.get('format_version')!r}; this eagle reads version "
            f"{FORMAT_VERSION}. Re-capture with this version of eagle-capture"
        )
    for entry in manifest.get("shards", []):
        member_path(root, entry.get("file"))
    return manifest


def completed_shards(root: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """Shard entries recorded by any earlier or concurrent run (main and per-rank manifests) whose
    file is present with the recorded size. A shard file without an entry is not trusted."""
    entries: dict[tuple[str, int], dict[str, Any]] = {}
    sources = [root / MANIFEST, *sorted(root.glob(RANK_MANIFEST.format(rank="*")))]
    for src in sources:
        if not src.is_file():
            continue
        try:
            data = json.loads(src.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # written atomically, so only a foreign file can be unreadable: ignore it
        for e in data.get("shards", []):
            try:
                path = member_path(root, e["file"])
            except (CaptureError, KeyError):
                continue
            if path.is_file() and path.stat().st_size == e.get("bytes"):
                entries[(e["split"], int(e["index"]))] = e
    return entries


def assemble_manifest(header: dict[str, Any], shards: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    """Header + shard entries in (split, index) order + totals; `complete` when every planned shard is there."""
    ordered = [shards[k] for k in sorted(shards, key=lambda k: (SPLITS.index(k[0]) if k[0] in SPLITS else 99, k[1]))]
    planned = sum(s["num_shards"] for s in header["splits"].values())
    totals = {
        "conversations": sum(e["conversations"] for e in ordered),
        "tokens": sum(e["tokens"] for e in ordered),
        "shards": len(ordered),
        "bytes": sum(e["bytes"] for e in ordered),
    }
    return {**header, "shards": ordered, "totals": totals, "complete": len(ordered) == planned}
