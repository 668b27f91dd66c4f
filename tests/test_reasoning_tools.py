"""Reasoning and tool calls through records, loss masks and regeneration, rendered by the real Qwen3 chat
template (tests/data/qwen3_chat_template.jinja): thinking trained or not (`data.train_on_reasoning`), earlier
turns' thinking dropped where the template drops it, tool calls trained, tool results never, and
`regenerate.reasoning=keep|drop|off`."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle.config import RegenerateConfig
from eagle.data.records import normalise_record
from eagle.data.template import render, tokenize_conversation
from eagle.errors import DataError
from eagle.regenerate.job import ConversationJob, check_reasoning_setting, split_reasoning
from tests.tiny_models import make_tokenizer

QWEN3_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()

TOOL_RECORD = {
    "id": "tools",
    "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should call the weather tool.",
            "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "content": "sunny, 18 degrees"},
        {"role": "assistant", "content": "It is sunny and 18 degrees.", "reasoning_content": "Report the result."},
    ],
}
TWO_TURNS = {
    "id": "two",
    "messages": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue.", "reasoning_content": "Any colour will do."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Green.", "reasoning_content": "Not blue again."},
    ],
}


@pytest.fixture(scope="module")
def qwen3_tok():
    tok = make_tokenizer("qwen3")
    tok.chat_template = QWEN3_TEMPLATE
    return tok


def _trained_text(tok, record, train_on_reasoning=True) -> tuple[str, str]:
    conv = normalise_record(record, index=0, source="t.jsonl")
    tc = tokenize_conversation(conv, tok, 4096, "truncate", train_on_reasoning=train_on_reasoning)
    trained = tok.decode([t for t, m in zip(tc.input_ids, tc.loss_mask, strict=True) if m])
    return tok.decode(tc.input_ids), trained


def test_thinking_and_tool_calls_are_trained_tool_results_are_not(qwen3_tok):
    full, trained = _trained_text(qwen3_tok, TOOL_RECORD)
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>' in full
    assert "<tool_response>\nsunny, 18 degrees\n</tool_response>" in full
    for text in (
        "I should call the weather tool.",
        '"name": "weather"',
        "Report the result.",
        "It is sunny and 18 degrees.<|im_end|>",
    ):
        assert text in trained, text
    assert "sunny, 18 degrees" not in trained and "What is the weather" not in trained


def test_train_on_reasoning_false_keeps_the_thinking_out_of_the_loss_only(qwen3_tok):
    full, trained = _trained_text(qwen3_tok, TOOL_RECORD, train_on_reasoning=False)
    assert "I should call the weather tool." in full and "Report the result." in full  # still in the context
    assert "I should call the weather tool." not in trained and "Report the result." not in trained
    assert '"name": "weather"' in trained and "It is sunny and 18 degrees." in trained


def test_earlier_turns_thinking_is_rendered_as_the_template_renders_it(qwen3_tok):
    """Qwen3 drops the thinking of turns before the last user turn: it is neither in the ids nor trained;
    the answer of that turn still is (located in the rendering by search)."""
    full, trained = _trained_text(qwen3_tok, TWO_TURNS)
    assert "Any colour will do." not in full and "Not blue again." in trained
    assert "Blue.<|im_end|>" in trained and "Green.<|im_end|>" in trained


def test_split_reasoning():
    assert split_reasoning("<think>\nLet me see.\n</think>\n\nFour.") == ("Let me see.", "Four.")
    assert split_reasoning("Let me see.</think>Four.") == ("Let me see.", "Four.")  # template opened <think>
    assert split_reasoning("Four.") == (None, "Four.")


def _replay(tok, record, mode, answer):
    job = ConversationJob(normalise_record(record, index=0, source="t.jsonl"), tok, RegenerateConfig(reasoning=mode))
    prompts = []
    while job.next_prompt() is not None:
        prompts.append(job.prompt_text)
        job.finish_text(answer)
    return job.record, prompts


@pytest.mark.parametrize("mode", ["keep", "drop"])
def test_regenerated_thinking_is_kept_apart_or_dropped(qwen3_tok, mode):
    record, prompts = _replay(qwen3_tok, TWO_TURNS, mode, "<think>\nSome thought.\n</think>\n\nRed.")
    answers = [m for m in record["messages"] if m["role"] == "assistant"]
    assert [m["content"] for m in answers] == ["Red.", "Red."] and len(prompts) == 2
    assert all("token_ids" not in m for m in answers)  # a split answer keeps no ids
    assert all(("reasoning_content" in m) == (mode == "keep") for m in answers)
    if mode == "keep":
        assert answers[0]["reasoning_content"] == "Some thought."


def test_reasoning_off_renders_the_templates_switch_and_is_refused_without_one(qwen3_tok):
    _, prompts = _replay(qwen3_tok, TWO_TURNS, "off", "Red.")
    assert all(p.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for p in prompts)
    check_reasoning_setting(qwen3_tok, RegenerateConfig(reasoning="off"))
    with pytest.raises(DataError, match="regenerate.reasoning=off.*enable_thinking"):
        check_reasoning_setting(make_tokenizer("llama"), RegenerateConfig(reasoning="off"))


def test_tool_calls_and_results_are_replayed_never_run(qwen3_tok):
    record, prompts = _replay(qwen3_tok, TOOL_RECORD, "keep", "It is sunny.")
    roles = [m["role"] for m in record["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"] and len(prompts) == 1
    assert record["messages"][1] == normalise_record(TOOL_RECORD, index=0, source="t").messages[1]  # verbatim
    assert record["messages"][3]["content"] == "It is sunny."
    assert "<tool_response>\nsunny, 18 degrees\n</tool_response>" in prompts[0]  # the answer saw the result
    assert render(qwen3_tok, record["messages"], add_generation_prompt=False).count("<tool_call>") == 1


def test_harmony_channels_split_into_thinking_and_answer():
    """gpt-oss answers on channels (special tokens): analysis is the thinking, final the answer."""
    from eagle.regenerate.job import split_harmony

    text = "<|channel|>analysis<|message|>Think first.<|end|><|start|>assistant<|channel|>final<|message|>Paris."
    assert split_harmony(text) == ("Think first.", "Paris.")
    assert split_harmony("<|channel|>final<|message|>Paris.<|return|>") == (None, "Paris.")
    assert split_harmony("Paris.") is None


def test_gpt_oss_answers_keep_their_analysis_channel_as_thinking_and_render_it():
    tok = make_tokenizer("gpt_oss")
    generated = "<|channel|>analysis<|message|>Blue is common.<|end|><|start|>assistant<|channel|>final<|message|>Blue."
    ids = tok(generated, add_special_tokens=False)["input_ids"]
    job = ConversationJob(normalise_record(TWO_TURNS, index=0, source="t"), tok, RegenerateConfig(reasoning="keep"))
    while job.next_prompt() is not None:
        job.finish_answer(ids)
    answers = [m for m in job.record["messages"] if m["role"] == "assistant"]
    assert [(m["content"], m["reasoning_content"]) for m in answers] == [("Blue.", "Blue is common.")] * 2
    assert all("token_ids" not in m for m in answers)
    full, trained = _trained_text(tok, job.record)
    assert full.count("<|channel|>analysis<|message|>Blue is common.<|end|>") == 1  # the last turn's only
    assert "Blue is common." in trained and trained.count("Blue.") >= 2
