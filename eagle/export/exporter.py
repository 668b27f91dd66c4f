"""`eagle-export`: a trained head -> a folder a serving runtime (or the Hub) loads directly.

The export works on tensors and the `HeadConfig`, never on runtime code: refuse a head the format's
engine cannot serve (before anything is read or written), rename per format, cast floating tensors to
`export.dtype` (vocab maps keep int64 / bool), write config.json (+ our head_config.json for format=hf,
LLAMACPP.md for format=llamacpp) into a temporary folder, validate that folder with the same checks
`eagle-export --check` runs, and only then move the files into `output_dir`.
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
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError
from omegaconf import OmegaConf
from safetensors import safe_open

from eagle.algorithms import get_algorithm
from eagle.artifacts import TRAIN_CONFIG, resolve_draft
from eagle.config import TargetConfig
from eagle.errors import EagleError, ExportError
from eagle.export.formats import (
    CONFIG_FILE,
    HEAD_CONFIG_FILE,
    LLAMACPP_FILE,
    LLAMACPP_GGUF,
    SPECULATORS_EMBED,
    WEIGHTS_FILE,
    algorithm_of,
    expected_tensors,
    hub_id_for_target,
    to_format_name,
)
from eagle.export.hf_generate import CUSTOM_GENERATE_DIR
from eagle.export.registry import FORMATS, build_config, check_servable, get_format
from eagle.export.validate import ExportedHead, check_folder, read_json
from eagle.fileio import safetensors_bytes
from eagle.heads.base import DraftHead, HeadConfig
from eagle.target.loading import load_target
from eagle.target.precision import DTYPES as _DTYPES
from eagle.target.resolve import resolve_target_path

log = logging.getLogger(__name__)

# Files an earlier export into the same folder may have left; removed so formats never mix (and a GGUF
# converted from the old weights is never served beside the new ones).
_HEAD_FILES = (
    WEIGHTS_FILE,
    "model.safetensors.index.json",
    "pytorch_model.bin",
    CONFIG_FILE,
    HEAD_CONFIG_FILE,
    LLAMACPP_FILE,
    LLAMACPP_GGUF,
    CUSTOM_GENERATE_DIR,  # a folder: transformers' custom_generate of format=hf
)


def resolve_head_source(path: str | Path) -> tuple[Path, Path | None]:
    """`draft.path` -> (folder to export from, training output dir or None); see `eagle.artifacts.resolve_draft`."""
    resolved = resolve_draft(path)
    return resolved.folder, resolved.training_dir


VERIFIER_MODES = ("local", "hub")


def verifier_info(target_path: str | None, verifier: str | None = None, default: str = "local") -> dict[str, Any]:
    """{"name_or_path", "architectures"} for a speculators `verifier` block, read locally (no network).

    `verifier` is `export.verifier`: None means `default`. "local": the target's local folder (a
    target folder as given, the converted folder of a `.gguf` / built-in target), so the speculators
    library loads offline; a Hub-id target stays its Hub id. "hub": the target's Hub id (what a
    published repo should name). Anything else is written as given (an existing folder made absolute).
    """
    mode = verifier or default
    local: Path | None = None
    if target_path:
        try:
            resolved, _ = resolve_target_path(TargetConfig(path=target_path))
            local = Path(resolved) if Path(resolved).is_dir() else None
        except EagleError as e:  # a missing asset: the name alone still identifies the target
            log.warning("target.path=%s does not resolve locally (%s)", target_path, e)
    if mode == "local":
        if verifier == "local" and local is None:
            raise ExportError(
                f"export.verifier=local: target.path={target_path!r} has no local folder (a Hub id "
                "or missing file); give export.verifier=FOLDER or a local target.path"
            )
        name = str(local) if local is not None else (hub_id_for_target(target_path) if target_path else None)
    elif mode == "hub":
        name = hub_id_for_target(target_path) if target_path else None
    else:
        given = Path(mode).expanduser()
        name = str(given.resolve()) if given.is_dir() else mode
    archs: list[str] = []
    for folder in (Path(name) if name else None, local):
        if folder is not None and (folder / CONFIG_FILE).is_file():
            archs = list(read_json(folder / CONFIG_FILE).get("architectures") or [])
            break
    else:
        log.warning(
            "verifier %s: architectures unknown (no local config.json); the speculators verifier lists none", name
        )
    return {"name_or_path": name, "architectures": archs}


def target_input_embedding(target_path: str) -> torch.Tensor:
    """The target's input embedding [vocab, hidden], read from its safetensors without building the
    model where possible (a local folder, or the Hub / local HF cache for a Hub id); otherwise the
    target is loaded once and its `get_input_embeddings()` taken."""
    target = TargetConfig(path=target_path)
    resolved, _ = resolve_target_path(target)
    try:
        found = _embedding_from_safetensors(resolved, target.revision)
    except Exception as e:  # an unusual layout / a Hub error: fall back to loading the model
        log.info("embedding of %s not read from safetensors (%s); loading the target", resolved, e)
        found = None
    if found is not None:
        return found
    model, _, _ = load_target(target)
    return model.get_input_embeddings().weight.detach().to("cpu")


def _embedding_from_safetensors(resolved: str, revision: str | None) -> torch.Tensor | None:
    folder = Path(resolved)

    def get(name: str) -> Path | None:
        if folder.is_dir():
            return folder / name if (folder / name).is_file() else None
        try:
            return Path(hf_hub_download(resolved, name, revision=revision))
        except EntryNotFoundError:
            return None

    index = get("model.safetensors.index.json")
    if index is not None:
        weight_map: dict[str, str] = dict(read_json(index).get("weight_map") or {})
    else:
        single = get(WEIGHTS_FILE)
        if single is None:
            return None
        with safe_open(str(single), framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), WEIGHTS_FILE)
    keys = [k for k in weight_map if k.endswith("embed_tokens.weight")]
    if not keys:
        return None
    key = min(keys, key=len)  # model.embed_tokens.weight over e.g. a vision tower's
    shard = get(weight_map[key])
    if shard is None:
        return None
    with safe_open(str(shard), framework="pt") as f:
        return f.get_tensor(key)


def _cast(name: str, t: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    if kind == "float":
        return t.detach().to("cpu", dtype).contiguous()
    if kind == "int":
        return t.detach().to("cpu", torch.long).contiguous()
    return t.detach().to("cpu", torch.bool).contiguous()


def format_tensors(cfg: HeadConfig, tensors: dict[str, torch.Tensor], fmt: str, dtype: str) -> dict[str, torch.Tensor]:
    """Our-named tensors -> the exact tensor dict a `fmt` folder stores (renamed, cast, completed)."""
    spec = expected_tensors(cfg)
    unknown = sorted(set(tensors) - set(spec))
    if unknown:
        raise ExportError(
            f"the head has tensors the {fmt} format has no place for: {unknown}; exporting would drop them"
        )
    algo = algorithm_of(cfg)
    # What the format may leave out takes the value its absence means (a full-vocabulary EAGLE-3
    # head gets identity maps, so every runtime reads the same thing).
    tensors = {**algo.default_tensors(cfg, fmt), **tensors}
    missing = sorted(set(spec) - set(tensors))
    if missing:
        raise ExportError(f"the head lacks tensors {missing} required by its config")
    tensors = algo.export_tensors(cfg, tensors, fmt)  # e.g. vLLM's EAGLE-1 has no fc bias
    out = {}
    for name, t in tensors.items():
        out[to_format_name(name, fmt, cfg.algorithm)] = _cast(name, t, spec[name][1], _DTYPES[dtype])
    return out


def write_export(
    cfg: HeadConfig,
    tensors: dict[str, torch.Tensor],
    output_dir: str | Path,
    fmt: str,
    dtype: str = "float16",
    target_path: str | None = None,
    speculative_tokens: int = 4,
    extra_files: dict[str, str] | None = None,
    embed_tokens: torch.Tensor | None = None,
    verifier: str | None = None,
    verifier_default: str = "local",
    local_paths: bool = True,
) -> ExportedHead:
    """Write and validate a `fmt` folder for a head given as (HeadConfig, our-named tensors).

    A head the format's engine cannot serve is refused first, with nothing written. format=speculators
    also stores the target's input embedding (`embed_tokens`, else read from `target_path`) and names the
    verifier per `verifier` / `verifier_default` (see `verifier_info`). format=llamacpp adds LLAMACPP.md
    with this machine's paths (the output folder, the target's HF folder and GGUF), or with placeholders
    and the target's Hub id when not `local_paths` (a folder for the Hub).
    """
    check_servable(cfg, fmt)
    form = get_format(fmt)
    if dtype not in _DTYPES:
        raise ExportError(f"export.dtype={dtype!r} is not one of {', '.join(_DTYPES)}")
    info = verifier_info(target_path, verifier, verifier_default) if form.names_verifier else None
    config = build_config(cfg, fmt, dtype, verifier=info, speculative_tokens=speculative_tokens)
    if info is not None and not info.get("name_or_path"):
        raise ExportError(
            f"format={fmt} needs the target's name for the verifier: set target.path (or export.verifier)"
        )
    stored = format_tensors(cfg, tensors, fmt, dtype)
    if form.stores_target_embedding:
        stored[SPECULATORS_EMBED] = _target_embedding(cfg, fmt, embed_tokens, target_path, dtype)
    extra_files = {
        **(extra_files or {}),
        **form.files(cfg, str(Path(output_dir).resolve()), target_path, local_paths, dtype, speculative_tokens),
    }
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
    try:
        meta = {"format": "pt", "eagle_format": fmt, "eagle_algorithm": cfg.algorithm}
        (tmp / WEIGHTS_FILE).write_bytes(safetensors_bytes(stored, meta))  # same tensors, same bytes
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name, text in extra_files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)  # e.g. custom_generate/generate.py
            (tmp / name).write_text(text)
        check_folder(tmp, expect_format=fmt, dtype=dtype)  # validated before anything replaces old files
        for stale in _HEAD_FILES:
            if (out / stale).exists() and not (tmp / stale).exists():
                shutil.rmtree(out / stale) if (out / stale).is_dir() else (out / stale).unlink()
        # Weights before config: a folder whose config is new always has the new weights.
        names = sorted(os.listdir(tmp), key=lambda n: (n == CONFIG_FILE, n))
        for name in names:
            if (out / name).is_dir():  # a folder is replaced whole (os.replace refuses a non-empty one)
                shutil.rmtree(out / name)
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return check_folder(out, expect_format=fmt, dtype=dtype)


def _target_embedding(
    cfg: HeadConfig, fmt: str, embed: torch.Tensor | None, target_path: str | None, dtype: str
) -> torch.Tensor:
    """The target's input embedding, cast to the export dtype, for a folder that stores it (speculators)."""
    if embed is None:
        if not target_path:
            raise ExportError(
                f"format={fmt} stores the target's input embedding (the {get_format(fmt).engine} "
                "library would otherwise run on zeros): set target.path to the head's target"
            )
        try:
            embed = target_input_embedding(target_path)
        except EagleError as e:
            raise ExportError(
                f"format={fmt} stores the target's input embedding, and it cannot be read "
                f"from target.path={target_path!r}: {e}"
            ) from e
    if tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ExportError(
            f"the target's input embedding has shape {list(embed.shape)}, the head expects "
            f"[{cfg.vocab_size}, {cfg.hidden_size}]: target.path is not the head's target"
        )
    return _cast(SPECULATORS_EMBED, embed, "float", _DTYPES[dtype])


