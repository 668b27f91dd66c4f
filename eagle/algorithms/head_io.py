"""Building draft heads from a target's config, and saving / loading them (safetensors only).

A saved head is a folder with `model.safetensors` (the head's own weights and vocab maps, nothing
borrowed from the target) and `head_config.json` (a `HeadConfig`). Both files are written to a
temporary name and renamed, so a crash never leaves a half-written head behind.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from transformers.activations import ACT2FN
from transformers.integrations.heterogeneity.configuration_utils import AmbiguousGlobalPerLayerAttributeError

from eagle.algorithms import ALGORITHMS, get_algorithm
from eagle.artifacts import HEAD_CONFIG, HEAD_WEIGHTS
from eagle.config import ConfigError, DraftConfig
from eagle.errors import CheckpointError
from eagle.fileio import atomic_write_bytes, atomic_write_text, safetensors_bytes
from eagle.heads.base import DraftHead, HeadConfig
from eagle.target.loading import TargetInfo
from eagle.target.structure import aux_layer_problem, default_aux_layer_ids, text_config

log = logging.getLogger(__name__)

WEIGHTS_NAME = HEAD_WEIGHTS
CONFIG_NAME = HEAD_CONFIG
_EXTRA_KEY = "eagle_extra"


def _rope_parameters(text: Any, m_rope: bool = True) -> dict[str, Any]:
    """The target's RoPE parameters as one flat dict.

    Targets with per-layer-type RoPE (e.g. Gemma 3: sliding vs full attention) keep a dict per
    layer type; the head attends over the whole context, so it takes the full-attention one.
    m_rope=False drops a vision-language target's M-RoPE fields: vLLM refuses an M-RoPE draft that
    drafts in parallel (DFlash, P-EAGLE: `_raise_if_mrope`) and gives such a 1-D draft the time row
    of the target's positions, which is what the head's rotary then reads (`RotaryEmbedding`).
    """
    rope = getattr(text, "rope_parameters", None)
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        rope = rope.get("full_attention") or next(iter(rope.values()))
    if not rope:  # old-style configs: rope_theta (+ rope_scaling)
        rope = dict(getattr(text, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", float(getattr(text, "rope_theta", 10000.0)))
    rope = dict(rope)
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", 10000.0)
    if not m_rope:
        rope.pop("mrope_section", None)
        rope.pop("mrope_interleaved", None)
    if rope["rope_type"] == "default":
        # The head's default RoPE rotates its whole head_dim (`eagle.heads.layers.rope_inv_freq`); a partial
        # factor copied from the target (DeepSeek-V4: 0.125) would tell an engine reading the exported
        # config to rotate fewer dimensions than the head was trained with.
        rope.pop("partial_rotary_factor", None)
    return rope


def draft_layer_index(text: Any) -> int:
    """The target layer whose attention shape the draft layer copies, for a config whose head sizes
    differ by layer (transformers' per-layer configs, e.g. Gemma 4: sliding layers with 256-wide
    heads, full-attention layers with 512-wide heads and fewer KV heads).

    The last full-attention layer (else the last layer): the draft attends over the whole context as
    a full-attention layer does, and its RoPE is the full-attention one (`_rope_parameters`), whose
    partial rotary factor is a fraction of that layer type's head_dim; sizing the heads from a sliding
    layer would rotate a different number of dimensions than the target's full layers do."""
    types = list(_global_attr(text, "layer_types") or [])
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    return full[-1] if full else int(_global_attr(text, "num_hidden_layers")) - 1


def _global_attr(text: Any, name: str) -> Any:
    """`text.name`, or None when the config does not have it (never a per-layer attribute)."""
    try:
        return getattr(text, name, None)
    except AmbiguousGlobalPerLayerAttributeError:
        return None


