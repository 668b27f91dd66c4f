"""Target forwards over a KV cache with an explicit 4D (tree) attention mask, for any HF causal LM.

What the decoder may verify follows from what each cache layer keeps (`eagle.decode.cache`), decided
once per target by `verify_plan`:

  * Every layer keeps keys and values (or nothing) and every attention layer's mask is one we can
    build: trees. transformers 5 passes a 4D mask through unchanged
    (`masking_utils._preprocess_mask_arguments`), so the mask we build is exactly what every layer
    sees: sdpa takes bool [B, 1, T_q, T_past + T_q], True = may attend; eager the same as an additive
    float mask (0 / dtype min). Flash attention cannot take an arbitrary mask and is refused.
    Sliding-window layers (Gemma 2/3, Mistral with sliding_window, Qwen with use_sliding_window)
    would lose their window with a plain 4D mask, so we AND the window in ourselves from position ids
    (key visible iff q_pos - k_pos < window, transformers' own rule). Models with several layer
    types get a {layer_type: mask} dict, which those models accept in place of their own masks.
  * Some layer keeps a state that follows the sequence (recurrent, convolution, compressed), or an
    attention layer's mask is one we do not build (chunked attention): chains. A chain's mask is
    plain causal, so the target builds its own masks from its cache and position ids, as in its
    own `generate`: whatever its layer types are, each gets the mask its family defines.

The cache holds full attention layers (`DynamicLayer`) where transformers would keep a sliding window:
sliding layers keep all keys and the mask hides the old ones, so cropping and gathering after
verification is uniform.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
)

from eagle.decode.cache import LayerKind, layer_kind
from eagle.errors import TargetError
from eagle.target.features import layer_features
from eagle.target.loading import MASKABLE_ATTENTION, target_errors
from eagle.target.structure import text_config

# The attention masks we build for a tree, by layer type: full, or full with a sliding window.
_WINDOWED = ("sliding_attention",)
_FULL = ("full_attention",)


@dataclass(frozen=True)
class VerifyPlan:
    """How a target verifies drafts, from what its cache layers keep (`verify_plan`)."""

    model_type: str
    kinds: tuple[LayerKind, ...]  # one per decoder layer
    # {layer_type: sliding window or None}: the tree masks we build; None = the target verifies chains
    # under its own causal masks.
    windows: dict[str, int | None] | None
    why_chains: str = ""  # what makes the target verify chains, for messages

    @property
    def trees(self) -> bool:
        return self.windows is not None

    @property
    def holds_state(self) -> bool:
        """Whether some layer keeps a state that a partial acceptance must restore and replay."""
        return any(k.holds_state for k in self.kinds)


def _layer_types(config: Any) -> list[str] | None:
    types = getattr(text_config(config), "layer_types", None)
    return list(types) if types else None


def new_cache(config: Any = None, plan: VerifyPlan | None = None) -> DynamicCache:
    """A cache laid out as the target's own (`DynamicCache(config=...)`: one layer class per decoder
    layer, as its family defines it), with the layers the plan crops made full (`_uncut`).
    `config=None`: full attention layers created on use (the head's cache, tests)."""
    if config is None:
        return DynamicCache()
    plan = plan if plan is not None else verify_plan(config)
    cache = _target_layout(config)
    cache.layers = [_uncut(layer, plan.trees) for layer in cache.layers]
    return cache


def _target_layout(config: Any) -> DynamicCache:
    try:
        return DynamicCache(config=config)
    except Exception as e:  # an unknown layer type, a per-layer attribute transformers cannot read
        model_type = getattr(text_config(config), "model_type", "target")
        raise TargetError(f"transformers cannot lay out a cache for {model_type}: {type(e).__name__}: {e}") from e


def _uncut(layer: Any, trees: bool) -> Any:
    """A layer that would cut its keys to a window, as one that keeps every key (the mask hides the old
    ones), where the decoder crops or gathers it: plain sliding layers of a target that verifies trees,
    and the keys beside a linear state. Any other layer stays as the target's family lays it out (a
    chain is verified under the target's own masks over its own layout, as its `generate` runs)."""
    if trees and type(layer) is DynamicSlidingWindowLayer:
        return DynamicLayer()
    if type(layer) is LinearAttentionAndSlidingWindowAttentionLayer:
        return LinearAttentionAndFullAttentionLayer(number_of_states=layer.number_of_states)
    return layer


def _classify(config: Any, layers: list[Any]) -> tuple[LayerKind, ...]:
    """What each decoder layer keeps; a layer class the decoder does not know is refused by name."""
    kinds = []
    for i, layer in enumerate(layers):
        kind = layer_kind(layer)
        if kind is None:
            raise TargetError(
                f"{text_config(config).model_type}: decoder layer {i} keeps its cache in a "
                f"{type(layer).__name__}, which speculative decoding does not know how to roll back; it "
                "verifies layers of keys and values (DynamicLayer), layers with a recurrent or convolution "
                "state (LinearAttentionLayer), both (LinearAttentionAndFullAttentionLayer), keys kept with "
                "more state (DynamicLayer subclasses) and layers that keep nothing (DummyLayer)"
            )
        kinds.append(kind)
    return tuple(kinds)


def verify_plan(config: Any) -> VerifyPlan:
    """Trees where every layer's cache can be gathered to the accepted path (sliding layers made full)
    and every attention mask is one we build; chains otherwise (see the module docstring)."""
    model_type = str(getattr(text_config(config), "model_type", "target"))
    layout = _target_layout(config).layers
    as_trees = _classify(config, [_uncut(layer, trees=True) for layer in layout])
    state = [i for i, k in enumerate(as_trees) if k.holds_state]
    types = _layer_types(config)
    masked = {types[i] for i, k in enumerate(as_trees) if k.holds_keys_values} if types else set()
    unknown = sorted(masked - set(_WINDOWED) - set(_FULL))
    if not state and not unknown:
        return VerifyPlan(model_type, as_trees, layer_windows(config))
    if state:
        listed = f"{state[:8]}{'...' if len(state) > 8 else ''}"
        why = f"{model_type} keeps a state that follows the sequence in layers {listed}"
    else:
        why = f"{model_type}'s {', '.join(unknown)} layers take masks of their own"
    return VerifyPlan(model_type, _classify(config, [_uncut(layer, trees=False) for layer in layout]), None, why)


def layer_windows(config: Any) -> dict[str, int | None]:
    """{layer_type: sliding window or None} for the target's attention layers (tree masks)."""
    text = text_config(config)
    window = getattr(text, "sliding_window", None)
    types = _layer_types(config)
    if not types:
        # Single-type models (Llama, Mistral): one mask for all layers, windowed if the config says so.
        use = getattr(text, "use_sliding_window", True)
        return {"full_attention": window if (window and use) else None}
    return {t: (window if t in _WINDOWED else None) for t in set(types) if t in _WINDOWED + _FULL}


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
) -> torch.Tensor | dict[str, torch.Tensor]:
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
    masks: dict[str, torch.Tensor] = {}
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


