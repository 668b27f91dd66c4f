"""`eagle-export`: a trained head -> a folder a serving runtime (or the Hub) loads directly.

The export works on tensors and the `HeadConfig`, never on runtime code: rename per format, cast
floating tensors to `export.dtype` (vocab maps keep int64 / bool), write config.json (+ our
head_config.json for format=hf) into a temporary folder, validate that folder with the same
checks `eagle-export --check` runs, and only then move the files into `output_dir`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from eagle.errors import EagleError, ExportError
from eagle.export.formats import (
    CONFIG_FILE,
    FORMATS,
    HEAD_CONFIG_FILE,
    WEIGHTS_FILE,
    build_config,
    expected_tensors,
    hub_id_for_target,
    to_format_name,
)
from eagle.export.validate import ExportedHead, check_folder, read_json
from eagle.heads.base import DraftHead, HeadConfig
from eagle.heads.resolve import resolve_draft

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Files an earlier export into the same folder may have left; removed so formats never mix.
_HEAD_FILES = (WEIGHTS_FILE, "model.safetensors.index.json", "pytorch_model.bin", CONFIG_FILE, HEAD_CONFIG_FILE)


def resolve_head_source(path: str | Path) -> tuple[Path, Path | None]:
    """`draft.path` -> (folder to export from, training output dir or None); see `eagle.heads.resolve`."""
    resolved = resolve_draft(path)
    return resolved.folder, resolved.training_dir


def verifier_info(target_path: str) -> dict[str, Any]:
    """{"name_or_path", "architectures"} of the target, read locally where possible (no network)."""
    from eagle.config import TargetConfig
    from eagle.targets import resolve_target_path

    archs: list[str] = []
    try:
        resolved, _ = resolve_target_path(TargetConfig(path=target_path))
        if Path(resolved).is_dir():
            archs = list(read_json(Path(resolved) / CONFIG_FILE).get("architectures") or [])
    except EagleError as e:  # a Hub id offline or a missing asset: the name alone still identifies it
        log.warning("target architectures unknown (%s); the speculators verifier lists none", e)
    return {"name_or_path": hub_id_for_target(target_path), "architectures": archs}


def _cast(name: str, t: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    if kind == "float":
        return t.detach().to("cpu", dtype).contiguous()
    if kind == "int":
        return t.detach().to("cpu", torch.long).contiguous()
    return t.detach().to("cpu", torch.bool).contiguous()


def format_tensors(cfg: HeadConfig, tensors: dict[str, torch.Tensor], fmt: str, dtype: str
                   ) -> dict[str, torch.Tensor]:
    """Our-named tensors -> the exact tensor dict a `fmt` folder stores (renamed, cast, completed)."""
    spec = expected_tensors(cfg)
    unknown = sorted(set(tensors) - set(spec))
    if unknown:
        raise ExportError(f"the head has tensors the {fmt} format has no place for: {unknown}; exporting would "
                          "drop them")
    tensors = dict(tensors)
    if cfg.algorithm == "eagle3" and "d2t" not in tensors and cfg.draft_vocab_size == cfg.vocab_size:
        # A full-vocabulary head: identity maps, so every runtime reads the same thing.
        tensors["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        tensors["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    if fmt == "vllm" and cfg.algorithm == "eagle1" and "fc.bias" in tensors:
        bias = tensors.pop("fc.bias")
        if bool(bias.abs().max() > 0):
            raise ExportError("vLLM's EAGLE-1 model (EagleLlamaForCausalLM) builds fc without a bias, and this "
                              f"head's fc.bias is non-zero (max |b| = {float(bias.abs().max()):.3g}): a vLLM "
                              "export would change its outputs. Use format=sglang (fc with bias) or format=hf.")
    missing = sorted(set(spec) - set(tensors) - ({"fc.bias"} if fmt == "vllm" else set()))
    if missing:
        raise ExportError(f"the head lacks tensors {missing} required by its config")
    out = {}
    for name, t in tensors.items():
        out[to_format_name(name, fmt, cfg.algorithm)] = _cast(name, t, spec[name][1], _DTYPES[dtype])
    return out


def write_export(cfg: HeadConfig, tensors: dict[str, torch.Tensor], output_dir: str | Path, fmt: str,
                 dtype: str = "float16", target_path: str | None = None, speculative_tokens: int = 4,
                 extra_files: dict[str, str] | None = None) -> ExportedHead:
    """Write and validate a `fmt` folder for a head given as (HeadConfig, our-named tensors)."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ExportError(f"format={fmt!r} is not one of {', '.join(FORMATS)}")
    if dtype not in _DTYPES:
        raise ExportError(f"export.dtype={dtype!r} is not one of {', '.join(_DTYPES)}")
    verifier = verifier_info(target_path) if (fmt == "speculators" and target_path) else None
    config = build_config(cfg, fmt, dtype, verifier=verifier, speculative_tokens=speculative_tokens)
    if fmt == "speculators" and not config["speculators_config"]["verifier"]["name_or_path"]:
        raise ExportError("format=speculators needs the target's name for the verifier: set target.path")
    stored = format_tensors(cfg, tensors, fmt, dtype)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
    try:
        meta = {"format": "pt", "eagle_format": fmt, "eagle_algorithm": cfg.algorithm}
        save_file(stored, str(tmp / WEIGHTS_FILE), metadata=meta)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if fmt == "hf":
            (tmp / HEAD_CONFIG_FILE).write_text(cfg.to_json() + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        check_folder(tmp, expect_format=fmt, dtype=dtype)  # validated before anything replaces old files
        for stale in _HEAD_FILES:
            if (out / stale).exists() and not (tmp / stale).exists():
                (out / stale).unlink()
        # Weights before config: a folder whose config is new always has the new weights.
        names = sorted(os.listdir(tmp), key=lambda n: (n == CONFIG_FILE, n))
        for name in names:
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return check_folder(out, expect_format=fmt, dtype=dtype)


def export_head(head: DraftHead, output_dir: str | Path, fmt: str, dtype: str = "float16",
                target_path: str | None = None, speculative_tokens: int = 4) -> ExportedHead:
    """Export a live head module (its own weights and vocab maps, nothing borrowed)."""
    return write_export(head.config, head.trainable_state_dict(), output_dir, fmt, dtype,
                        target_path=target_path, speculative_tokens=speculative_tokens)


def _trained_target_path(train_dir: Path | None) -> str | None:
    """`target.path` of the training run, from its resolved train_config.yaml."""
    if train_dir is None or not (train_dir / "train_config.yaml").is_file():
        return None
    from omegaconf import OmegaConf

    try:
        return str(OmegaConf.load(train_dir / "train_config.yaml").target.path)
    except Exception:  # an unreadable or foreign yaml only loses this hint
        return None


def run_export(cfg: Any) -> ExportedHead:
    """The `eagle-export` stage: validate `export.check`, or export `draft.path` to `output_dir`."""
    if cfg.export.check:
        head = check_folder(cfg.export.check)
        print(summary(head))
        return head
    if not cfg.draft.path:
        raise ExportError("draft.path is required: a training output dir, checkpoint dir or head folder")
    src, train_dir = resolve_head_source(cfg.draft.path)
    source = check_folder(src)
    target_path = _trained_target_path(train_dir) or cfg.target.path
    head = write_export(source.config, source.tensors, cfg.output_dir, cfg.format, cfg.export.dtype,
                        target_path=target_path, speculative_tokens=cfg.decode.tree_depth)
    print(summary(head))
    return head


def summary(head: ExportedHead) -> str:
    """One paragraph describing a validated folder (what --check prints)."""
    c = head.config
    n = sum(t.numel() for t in head.tensors.values() if t.is_floating_point())
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in head.tensors.values() if t.is_floating_point()})
    lines = [
        f"OK: {head.folder} is a valid {c.algorithm} draft head (format {head.format})",
        f"  hidden {c.hidden_size}, target hidden {c.target_hidden_size}, heads {c.num_attention_heads}/"
        f"{c.num_key_value_heads}, intermediate {c.intermediate_size}",
        f"  vocab {c.vocab_size}, draft vocab {c.draft_vocab_size}, aux layers {c.aux_layer_ids or 'n/a'}",
        f"  {len(head.tensors)} tensors, {n / 1e6:.2f}M parameters, dtype {', '.join(dtypes)}",
    ]
    if head.borrowed:
        lines.append(f"  also stores target-owned {', '.join(sorted(head.borrowed))} (not used: eagle borrows "
                     "the target's)")
    lines += [f"  note: {m}" for m in head.notes]
    return "\n".join(lines)