def export_head(
    head: DraftHead,
    output_dir: str | Path,
    fmt: str,
    dtype: str = "float16",
    target_path: str | None = None,
    speculative_tokens: int = 4,
    verifier: str | None = None,
) -> ExportedHead:
    """Export a live head module (its own weights and vocab maps; format=speculators also stores the
    embedding of the target it is attached to, if any, else reads it from `target_path`)."""
    borrowed = getattr(head, "_borrowed", None) or {}
    module = borrowed.get("embed_tokens")
    embed = module.weight.detach() if module is not None and get_format(fmt).stores_target_embedding else None
    return write_export(
        head.config,
        head.trainable_state_dict(),
        output_dir,
        fmt,
        dtype,
        target_path=target_path,
        speculative_tokens=speculative_tokens,
        embed_tokens=embed,
        verifier=verifier,
    )


def trained_target_path(train_dir: Path | None) -> str | None:
    """`target.path` of the training run, from its resolved train_config.yaml."""
    if train_dir is None or not (train_dir / TRAIN_CONFIG).is_file():
        return None
    try:
        return str(OmegaConf.load(train_dir / TRAIN_CONFIG).target.path)
    except Exception:  # an unreadable or foreign yaml only loses this hint
        return None


def served_chain_length(cfg: Any, head: HeadConfig) -> int:
    """The `num_speculative_tokens` an export advertises for `head`.

    A block drafter's block (the engines draft all of it in one pass); otherwise `export.speculative_tokens`
    (the user's, for any head), else the entry of `export.speculative_tokens_by_algorithm` for the head's
    own algorithm (a recipe's measured value, which therefore never reaches a head of another algorithm),
    else the decoder's tree depth (what eagle's own decoder drafts at most). The head's algorithm, not
    `draft.algorithm`: the README's export command names no algorithm, the head folder does.
    """
    export = cfg.export
    measured = export.speculative_tokens_by_algorithm.get(head.algorithm)
    block = get_algorithm(head.algorithm).block_drafts(head)
    if block is None:
        return export.speculative_tokens or measured or cfg.decode.tree_depth
    for key, value in (
        ("export.speculative_tokens", export.speculative_tokens),
        (f"export.speculative_tokens_by_algorithm.{head.algorithm}", measured),
    ):
        if value not in (None, block):
            raise ExportError(
                f"{key}={value}: a {head.algorithm} head drafts {block} tokens a pass, which is what an "
                "engine must be given; drop the option (a value measured for one algorithm belongs in "
                "export.speculative_tokens_by_algorithm.NAME)"
            )
    return block


