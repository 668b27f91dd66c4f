"""gpt-oss's Harmony format rendered by openai-harmony (eagle/data/harmony.py): ids, loss masks, regeneration
prompts and answers, with gpt-oss's real vocabulary (o200k_base + its special tokens)."""

from __future__ import annotations

import json

import pytest

from eagle.config import DataConfig, RegenerateConfig
from eagle.data.dataset import build_splits
from eagle.data.harmony import HarmonyRenderer, renderer_for, tokenize_harmony
from eagle.data.records import normalise_record
from eagle.errors import DataError
from eagle.regenerate.job import ConversationJob, check_reasoning_setting
from tests.support.harmony import gpt_oss_tokenizer, harmony_encoding
from tests.tiny_models import make_tokenizer

pytestmark = pytest.mark.harmony

TOOLS_AND_THINKING = {
    "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I need the weather tool.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20}'},
        {"role": "assistant", "content": "20 degrees.", "reasoning_content": "The tool says 20."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome.", "reasoning_content": "Be polite."},
    ]
}


@pytest.fixture(scope="module")
def harmony() -> HarmonyRenderer:
    return HarmonyRenderer(harmony_encoding())


def _conv(record):
    return normalise_record(record, index=0, source="t.jsonl")


def _trained(enc, ids, mask) -> list[str]:
    """The text of each run of masked tokens."""
    runs, run = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            run.append(t)
        elif run:
            runs.append(enc.decode(run))
            run = []
    return runs + ([enc.decode(run)] if run else [])


def test_a_record_renders_as_openai_harmony_trains_it_and_masks_what_the_assistant_generates(harmony):
    h = harmony.harmony
    ids, mask = harmony.tokenize(_conv(TOOLS_AND_THINKING).messages)
    conversation = h.Conversation.from_messages(harmony.messages(_conv(TOOLS_AND_THINKING).messages))
    assert ids == list(harmony.encoding.render_conversation_for_training(conversation))
    text = harmony.encoding.decode(ids)
    assert "# Instructions\n\nAnswer briefly." in text  # the system message, as gpt-oss's developer message
    assert '<|start|>functions.weather to=assistant<|channel|>commentary<|message|>{"temp": 20}<|end|>' in text
    # Earlier turns' thinking is dropped as openai-harmony drops it; the last turn's stays, and is trained.
    assert "I need the weather tool." not in text and "The tool says 20." not in text and "Be polite." in text
    assert _trained(harmony.encoding, ids, mask) == [
        ' to=functions.weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
        "<|channel|>final<|message|>20 degrees.<|end|>",
        "<|channel|>analysis<|message|>Be polite.<|end|><|start|>assistant<|channel|>final<|message|>You are welcome.<|return|>",
    ]


def test_without_reasoning_the_thinking_is_context_and_the_answer_after_it_is_trained(harmony):
    ids, mask = harmony.tokenize(_conv(TOOLS_AND_THINKING).messages, train_on_reasoning=False)
    assert _trained(harmony.encoding, ids, mask)[-2:] == [
        "<|channel|>analysis<|message|>",
        "<|end|><|start|>assistant<|channel|>final<|message|>You are welcome.<|return|>",
    ]
    assert "Be polite." in harmony.encoding.decode(ids)


def test_truncation_drops_and_bad_records_are_counted(harmony):
    conv = _conv(TOOLS_AND_THINKING)
    full, _ = tokenize_harmony(conv, harmony, 10_000, "truncate")
    assert full is not None and not full.truncated
    cut, _ = tokenize_harmony(conv, harmony, len(full.input_ids) - 5, "truncate")
    assert cut is not None and cut.truncated and cut.input_ids == full.input_ids[:-5]
    assert tokenize_harmony(conv, harmony, len(full.input_ids) - 5, "drop") == (None, "too_long")
    assert tokenize_harmony(conv, harmony, 20, "truncate") == (None, "empty_loss_mask")  # the system prompt only
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}  # no id, so nothing names the result's
    nameless = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    nameless += [{"role": "tool", "content": "?"}, {"role": "assistant", "content": "Ok"}]
    assert tokenize_harmony(_conv({"messages": nameless}), harmony, 100, "truncate") == (None, "template_error")


def test_the_test_tokenizer_is_gpt_oss_s_vocabulary():
    """The HF tokenizer the pipeline tests use gives openai-harmony's ids (same BPE, same special ids)."""
    tok, enc = gpt_oss_tokenizer(), harmony_encoding()
    texts = [
        "Hello, world!",
        "  leading spaces\n\nand newlines\t",
        "naïve café 1234567 don't",
        "def f(x):\n    return x**2",
    ]
    for text in texts + ["<|start|>assistant<|channel|>final<|message|>Hi<|return|>"]:
        assert tok(text, add_special_tokens=False)["input_ids"] == enc.encode(text, allowed_special="all")


def test_auto_renders_gpt_oss_with_harmony_and_others_with_their_template():
    assert isinstance(renderer_for("auto", gpt_oss_tokenizer()), HarmonyRenderer)
    assert renderer_for("chat_template", gpt_oss_tokenizer()) is None
    smol = make_tokenizer("llama")
    assert renderer_for("auto", smol) is None
    with pytest.raises(DataError, match="data.renderer=harmony needs gpt-oss's tokenizer"):
        renderer_for("harmony", smol)


def test_data_splits_of_gpt_oss_are_harmony_renderings(tmp_path, harmony):
    path = tmp_path / "tools.jsonl"
    records = [{**TOOLS_AND_THINKING, "id": f"c{k}"} for k in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(source="local", path=str(path), max_length=4096, heldout_fraction=0.0, dedup_against=[])
    splits = build_splits(cfg, gpt_oss_tokenizer(), progress=False)
    ids, mask = harmony.tokenize(_conv(TOOLS_AND_THINKING).messages)
    assert [(c.input_ids, c.loss_mask) for c in splits.train] == [(ids, mask)] * 3


def test_regeneration_prompts_are_harmony_and_answers_are_read_by_channel(harmony):
    tok = gpt_oss_tokenizer()
    record = {"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "old"}]}
    answer = "<|channel|>analysis<|message|>Easy one.<|end|><|start|>assistant<|channel|>final<|message|>Paris."
    for mode in ("keep", "drop"):
        job = ConversationJob(_conv(record), tok, RegenerateConfig(reasoning=mode), harmony=harmony)
        prompt = job.next_prompt()
        assert prompt == harmony.prompt_ids([{"role": "user", "content": "Capital of France?"}])
        assert job.prompt_text.endswith("<|start|>user<|message|>Capital of France?<|end|><|start|>assistant")
        job.finish_answer(tok(answer, add_special_tokens=False)["input_ids"])
        assert job.next_prompt() is None
        reply = job.record["messages"][-1]
        assert reply["content"] == "Paris." and reply.get("reasoning_content") == (
            "Easy one." if mode == "keep" else None
        )
    assert harmony.parse_answer(tok("Just text, no channels", add_special_tokens=False)["input_ids"]) == (None, "")
    assert set(harmony.stop_ids()) == {200002, 200012}  # <|return|>, <|call|>


def test_reasoning_off_is_refused_for_harmony(harmony):
    with pytest.raises(DataError, match="Harmony format has no switch"):
        check_reasoning_setting(gpt_oss_tokenizer(), RegenerateConfig(reasoning="off"), harmony)
