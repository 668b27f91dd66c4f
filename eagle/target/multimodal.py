"""Vision-language targets (Qwen3-VL first): what differs from a text-only target, kept in one place.

A vision-language target is still the frozen target of a text-only head: the head reads the hidden states
of the target's text model at every position (image positions included) and drafts text. What differs:
  * the checkpoint loads through `AutoModelForImageTextToText` (its config has a `vision_config`);
  * a sequence holding an image carries the image's pixel patches (`VisionInputs`); the target's
    multimodal model (`multimodal_model`, Qwen3-VL's `Qwen3VLModel`) encodes them and scatters them
    over the image-placeholder tokens (one per merged patch: `tokens_per_image`);
  * its rotary positions are M-RoPE: three rows (time, height, width) that equal the sequence index on
    text before the first image, differ inside an image, and equal `index + delta` after it (`delta` < 0:
    an image of N tokens advances the positions by its side length, not by N). `mrope_positions` gives
    transformers' own `get_rope_index` result; the decoder passes `[4, 1, T]` rows (sequence index, then
    the three M-RoPE rows) exactly as `generate` does (`Qwen3VLForConditionalGeneration.
    _prepare_position_ids_for_generation`).

Images are turned into pixels with the checkpoint's own image processor, loaded with the PIL backend:
torchvision is not needed (the torchvision wheel on PyPI is a CUDA build whose ops do not load beside
the CPU torch wheel: `operator torchvision::nms does not exist`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoImageProcessor, AutoModelForCausalLM, AutoModelForImageTextToText

from eagle.errors import TargetError

IMAGE_TOKEN_TYPE = 1  # transformers' mm_token_type_ids: text 0, image 1, video 2


def is_vision_language(config: Any) -> bool:
    """Whether `config` (a target's HF config) is a vision-language model's: it has a vision tower."""
    return getattr(config, "vision_config", None) is not None


def auto_model_class(config: Any) -> Any:
    """The transformers auto class that loads this target with its LM head: causal LM, or image-text-to-text
    for a vision-language checkpoint (AutoModelForCausalLM refuses Qwen3VLConfig)."""
    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def image_token_id(config: Any) -> int:
    """The id of the image-placeholder token (repeated once per merged patch of each image)."""
    value = getattr(config, "image_token_id", None)
    if value is None:
        raise TargetError(f"{getattr(config, 'model_type', '?')}: the config names no image_token_id")
    return int(value)


@dataclass(frozen=True)
class VisionProcessor:
    """What turns a target's images into its inputs: its image processor (PIL backend) and image token."""

    image_processor: Any
    image_token_id: int
    model_type: str

    @property
    def merge_size(self) -> int:
        return int(getattr(self.image_processor, "merge_size", 1) or 1)

    def tokens_for(self, height: int, width: int) -> int:
        """Placeholder tokens an image of this size takes (its patches over the merge window)."""
        patches = int(self.image_processor.get_number_of_image_patches(height, width, {}))
        return patches // (self.merge_size * self.merge_size)

    def pixels(self, images: list[Any]) -> VisionInputs:
        """`images` (PIL images) through the image processor."""
        out = self.image_processor(images=images, return_tensors="pt")
        return VisionInputs(out["pixel_values"], out["image_grid_thw"].long())


@cache
def load_vision_processor(path: str) -> VisionProcessor | None:
    """The image processor and image token of the vision-language target in folder `path`, or None when the
    folder holds no vision-language checkpoint (a text-only target, or a tokenizer built in memory). Cached:
    the data stage, capture and evaluation ask per conversation."""
    folder = Path(path).expanduser() if path else None
    if folder is None or not (folder / "config.json").is_file():
        return None
    try:
        config = AutoConfig.from_pretrained(str(folder))
    except Exception:  # not a transformers checkpoint folder: nothing vision-language to load
        return None
    if not is_vision_language(config):
        return None
    try:
        processor = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    except Exception as e:  # a missing or broken preprocessor config: say which folder
        raise TargetError(
            f"the vision-language target in {folder} ({config.model_type}) has no usable image processor "
            f"(preprocessor_config.json): {e}"
        ) from e
    return VisionProcessor(processor, image_token_id(config), str(config.model_type))


@dataclass
class VisionInputs:
    """The images of one sequence (or a batch of them, in order): what the target's multimodal model reads."""

    pixel_values: torch.Tensor  # [P, C * T_patch * patch * patch], every image's patches in order
    image_grid_thw: torch.Tensor  # [N, 3] long: (time, height, width) patches of each of the N images

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> VisionInputs:
        return VisionInputs(self.pixel_values.to(device, dtype=dtype), self.image_grid_thw.to(device))

    def model_kwargs(self, input_ids: torch.Tensor, image_id: int) -> dict[str, Any]:
        """Keyword arguments of the target's forward for `input_ids` [B, T] holding these images' tokens."""
        return {
            "pixel_values": self.pixel_values,
            "image_grid_thw": self.image_grid_thw,
            "mm_token_type_ids": (input_ids == image_id).int() * IMAGE_TOKEN_TYPE,  # [B, T]
        }


def concat_vision(parts: list[VisionInputs | None]) -> VisionInputs | None:
    """The images of several sequences as one batch's (in row order), None when none has any."""
    kept = [p for p in parts if p is not None and p.num_images]
    if not kept:
        return None
    return VisionInputs(torch.cat([p.pixel_values for p in kept]), torch.cat([p.image_grid_thw for p in kept]))


def multimodal_model(model: Any) -> Any:
    """The module whose forward takes pixel values and returns the text model's hidden states (no LM head):
    `model.model` of a `...ForConditionalGeneration`."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "get_rope_index"):
        raise TargetError(
            f"{type(model).__name__}: no multimodal base model with get_rope_index (M-RoPE); this vision-language "
            "family is not supported yet (tested: qwen3_vl)"
        )
    return inner


def mrope_positions(
    model: Any,
    input_ids: torch.Tensor,  # [T] one sequence
    vision: VisionInputs | None,
) -> tuple[torch.Tensor, int]:
    """(M-RoPE positions [3, T], delta): transformers' `get_rope_index` for the sequence; a token at sequence
    index i >= T (a generated one) has position i + delta in all three rows."""
    if vision is None or not vision.num_images:
        pos = torch.arange(input_ids.numel(), device=input_ids.device)
        return pos.expand(3, -1), 0
    inner = multimodal_model(model)
    ids = input_ids[None]  # [1, T]
    kw = vision.model_kwargs(ids, image_token_id(model.config))
    positions, delta = inner.get_rope_index(
        ids, mm_token_type_ids=kw["mm_token_type_ids"], image_grid_thw=kw["image_grid_thw"]
    )  # [3, 1, T], [1, 1]
    return positions[:, 0], int(delta.reshape(-1)[0])


def position_rows(sequence_positions: torch.Tensor, mrope: torch.Tensor) -> torch.Tensor:
    """`position_ids` for the target: [4, 1, T], the sequence index (what masks are built from) over the
    three M-RoPE rows, as `generate` passes them."""
    return torch.cat([sequence_positions[None], mrope], dim=0)[:, None]
