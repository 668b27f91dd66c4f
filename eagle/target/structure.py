"""Facts about a loaded target that every stage reads the same way: its decoder and decoder layers, its
text config, EAGLE-3's feature layers, and special token ids.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from eagle.errors import CaptureError


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
