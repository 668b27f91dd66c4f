"""Read and validate an exported (or third-party) draft-head folder.

`read_folder` turns any supported folder into one canonical form (HeadConfig + tensors under our
own names); `check_folder` additionally proves the folder is complete and consistent: every
required tensor present, nothing unexpected, shapes and dtypes right, the vocabulary maps
coherent, and (for folders we wrote) every config field equal to what the format prescribes.
Every failure is an `ExportError` naming the folder, file, tensor or field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from eagle.errors import ExportError
from eagle.export.exported import ExportedHead
from eagle.export.formats import (
    CONFIG_FILE,
    EXPORT_META_KEY,
    HEAD_CONFIG_FILE,
    SPECULATORS_EMBED,
    WEIGHTS_FILE,
    algorithm_of,
    expected_tensors,
    from_format_name,
    head_config_from_config,
    tensor_kind,
    to_format_name,
)
from eagle.export.registry import FORMATS, format_config, format_keys
from eagle.heads.base import HeadConfig
from eagle.target.precision import DTYPES as _DTYPES

# Tensors a third-party folder may carry that our heads take from the target instead.
_BORROWED = ("embed_tokens.weight", "lm_head.weight")


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ExportError(f"{path} is missing") from e
    except (OSError, json.JSONDecodeError) as e:
        raise ExportError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ExportError(f"{path} must hold a JSON object")
    return data


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder: model.safetensors, a sharded safetensors index, or pytorch_model.bin."""
    files: list[Path]
    index = folder / "model.safetensors.index.json"
    if (folder / WEIGHTS_FILE).is_file():
        files = [folder / WEIGHTS_FILE]
    elif index.is_file():
        files = sorted({folder / f for f in read_json(index).get("weight_map", {}).values()})
    elif (folder / "pytorch_model.bin").is_file():
        try:  # weights_only: a pickle from elsewhere must not run code
            data = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types for corrupt/unsafe pickles
            raise ExportError(f"{folder / 'pytorch_model.bin'} cannot be read safely: {e}") from e
        return {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
    else:
        raise ExportError(f"{folder} has no {WEIGHTS_FILE} (nor a sharded index or pytorch_model.bin)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(str(f)))
        except (OSError, SafetensorError) as e:
            raise ExportError(f"{f} is not a readable safetensors file: {e}") from e
    return out


def read_folder(folder: str | Path, num_target_layers: int | None = None) -> ExportedHead:
    """Read a head folder of any supported format into canonical form (no completeness checks)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ExportError(f"{folder} is not a folder")
    if (folder / HEAD_CONFIG_FILE).is_file() and not (folder / CONFIG_FILE).is_file():
        # A plain head folder as written by `save_head`.
        try:
            cfg, fmt, raw = HeadConfig.load(folder / HEAD_CONFIG_FILE), "hf", {}
        except (TypeError, ValueError, json.JSONDecodeError) as e:
            raise ExportError(f"{folder / HEAD_CONFIG_FILE} is not a valid head config: {e}") from e
    else:
        raw = read_json(folder / CONFIG_FILE)
        cfg, fmt = head_config_from_config(raw, str(folder / CONFIG_FILE), num_target_layers)
    stored = read_tensors(folder)
    tensors: dict[str, torch.Tensor] = {}
    borrowed: dict[str, torch.Tensor] = {}
    own = expected_tensors(cfg)
    for name, t in stored.items():
        ours = from_format_name(name, cfg.algorithm)
        if ours in _BORROWED and ours not in own:  # the target's (EAGLE-3 has its own lm_head)
            borrowed[ours] = t
            continue
        if ours in tensors:
            raise ExportError(f"{folder}: tensors {name!r} and another stored name both map to {ours!r}")
        tensors[ours] = t
    return ExportedHead(folder=folder, format=fmt, config=cfg, tensors=tensors, borrowed=borrowed, raw_config=raw)


def _fmt_shape(shape: Any) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, where: str) -> None:
    """d2t/t2d must describe the same strictly increasing draft -> target id map."""
    target_ids = torch.arange(d2t.numel(), dtype=torch.long) + d2t.long()  # [V_draft]
    if target_ids.numel() and (target_ids.min() < 0 or target_ids.max() >= t2d.numel()):
        raise ExportError(f"{where}: d2t maps draft ids outside the target vocabulary [0, {t2d.numel()})")
    if target_ids.numel() > 1 and not bool((target_ids[1:] > target_ids[:-1]).all()):
        raise ExportError(f"{where}: d2t must map draft ids to strictly increasing target ids")
    if int(t2d.sum()) != d2t.numel() or not torch.equal(torch.nonzero(t2d).flatten(), target_ids):
        raise ExportError(f"{where}: t2d does not mark exactly the target ids that d2t maps to")


def _check_our_config(head: ExportedHead, dtype: str | None) -> None:
    """A folder we wrote: every config field must equal what the format prescribes."""
    where = head.folder / CONFIG_FILE
    raw = head.raw_config
    # The layout only: whether the format's engine serves the head is `eagle-export --check`'s question
    # (run_export), not the loader's, which must still read e.g. a vllm folder of a non-SiLU head.
    expected = format_config(head.config, head.format, dtype or str(raw.get("torch_dtype", "float16")))
    for key, value in expected.items():
        if key in ("speculators_config", EXPORT_META_KEY):
            continue
        if key not in raw:
            raise ExportError(f"{where}: config field {key!r} is missing (expected {value!r})")
        if raw[key] != value and not (isinstance(value, float) and raw[key] == value):
            raise ExportError(f"{where}: config field {key!r}={raw[key]!r} does not match the head ({value!r})")
    FORMATS[head.format].check_folder(head, head.folder)


def check_folder(
    folder: str | Path, expect_format: str | None = None, dtype: str | None = None, num_target_layers: int | None = None
) -> ExportedHead:
    """Validate a head folder; returns it in canonical form or raises `ExportError`.

    `dtype` (float16 | bfloat16 | float32): every floating tensor must have it; None accepts any
    floating dtype. Folders we wrote are also checked field by field against their format.
    """
    head = read_folder(folder, num_target_layers)
    if expect_format is not None and head.format != expect_format:
        raise ExportError(f"{head.folder} is a {head.format!r} folder, expected format={expect_format!r}")
    _check_head_config(head)
    want = _DTYPES[dtype] if dtype else None
    _check_own_tensors(head, dtype, want)
    _check_borrowed_tensors(head, dtype, want)
    if "d2t" in head.tensors or "t2d" in head.tensors:
        if not ("d2t" in head.tensors and "t2d" in head.tensors):
            raise ExportError(f"{head.folder}: d2t and t2d must be stored together")
        check_vocab_maps(head.tensors["d2t"], head.tensors["t2d"], str(head.folder))
    if head.format in FORMATS and head.raw_config:
        _check_our_config(head, dtype)  # and the format's own checks (e.g. llamacpp's LLAMACPP.md)
        _check_stored_names(head)
    return head


def _check_head_config(head: ExportedHead) -> None:
    """Aux layer ids the algorithm needs; a draft vocabulary within the target's."""
    cfg, where = head.config, head.folder
    algo = algorithm_of(cfg)
    if n := algo.num_aux_layers:
        if head.format != "third-party" and len(cfg.aux_layer_ids) != n:
            raise ExportError(f"{where}: {algo.title} needs {n} aux layer ids, config has {cfg.aux_layer_ids}")
        if cfg.aux_layer_ids and (len(set(cfg.aux_layer_ids)) != n or min(cfg.aux_layer_ids) < 0):
            raise ExportError(f"{where}: aux layer ids {cfg.aux_layer_ids} must be {n} distinct ids >= 0")
        if not cfg.aux_layer_ids:
            head.notes.append("no aux layer ids in the config: runtimes use their default (2, L//2, L-3)")
    if cfg.draft_vocab_size > cfg.vocab_size:
        raise ExportError(f"{where}: draft_vocab_size={cfg.draft_vocab_size} exceeds vocab_size={cfg.vocab_size}")


def _check_own_tensors(head: ExportedHead, dtype: str | None, want: torch.dtype | None) -> None:
    """Exactly the head's tensors (those the format may leave out aside), each of its shape, kind and dtype,
    all finite."""
    cfg, where = head.config, head.folder
    algo = algorithm_of(cfg)
    spec = expected_tensors(cfg)
    optional = set(algo.default_tensors(cfg, head.format))  # e.g. no maps for a full vocabulary
    missing = sorted(set(spec) - set(head.tensors) - optional)
    if missing:
        raise ExportError(
            f"{where}: required tensors missing: {', '.join(missing)} (a runtime that skips "
            "unknown keys, like SGLang, would silently leave them at their initial values)"
        )
    unexpected = sorted(set(head.tensors) - set(spec))
    if unexpected:
        raise ExportError(
            f"{where}: unexpected tensors {', '.join(unexpected)} for a {cfg.algorithm} head of this config"
        )
    for name, t in head.tensors.items():
        shape, kind = spec[name]
        if tuple(t.shape) != shape:
            raise ExportError(
                f"{where}: tensor {name} has shape {_fmt_shape(t.shape)}, the config implies {_fmt_shape(shape)}"
            )
        if tensor_kind(t) != kind:
            raise ExportError(f"{where}: tensor {name} has dtype {t.dtype}, expected a {kind} tensor")
        if kind == "float" and want is not None and t.dtype != want:
            raise ExportError(f"{where}: tensor {name} is {t.dtype}, the export dtype is {dtype}")
        if kind == "float" and not bool(torch.isfinite(t.float()).all()):
            raise ExportError(f"{where}: tensor {name} holds NaN or inf values")


def _check_borrowed_tensors(head: ExportedHead, dtype: str | None, want: torch.dtype | None) -> None:
    """The target's tensors a folder holds: of the target's shape; one a format stores on purpose (speculators'
    embedding) also in the export dtype, finite and not all zeros."""
    cfg, where = head.config, head.folder
    form = FORMATS.get(head.format)
    stored_extra = {from_format_name(n, cfg.algorithm) for n in form.extra_tensors(cfg)} if form else set()
    for name, t in head.borrowed.items():
        if tuple(t.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ExportError(
                f"{where}: tensor {name} has shape {_fmt_shape(t.shape)}, expected "
                f"{_fmt_shape((cfg.vocab_size, cfg.hidden_size))}"
            )
        if name in stored_extra:
            if want is not None and t.dtype != want:
                raise ExportError(f"{where}: tensor {name} is {t.dtype}, the export dtype is {dtype}")
            if not bool(torch.isfinite(t.float()).all()):
                raise ExportError(f"{where}: tensor {name} holds NaN or inf values")
            if not bool(t.abs().amax() > 0):
                raise ExportError(f"{where}: tensor {name} is all zeros (it must be the target's input embedding)")


def _check_stored_names(head: ExportedHead) -> None:
    """A folder eagle wrote stores exactly the names its format prescribes."""
    cfg, form = head.config, FORMATS[head.format]
    stored = set(format_keys(cfg, head.format))
    have = set(head.tensors) | set(head.borrowed)
    have_stored = {to_format_name(n, head.format, cfg.algorithm) for n in have}
    if form.stores_target_embedding and SPECULATORS_EMBED not in have_stored:
        # Written before speculators exports stored the embedding: still a valid head for vLLM and
        # eagle, but the speculators library would run it on a zero embedding.
        stored.discard(SPECULATORS_EMBED)
        head.notes.append(
            f"no {SPECULATORS_EMBED}: the {form.engine} library (0.9) would run this head on an "
            "all-zero input embedding; re-export with this eagle to store the target's"
        )
    if have_stored != stored:
        raise ExportError(
            f"{head.folder}: tensor names {sorted(have_stored ^ stored)} differ from what format={head.format} "
            "prescribes"
        )
