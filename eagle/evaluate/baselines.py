"""Hugging Face `generate` baselines (plain and prompt-lookup) and the shared chat encoding.

Every method is timed the same way (`timed`): the wall clock around one call, after
`torch.no_grad()` and with the same torch thread count, so the speedups in a report compare like
with like. HF `generate` is given the same stop tokens, length limit and sampling settings as the
speculative decoder, so at temperature 0 its output is the reference the speculative output must
equal token for token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from eagle.config import DecodeConfig
from eagle.errors import TargetError
from eagle.target.multimodal import VisionInputs, image_token_id
from eagle.target.structure import config_token_ids


@dataclass
class MethodRun:
    """One method's output on one prompt turn."""

    tokens: list[int]  # new tokens only (prompt excluded), stop token included if emitted
    seconds: float


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> torch.Tensor:
    """Messages -> [1, T] prompt ids via the tokenizer's chat template, ready for the assistant turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise TargetError(
            "the target's tokenizer has no chat template; set target.chat_template to a Jinja template "
            "(or a file holding one)"
        )
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = enc["input_ids"]
    if torch.is_tensor(ids):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):  # some tokenizers return a batch of one
        ids = ids[0]
    return torch.tensor([ids], dtype=torch.long)  # [1, T]


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """End-of-sequence ids: the model's generation config first (chat models list several), then the tokenizer's."""
    return config_token_ids(("eos_token_id",), getattr(model, "generation_config", None), tokenizer)


def hf_generate_kwargs(model: Any, tokenizer: Any, decode: DecodeConfig) -> dict[str, Any]:
    """Arguments that make HF `generate` decode exactly as `decode` asks (and nothing more)."""
    kw: dict[str, Any] = {
        "max_new_tokens": decode.max_new_tokens,
        "eos_token_id": stop_token_ids(model, tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        # `generate` otherwise reads a model's own defaults (sampling, repetition penalty, ...).
        "repetition_penalty": 1.0,
        "min_new_tokens": 0,
    }
    if decode.temperature == 0:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kw.update(do_sample=True, temperature=decode.temperature, top_p=decode.top_p, top_k=decode.top_k or None)
    if decode.stop_strings:
        kw.update(stop_strings=list(decode.stop_strings), tokenizer=tokenizer)
    return kw


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn(), wall seconds), with gradients off."""
    with torch.no_grad():
        start = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - start


def hf_generate(
    model: Any,
    tokenizer: Any,
    input_ids: torch.Tensor,  # [1, T]
    decode: DecodeConfig,
    prompt_lookup_num_tokens: int | None = None,
    vision: VisionInputs | None = None,
) -> MethodRun:
    """HF `generate` on one prompt (prompt-lookup decoding when `prompt_lookup_num_tokens` is set); `vision`: the
    prompt's images, passed as a vision-language model's `generate` takes them (it computes M-RoPE itself)."""
    kw = hf_generate_kwargs(model, tokenizer, decode)
    if prompt_lookup_num_tokens:
        kw["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    attention_mask = torch.ones_like(input_ids)
    device = next(model.parameters()).device
    if decode.temperature > 0:
        torch.manual_seed(decode.seed)
    if vision is not None and vision.num_images:
        dtype = next(model.parameters()).dtype
        kw.update(vision.to(device, dtype=dtype).model_kwargs(input_ids.to(device), image_token_id(model.config)))
    out, seconds = timed(lambda: model.generate(input_ids.to(device), attention_mask=attention_mask.to(device), **kw))
    return MethodRun(tokens=out[0, input_ids.shape[1] :].tolist(), seconds=seconds)  # out: [1, T + N]
