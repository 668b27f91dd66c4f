"""Vision-language targets (Qwen3-VL, Gemma 3): what differs from a text-only target, kept in one place.

A vision-language target is still the frozen target of a text-only head: the head reads the hidden states
of the target's text model at every position (image positions included) and drafts text. What differs:
  * the checkpoint loads through `AutoModelForImageTextToText` (its config has a `vision_config`);
  * the chat template renders an image as a placeholder, which the checkpoint's processor replaces by the
    image's text: its image tokens (one per merged patch or pooled soft token: `tokens_for`), and around
    them whatever that processor puts there (Qwen3-VL: nothing; Gemma 3: `\n\n<start_of_image>` before,
    `<end_of_image>\n\n` after). `VisionProcessor.expand` does the same to rendered text;
  * a sequence holding an image carries the image processor's tensors (`VisionInputs`: pixel values, and
    whatever else the model's forward takes, e.g. Qwen3-VL's `image_grid_thw`), and a token-type row marking
    the image tokens, under the name the model's forward takes (`mm_token_type_ids`, Gemma 3's
    `token_type_ids`: in its prefill an image's tokens attend to each other both ways). Its multimodal model
    (`multimodal_model`, `model.model`) encodes them and scatters them over the image tokens;
  * its rotary positions: the plain sequence index for a 1-D RoPE family (Gemma 3), M-RoPE for a family whose
    multimodal model has `get_rope_index` (Qwen2/2.5/3-VL: `has_mrope`): three rows (time, height, width)
    that equal the sequence index on text before the first image, differ inside an image, and equal
    `index + delta` after it (`delta` < 0: an image of N tokens advances the positions by its side length,
    not by N). `mrope_positions` gives transformers' own `get_rope_index` result (three equal rows of the
    sequence index, delta 0, for a 1-D family); the decoder passes `[4, 1, T]` rows (sequence index, then the
    three M-RoPE rows) exactly as `generate` does (`Qwen3VLForConditionalGeneration.
    _prepare_position_ids_for_generation`).

What the family has decides, not its name: the model class's forward parameters (which tensors and which
token-type name), `get_rope_index` (M-RoPE), the processor's own text for an image and its own count of image
tokens. Images are turned into pixels with the checkpoint's own image processor, loaded with the PIL backend:
torchvision is not needed (the torchvision wheel on PyPI is a CUDA build whose ops do not load beside the CPU
torch wheel: `operator torchvision::nms does not exist`). The whole processor (`AutoProcessor`) is loaded where
it loads without torchvision (Gemma 3's); where it does not (Qwen3-VL's needs its video processor), the
placeholder is the image token itself and an image's text is its image tokens alone, which is what Qwen's
processor writes.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
)

from eagle.errors import DataError, TargetError

IMAGE_TOKEN_TYPE = 1  # transformers' mm_token_type_ids (and Gemma 3's token_type_ids): text 0, image 1, video 2
TOKEN_TYPE_NAMES = ("mm_token_type_ids", "token_type_ids")  # the forward parameter that takes them, first found
_PROBE_SIDE = 64  # pixels a side of the blank image whose text the processor is asked for (`_image_text_around`)


def is_vision_language(config: Any) -> bool:
    """Whether `config` (a target's HF config) is a vision-language model's: it has a vision tower."""
    return getattr(config, "vision_config", None) is not None


def auto_model_class(config: Any) -> Any:
    """The transformers auto class that loads this target with its LM head: causal LM, or image-text-to-text
    for a vision-language checkpoint (AutoModelForCausalLM refuses Qwen3VLConfig)."""
    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def image_token_id(config: Any) -> int:
    """The id of the image token (repeated once per merged patch or soft token of each image)."""
    value = getattr(config, "image_token_id", None)
    if value is None:
        raise TargetError(f"{getattr(config, 'model_type', '?')}: the config names no image_token_id")
    return int(value)


def forward_parameters(config: Any) -> frozenset[str]:
    """The parameter names of the forward of the class `AutoModelForImageTextToText` loads for `config`."""
    try:
        model_class: Any = AutoModelForImageTextToText._model_mapping[type(config)]  # the class itself
    except (KeyError, ValueError) as e:
        raise TargetError(
            f"{getattr(config, 'model_type', '?')}: transformers has no image-text-to-text model for this config"
        ) from e
    return frozenset(inspect.signature(model_class.forward).parameters)


def token_type_name(parameters: frozenset[str]) -> str | None:
    """The forward parameter that takes the image-token row (`TOKEN_TYPE_NAMES`), None when it takes none."""
    return next((name for name in TOKEN_TYPE_NAMES if name in parameters), None)


@dataclass(frozen=True)
class VisionProcessor:
    """What turns a target's images into its inputs and its text: the image processor (PIL backend), the whole
    processor where it loads, and what the model's forward takes."""

    image_processor: Any
    image_token_id: int
    model_type: str
    forward_inputs: frozenset[str] = frozenset({"pixel_values", "image_grid_thw", "mm_token_type_ids"})
    processor: Any = None  # the checkpoint's whole processor (AutoProcessor), None where it does not load
    placeholder: str | None = None  # what the template renders for an image; None: the image token itself
    before: str = ""  # the processor's text before an image's image tokens (Gemma 3: "\n\n<start_of_image>")
    after: str = ""  # and after them (Gemma 3: "<end_of_image>\n\n")
    no_processor: str = ""  # why the whole processor did not load (said when a placeholder count is off)
    config: Any = field(default=None, compare=False)

    @property
    def merge_size(self) -> int:
        return int(getattr(self.image_processor, "merge_size", 1) or 1)

    @property
    def token_type_name(self) -> str | None:
        return token_type_name(self.forward_inputs)

    def tokens_for(self, height: int, width: int) -> int:
        """Image tokens an image of this size takes: the processor's own count where it loaded (vLLM asks it the
        same: `_get_num_multimodal_tokens`), else its image processor's patches over the merge window, else the
        config's fixed `mm_tokens_per_image`."""
        counter = getattr(self.processor, "_get_num_multimodal_tokens", None)
        if counter is not None:
            return int(counter(image_sizes=[[height, width]])["num_image_tokens"][0])
        patches = getattr(self.image_processor, "get_number_of_image_patches", None)
        if patches is not None:
            return int(patches(height, width, {})) // (self.merge_size * self.merge_size)
        fixed = getattr(self.config, "mm_tokens_per_image", None)
        if fixed is None:
            raise TargetError(
                f"{self.model_type}: neither its processor nor its config says how many tokens an image takes"
            )
        return int(fixed)

    def expand(self, text: str, counts: list[int], image_token: str, where: str) -> tuple[str, list[tuple[int, int]]]:
        """(`text` with its k-th image placeholder replaced by the k-th image's text, as the processor does;
        each placeholder's (start, end) in `text`). `image_token`: the image token's text (the tokenizer's).
        `DataError` naming `where` when the template rendered another number of placeholders than images."""
        placeholder = self.placeholder or image_token
        found = [(m.start(), m.end()) for m in re.finditer(re.escape(placeholder), text)]
        if len(found) != len(counts):
            why = f" (its processor did not load: {self.no_processor})" if self.no_processor else ""
            raise DataError(
                f"{where}: the chat template rendered {len(found)} image placeholders ({placeholder!r}) for "
                f"{len(counts)} images; the target's template must render each image part as its placeholder{why}"
            )
        pieces: list[str] = []
        last = 0
        for (start, end), n in zip(found, counts, strict=True):
            pieces += [text[last:start], self.before, image_token * n, self.after]
            last = end
        pieces.append(text[last:])
        return "".join(pieces), found

    def pixels(self, images: list[Any]) -> VisionInputs:
        """`images` (PIL images) through the image processor: the tensors the model's forward takes."""
        out = self.image_processor(images=images, return_tensors="pt")
        tensors = {k: v for k, v in out.items() if k in self.forward_inputs and torch.is_tensor(v)}
        if "image_grid_thw" in tensors:
            tensors["image_grid_thw"] = tensors["image_grid_thw"].long()
        return VisionInputs(tensors, len(images), self.token_type_name)


def _image_text_around(processor: Any, image_token: str) -> tuple[str, str]:
    """(before, after): the text the processor writes around one image's run of image tokens, read off its own
    replacement for a blank image (`replace_image_token`, the text `processor(text=..., images=...)` puts in
    place of the placeholder)."""
    probe = Image.new("RGB", (_PROBE_SIDE, _PROBE_SIDE))
    text = str(processor.replace_image_token(processor.image_processor(images=[probe]), 0))
    first, last = text.find(image_token), text.rfind(image_token)
    run = text[first : last + len(image_token)] if first >= 0 else ""
    if not run or run != image_token * (len(run) // len(image_token)):
        raise TargetError(
            f"{type(processor).__name__} writes {text[:120]!r} for an image: not one run of its image token "
            f"{image_token!r}; eagle expands images as such a run"
        )
    return text[:first], text[last + len(image_token) :]


@cache
def load_vision_processor(path: str) -> VisionProcessor | None:
    """The image processor, processor and image token of the vision-language target in folder `path`, or None
    when the folder holds no vision-language checkpoint (a text-only target, or a tokenizer built in memory).
    Cached: the data stage, capture and evaluation ask per conversation."""
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
        images = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    except Exception as e:  # a missing or broken preprocessor config: say which folder
        raise TargetError(
            f"the vision-language target in {folder} ({config.model_type}) has no usable image processor "
            f"(preprocessor_config.json): {e}"
        ) from e
    if getattr(images, "do_pan_and_scan", False):
        # Extra crops per image, each with its own image text: not one run of image tokens per image.
        raise TargetError(
            f"the image processor of {folder} ({config.model_type}) has do_pan_and_scan=true; eagle does not "
            "support pan-and-scan crops: set it to false in preprocessor_config.json"
        )
    kept: dict[str, Any] = {}
    try:
        processor = AutoProcessor.from_pretrained(str(folder), backend="pil")
        placeholder = getattr(processor, "image_token", None)
        tokenizer = processor.tokenizer
        image_token = tokenizer.convert_ids_to_tokens(image_token_id(config))
        before, after = _image_text_around(processor, image_token)
        kept = {"processor": processor, "placeholder": placeholder, "before": before, "after": after}
    except TargetError:
        raise
    except Exception as e:  # e.g. Qwen3-VL's processor needs torchvision for its video processor
        why = f"{type(e).__name__}: {str(e)[:200]}"
        if getattr(config, "boi_token_id", None) is not None:
            # A begin-of-image token: the processor writes text around an image's tokens (Gemma 3, Gemma 4), and
            # only it says which; image tokens alone would not be the sequences the target is served with.
            raise TargetError(
                f"the processor of the vision-language target in {folder} ({config.model_type}) does not load "
                f"({why}); its config names a begin-of-image token, so only that processor says the text around "
                "an image's tokens: install what it needs (Gemma 4's video processor imports torchvision)"
            ) from e
        kept = {"no_processor": why}
    return VisionProcessor(
        images,
        image_token_id(config),
        str(config.model_type),
        forward_parameters(config),
        config=config,
        **kept,
    )


@dataclass
class VisionInputs:
    """The images of one sequence (or a batch of them, in order): what the target's multimodal model reads."""

    # The image processor's tensors the model's forward takes, every image's in order along dim 0: pixel_values
    # (Qwen3-VL: [P, C * T_patch * patch^2] patches; Gemma 3: [N, C, H, W]), Qwen3-VL's image_grid_thw [N, 3].
    tensors: dict[str, torch.Tensor]
    num_images: int
    token_type_name: str | None = "mm_token_type_ids"  # the forward parameter of the image-token row, if any

    @property
    def pixel_values(self) -> torch.Tensor:
        return self.tensors["pixel_values"]

    @property
    def image_grid_thw(self) -> torch.Tensor | None:
        return self.tensors.get("image_grid_thw")

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> VisionInputs:
        """On `device`; floating-point tensors (pixels) in `dtype` too."""
        moved = {
            k: v.to(device, dtype=dtype) if v.is_floating_point() else v.to(device) for k, v in self.tensors.items()
        }
        return VisionInputs(moved, self.num_images, self.token_type_name)

    def model_kwargs(self, input_ids: torch.Tensor, image_id: int) -> dict[str, Any]:
        """Keyword arguments of the target's forward for `input_ids` [B, T] holding these images' tokens."""
        kw: dict[str, Any] = dict(self.tensors)
        if self.token_type_name is not None:
            kw[self.token_type_name] = (input_ids == image_id).int() * IMAGE_TOKEN_TYPE  # [B, T]
        return kw


def concat_vision(parts: list[VisionInputs | None]) -> VisionInputs | None:
    """The images of several sequences as one batch's (in row order), None when none has any."""
    kept = [p for p in parts if p is not None and p.num_images]
    if not kept:
        return None
    tensors = {k: torch.cat([p.tensors[k] for p in kept]) for k in kept[0].tensors}
    return VisionInputs(tensors, sum(p.num_images for p in kept), kept[0].token_type_name)


def multimodal_model(model: Any) -> Any:
    """The module whose forward takes pixel values and returns the text model's hidden states (no LM head):
    `model.model` of a `...ForConditionalGeneration`."""
    inner = getattr(model, "model", None)
    if inner is None or not is_vision_language(getattr(model, "config", None)):
        raise TargetError(
            f"{type(model).__name__}: no multimodal base model (`.model` of a vision-language checkpoint); "
            "load the target with its vision tower (tested: qwen3_vl, gemma3)"
        )
    return inner


def has_mrope(model: Any) -> bool:
    """Whether `model` numbers its tokens with M-RoPE rows: its multimodal model has `get_rope_index`
    (Qwen2/2.5/3-VL). A 1-D RoPE family (Gemma 3) numbers them by the plain sequence index."""
    inner = getattr(model, "model", None)
    return is_vision_language(getattr(model, "config", None)) and hasattr(inner, "get_rope_index")


def builds_image_masks(model: Any) -> bool:
    """Whether `model` builds attention masks of its own for a prompt with images (`create_masks_for_generate`,
    as Gemma 3 does: an image's tokens attend to each other both ways), rather than plain causal ones."""
    return hasattr(type(model), "create_masks_for_generate")


def batch_mrope_positions(
    model: Any,
    input_ids: torch.Tensor,  # [B, T]
    attention_mask: torch.Tensor | None,  # [B, T], 1 = real token; None = all real
    vision: VisionInputs | None,  # the batch's images, in row order
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M-RoPE positions [3, B, T], deltas [B]): transformers' `get_rope_index` for the batch, the call the
    target's own forward makes; a token at sequence index i past a row's end has position i + delta in all
    three rows. Without images, or for a 1-D RoPE family (no `get_rope_index`: Gemma 3), three equal rows of
    the sequence index and delta 0."""
    b, t = input_ids.shape
    if vision is None or not vision.num_images or not has_mrope(model):
        pos = torch.arange(t, device=input_ids.device).expand(3, b, t)
        return pos, torch.zeros(b, dtype=torch.long, device=input_ids.device)
    kw = vision.model_kwargs(input_ids, image_token_id(model.config))
    positions, delta = multimodal_model(model).get_rope_index(
        input_ids,
        mm_token_type_ids=kw["mm_token_type_ids"],
        image_grid_thw=kw["image_grid_thw"],
        attention_mask=attention_mask,
    )  # [3, B, T], [B, 1]
    return positions.long(), delta.reshape(-1).long()


def mrope_positions(
    model: Any,
    input_ids: torch.Tensor,  # [T] one sequence
    vision: VisionInputs | None,
) -> tuple[torch.Tensor, int]:
    """(M-RoPE positions [3, T], delta) of one sequence (`batch_mrope_positions`)."""
    positions, delta = batch_mrope_positions(model, input_ids[None], None, vision)
    return positions[:, 0], int(delta[0])


def position_rows(sequence_positions: torch.Tensor, mrope: torch.Tensor) -> torch.Tensor:
    """`position_ids` for the target: [4, 1, T], the sequence index (what masks are built from) over the
    three M-RoPE rows, as `generate` passes them."""
    return torch.cat([sequence_positions[None], mrope], dim=0)[:, None]