def _attention_sizes(text: Any) -> dict[str, int]:
    """The numbers a draft layer is sized by, read per layer where the config is per layer.

    A config that lacks one, or holds something other than a positive integer there, stops with a
    ConfigError naming the attribute and the family, never a raw traceback from deep in the head."""
    family = str(_global_attr(text, "model_type") or type(text).__name__)
    per_layer = set(_global_attr(text, "per_layer_attributes") or ())  # None for homogeneous configs
    layer = draft_layer_index(text) if per_layer else None

    def read(name: str, default: Any = None) -> Any:
        try:
            if name in per_layer:
                return getattr(text.per_layer_config[layer], name, None) or default
            return getattr(text, name, None) or default
        except (AmbiguousGlobalPerLayerAttributeError, IndexError, KeyError, TypeError) as e:
            raise ConfigError(
                f"cannot size a draft head from the {family} target config: reading {name!r} failed ({e})"
            ) from e

    def need(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            where = f" of layer {layer} (per_layer_config)" if name in per_layer else ""
            raise ConfigError(
                f"cannot size a draft head from the {family} target config: {name}{where} is {value!r}, "
                "expected a positive integer"
            )
        return value

    out = {name: need(name, read(name)) for name in ("hidden_size", "vocab_size", "num_hidden_layers")}
    out["num_attention_heads"] = need("num_attention_heads", read("num_attention_heads"))
    out["num_key_value_heads"] = need("num_key_value_heads", read("num_key_value_heads", out["num_attention_heads"]))
    if out["num_attention_heads"] % out["num_key_value_heads"]:
        raise ConfigError(
            f"cannot size a draft head from the {family} target config: num_attention_heads="
            f"{out['num_attention_heads']} is not a multiple of num_key_value_heads={out['num_key_value_heads']}"
        )
    out["head_dim"] = need("head_dim", read("head_dim", out["hidden_size"] // out["num_attention_heads"]))
    out["intermediate_size"] = need("intermediate_size", read("intermediate_size"))
    return out


def head_config_from_target(
    target_config: Any, draft_cfg: DraftConfig, target_info: TargetInfo | None = None
) -> HeadConfig:
    """A `HeadConfig` sized from the target's HF config; model families differ only in these numbers.

    A head without `reduced_vocab` (EAGLE-1) uses the full target vocabulary (`draft.draft_vocab_size`
    is ignored); one with it (EAGLE-3) uses `draft.draft_vocab_size` (None = full vocabulary). A head
    with `num_aux_layers` reads `draft.aux_layer_ids` (None = the target's default three) and the
    EAGLE-3.1 options `draft.fc_norm` / `draft.norm_output` (ignored, with a log line, by other heads).
    """
    text = text_config(target_config)
    algo = draft_cfg.algorithm
    head_cls = get_algorithm(algo).head_class
    sizes = _attention_sizes(text)
    hidden, vocab, layers = sizes["hidden_size"], sizes["vocab_size"], sizes["num_hidden_layers"]
    n_heads, n_kv, head_dim = sizes["num_attention_heads"], sizes["num_key_value_heads"], sizes["head_dim"]
    draft_vocab = vocab
    aux: list[int] = []
    if head_cls.reduced_vocab:
        draft_vocab = draft_cfg.draft_vocab_size or vocab
        if draft_vocab > vocab:
            raise ConfigError(
                f"draft.draft_vocab_size={draft_vocab} exceeds the target's vocabulary ({vocab}); "
                f"set draft.draft_vocab_size<={vocab} or null for the full vocabulary"
            )
    if head_cls.num_aux_layers:
        if draft_cfg.aux_layer_ids is None:
            try:
                aux = default_aux_layer_ids(layers)
            except ValueError as e:
                raise ConfigError(f"draft.algorithm={algo}: {e}") from e
        else:
            aux = [int(i) for i in draft_cfg.aux_layer_ids]
            if problem := aux_layer_problem(aux, layers):
                raise ConfigError(problem)
    eagle31 = head_cls.eagle31_options  # EAGLE-3's fc_norm / norm_output
    if (draft_cfg.fc_norm or draft_cfg.norm_output) and not eagle31:
        # Like draft_vocab_size and aux_layer_ids: a recipe sets them for its EAGLE-3 head, and
        # `recipe=... draft=eagle1` must still work.
        log.info(
            "draft.fc_norm / draft.norm_output are EAGLE-3.1 options of EAGLE-3 / P-EAGLE heads; "
            "draft.algorithm=%s has no such parts, so they are ignored",
            algo,
        )
    act = getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None) or "silu"
    if draft_cfg.hidden_act is not None:
        if draft_cfg.hidden_act not in ACT2FN:
            raise ConfigError(
                f"draft.hidden_act={draft_cfg.hidden_act!r} is not an activation transformers knows "
                "(e.g. silu, gelu_pytorch_tanh); null = the target's"
            )
        act = draft_cfg.hidden_act
    block: dict[str, Any] = {}
    if head_cls.drafts_block:
        mask = draft_cfg.mask_token_id if draft_cfg.mask_token_id is not None else default_mask_token_id(text)
        if not 0 <= mask < vocab:
            raise ConfigError(f"draft.mask_token_id={mask} is outside the target's vocabulary [0, {vocab - 1}]")
        block = {**head_cls.block_fields(draft_cfg), "mask_token_id": int(mask)}
    return HeadConfig(
        algorithm=algo,
        hidden_size=hidden,
        target_hidden_size=hidden,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        intermediate_size=draft_cfg.intermediate_size or sizes["intermediate_size"],
        hidden_act=act,
        rms_norm_eps=float(getattr(text, "rms_norm_eps", None) or 1e-6),
        attention_bias=bool(getattr(text, "attention_bias", False) or False),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 4096) or 4096),
        rope_parameters=_rope_parameters(text, m_rope=not head_cls.drafts_block),
        aux_layer_ids=aux,
        target_model_type=str(getattr(text, "model_type", "") or ""),
        target_fingerprint=target_info.fingerprint if target_info is not None else "",
        fc_norm=eagle31 and bool(draft_cfg.fc_norm),
        norm_output=eagle31 and bool(draft_cfg.norm_output),
        **block,
    )


