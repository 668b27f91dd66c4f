"""`target.path` -> the checkpoint to load: a Hub id, a local folder, a built-in name (`eagle.assets`) or a
`.gguf` file, converted once into an HF checkpoint (safetensors + tokenizer) cached under a key derived
from the file's content hash, so later loads take well under a second; and the target's fingerprint.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle.assets import ASSETS, asset_path
from eagle.config import TargetConfig
from eagle.errors import TargetError
from eagle.fileio import atomic_dir, atomic_write_text, exclusive_lock, file_sha256


def default_cache_dir(cfg: TargetConfig | None = None) -> Path:
    if cfg is not None and cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    return Path(os.environ.get("EAGLE_CACHE", Path.home() / ".cache" / "eagle")).expanduser()


def cached_file_hash(path: Path, cache_dir: Path) -> str:
    """sha256 of a large file, remembered by (path, size, mtime) so it is computed once."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = cache_dir / "hashes" / f"{key}.txt"
    if memo.is_file():
        return memo.read_text().strip()
    digest = file_sha256(path)
    # A temporary name of its own per writer: concurrent first uses of one file (two processes converting
    # the same GGUF) wrote and renamed the same `.tmp`, and the second rename found it gone.
    atomic_write_text(memo, digest)
    return digest


# Bumped when the layout of a converted folder changes, so folders made by an older version are
# repaired (or re-made) on next use. v2: a plain dense checkpoint (no `quantization_config`).
GGUF_CONVERSION_VERSION = 2


def _plain_checkpoint_config(folder: Path) -> None:
    """Make a converted folder's config.json describe the dense float32 weights it holds.

    A model loaded with `gguf_file=` carries `quantization_config: {quant_method: gguf, ...}`; saved as
    is, vLLM refuses the folder (unknown quantization method) and transformers treats the dense
    safetensors as packed GGUF weights (casting around every matmul).
    """
    path = folder / "config.json"
    config = json.loads(path.read_text())
    changed = config.pop("quantization_config", None) is not None
    if config.get("dtype") != "float32":
        config["dtype"] = "float32"  # what model.safetensors holds (GGUF weights dequantised to float32)
        changed = True
    config.pop("torch_dtype", None)
    if changed:
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Convert a GGUF file to a cached plain HF checkpoint folder once; return the folder."""
    digest = cached_file_hash(gguf, cache_dir)
    out = cache_dir / "gguf" / f"{gguf.stem}-{digest[:16]}-v{GGUF_CONVERSION_VERSION}"
    if (out / "config.json").is_file() and (out / ".complete").is_file():
        return out
    # Several processes may ask at once (a launcher's ranks, parallel test workers): one converts, the
    # others wait and then take its folder instead of replacing it under a reader.
    with exclusive_lock(cache_dir / "gguf" / f".{out.name}.lock"):
        return _convert_gguf_locked(gguf, digest, out, cache_dir)


def _convert_gguf_locked(gguf: Path, digest: str, out: Path, cache_dir: Path) -> Path:
    if (out / "config.json").is_file() and (out / ".complete").is_file():
        return out
    legacy = cache_dir / "gguf" / f"{gguf.stem}-{digest[:16]}"  # v1: same weights, GGUF quantization_config
    if (legacy / "config.json").is_file() and (legacy / ".complete").is_file() and not out.exists():
        _plain_checkpoint_config(legacy)
        os.replace(legacy, out)
        return out
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:  # transformers raises many types for unreadable/unsupported GGUF files
        raise TargetError(f"cannot read GGUF file {gguf}: {e}") from e
    # A model loaded from GGUF keeps GGUF-specific loading state; a fresh model from a copy of its
    # config without the GGUF quantization entry, holding the dequantised weights, saves as a plain
    # dense checkpoint.
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise TargetError(f"GGUF conversion of {gguf} lost weights: missing={missing} unexpected={unexpected}")
    with atomic_dir(out) as tmp:  # replaces an incomplete earlier attempt
        fresh.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _plain_checkpoint_config(tmp)
        source = {"gguf": str(gguf), "sha256": digest, "conversion_version": GGUF_CONVERSION_VERSION}
        (tmp / "eagle_source.json").write_text(json.dumps(source, indent=2))
        (tmp / ".complete").write_text("")
    return out


def resolve_target_path(cfg: TargetConfig) -> tuple[str, str]:
    """Return (path or Hub id to load, fingerprint) for `cfg.path`."""
    raw = cfg.path
    if raw in ASSETS and ASSETS[raw].relative_path.endswith(".gguf"):
        raw = str(asset_path(raw))
    path = Path(raw).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TargetError(f"target.path={cfg.path!r}: GGUF file {path} does not exist")
        folder = convert_gguf(path, default_cache_dir(cfg))
        return str(folder), "gguf-sha256:" + cached_file_hash(path, default_cache_dir(cfg))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetError(f"target.path={cfg.path!r}: folder {path} has no config.json (not an HF checkpoint)")
        return str(path.resolve()), "folder:" + folder_fingerprint(path)
    if path.exists():
        raise TargetError(f"target.path={cfg.path!r} is a file but not a .gguf; give a folder, .gguf or Hub id")
    if raw.startswith((".", "/", "~")) or raw.count("/") > 1:
        raise TargetError(f"target.path={cfg.path!r} does not exist (not a folder, .gguf file or Hub id)")
    # A Hub id: transformers/huggingface_hub resolve it (from the local HF cache when offline).
    return raw, f"hub:{raw}@{cfg.revision or 'main'}"


def folder_fingerprint(path: Path) -> str:
    """Content-derived identity of a checkpoint folder: config plus size and edges of each weight file."""
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    for f in sorted(path.iterdir()):
        if f.suffix in {".safetensors", ".bin", ".pt"}:
            size = f.stat().st_size
            h.update(f"{f.name}:{size}".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
                if size > 1 << 20:
                    fh.seek(max(0, size - (1 << 20)))
                    h.update(fh.read(1 << 20))
    return h.hexdigest()[:32]
