"""Decoding on a vision-language target: the prompt's images and M-RoPE positions, given to every forward.

The decoder counts positions as sequence indices (0 .. T-1 for the prompt, then one per accepted token):
they build the tree masks and place the head's context. A vision-language target (Qwen3-VL) wants more:
the prefill must carry the prompt's pixel inputs, and every forward its M-RoPE positions, three rows that
inside an image differ from the sequence index and after the prompt are `index + delta`
(`eagle.target.multimodal.mrope_positions`, transformers' own `get_rope_index`). `VisionTarget` wraps the
model so that the decoder's forwards (`eagle.decode.target.target_forward`, unchanged) pass exactly what
`generate` passes (`[4, 1, T]` position rows: the sequence index, then the M-RoPE rows; pixel inputs on the
prefill only): the same logits, so greedy decoding is token for token HF `generate`'s.

The head is text-only and reads the target's text-model hidden states at every position, image positions
included, at the sequence positions (as it was trained). vLLM's `Eagle3Qwen3vlForCausalLM` (its Llama EAGLE-3
draft with an M-RoPE rotary from the exported `rope_scaling`) gives the draft the target's M-RoPE positions
instead; on text they differ from ours by `delta` in all three rows, which rotary attention does not see
(it depends on position differences), and only queries against image-position keys differ.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from eagle.errors import EagleError
from eagle.target.multimodal import (
    VisionInputs,
    image_token_id,
    is_vision_language,
    mrope_positions,
    position_rows,
)


class VisionTarget:
    """A vision-language model as the decoder calls it (`model(input_ids=..., position_ids=[1, T], ...)`), with
    the current prompt's images (`begin`) turned into M-RoPE position rows and prefill pixel inputs."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.image_id = image_token_id(model.config)
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
        positions inside the prompt, `index + delta` after it (all three rows equal there, as in `generate`)."""
        n = int(self.mrope.shape[1])
        after = (sequence + self.delta).expand(3, -1)  # [3, T_q]
        if n == 0:
            return position_rows(sequence, after)
        inside = self.mrope[:, sequence.clamp(max=n - 1)]  # [3, T_q]
        return position_rows(sequence, torch.where(sequence < n, inside, after))

    def forward(
        self, *, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: int = 0, **kw: Any
    ) -> Any:
        """The model's forward with M-RoPE rows for `position_ids` [1, T_q] (sequence positions) and, on the
        prefill (the first forward, from position 0), the prompt's pixel inputs."""
        sequence = position_ids[0]  # [T_q]
        extra: dict[str, Any] = {}
        if self.vision is not None and int(sequence[0]) == 0:
            extra = self.vision.model_kwargs(input_ids, self.image_id)
        return self.model(
            input_ids=input_ids, position_ids=self.positions(sequence), logits_to_keep=logits_to_keep, **extra, **kw
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