def default_mask_token_id(text_config: Any) -> int:
    """The token whose embedding fills a DFlash block's draft positions when `draft.mask_token_id` is
    unset: the target's pad token unless it is also an end of sequence (the embedding of a token the
    target reads in every answer would blur what the draft layers can tell apart), else the last
    vocabulary id (the reserved rows of most vocabularies). The embedding stays the target's (frozen):
    the draft layers learn to read it, and the engines embed the same id."""
    pad = getattr(text_config, "pad_token_id", None)
    eos = getattr(text_config, "eos_token_id", None)
    eos_ids = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    if isinstance(pad, int) and pad not in eos_ids and 0 <= pad < text_config.vocab_size:
        return pad
    return int(text_config.vocab_size) - 1


def build_head(
    head_cfg: HeadConfig,
    target_model: Any | None = None,
    vocab_counts: torch.Tensor | None = None,
    special_ids: Sequence[int] | None = None,
) -> DraftHead:
    """A freshly initialised head.

    A head with a reduced vocabulary (EAGLE-3, draft_vocab_size < vocab_size) needs `vocab_counts`
    [V] (see `eagle.heads.vocab.count_tokens`) to choose it; special ids (default: eos/bos/pad of
    `target_model`) are always kept, and its lm_head starts from the target's LM-head rows of the
    draft vocabulary (`DraftHead.init_from_target`). With a `target_model` the head is attached to
    it (embeddings, EAGLE-1's LM head).
    """
    if target_model is not None:
        check_head_fits_target(head_cfg, target_model)
    head = get_algorithm(head_cfg.algorithm).head_class(head_cfg)
    head.init_from_target(target_model, vocab_counts, special_ids)
    if target_model is not None:
        head.attach_target(target_model)
    return head


