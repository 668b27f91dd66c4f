"""`target.path` -> frozen target model + tokenizer.

A target is any Hugging Face causal LM, given as a Hub id, a local checkpoint folder, a `.gguf`
file, or a built-in name (see `eagle.assets`). A GGUF file is converted once into an HF checkpoint
(safetensors + tokenizer) cached under a key derived from the file's content hash, so later loads
take well under a second. Nothing here is family specific: sizes and layer counts come from the
model's own config.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from eagle.assets import ASSETS, asset_path
from eagle.config import ConfigError, TargetConfig
from eagle.cpu_gemm import apply_cpu_gemm
from eagle.errors import CaptureError, TargetError
from eagle.fileio import atomic_dir, atomic_write_text, exclusive_lock, file_sha256
from eagle.precision import dtype_name, resolve_dtype


@dataclass(frozen=True)
class TargetInfo:
    """What later stages need to know about a target, independent of how it was loaded."""

    source: str  # what the user gave in target.path
    resolved: str  # local folder or Hub id actually loaded
    fingerprint: str  # content-derived identity, stored in manifests and checkpoints
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str = "float32"  # the dtype the weights were loaded in (target.dtype resolved)
    gemm: str = "stock"  # the kernel of float32 CPU linears of 2-32 rows (target.cpu_gemm resolved)
    shard: str = "none"  # how this process holds it: whole, or FSDP2 shards of its layers (target.shard)


def default_cache_dir(cfg: TargetConfig | None = None) -> Path:
    if cfg is not None and cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    return Path(os.environ.get("EAGLE_CACHE", Path.home() / ".cache" / "eagle")).expanduser()


def _cached_file_hash(path: Path, cache_dir: Path) -> str:
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
    digest = _cached_file_hash(gguf, cache_dir)
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
        return str(folder), "gguf-sha256:" + _cached_file_hash(path, default_cache_dir(cfg))
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


def load_chat_template(value: str) -> str:
    """`target.chat_template` is either a Jinja string or a path to a file holding one."""
    candidate = Path(value).expanduser()
    if "{" not in value and candidate.is_file():
        return candidate.read_text()
    if "{" not in value:
        raise TargetError(f"target.chat_template={value!r} is neither a Jinja template nor an existing file")
    return value


def load_tokenizer(cfg: TargetConfig, resolved: str | None = None) -> Any:
    resolved = resolved or resolve_target_path(cfg)[0]
    try:
        tok = AutoTokenizer.from_pretrained(resolved, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:
        raise TargetError(f"cannot load the tokenizer of target.path={cfg.path!r} ({resolved}): {e}") from e
    if cfg.chat_template:
        tok.chat_template = load_chat_template(cfg.chat_template)
    if tok.pad_token_id is None:
        # Padding positions are masked out everywhere; any id works, eos is the usual choice.
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.convert_ids_to_tokens(0)
    return tok


# Stages that decode with the target, and the tool that runs each (named when target.shard is refused).
DECODING_STAGES = {"decode": "eagle-eval (speculative decoding)", "regenerate": "eagle-regenerate (generation)"}


def check_shard_stage(cfg: TargetConfig, stage: str) -> None:
    """Refuse `target.shard` other than none for a decoding stage: a decoding step computes a few tokens,
    and a sharded target would all-gather every layer's weights for each of them."""
    if cfg.shard != "none" and stage in DECODING_STAGES:
        raise ConfigError(
            f"target.shard={cfg.shard}: {DECODING_STAGES[stage]} runs the whole target in one process (each "
            "decoding step computes a few tokens; a sharded target would all-gather every layer's weights for "
            "each step). Set target.shard=none here; sharding is for eagle-capture and eagle-train"
        )


@contextlib.contextmanager
def target_errors(model: Any) -> Iterator[None]:
    """A failure inside the target's own forward stops with the target's name and the error: the usual
    cause is its config (one transformers accepts but cannot run), which a tensor-size traceback hides."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        config = getattr(model, "config", None)
        name = getattr(config, "_name_or_path", "") or type(model).__name__
        model_type = getattr(text_config(config), "model_type", "?") if config is not None else "?"
        raise TargetError(
            f"the target's own forward failed (target.path={name}, model_type {model_type}): {type(e).__name__}: "
            f"{e}. Check its config.json (e.g. num_key_value_heads must divide num_attention_heads) by running the "
            "model with transformers alone"
        ) from e


# Attention implementations that take the decoder's 4D tree mask (eagle.decode.target); eager also runs
# attention sinks (gpt-oss) and is in every transformers model.
MASKABLE_ATTENTION = ("sdpa", "eager")


def attention_implementation(requested: str, model_config: Any) -> str:
    """`target.attn_implementation`, with `auto` resolved for this family: sdpa where its transformers
    class runs it, eager elsewhere (gpt-oss: its sinks have no sdpa path). Remote-code families get sdpa,
    transformers' own default."""
    if requested != "auto":
        return requested
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(model_config), None)
    if model_class is None or getattr(model_class, "_supports_sdpa", False):
        return "sdpa"
    return "eager"


