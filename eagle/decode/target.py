"""Target forwards over a KV cache with an explicit 4D (tree) attention mask, for any HF causal LM.

transformers 5 passes a 4D mask through unchanged (`masking_utils._preprocess_mask_arguments`), so
the mask we build is exactly what every layer sees:
  * sdpa: bool [B, 1, T_q, T_past + T_q], True = may attend; eager: the same as an additive float
    mask (0 / dtype min). Flash attention cannot take an arbitrary mask and is refused.
  * Sliding-window layers (Gemma 2/3, Mistral with sliding_window, Qwen with use_sliding_window)
    would lose their window with a plain 4D mask, so we AND the window in ourselves from position
    ids (key visible iff q_pos - k_pos < window, transformers' own rule). Models with several layer
    types get a {layer_type: mask} dict, which those models accept in place of their own masks.
  * The cache holds full attention layers (`DynamicLayer`) for every attention type: sliding layers
    keep all keys and the mask hides the old ones, so cropping and gathering after verification is
    uniform.
  * Recurrent (linear-attention) layers of hybrid targets (Qwen3-Next, Qwen3.5: Gated DeltaNet) take
    no mask: they read the new tokens in order, so a verify pass over them must be a chain, and their
    state cannot be cropped. Their cache layers (`LinearAttentionLayer`) are snapshotted before a
    verify pass and rolled back by the decoder (`eagle.decode.cache.RecurrentSnapshot`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from eagle.errors import TargetError
from eagle.target.loading import MASKABLE_ATTENTION, target_errors
from eagle.target.structure import text_config

_WINDOWED = ("sliding_attention",)
_FULL = ("full_attention",)
# Layer types whose cache is a recurrent state (transformers' LinearAttentionLayer), not keys and values.
RECURRENT_TYPES = ("linear_attention",)


def _layer_types(config: Any) -> list[str]:
    return list(getattr(text_config(config), "layer_types", None) or [])


def recurrent_layer_types(config: Any) -> set[str]:
    """The target's recurrent layer types (empty for attention-only targets)."""
    return {t for t in _layer_types(config) if t in RECURRENT_TYPES}


def layer_windows(config: Any) -> dict[str, int | None]:
    """{layer_type: sliding window or None} for the target's decoder layers."""
    text = text_config(config)
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if not types:
        # Single-type models (Llama, Mistral): one mask for all layers, windowed if the config says so.
        use = getattr(text, "use_sliding_window", True)
        return {"full_attention": window if (window and use) else None}
    out: dict[str, int | None] = {}
    for t in set(types):
        if t in _WINDOWED:
            out[t] = window
        elif t in _FULL:
            out[t] = None
        elif t not in RECURRENT_TYPES:  # recurrent layers take no mask (build_attention_mask)
            raise TargetError(
                f"target layer type {t!r} ({text.model_type}) cannot verify drafts: speculative decoding "
                f"supports full and sliding-window attention layers and {', '.join(RECURRENT_TYPES)} layers"
            )
    return out