def save_head(head: DraftHead, folder: Path, extra: dict[str, Any] | None = None) -> None:
    """Write `model.safetensors` + `head_config.json` into `folder` (created), atomically per file.

    `extra` (JSON-serialisable, e.g. training step or vocab coverage) goes into the safetensors
    metadata; read it back with `read_head_extra`.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.trainable_state_dict().items()}
    meta = {"format": "pt", "algorithm": head.config.algorithm}
    if extra:
        meta[_EXTRA_KEY] = json.dumps(extra, sort_keys=True)
    # Weights first, config last: a folder with a config always has matching weights.
    atomic_write_bytes(folder / WEIGHTS_NAME, safetensors_bytes(state, meta))
    atomic_write_text(folder / CONFIG_NAME, head.config.to_json())


def read_head_config(folder: Path) -> HeadConfig:
    """The `HeadConfig` of a saved head, with a CheckpointError naming the file on any problem."""
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(
            f"{path} not found: {folder} is not a saved draft head (expected {CONFIG_NAME} and {WEIGHTS_NAME})"
        )
    try:
        cfg = HeadConfig.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path} is not a valid head config: {e}") from e
    if cfg.algorithm not in ALGORITHMS:
        raise CheckpointError(f"{path}: algorithm={cfg.algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    return cfg


def read_head_extra(folder: Path) -> dict[str, Any]:
    """The `extra` dict given to `save_head` ({} if none)."""
    path = Path(folder) / WEIGHTS_NAME
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    return json.loads(meta[_EXTRA_KEY]) if _EXTRA_KEY in meta else {}


def load_head(
    folder: Path,
    target_model: Any | None = None,
    map_location: str | torch.device = "cpu",
    algorithm: str | None = None,
) -> DraftHead:
    """Rebuild a head saved by `save_head`; attach it to `target_model` after checking they fit.

    `algorithm`, when given, must match the saved one (e.g. the run's `draft.algorithm`).
    """
    folder = Path(folder)
    cfg = read_head_config(folder)
    if algorithm is not None and cfg.algorithm != algorithm:
        raise CheckpointError(f"{folder / CONFIG_NAME} holds an {cfg.algorithm} head, but draft.algorithm={algorithm}")
    weights = folder / WEIGHTS_NAME
    if not weights.is_file():
        raise CheckpointError(f"{weights} not found (only safetensors heads are supported)")
    try:
        state = load_file(str(weights), device=str(map_location))
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"cannot read {weights}: {e}") from e
    if target_model is not None:
        check_head_fits_target(cfg, target_model)
    head = ALGORITHMS[cfg.algorithm].head_class(cfg)
    expected = head.trainable_state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{weights} does not match {folder / CONFIG_NAME}: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    for name, value in state.items():
        if value.shape != expected[name].shape:
            raise CheckpointError(
                f"{weights}: {name} has shape {tuple(value.shape)}, the config implies {tuple(expected[name].shape)}"
            )
    head.load_state_dict(state, strict=False)  # strict check done above, with a clearer message
    head.to(map_location)
    if target_model is not None:
        head.attach_target(target_model)
    return head


def check_head_fits_target(head_cfg: HeadConfig, target: Any, strict_fingerprint: bool = False) -> None:
    """Raise CheckpointError if the head was made for a target of other sizes.

    `target` is a loaded HF model or a `TargetInfo`. A differing fingerprint (the same model from
    another source, or retrained weights) only logs a warning unless `strict_fingerprint`.
    """
    if isinstance(target, TargetInfo):
        hidden, vocab, layers = target.hidden_size, target.vocab_size, target.num_layers
        model_type, fingerprint = target.model_type, target.fingerprint
    else:
        text = text_config(target.config)
        hidden, vocab, layers = text.hidden_size, text.vocab_size, text.num_hidden_layers
        model_type, fingerprint = getattr(text, "model_type", ""), ""
    problems = []
    if head_cfg.target_hidden_size != hidden:
        problems.append(f"hidden size {head_cfg.target_hidden_size} vs the target's {hidden}")
    if head_cfg.vocab_size != vocab:
        problems.append(f"vocabulary {head_cfg.vocab_size} vs the target's {vocab}")
    if head_cfg.aux_layer_ids and aux_layer_problem(head_cfg.aux_layer_ids, layers):
        problems.append(f"aux layers {head_cfg.aux_layer_ids} outside the target's [0, {layers - 1}]")
    if head_cfg.target_model_type and model_type and head_cfg.target_model_type != model_type:
        problems.append(f"model type {head_cfg.target_model_type!r} vs the target's {model_type!r}")
    if problems:
        raise CheckpointError(
            f"the {head_cfg.algorithm} head does not fit this target: "
            + "; ".join(problems)
            + ". Use the target the head was trained on (target.path) or retrain."
        )
    if head_cfg.target_fingerprint and fingerprint and head_cfg.target_fingerprint != fingerprint:
        msg = (
            f"the head was trained on target {head_cfg.target_fingerprint}, this target is {fingerprint}; "
            "acceptance may be lower if the weights differ"
        )
        if strict_fingerprint:
            raise CheckpointError(msg)
        log.warning(msg)
