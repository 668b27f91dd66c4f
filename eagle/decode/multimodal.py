"""Decoding on a vision-language target: the prompt's images, its positions and its prefill masks.

The decoder counts positions as sequence indices (0 .. T-1 for the prompt, then one per accepted token):
they build the tree masks and place the head's context. A vision-language target wants more, and
`VisionTarget` wraps the model so that the decoder's forwards (`eagle.decode.target.target_forward`,
unchanged) pass exactly what `generate` passes, for the same logits (greedy decoding is then token for token
HF `generate`'s):
  * the prefill carries the prompt's image inputs (pixels, and the image-token row under the name the
    model's forward takes: `mm_token_type_ids`, Gemma 3's `token_type_ids`); later forwards carry none, as
    `generate`'s `prepare_inputs_for_generation` drops them after the first step;
  * a model that builds its own masks for a prompt with images (`create_masks_for_generate`: Gemma 3, whose
    image tokens attend to each other both ways in the prefill) builds the prefill's masks itself: the
    decoder's causal (and windowed) prefill mask is left out there. The keys and values it caches are then
    `generate`'s; later forwards (verify passes, with tree masks) attend causally to them, as in `generate`;
  * an M-RoPE family (Qwen3-VL: `eagle.target.multimodal.has_mrope`) gets its M-RoPE positions on every
    forward, three rows that inside an image differ from the sequence index and after the prompt are
    `index + delta` (`mrope_positions`, transformers' own `get_rope_index`), passed as `[4, 1, T]` rows (the
    sequence index, then the M-RoPE rows); a 1-D RoPE family (Gemma 3) gets the sequence positions as they are.

The head is text-only and reads the target's text-model hidden states at every position, image positions
included, at the target's own position rows as vLLM hands them to its draft (`positions`, read by the decoder's
`SpeculativeGenerator._head_positions`): the M-RoPE rows for an M-RoPE head, the time row otherwise, which for a
1-D RoPE family is the sequence index.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from eagle.errors import EagleError
from eagle.target.multimodal import (
    VisionInputs,
    builds_image_masks,
    has_mrope,
    image_token_id,
    is_vision_language,
    mrope_positions,
    position_rows,
)


class VisionTarget:
    """A vision-language model as the decoder calls it (`model(input_ids=..., position_ids=[1, T], ...)`), with
    the current prompt's images (`begin`) turned into prefill image inputs (and masks, and M-RoPE position rows,
    where the family has them)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.image_id = image_token_id(model.config)
        self.mrope_rows = has_mrope(model)  # False: a 1-D RoPE family, positions passed as they are
        self.own_masks = builds_image_masks(model)  # the prefill with images: the model's own masks
        self.vision: VisionInputs | None = None
        self.mrope = torch.zeros(3, 0, dtype=torch.long)  # [3, T_prompt] the prompt's M-RoPE positions
        self.delta = 0  # M-RoPE position - sequence index, for every token after the prompt

    def __getattr__(self, name: str) -> Any:
        # Everything else (get_output_embeddings, generation_config, ...) is the model's own.
        return getattr(self.__dict__["model"], name)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def begin(self, prompt: torch.Tensor, vision: VisionInputs | None) -> None:
        """The next generation's prompt ([T] ids) and its images (None: a text prompt, plain positions)."""
        device = prompt.device
        self.vision = vision.to(device, dtype=self.dtype) if vision is not None and vision.num_images else None
        mrope, self.delta = mrope_positions(self.model, prompt, self.vision)
        self.mrope = mrope.to(device)

    def positions(self, sequence: torch.Tensor) -> torch.Tensor:
        """[4, 1, T_q] position rows for tokens at sequence positions `sequence` [T_q]: the prompt's M-RoPE
        positions inside the prompt, `index + delta` after it (all three rows equal there, as in `generate`).
        A 1-D RoPE family's three rows are the sequence index (`mrope_positions`); its forward takes row 0."""
        n = int(self.mrope.shape[1])
        after = (sequence + self.delta).expand(3, -1)  # [3, T_q]
        if n == 0:
            return position_rows(sequence, after)
        inside = self.mrope[:, sequence.clamp(max=n - 1)]  # [3, T_q]
        return position_rows(sequence, torch.where(sequence < n, inside, after))

    def forward(
        self, *, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: int = 0, **kw: Any
    ) -> Any:
        """The model's forward with its positions for `position_ids` [1, T_q] (sequence positions) and, on the
        prefill (the first forward, from position 0), the prompt's image inputs (and, for a model that builds
        them, its own masks: module docstring)."""
        sequence = position_ids[0]  # [T_q]
        extra: dict[str, Any] = {}
        if self.vision is not None and int(sequence[0]) == 0:
            extra = self.vision.model_kwargs(input_ids, self.image_id)
            if self.own_masks:
                kw["attention_mask"] = None  # the model's own: causal, windowed, and both ways inside an image
        rows = self.positions(sequence)  # [4, 1, T_q]
        return self.model(
            input_ids=input_ids,
            position_ids=rows if self.mrope_rows else rows[0],  # a 1-D RoPE family: [1, T_q], the sequence index
            logits_to_keep=logits_to_keep,
            **extra,
            **kw,
        )

    __call__ = forward


def decoding_target(model: Any) -> Any:
    """`model` as the decoder calls it: wrapped in a `VisionTarget` for a vision-language target."""
    return VisionTarget(model) if is_vision_language(getattr(model, "config", None)) else model


def begin_prompt(target: Any, prompt: torch.Tensor, vision: VisionInputs | None) -> None:
    """Tell a wrapped vision-language target the next prompt; a text-only target takes no images."""
    if isinstance(target, VisionTarget):
        target.begin(prompt, vision)
    elif vision is not None and vision.num_images:
        model_type = getattr(getattr(target, "config", None), "model_type", "the target")
        raise EagleError(f"the prompt holds {vision.num_images} image(s) but {model_type} is a text-only target")
