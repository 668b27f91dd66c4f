"""Assistant loss masks from chat templates: hand-written expectations per template shape."""

from __future__ import annotations

import pytest

from eagle.data.records import Conversation
from eagle.data.template import (
    assistant_char_spans,
    end_of_turn_ids,
    tokenize_conversation,
    tokenize_with_mask,
    tokenize_with_reason,
)
from eagle.errors import TargetError
from tests.tiny_models import FAMILIES, make_tokenizer

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello!"},
    {"role": "assistant", "content": "Hi, how can I help?"},
    {"role": "user", "content": "Write a poem"},
    {"role": "assistant", "content": "The sea is wide"},
]

# The rendering of MESSAGES written out by hand per template, cut into (text, is_assistant) pieces:
# the answer pieces include the end-of-turn token and nothing after it.
EXPECTED: dict[str, list[tuple[str, int]]] = {
    "qwen2": [
        ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello!<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Hi, how can I help?<|im_end|>", 1),
        ("\n<|im_start|>user\nWrite a poem<|im_end|>\n<|im_start|>assistant\n", 0),
        ("The sea is wide<|im_end|>", 1),
        ("\n", 0),
    ],
    "qwen3": [  # the think block is produced by the model after the generation prompt: it is learnt
        ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello!<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\n\n</think>\n\nHi, how can I help?<|im_end|>", 1),
        ("\n<|im_start|>user\nWrite a poem<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\n\n</think>\n\nThe sea is wide<|im_end|>", 1),
        ("\n", 0),
    ],
    "llama": [
        (
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nhello!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
            0,
        ),
        ("Hi, how can I help?<|eot_id|>", 1),
        (
            "<|start_header_id|>user<|end_header_id|>\n\nWrite a poem<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
            0,
        ),
        ("The sea is wide<|eot_id|>", 1),
    ],
    "mistral": [
        ("<s>Be brief.\n\n[INST] hello! [/INST]", 0),
        ("Hi, how can I help?</s>", 1),
        ("[INST] Write a poem [/INST]", 0),
        ("The sea is wide</s>", 1),
    ],
    "gemma3": [
        (
            "<bos><start_of_turn>system\nBe brief.<end_of_turn>\n<start_of_turn>user\nhello!<end_of_turn>\n"
            "<start_of_turn>model\n",
            0,
        ),
        ("Hi, how can I help?<end_of_turn>", 1),
        ("\n<start_of_turn>user\nWrite a poem<end_of_turn>\n<start_of_turn>model\n", 0),
        ("The sea is wide<end_of_turn>", 1),
        ("\n", 0),
    ],
}


def expected_ids_and_mask(tok, pieces):
    ids, mask = [], []
    for text, flag in pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [flag] * len(piece)
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_mask_matches_hand_written_rendering(family):
    tok = make_tokenizer(family)
    tc = tokenize_conversation(Conversation("c", MESSAGES), tok, max_length=4096, overflow="truncate")
    ids, mask = expected_ids_and_mask(tok, EXPECTED[family])
    # The full rendering tokenised in one go must equal the hand-written pieces tokenised apart.
    assert tok.decode(tc.input_ids) == "".join(t for t, _ in EXPECTED[family])
    assert tc.input_ids == ids
    assert tc.loss_mask == mask
    assert tc.fallback_turns == 0 and not tc.truncated
    # The last masked token is the end-of-turn token: the model learns to stop.
    last = max(i for i, m in enumerate(tc.loss_mask) if m)
    assert tc.input_ids[last] in end_of_turn_ids(tok)


@pytest.mark.parametrize("family", FAMILIES)
def test_piecewise_tokenisation_matches_offsets(family):
    tok = make_tokenizer(family)
    text, spans, _ = assistant_char_spans(tok, MESSAGES)
    assert tokenize_with_mask(tok, text, spans, use_offsets=True) == tokenize_with_mask(
        tok, text, spans, use_offsets=False
    )


def test_masked_tokens_decode_to_answers_plus_end_of_turn():
    tok = make_tokenizer("qwen2")
    tc = tokenize_conversation(Conversation("c", MESSAGES), tok, 4096, "truncate")
    runs, cur = [], []
    for t, m in zip(tc.input_ids, tc.loss_mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    assert [tok.decode(r) for r in runs] == ["Hi, how can I help?<|im_end|>", "The sea is wide<|im_end|>"]


# A template that is not prefix-consistent: like Qwen3, it shows reasoning only for the last answer.
DROPS_HISTORY = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.last %}<think>\nreasoning\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_fallback_when_template_rewrites_history():
    tok = make_tokenizer("qwen3")
    tok.chat_template = DROPS_HISTORY
    tc = tokenize_conversation(Conversation("c", MESSAGES), tok, 4096, "truncate")
    assert tc.fallback_turns == 1  # the first answer: its rendering changes once a later turn follows
    pieces = [
        ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello!<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Hi, how can I help?<|im_end|>", 1),
        ("\n<|im_start|>user\nWrite a poem<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\nreasoning\n</think>\n\nThe sea is wide<|im_end|>", 1),  # the last turn is exact
        ("\n", 0),
    ]
    assert (tc.input_ids, tc.loss_mask) == expected_ids_and_mask(tok, pieces)