def load_weights(cfg: TargetConfig, resolved: str, dtype: torch.dtype) -> Any:
    """The target's HF model from `resolved` (see `resolve_target_path`) on the CPU, eval mode, no grads."""
    try:
        config = AutoConfig.from_pretrained(resolved, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            resolved,
            config=config,
            revision=cfg.revision,
            dtype=dtype,
            trust_remote_code=cfg.trust_remote_code,
            attn_implementation=attention_implementation(cfg.attn_implementation, config),
        )
    except Exception as e:
        raise TargetError(f"cannot load target.path={cfg.path!r} ({resolved}): {e}") from e
    return model.eval().requires_grad_(False)


def target_info(cfg: TargetConfig, resolved: str, fingerprint: str, model_config: Any, dtype: torch.dtype,
                gemm: str = "stock", shard: str = "none") -> TargetInfo:
    """The `TargetInfo` of a target loaded from `resolved` with `model_config` (its HF config)."""
    text = text_config(model_config)
    return TargetInfo(
        source=cfg.path,
        resolved=resolved,
        fingerprint=fingerprint,
        model_type=text.model_type,
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        vocab_size=text.vocab_size,
        dtype=dtype_name(dtype),
        gemm=gemm,
        shard=shard,
    )


def load_target(
    cfg: TargetConfig, device: torch.device | str | None = None, stage: str = "capture"
) -> tuple[Any, Any, TargetInfo]:
    """Load the whole frozen target (eval mode, no grads), its tokenizer and its `TargetInfo`.

    `stage` (decode | regenerate | capture | train) picks `target.dtype=auto`'s dtype (see `eagle.precision`)
    and whether `target.cpu_gemm` applies (decode and regenerate only; see `eagle.cpu_gemm`). Decoding
    stages refuse `target.shard`; capture and training load a sharded target with `eagle.shard`.
    """
    check_shard_stage(cfg, stage)
    dtype = resolve_dtype(cfg.dtype, device, stage)
    resolved, fingerprint = resolve_target_path(cfg)
    tokenizer = load_tokenizer(cfg, resolved)
    model = load_weights(cfg, resolved, dtype)
    if device is not None:
        model.to(device)
    # Only decoding and regeneration run products of 2-32 rows; elsewhere the load-time probe is wasted work.
    gemm = apply_cpu_gemm(model, cfg.cpu_gemm)["kernel"] if stage in ("decode", "regenerate") else "stock"
    return model, tokenizer, target_info(cfg, resolved, fingerprint, model.config, dtype, gemm)


def decoder_layer_stacks(model: nn.Module) -> list[nn.ModuleList]:
    """Module lists of `model` as long as its `num_hidden_layers`: exactly one, its decoder layers, in
    every Llama-style family (the one rule for `train.init_layer_from_target` and `target.shard`)."""
    n = int(text_config(model.config).num_hidden_layers)
    return [m for _, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n]


def decoder_of(model: nn.Module) -> nn.Module:
    """The target's base decoder (no LM head): what a capture forward calls, so that it skips the [B, T, V]
    logits, and what `target.shard=fsdp` shards."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    if decoder is None or decoder is model:
        decoder = getattr(model, "model", None)
    if decoder is None:
        raise CaptureError(
            f"cannot find the base decoder of {type(model).__name__} (no get_decoder() or .model); "
            "capture needs a transformers causal LM"
        )
    return decoder


def text_config(config: Any) -> Any:
    """The decoder's config (multimodal configs keep it under `text_config`)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high feature layers for an L-layer target: (2, L // 2, L - 3).

    Indices follow vLLM's `eagle_aux_hidden_state_layer_ids`: id i means the input of decoder layer
    i, which is `output_hidden_states[i]` in transformers (index 0 is the embedding output).
    """
    if num_layers >= 8:
        return [2, num_layers // 2, num_layers - 3]
    if num_layers < 3:
        raise ValueError(f"EAGLE-3 needs a target with at least 3 layers, got {num_layers}")
    # Small test models: three distinct layers spread over what exists.
    return [1, num_layers // 2, num_layers - 1]


def aux_layer_problem(aux_layer_ids: list[int], num_layers: int) -> str | None:
    """Why `aux_layer_ids` are not EAGLE-3 feature layers of an L-layer target (None if they are).

    The one rule, used by config, capture and head loading alike: three ids, each the input of an
    existing decoder layer (0 <= i < L, the convention of `default_aux_layer_ids`).
    """
    ids = [int(i) for i in aux_layer_ids]
    if len(ids) == 3 and all(0 <= i < num_layers for i in ids):
        return None
    return f"draft.aux_layer_ids={ids} must be 3 layer ids in [0, {num_layers - 1}] for this {num_layers}-layer target"


def config_token_ids(names: tuple[str, ...], *sources: Any) -> list[int]:
    """Token ids named `names` (e.g. "eos_token_id") on each source in order (a tokenizer, a model's
    config or generation_config; a value may be a list, as chat models list several EOS ids),
    without repeats, in first-seen order. The one reader of such ids for stopping, baselines and
    the draft vocabulary."""
    ids: list[int] = []
    for source in sources:
        for name in names:
            value = getattr(source, name, None) if source is not None else None
            for v in value if isinstance(value, (list, tuple)) else ([] if value is None else [value]):
                if int(v) not in ids:
                    ids.append(int(v))
    return ids
