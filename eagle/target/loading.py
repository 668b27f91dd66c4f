"""The whole frozen target in this process: weights (in the stage's dtype, with an attention
implementation that takes the decoder's tree masks), tokenizer and chat template, and the `TargetInfo`
later stages record. Nothing here is family specific: sizes and layer counts come from the model's own
config. Sharded targets: `eagle.target.shard`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from eagle.config import ConfigError, TargetConfig
from eagle.errors import TargetError
from eagle.target.cpu_gemm import apply_cpu_gemm
from eagle.target.multimodal import auto_model_class
from eagle.target.precision import dtype_name, resolve_dtype
from eagle.target.resolve import resolve_target_path
from eagle.target.structure import text_config


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
        # A vision-language checkpoint loads with its vision tower (eagle.target.multimodal).
        model = auto_model_class(config).from_pretrained(
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


def target_info(
    cfg: TargetConfig,
    resolved: str,
    fingerprint: str,
    model_config: Any,
    dtype: torch.dtype,
    gemm: str = "stock",
    shard: str = "none",
) -> TargetInfo:
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

    `stage` (decode | regenerate | capture | train) picks `target.dtype=auto`'s dtype (see `eagle.target.precision`)
    and whether `target.cpu_gemm` applies (decode and regenerate only; see `eagle.target.cpu_gemm`). Decoding
    stages refuse `target.shard`; capture and training load a sharded target with `eagle.target.shard`.
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
