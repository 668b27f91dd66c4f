"""The one rule from a target's `output_hidden_states` to the features a draft head reads.

Capture and online training (`eagle.capture.features.extract_features`) and the decoder
(`eagle.decode.target.select_features`) all call `layer_features`, so a head is trained on exactly
what it reads while decoding.

Layer id i is the input of decoder layer i (`output_hidden_states[i]`, index 0 the embedding output,
vLLM's convention); -1 is the post-norm final state, what the LM head reads.

Most targets keep one residual stream per token: the state is [B, T, H] and is used as it is.
DeepSeek-V4 keeps `hc_mult` streams (manifold-constrained hyper-connections): its decoder layers pass
[B, T, hc_mult, H], each block reads a weighted sum of the streams that its own hyper-connection
computes from them, and the model sums the last layer's streams with its `hc_head` before the final
norm. A draft head reads [.., H] features, so a stream state is collapsed the way the target itself
collapses it at that point: the input of layer i by layer i's attention hyper-connection (the tensor
that layer's attention normalises and reads, which vLLM's and SGLang's DeepSeek-V4 layers compute as
their `hc_pre` output), the final state by `hc_head` + norm (transformers already returns it
collapsed). Why this tensor and not the raw streams: docs/train-your-own-target.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from eagle.errors import TargetError
from eagle.target.structure import decoder_of, text_config


def layer_features(model: nn.Module, hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """output_hidden_states (L + 1 states of [B, T, H] or [B, T, hc_mult, H]) -> [B, T, k, H] for
    `layer_ids`; stream states collapsed as `collapse_streams` does."""
    picked = []
    for i in layer_ids:
        state = hidden_states[i]
        picked.append(collapse_streams(model, i, len(hidden_states), state) if state.dim() == 4 else state)
    return torch.stack(picked, dim=2)


def collapse_streams(model: nn.Module, layer_id: int, num_states: int, streams: torch.Tensor) -> torch.Tensor:
    """[B, T, hc_mult, H] streams at the input of decoder layer `layer_id` -> [B, T, H], collapsed by that
    layer's attention hyper-connection (its weights of the streams depend on the streams themselves, so
    no fixed sum would do); the output of the last layer (id L) by the model's `hc_head` and final norm.
    A target whose stream states have no collapse we know is refused naming its family."""
    decoder = decoder_of(model)
    layers: Any = getattr(decoder, "layers", None)
    index = layer_id % num_states  # -1 -> L
    if layers is not None and index < len(layers):
        # DeepSeek-V4's `DeepseekV4HyperConnection` returns (post, comb, collapsed); it runs in float32
        # (transformers keeps it there) and returns the streams' dtype.
        hyper = getattr(layers[index], "attn_hc", None)
        if hyper is not None:
            return hyper(streams)[-1]
    else:
        hc_head, norm = getattr(decoder, "hc_head", None), getattr(decoder, "norm", None)
        if isinstance(hc_head, nn.Module) and isinstance(norm, nn.Module):
            return norm(hc_head(streams))
    family = getattr(text_config(model.config), "model_type", type(model).__name__)
    raise TargetError(
        f"{family}: hidden state {layer_id} holds {streams.shape[-2]} residual streams ({tuple(streams.shape)}) and "
        "no hyper-connection collapse is known for this family; a draft head reads one [.., hidden] state per layer"
    )
