"""Images in conversations and prompts: parsing, checking, opening, and the image tokens of a rendering.

A user turn carries images in either of the two shapes data sets use:
  * OpenAI content parts: `{"type": "image_url", "image_url": {"url": REF}}` (or `"image_url": REF`) and
    `{"type": "image", "image": REF}` beside `{"type": "text", "text": ...}` parts, in order;
  * ShareGPT / LLaVA: a record-level `"images": [REF, ...]` list, each `<image>` in a user turn's text
    standing for the next image (images without a placeholder go before the first user turn's text).
REF is a local path (relative paths are looked up beside the data file, then in the working directory) or
a `data:image/...;base64,` URL. Every image is checked when its record is read: a path that does not exist
or a file that does not decode stops with a `DataError` naming the record (exit status 2).

A normalised user message with images keeps its text in `content` (what deduplication and the mask search
read) and the ordered parts in `parts`: `{"type": "text", "text": ...}` and `{"type": "image", "image": REF}`
with REF resolved (an absolute path or the data URL). The chat template renders each image as its
placeholder (Qwen3-VL: `<|image_pad|>` inside `<|vision_start|>...<|vision_end|>`; Gemma 3: `<start_of_image>`);
the rendering then gets each placeholder replaced by the image's text as the model's own processor writes it
(its image tokens, one per merged patch or soft token, and the processor's text around them:
`eagle.target.multimodal.VisionProcessor.expand`), outside every answer's span, so the loss mask is 0 there
(image positions are never training targets).
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from eagle.errors import DataError

IMAGE_PLACEHOLDER = "<image>"  # ShareGPT / LLaVA: where the next image of the record's `images` goes
_DATA_URL = "data:"


def _bytes_of_data_url(ref: str, where: str) -> bytes:
    head, _, payload = ref.partition(",")
    if ";base64" not in head or not payload:
        raise DataError(f"{where}: image data URL {ref[:40]!r}... is not a base64 data URL (data:image/...;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise DataError(f"{where}: image data URL {ref[:40]!r}... does not decode as base64 ({e})") from e


def resolve_image(ref: Any, where: str, base_dir: Path | None = None) -> str:
    """`ref` checked: an existing path (made absolute; relative ones are looked up in `base_dir` first) or a
    data URL, either of which decodes as an image. Raises `DataError` naming `where` otherwise."""
    if not isinstance(ref, str) or not ref.strip():
        raise DataError(f"{where}: an image must be a path or a data URL (a non-empty string), got {str(ref)[:60]!r}")
    if ref.startswith(_DATA_URL):
        open_image(ref, where)
        return ref
    path = Path(ref).expanduser()
    if not path.is_absolute() and base_dir is not None and (base_dir / path).exists():
        path = base_dir / path
    if not path.is_file():
        raise DataError(
            f"{where}: image {ref!r} does not exist (looked in {base_dir or '.'} and the working directory)"
        )
    resolved = str(path.resolve())
    open_image(resolved, where)
    return resolved


def open_image(ref: str, where: str) -> Image.Image:
    """The image at `ref` (a resolved path or a data URL), as RGB; `DataError` naming `where` if it does not decode."""
    try:
        source: Any = io.BytesIO(_bytes_of_data_url(ref, where)) if ref.startswith(_DATA_URL) else ref
        with Image.open(source) as img:
            img.load()  # decode now: a truncated file fails here, not inside the target's processor
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise DataError(f"{where}: image {ref[:80]!r} does not decode as an image ({type(e).__name__}: {e})") from e


def image_size(ref: str, where: str) -> tuple[int, int]:
    """(height, width) of the image at `ref`."""
    img = open_image(ref, where)
    return img.height, img.width


def _url_of(part: dict[str, Any]) -> Any:
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return part.get("image")


def has_images(content: Any) -> bool:
    """Whether OpenAI-style content holds image parts."""
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") in ("image_url", "image") for p in content
    )


def content_parts(content: Any, where: str, base_dir: Path | None) -> tuple[str, list[dict[str, Any]]]:
    """(the text, the ordered text and image parts) of OpenAI-style content holding images."""
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in ("image_url", "image"):
            parts.append({"type": "image", "image": resolve_image(_url_of(part), where, base_dir)})
        else:
            raise DataError(
                f"{where}: content part {str(part)[:80]!r} is neither a text part nor an image part "
                "({'type': 'image_url', 'image_url': {'url': PATH_OR_DATA_URL}})"
            )
    return "".join(p["text"] for p in parts if p["type"] == "text"), parts


def attach_record_images(images: Any, messages: list[dict[str, Any]], where: str, base_dir: Path | None) -> None:
    """A ShareGPT record's `images` list placed into its user turns (module docstring), in place."""
    if not isinstance(images, list) or not images:
        raise DataError(f"{where}: field 'images' must be a non-empty list of image paths or data URLs")
    refs = [resolve_image(ref, f"{where}, images[{k}]", base_dir) for k, ref in enumerate(images)]
    users = [m for m in messages if m["role"] == "user"]
    if not users:
        raise DataError(f"{where}: the record has images but no user turn to hold them")
    placeholders = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in users)
    if placeholders > len(refs):
        raise DataError(f"{where}: {placeholders} '<image>' placeholders for {len(refs)} images")
    unplaced = refs[: len(refs) - placeholders]  # these go before the first user turn's text
    queue = refs[len(refs) - placeholders :]
    for k, m in enumerate(users):
        parts: list[dict[str, Any]] = [{"type": "image", "image": ref} for ref in (unplaced if k == 0 else [])]
        pieces = m["content"].split(IMAGE_PLACEHOLDER)
        for j, piece in enumerate(pieces):
            if j:
                parts.append({"type": "image", "image": queue.pop(0)})
            if piece:
                parts.append({"type": "text", "text": piece})
        if any(p["type"] == "image" for p in parts):
            m["parts"] = parts
            m["content"] = "".join(pieces)


def message_images(messages: list[dict[str, Any]]) -> list[str]:
    """The image references of a conversation, in rendering order."""
    return [p["image"] for m in messages for p in m.get("parts", ()) if p["type"] == "image"]


def template_content(message: dict[str, Any]) -> Any:
    """What the chat template reads as a message's content: the parts (images as `{"type": "image"}`) when it
    has images, else its text."""
    if "parts" not in message:
        return message["content"]
    return [{"type": "image"} if p["type"] == "image" else dict(p) for p in message["parts"]]


def keep_whole_images(ids: list[int], image_id: int, counts: list[int]) -> tuple[int, int]:
    """For a sequence cut to `ids`: (images kept whole, tokens to keep). An image whose tokens the cut split is
    dropped with its tokens (the target cannot read part of an image), so the cut moves before it. (Text the
    processor writes before an image's tokens, Gemma 3's `<start_of_image>`, may stay at the end: a user turn's
    text, masked from the loss.)"""
    pos = kept = 0
    while pos < len(ids) and kept < len(counts):
        if ids[pos] != image_id:
            pos += 1
            continue
        if pos + counts[kept] > len(ids):
            return kept, pos
        pos += counts[kept]
        kept += 1
    return kept, len(ids)
