"""Conversation data for tests: ShareGPT-format files and in-memory conversations."""

from __future__ import annotations

import json
import random
from pathlib import Path

from eagle.data.records import Conversation
from tests.tiny_models import _CORPUS

WORDS = "the quick brown fox jumps over lazy dog speculative decoding drafts several tokens and verifies".split()

# Three conversations of 1-2 user turns (one with a system prompt) whose answers regeneration replaces.
CONVS = [
    Conversation(
        "a",
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello!"},
            {"role": "assistant", "content": "ORIGINAL"},
            {"role": "user", "content": "Write a poem"},
            {"role": "assistant", "content": "ORIGINAL"},
        ],
    ),
    Conversation(
        "b", [{"role": "user", "content": "The quick brown fox"}, {"role": "assistant", "content": "ORIGINAL"}]
    ),
    Conversation("c", [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "ORIGINAL"}]),
]


def write_conversations(path: Path, n: int = 24) -> Path:
    """A ShareGPT-format jsonl of `n` short, distinct conversations."""
    with open(path, "w") as f:
        for i in range(n):
            a, b = _CORPUS[i % len(_CORPUS)], _CORPUS[(3 * i + 1) % len(_CORPUS)]
            turns = [{"from": "human", "value": f"{a} {i}"}, {"from": "gpt", "value": f"{b} {a}"}]
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
    return path


def write_word_salad(path: Path, n: int, seed: int = 0, max_words: int = 40) -> Path:
    """A small ShareGPT-format JSONL of random word salad (ids conv0, conv1, ...)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            turns = [
                {"from": "human", "value": " ".join(rng.choices(WORDS, k=rng.randint(3, max_words)))},
                {"from": "gpt", "value": " ".join(rng.choices(WORDS, k=rng.randint(3, max_words)))},
            ]
            f.write(json.dumps({"id": f"conv{i}", "conversations": turns}) + "\n")
    return path