def run_export(cfg: Any) -> ExportedHead:
    """The `eagle-export` stage: validate `export.check`, or export `draft.path` to `output_dir`."""
    if cfg.export.check:
        head = check_folder(cfg.export.check)
        if head.format in FORMATS:  # a folder of ours: its engine must serve every option of the head
            check_servable(head.config, head.format)
        print(summary(head))
        return head
    get_format(cfg.format)  # a name eagle writes, before anything is read
    if not cfg.draft.path:
        raise ExportError("draft.path is required: a training output dir, checkpoint dir or head folder")
    src, train_dir = resolve_head_source(cfg.draft.path)
    source = check_folder(src)
    target_path = trained_target_path(train_dir) or cfg.target.path
    head = write_export(
        source.config,
        source.tensors,
        cfg.output_dir,
        cfg.format,
        cfg.export.dtype,
        target_path=target_path,
        speculative_tokens=served_chain_length(cfg, source.config),
        embed_tokens=source.borrowed.get(SPECULATORS_EMBED),
        verifier=cfg.export.verifier,
        verifier_default="local",
    )
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
    form = FORMATS.get(head.format)
    if form is not None:
        lines += form.summary(head)
    if head.borrowed:
        needs = f"; the {form.engine} library needs it" if form is not None and form.stores_target_embedding else ""
        lines.append(
            f"  also stores target-owned {', '.join(sorted(head.borrowed))} (eagle itself borrows the target's{needs})"
        )
    lines += [f"  note: {m}" for m in head.notes]
    return "\n".join(lines)
