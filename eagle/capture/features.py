"""The one place where a target forward becomes draft-head training features.

Both the offline capture (`eagle.capture.runner`) and the online trainer call `extract_features`,
so captured shards and online batches are the same function of the same target.

Layer ids follow `eagle.target.structure.default_aux_layer_ids` (vLLM convention): id i is the input of
decoder layer i, i.e. transformers' `output_hidden_states[i]` (index 0 is the embedding output).
`final_hidden` is the post-norm last state (`output_hidden_states[-1]`), from which the target's
own LM head gives its next-token distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from eagle.data.images import open_image
from eagle.errors import CaptureError
from eagle.target.features import layer_features
from eagle.target.loading import target_errors
from eagle.target.multimodal import (
    VisionInputs,
    batch_mrope_positions,
    concat_vision,
    has_mrope,
    image_token_id,
    load_vision_processor,
    multimodal_model,
)
from eagle.target.shard import is_sharded
from eagle.target.structure import aux_layer_problem, decoder_of


def check_layer_ids(aux_layer_ids: list[int], num_layers: int) -> None:
    """Refuse layer ids outside the target; they would silently index the wrong hidden state."""
    problem = aux_layer_problem(aux_layer_ids, num_layers)
    if problem:
        raise CaptureError(f"{problem} (or null for the default)")


def extract_features(
    model: nn.Module,
    input_ids: torch.Tensor,  # [B, T]
    attention_mask: torch.Tensor,  # [B, T], 1 = real token (right padding)
    aux_layer_ids: list[int] | None,
    vision: VisionInputs | None = None,
) -> dict[str, torch.Tensor]:
    """Run the frozen target once and return its features, in the model's dtype and device.

    `vision`: the images of the batch's rows, in order (a vision-language target; `vision_batch`). The target's
    multimodal model then reads them and computes its own M-RoPE positions; the features are still its text
    model's hidden states, at every position (image positions included; their loss mask is 0).

    Returns {"final_hidden": [B, T, H]} plus {"aux_hidden": [B, T, 3, H]} when `aux_layer_ids` is
    given, plus {"positions": [B, T, 3] long} on an M-RoPE target (`eagle.target.multimodal.has_mrope`): each token's
    three rotary positions as the target numbers them, which vLLM hands an M-RoPE draft too. Values at
    padded positions are meaningless; callers mask them with `attention_mask`.
    The outputs may be inference tensors: `.clone()` them outside inference mode before they enter a
    graph that autograd saves (the online trainer's head forward).
    """
    # With images, the multimodal model: it encodes them into the image tokens' embeddings (same hidden states out).
    decoder = multimodal_model(model) if vision is not None else decoder_of(model)
    mm: dict[str, Any] = {} if vision is None else vision.model_kwargs(input_ids, image_token_id(model.config))
    want_aux = bool(aux_layer_ids)
    # A sharded target runs under no_grad instead: FSDP keeps each layer's gathered-weights buffer from one
    # forward to the next, and one first allocated in inference mode could not be written outside it
    # (`eagle.target.shard.gathered`, a layer copied into the head).
    with torch.no_grad() if is_sharded(model) else torch.inference_mode(), target_errors(model):
        # use_cache=False: a KV cache would only cost memory here. The decoder (not the CausalLM)
        # is called so no [B, T, V] logits are computed.
        out: Any = decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            use_cache=False,
            output_hidden_states=want_aux,
            return_dict=True,
            **mm,
        )
        final = out.last_hidden_state  # [B, T, H], post final norm
        features = {"final_hidden": final}
        if aux_layer_ids:
            states = out.hidden_states  # tuple of L + 1 tensors [B, T, H] (DeepSeek-V4: [B, T, hc_mult, H])
            if states is None:
                raise CaptureError(
                    f"{type(decoder).__name__} returned no hidden states for output_hidden_states=True; "
                    "the aux layers of EAGLE-3 cannot be captured from it"
                )
            num_layers = len(states) - 1
            check_layer_ids(list(aux_layer_ids), num_layers)
            # [B, T, 3, H]; a hyper-connection target's stream states collapsed as the decoder collapses them
            features["aux_hidden"] = layer_features(model, states, list(aux_layer_ids))
        if has_mrope(model):  # [B, T, 3] the rows its forward computed
            features["positions"] = batch_mrope_positions(model, input_ids, attention_mask, vision)[0].permute(1, 2, 0)
    return features


def vision_batch(model: nn.Module, images: Sequence[Sequence[str]], device: torch.device | str) -> VisionInputs | None:
    """The pixel inputs of a batch whose row r holds the images `images[r]` (references a data stage resolved,
    `eagle.data.images`), through the target's own image processor; None when no row has any."""
    if not any(images):
        return None
    where = getattr(model.config, "_name_or_path", "") or type(model).__name__
    processor = load_vision_processor(str(getattr(model.config, "_name_or_path", "") or ""))
    if processor is None:
        raise CaptureError(
            f"the batch holds images but the target ({where}) has no image processor beside it (a text-only "
            "target, or a vision-language one not loaded from its folder)"
        )
    rows = [
        processor.pixels([open_image(ref, f"image of row {r}") for ref in refs])
        for r, refs in enumerate(images)
        if refs
    ]
    vision = concat_vision(list(rows))
    assert vision is not None  # some row had images
    dtype = next(model.parameters()).dtype
    return vision.to(device, dtype=dtype)


def idle_forward(model: nn.Module, device: torch.device | str) -> None:
    """One forward of a single token whose result is dropped. Under `target.shard=fsdp` each forward
    all-gathers every layer's shards from all processes, so all must run the same number of forwards:
    a process that has run out of work calls this until the others are done."""
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)  # [1, 1]: any id works
    extract_features(model, ids, torch.ones_like(ids), None)
