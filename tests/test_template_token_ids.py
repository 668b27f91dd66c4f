"""Stored token ids (`"token_ids"` on assistant messages, as eagle-regenerate writes them) replace the
tokens of the answer's text; conversations without them tokenise exactly as before."""

from __future__ import annotations

import hashlib
import json

import pytest

from eagle.data.records import Conversation
from eagle.data.template import end_of_turn_ids, tokenize_conversation, tokenize_with_reason
from tests.test_template_mask import DROPS_HISTORY, EXPECTED, MESSAGES, expected_ids_and_mask
from tests.tiny_models import FAMILIES, make_tokenizer


def ids_of(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def odd_split(tok, text: str) -> list[int]:
    """Ids that decode to `text` but are not its tokenisation: the text tokenised in two pieces cut
    inside a word (as a sampled answer can be: `Bre|ndon` where the tokenizer makes `B|rend|on`)."""
    canonical = ids_of(tok, text)
    for k in range(len(text) // 2, len(text)):
        ids = ids_of(tok, text[:k]) + ids_of(tok, text[k:])
        if ids != canonical and tok.decode(ids) == text:
            return ids
    raise AssertionError(f"no other split of {text!r}")


def with_ids(messages, make_ids) -> list[dict]:
    return [dict(m, token_ids=make_ids(m["content"])) if m["role"] == "assistant" else dict(m) for m in messages]


def masked_runs(tc) -> list[list[int]]:
    runs: list[list[int]] = [[]]
    for t, m in zip(tc.input_ids, tc.loss_mask, strict=True):
        if m:
            runs[-1].append(t)
        elif runs[-1]:
            runs.append([])
    return [r for r in runs if r]


@pytest.mark.parametrize("use_offsets", [True, False], ids=["offsets", "pieces"])
@pytest.mark.parametrize("family", FAMILIES)
def test_stored_ids_are_the_masked_tokens_and_the_template_tokens_stay(family, use_offsets):
    tok = make_tokenizer(family)
    stored = {m["content"]: odd_split(tok, m["content"]) for m in MESSAGES if m["role"] == "assistant"}
    for ids in stored.values():
        assert ids != ids_of(tok, tok.decode(ids))  # they differ from the re-tokenisation of the content
    conv = Conversation("c", with_ids(MESSAGES, stored.get))
    tc, reason = tokenize_with_reason(conv, tok, 4096, "truncate", use_offsets)
    assert reason is None and (tc.id_turns, tc.id_fallback_turns, tc.fallback_turns) == (2, 0, 0)
    # Expected: the hand-written rendering with each answer's content tokens swapped for the stored ids;
    # the template's text before the content (a think block the ids lack), the end-of-turn token and
    # everything outside the answers tokenised as the template renders them.
    ids, mask = [], []
    for text, flag in EXPECTED[family]:
        content = next((c for c in stored if flag and c in text), None)
        if content is None:
            piece_ids, piece_mask = expected_ids_and_mask(tok, [(text, flag)])
        else:
            before, after = text.split(content)
            piece_ids = ids_of(tok, before) + stored[content] + ids_of(tok, after)
            piece_mask = [1] * len(piece_ids)
        ids += piece_ids
        mask += piece_mask
    assert (tc.input_ids, tc.loss_mask) == (ids, mask)
    eot = end_of_turn_ids(tok)[0]
    glue = ids_of(tok, "<think>\n\n</think>\n\n") if family == "qwen3" else []
    assert masked_runs(tc) == [glue + stored[c] + [eot] for c in stored]


# Conversations without token ids, per family: digests of what the code before token ids existed produced
# (eagle/data/template.py at 8515ed8) for each of
# GOLDEN_CONVERSATIONS under each of GOLDEN_SETTINGS. A tokenizers upgrade that retrains the tiny
# vocabularies differently changes them too: recompute them with that code before updating them here.
LONG = " ".join(f"word{k % 7} ünïcödé 🙂" for k in range(60))
GOLDEN_CONVERSATIONS = [
    (None, MESSAGES),
    (
        None,
        [
            {"role": "user", "content": " padded question \n"},
            {"role": "assistant", "content": "\n an answer \n\n"},
            {"role": "user", "content": "def add(a, b):"},
            {"role": "assistant", "content": "    return a + b\n"},
        ],
    ),
    (None, [{"role": "user", "content": "hi " + LONG[:90]}, {"role": "assistant", "content": LONG}]),
    (DROPS_HISTORY, MESSAGES),  # not prefix-consistent: fallback turns
]
GOLDEN_SETTINGS = [
    (4096, "truncate", None),
    (4096, "truncate", False),
    (40, "truncate", None),
    (40, "drop", None),
    (90, "truncate", False),
]
GOLDEN = {
    "llama": "55ef7ac08f8af1ee",
    "qwen2": "e379105284ffbe5f",
    "qwen3": "67c99d5e432efaf4",
    "mistral": "908e837956802e0e",
    "gemma3": "1055a543d481515f",
}


def golden_digest(tokenize, family: str) -> str:
    """sha256 over `tokenize`'s results (tokenize_with_reason's signature) for every golden conversation
    and setting."""
    h = hashlib.sha256()
    for template, messages in GOLDEN_CONVERSATIONS:
        tok = make_tokenizer(family)
        if template is not None:
            tok.chat_template = template
        for max_length, overflow, use_offsets in GOLDEN_SETTINGS:
            tc, reason = tokenize(Conversation("g", messages), tok, max_length, overflow, use_offsets)
            got = None if tc is None else [tc.input_ids, tc.loss_mask, tc.truncated, tc.fallback_turns]
            h.update(json.dumps([reason, got]).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("family", FAMILIES)
def test_without_token_ids_tokenisation_is_unchanged(family):
    assert golden_digest(tokenize_with_reason, family) == GOLDEN[family]


def test_whitespace_the_record_stripped_comes_back_with_the_ids():
    """An answer cut at max_new_tokens after a newline: the record's content is stripped, its ids are not.
    The ids win; the end-of-turn token and the next turn stay as the template renders them."""
    tok = make_tokenizer("qwen2")
    conv = Conversation("c", with_ids(MESSAGES, lambda content: ids_of(tok, content + "\n")))
    plain = tokenize_conversation(Conversation("c", MESSAGES), tok, 4096, "truncate")
    tc = tokenize_conversation(conv, tok, 4096, "truncate")
    eot = end_of_turn_ids(tok)[0]
    assert masked_runs(tc) == [ids_of(tok, m["content"] + "\n") + [eot] for m in MESSAGES if m["role"] == "assistant"]
    assert tok.decode(tc.input_ids).count("\n<|im_end|>\n<|im_start|>user\nWrite a poem") == 1
    unmasked = lambda t: [i for i, m in zip(t.input_ids, t.loss_mask, strict=True) if not m]  # noqa: E731
    assert unmasked(tc) == unmasked(plain)  # every template token outside the answers is as before


# Llama-2's shape: the template puts a space before the answer and another before </s> (no generation
# prompt: the target answers right after [/INST]).
LLAMA2 = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)
# A generation prompt that ends in a space: in the full rendering the space and the answer's first word
# are one token.
SPACE_PROMPT = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
ONE_TURN = [{"role": "user", "content": "hello!"}, {"role": "assistant", "content": "Hi, how can I help?"}]


@pytest.mark.parametrize("use_offsets", [True, False], ids=["offsets", "pieces"])
def test_template_whitespace_around_the_answer_is_not_doubled(use_offsets):
    tok = make_tokenizer("mistral")
    tok.chat_template = LLAMA2
    stored = ids_of(tok, " Hi, how can I help?")  # generated after "[/INST]": the space is the target's
    tc, _ = tokenize_with_reason(
        Conversation("c", with_ids(ONE_TURN, lambda c: stored)), tok, 4096, "truncate", use_offsets
    )
    prompt = ids_of(tok, "<s>[INST] hello! [/INST]")
    assert tc.input_ids == prompt + stored + [tok.eos_token_id]
    assert tc.loss_mask == [0] * len(prompt) + [1] * (len(stored) + 1)
    assert tc.id_turns == 1


@pytest.mark.parametrize(
    "use_offsets, trimmed", [(True, False), (True, True), (False, False)], ids=["offsets", "trimmed-offsets", "pieces"]
)
def test_a_token_straddling_the_prompt_end_is_split_there(use_offsets, trimmed):
    from tokenizers import processors

    tok = make_tokenizer("qwen2")
    tok.chat_template = SPACE_PROMPT
    if trimmed:  # offsets without the whitespace a token starts with (GPT-2/RoBERTa-style post-processors)
        tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    messages = [{"role": "user", "content": "hello!"}, {"role": "assistant", "content": "sea is wide"}]
    assert tok.convert_ids_to_tokens(ids_of(tok, " sea")) == ["Ġsea"]  # one token in the full rendering
    stored = odd_split(tok, "sea is wide")
    tc, _ = tokenize_with_reason(
        Conversation("c", with_ids(messages, lambda c: stored)), tok, 4096, "truncate", use_offsets
    )
    prompt = ids_of(tok, "user: hello!\nassistant: ")  # the prompt as the target saw it: ends with "Ġ"
    assert tok.convert_ids_to_tokens(prompt[-1]) == "Ġ"
    newline = ids_of(tok, "\n")  # no special end-of-turn token: the template's newline is the answer's end
    assert (tc.input_ids, tc.loss_mask) == (prompt + stored + newline, [0] * len(prompt) + [1] * len(stored + newline))
    assert (tc.id_turns, tc.id_fallback_turns) == (1, 0)


def test_a_think_block_in_the_ids_is_not_doubled_and_another_is_refused():
    tok = make_tokenizer("qwen3")  # its template renders an empty think block before every answer
    think = "<think>\n\n</think>\n\n"
    stored = ids_of(tok, think) + odd_split(tok, "Hi, how can I help?")  # the target generated the block
    tc = tokenize_conversation(Conversation("c", with_ids(ONE_TURN, lambda c: stored)), tok, 4096, "truncate")
    assert masked_runs(tc) == [stored + end_of_turn_ids(tok)[:1]] and tc.id_turns == 1
    # A think block the template renders otherwise: splicing would double it, so the text is tokenised.
    other = ids_of(tok, "<think>\nhmm\n</think>\n\nHi, how can I help?")
    content = tok.decode(other, skip_special_tokens=True).strip()  # what ConversationJob writes
    messages = [ONE_TURN[0], {"role": "assistant", "content": content, "token_ids": other}]
    tc = tokenize_conversation(Conversation("c", messages), tok, 4096, "truncate")
    assert (tc.id_turns, tc.id_fallback_turns) == (0, 1)
    text_only = Conversation("c", [ONE_TURN[0], {"role": "assistant", "content": content}])
    assert tc.input_ids == tokenize_conversation(text_only, tok, 4096, "truncate").input_ids


def test_ids_that_cannot_stand_for_the_text_fall_back_to_it_and_are_counted():
    tok = make_tokenizer("qwen2")
    plain = tokenize_conversation(Conversation("c", MESSAGES), tok, 4096, "truncate")
    cases = {
        "another text's ids": lambda c: ids_of(tok, "The quick brown fox"),
        "ids past the vocabulary": lambda c: [len(tok) + 5],
    }
    for name, make in cases.items():
        tc = tokenize_conversation(Conversation("c", with_ids(MESSAGES, make)), tok, 4096, "truncate")
        assert (tc.id_turns, tc.id_fallback_turns) == (0, 2), name
        assert (tc.input_ids, tc.loss_mask) == (plain.input_ids, plain.loss_mask), name
    # The template's text after the answer merges with its last word ("wi" + "de" -> "wide"): the token
    # cannot be split there correctly, so that turn keeps its text.
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}de{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    messages = [ONE_TURN[0], {"role": "assistant", "content": "The sea is wi"}]
    assert "wide" in tok.convert_ids_to_tokens(ids_of(tok, "The sea is wide"))[-1]
    plain = tokenize_conversation(Conversation("c", messages), tok, 4096, "truncate")
    conv = Conversation("c", with_ids(messages, lambda c: odd_split(tok, c)))
    tc = tokenize_conversation(conv, tok, 4096, "truncate")
    assert (tc.id_turns, tc.id_fallback_turns, tc.input_ids) == (0, 1, plain.input_ids)


@pytest.mark.parametrize("use_offsets", [True, False], ids=["offsets", "pieces"])
def test_truncation_cuts_the_spliced_ids(use_offsets):
    tok = make_tokenizer("llama")
    long = [{"role": "user", "content": "hi " + LONG[:90]}, {"role": "assistant", "content": " ".join([LONG] * 3)}]
    for messages in (MESSAGES, long):
        conv = Conversation("c", with_ids(messages, lambda c: odd_split(tok, c)))
        full, _ = tokenize_with_reason(conv, tok, 100_000, "truncate", use_offsets)
        assert not full.truncated and full.id_turns == sum(m["role"] == "assistant" for m in messages)
        first = full.loss_mask.index(1)
        # Cuts inside the first answer's ids and before the last token. For the long conversation only a
        # prefix of the text is tokenised (8 characters per token up to max_length + 64): the prefix ends
        # inside the answer, whose ids are spliced whole and then cut.
        for max_length in (first + 1, first + 5, len(full.input_ids) - 1):
            tc, reason = tokenize_with_reason(conv, tok, max_length, "truncate", use_offsets)
            assert reason is None and tc.truncated
            assert (tc.input_ids, tc.loss_mask) == (full.input_ids[:max_length], full.loss_mask[:max_length])
            assert tokenize_with_reason(conv, tok, max_length, "drop", use_offsets) == (None, "too_long")
        assert tokenize_with_reason(conv, tok, first, "truncate", use_offsets) == (None, "empty_loss_mask")


@pytest.mark.parametrize("use_offsets", [True, False], ids=["offsets", "pieces"])
def test_ids_cut_inside_a_character_are_spliced_whole(use_offsets):
    """An answer stopped mid-character: its text ends in U+FFFD (three bytes when re-tokenised), its ids
    end with the bytes the target generated."""
    tok = make_tokenizer("qwen2")
    stored = ids_of(tok, "Hi 🙂")[:-1]
    content = tok.decode(stored, skip_special_tokens=True).strip()
    assert content.endswith("\ufffd") and ids_of(tok, content) != stored
    messages = [ONE_TURN[0], {"role": "assistant", "content": content, "token_ids": stored}]
    tc, _ = tokenize_with_reason(Conversation("c", messages), tok, 4096, "truncate", use_offsets)
    assert masked_runs(tc) == [stored + end_of_turn_ids(tok)[:1]] and tc.id_turns == 1


@pytest.mark.smollm2
def test_smollm2_non_canonical_splits_reach_training_as_generated():
    """The splits SmolLM2 was seen generating (benchmarks/studies/retokenize.py): `Bre|ndon` where its tokenizer
    makes `B|rend|on`, and one `ĊĊ` where it makes `Ċ|Ċ`; an answer cut at the token limit after a newline."""
    from eagle.config import TargetConfig
    from eagle.target.loading import load_tokenizer

    tok = load_tokenizer(TargetConfig())
    stored = (
        ids_of(tok, "Bre")
        + ids_of(tok, "ndon Burch:")
        + tok.convert_tokens_to_ids(["ĊĊ"])
        + ids_of(tok, "1. Self-care\n")
    )
    content = tok.decode(stored, skip_special_tokens=True).strip()
    assert content == "Brendon Burch:\n\n1. Self-care" and ids_of(tok, content) != stored
    messages = [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": content, "token_ids": stored}]
    tc = tokenize_conversation(Conversation("c", messages), tok, 4096, "truncate")
    assert masked_runs(tc) == [stored + tok.convert_tokens_to_ids(["<|im_end|>"])]
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert tc.input_ids[: tc.loss_mask.index(1)] == ids_of(tok, prompt)  # the template's tokens before it