def test_repeated_answers_map_to_successive_turns_in_fallback():
    tok = make_tokenizer("qwen3")
    tok.chat_template = DROPS_HISTORY
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "done"},
    ]
    text, spans, fallbacks = assistant_char_spans(tok, msgs)
    assert fallbacks == 2
    assert [text[s:e] for s, e in spans] == [
        "ok<|im_end|>",
        "ok<|im_end|>",
        "<think>\nreasoning\n</think>\n\ndone<|im_end|>",
    ]
    assert spans[0][1] < spans[1][0]
    # The second "ok" answer is the one after the user's "ok", not the user turn itself.
    assert text[: spans[1][0]].endswith("<|im_start|>assistant\n")


def test_no_chat_template_asks_for_one():
    tok = make_tokenizer("qwen2")
    tok.chat_template = None
    with pytest.raises(TargetError, match="target.chat_template"):
        tokenize_conversation(Conversation("c", MESSAGES), tok, 4096, "truncate")


def test_overflow_truncate_drop_and_empty_mask():
    tok = make_tokenizer("qwen2")
    conv = Conversation("c", MESSAGES)
    full = tokenize_conversation(conv, tok, 4096, "truncate")
    n = len(full.input_ids)
    cut = tokenize_conversation(conv, tok, n - 3, "truncate")
    assert cut.truncated and cut.input_ids == full.input_ids[: n - 3] and cut.loss_mask == full.loss_mask[: n - 3]
    assert tokenize_with_reason(conv, tok, n - 3, "drop") == (None, "too_long")
    assert tokenize_conversation(conv, tok, n, "drop").input_ids == full.input_ids  # exactly max_length fits
    first_answer = full.loss_mask.index(1)
    assert tokenize_with_reason(conv, tok, first_answer, "truncate") == (None, "empty_loss_mask")


def test_long_conversations_truncate_as_if_fully_tokenised():
    tok = make_tokenizer("llama")
    words = " ".join(f"word{k % 7} ünïcödé 🙂" for k in range(400))
    conv = Conversation(
        "c", [{"role": "user", "content": "hi " + words[:300]}, {"role": "assistant", "content": words}]
    )
    text, spans, _ = assistant_char_spans(tok, conv.messages)
    ids, mask = tokenize_with_mask(tok, text, spans)
    first = mask.index(1)
    for max_length in (first + 1, first + 100, len(ids) - 1):
        tc = tokenize_conversation(conv, tok, max_length, "truncate")
        assert tc.truncated and (tc.input_ids, tc.loss_mask) == (ids[:max_length], mask[:max_length])
    assert tokenize_conversation(conv, tok, len(ids), "drop").input_ids == ids


def test_template_that_raises_is_a_counted_reason():
    tok = make_tokenizer("qwen2")
    tok.chat_template = "{{ raise_exception('System role not supported') }}"
    assert tokenize_with_reason(Conversation("c", MESSAGES), tok, 4096, "truncate") == (None, "template_error")


@pytest.mark.smollm2
def test_smollm2_tokenizer_mask():
    from eagle.config import TargetConfig
    from eagle.target.loading import load_tokenizer

    tok = load_tokenizer(TargetConfig())
    msgs = MESSAGES[1:]  # no system turn: SmolLM2's template inserts its default system prompt
    tc = tokenize_conversation(Conversation("c", msgs), tok, 4096, "truncate")
    pieces = [
        (
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nhello!<|im_end|>\n<|im_start|>assistant\n",
            0,
        ),
        ("Hi, how can I help?<|im_end|>", 1),
        ("\n<|im_start|>user\nWrite a poem<|im_end|>\n<|im_start|>assistant\n", 0),
        ("The sea is wide<|im_end|>", 1),
        ("\n", 0),
    ]
    assert (tc.input_ids, tc.loss_mask) == expected_ids_and_mask(tok, pieces)
    assert tok.convert_ids_to_tokens(end_of_turn_ids(tok)) == ["<|im_end|>"]