def select_features(model: Any, hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """output_hidden_states (L + 1 of [B, T, H]) -> [B, T, k, H] for the head's `feature_layer_ids()`.

    Same rule as `eagle.capture.features.extract_features` (both call `eagle.target.features.layer_features`):
    id i = hidden_states[i]; -1 is the post-norm final state (transformers 5 stores the normed state last);
    a hyper-connection target's (DeepSeek-V4) stream states collapsed as the target collapses them.
    """
    return layer_features(model, hidden_states, layer_ids)


def _takes_logits_to_keep(model: Any) -> bool:
    """Whether the model's forward accepts `logits_to_keep` (every transformers 5 causal LM; remote code may not)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


@torch.inference_mode()
def target_forward(
    model: Any,
    input_ids: torch.Tensor,  # [T_q]
    position_ids: torch.Tensor,  # [T_q]
    cache: DynamicCache,
    tree_mask: torch.Tensor | None = None,  # [T_q, T_q] bool; None = causal
    feature_layer_ids: list[int] | None = None,
    plan: VerifyPlan | None = None,
    last_logits_only: bool = False,
) -> TargetOutput:
    """One target forward of T_q new tokens over `cache` (which it extends by T_q entries).

    `plan`: the target's `verify_plan` (computed here when None: pass it in a loop).
    `last_logits_only`: logits for the last position only ([1, V]), as a prefill needs; the LM head
    over a whole prompt is the largest product of the pass (SmolLM2: 49,152 x 576 per position).
    """
    plan = plan if plan is not None else verify_plan(model.config)
    past = cache.get_seq_length()
    n = input_ids.numel()
    mask: Any = None  # chains: the target's own causal masks
    if plan.windows is not None:
        causal = torch.ones(n, n, dtype=torch.bool, device=input_ids.device).tril()
        mask = build_attention_mask(model, causal if tree_mask is None else tree_mask, past, position_ids, plan.windows)
    elif tree_mask is not None and not bool(tree_mask.equal(tree_mask.new_ones(n, n).tril())):
        # A state layer reads the new tokens in order, each after all the ones before it.
        raise TargetError(
            f"{plan.why_chains}: a verify pass must be a chain (each token after all earlier ones), not a tree"
        )
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
    feats = select_features(model, out.hidden_states, feature_layer_ids)[0] if feature_layer_ids else None
    return TargetOutput(logits=out.logits[0], features=feats)