def check_attention(model: Any) -> str:
    """The attention implementation, if it can take a custom 4D mask."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in MASKABLE_ATTENTION:
        raise TargetError(
            f"attn_implementation={impl!r} cannot take a tree attention mask; load the target with "
            "target.attn_implementation=auto (sdpa or eager, whichever the family runs)"
        )
    return impl


def build_attention_mask(
    model: Any,
    tree_mask: torch.Tensor,  # [T_q, T_q] bool, the new tokens among themselves
    past_len: int,
    position_ids: torch.Tensor,  # [T_q] positions of the new tokens
    windows: dict[str, int | None] | None = None,
) -> torch.Tensor | dict[str, torch.Tensor | None]:
    """The mask argument for a target forward of T_q new tokens after `past_len` cached ones.

    Cached tokens are the plain sequence 0 .. past_len - 1 (positions = indices), all visible except
    outside a sliding window. Returns [1, 1, T_q, past_len + T_q] (or a dict of them per layer type).
    """
    impl = check_attention(model)
    windows = windows if windows is not None else layer_windows(model.config)
    tq = tree_mask.shape[0]
    device = tree_mask.device
    base = torch.cat([torch.ones(tq, past_len, dtype=torch.bool, device=device), tree_mask], dim=1)  # [T_q, T_kv]
    k_pos = torch.cat([torch.arange(past_len, device=device), position_ids])  # [T_kv]
    masks: dict[str, torch.Tensor | None] = {t: None for t in recurrent_layer_types(model.config)}
    for layer_type, window in windows.items():
        m = base
        if window:
            m = m & ((position_ids.unsqueeze(1) - k_pos.unsqueeze(0)) < window)  # [T_q, T_kv]
        m = m[None, None]  # [1, 1, T_q, T_kv]
        if impl == "eager":
            dtype = model.dtype
            m = torch.zeros(m.shape, dtype=dtype, device=device).masked_fill(~m, torch.finfo(dtype).min)
        masks[layer_type] = m
    only = next(iter(masks.values())) if len(masks) == 1 else None
    return only if only is not None else masks


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [T_q, V]
    features: torch.Tensor | None  # [T_q, k, H] the head's feature layers, or None


def select_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """output_hidden_states (L + 1 of [B, T, H]) -> [B, T, k, H] for the head's `feature_layer_ids()`.

    Same indexing as `eagle.capture.features.extract_features`: id i = hidden_states[i]; -1 is the
    post-norm final state (transformers 5 stores the normed state last).
    """
    return torch.stack([hidden_states[i] for i in layer_ids], dim=2)


def _takes_logits_to_keep(model: Any) -> bool:
    """Whether the model's forward accepts `logits_to_keep` (every transformers 5 causal LM; remote code may not)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def new_cache(config: Any = None) -> DynamicCache:
    """A cache of full (uncropped) attention layers, and the target's own recurrent layers where
    `config` (the target's HF config) has any; see the module docstring for why sliding layers are full."""
    if config is None or not recurrent_layer_types(config):
        return DynamicCache()
    cache = DynamicCache(config=config)  # LinearAttentionLayer for recurrent types, in layer order
    types = _layer_types(config)
    cache.layers = [
        layer if t in RECURRENT_TYPES else DynamicLayer() for t, layer in zip(types, cache.layers, strict=True)
    ]
    return cache


@torch.inference_mode()
def target_forward(
    model: Any,
    input_ids: torch.Tensor,  # [T_q]
    position_ids: torch.Tensor,  # [T_q]
    cache: DynamicCache,
    tree_mask: torch.Tensor | None = None,  # [T_q, T_q] bool; None = causal
    feature_layer_ids: list[int] | None = None,
    windows: dict[str, int | None] | None = None,
    last_logits_only: bool = False,
) -> TargetOutput:
    """One target forward of T_q new tokens over `cache` (which it extends by T_q entries).

    `last_logits_only`: logits for the last position only ([1, V]), as a prefill needs; the LM head
    over a whole prompt is the largest product of the pass (SmolLM2: 49,152 x 576 per position).
    """
    past = cache.get_seq_length()
    causal = torch.ones(input_ids.numel(), input_ids.numel(), dtype=torch.bool, device=input_ids.device).tril()
    if tree_mask is None:
        tree_mask = causal
    elif recurrent_layer_types(model.config) and not torch.equal(tree_mask, causal):
        # A recurrent layer reads the new tokens in order, each after all the ones before it.
        raise TargetError(
            f"{text_config(model.config).model_type} has recurrent layers: a verify pass must be a "
            "chain (each token after all earlier ones), not a tree"
        )
    mask = build_attention_mask(model, tree_mask, past, position_ids, windows)
    with target_errors(model):
        out = model(
            input_ids=input_ids[None],
            position_ids=position_ids[None],
            attention_mask=mask,
            cache=cache,
            use_cache=True,
            output_hidden_states=bool(feature_layer_ids),
            return_dict=True,
            **({"logits_to_keep": 1} if last_logits_only and _takes_logits_to_keep(model) else {}),
        )
    feats = select_features(out.hidden_states, feature_layer_ids)[0] if feature_layer_ids else None
    return TargetOutput(logits=out.logits[0], features=feats)
