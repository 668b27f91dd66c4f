"""One conversation replayed turn by turn (`ConversationJob`): each assistant turn replaced by the target's
answer to the regenerated history before it, its thinking kept apart, dropped or not asked for
(`regenerate.reasoning`), tool-calling turns and results replayed verbatim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eagle.config import RegenerateConfig
from eagle.data.harmony import HarmonyRenderer
from eagle.data.records import Conversation
from eagle.data.template import TemplateFailure, render
from eagle.decode.continuous import Job
from eagle.errors import DataError

THINK_END = "</think>"  # where a reasoning model's thinking ends (Qwen3, DeepSeek-R1, ...)
# gpt-oss's Harmony format: thinking on the analysis channel, the answer on the final one (special tokens,
# so read from the text decoded with them).
HARMONY_ANALYSIS = "<|channel|>analysis<|message|>"
HARMONY_FINAL = "<|channel|>final<|message|>"
HARMONY_END = ("<|end|>", "<|return|>", "<|call|>")


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(thinking, answer) of a generated text: thinking is what comes before the first `</think>` (an
    opening `<think>` removed), None when there is none."""
    if THINK_END not in text:
        return None, text
    thinking, answer = text.split(THINK_END, 1)
    return thinking.replace("<think>", "", 1).strip(), answer.strip()


def split_harmony(text: str) -> tuple[str | None, str] | None:
    """(thinking, answer) of a Harmony generation (text decoded with its special tokens): the analysis
    channel's messages and the final channel's; None when `text` has no final channel (not Harmony)."""
    if HARMONY_FINAL not in text:
        return None

    def message(part: str) -> str:
        for end in HARMONY_END:
            part = part.split(end, 1)[0]
        return part.strip()

    head, final = text.rsplit(HARMONY_FINAL, 1)
    analysis = [message(p) for p in head.split(HARMONY_ANALYSIS)[1:]]
    return ("\n\n".join(a for a in analysis if a) or None), message(final)


def check_reasoning_setting(tokenizer: Any, cfg: RegenerateConfig, harmony: HarmonyRenderer | None = None) -> None:
    """regenerate.reasoning=off needs a template with a thinking switch; refused at start otherwise."""
    if cfg.reasoning == "off" and harmony is not None:
        raise DataError(
            "regenerate.reasoning=off: gpt-oss's Harmony format has no switch that turns its thinking off (only "
            "its reasoning effort); use regenerate.reasoning=drop to leave the thinking out of the records"
        )
    template = getattr(tokenizer, "chat_template", None) or ""
    if cfg.reasoning == "off" and "enable_thinking" not in template:
        raise DataError(
            f"regenerate.reasoning=off renders prompts with enable_thinking=False, but the chat "
            f"template of {getattr(tokenizer, 'name_or_path', 'the target')!r} has no such switch "
            "(no 'enable_thinking' in it); use regenerate.reasoning=keep or drop"
        )


class ConversationJob(Job):
    """One conversation replayed turn by turn: each assistant turn is replaced by the target's answer
    to the regenerated history before it. `on_done(record)` is called once, when nothing is left.

    `next_prompt()` gives the next turn's prompt ids (its text stays in `prompt_text`); the answer comes
    back as tokens (`finish_answer`) or as text (`finish_text`, from a server that returns no ids).
    Asking for the same turn again (after a server failed) renders the same prompt. With `harmony` (gpt-oss,
    `data.renderer`), prompts are rendered and answers read by openai-harmony instead of the chat template."""

    def __init__(
        self,
        conversation: Conversation,
        tokenizer: Any,
        cfg: RegenerateConfig,
        on_done: Callable[[dict[str, Any]], None] | None = None,
        harmony: HarmonyRenderer | None = None,
    ) -> None:
        self.id = conversation.id
        self.tokenizer, self.cfg, self.on_done, self.harmony = tokenizer, cfg, on_done, harmony
        self.pending = list(conversation.messages)  # turns still to replay
        self.history: list[dict[str, Any]] = []  # the regenerated conversation so far
        self.token_ids: dict[int, list[int]] = {}  # history index of an answer -> its generated ids, where kept
        self.prompt_text = ""  # the rendered prompt of the last `next_prompt()`
        self.answered = 0
        self.record: dict[str, Any] | None = None

    def next_prompt(self) -> list[int] | None:
        # Turns that are not answers to regenerate join the history as they are: user and tool turns, and
        # the source's tool-calling turns (the target's own call could differ, and nothing runs a tool to
        # answer it; the source's results answer the source's calls).
        while self.pending and (self.pending[0]["role"] != "assistant" or self.pending[0].get("tool_calls")):
            self.history.append(self.pending.pop(0))
        ids: list[int] = []
        if (
            self.pending
            and self.history
            and self.history[-1]["role"] in ("user", "tool")
            and (self.cfg.max_turns is None or self.answered < self.cfg.max_turns)
        ):
            try:
                ids = self._render_prompt()
            except TemplateFailure:
                ids = []
            # A longer prompt ends the conversation here: training truncates at data.max_length anyway.
            ids = ids if len(ids) <= self.cfg.max_prompt_tokens else []
        if ids:
            return ids
        self._finish()
        return None

    def _render_prompt(self) -> list[int]:
        """The history's prompt ids, ready for the answer (its text kept in `prompt_text`)."""
        if self.harmony is not None:
            ids = self.harmony.prompt_ids(self.history)
            self.prompt_text = self.tokenizer.decode(ids, skip_special_tokens=False)
            return ids
        switch = {"enable_thinking": False} if self.cfg.reasoning == "off" else {}
        self.prompt_text = render(self.tokenizer, self.history, add_generation_prompt=True, **switch)
        return list(self.tokenizer(self.prompt_text, add_special_tokens=False)["input_ids"])

    def finish_answer(self, tokens: list[int], keep_ids: bool = True) -> None:
        """The answer as generated token ids (stop token excluded); `keep_ids` stores them in the record
        beside the text, so that training reads the ids the target generated (`eagle.data.template`).
        A Harmony answer (gpt-oss) is split by its channels, which are special tokens."""
        if self.harmony is not None:
            self._answer(*self.harmony.parse_answer(tokens), None)
            return
        harmony = split_harmony(self.tokenizer.decode(tokens, skip_special_tokens=False))
        if harmony is not None:
            self._answer(harmony[0], harmony[1], None)  # its ids hold the channel markers too
            return
        self.finish_text(self.tokenizer.decode(tokens, skip_special_tokens=True), list(tokens) if keep_ids else None)

    def finish_text(self, text: str, token_ids: list[int] | None = None) -> None:
        """The answer as text (the ids' decoding, special tokens skipped), with its ids where known."""
        thinking, reply = split_harmony(text) or split_reasoning(text.strip())
        self._answer(thinking, reply, token_ids if thinking is None else None)

    def _answer(self, thinking: str | None, reply: str, token_ids: list[int] | None) -> None:
        """Replace the pending answer by the target's: its reply, its thinking as regenerate.reasoning says, its
        ids where they stand for the reply alone."""
        self.pending.pop(0)  # the original answer is replaced
        message: dict[str, Any] = {"role": "assistant", "content": reply}
        if thinking is not None and self.cfg.reasoning == "keep":
            message["reasoning_content"] = thinking
        if reply:
            self.history.append(message)
            if token_ids is not None:
                self.token_ids[len(self.history) - 1] = token_ids
            self.answered += 1
        else:
            self.pending = []  # stop this conversation here; the reader counts it if nothing is left

    def _finish(self) -> None:
        if self.record is not None:
            return
        h = self.history
        last = max((k for k, m in enumerate(h) if m["role"] == "assistant"), default=None)
        # A trailing user turn without a reply is no training data. With no reply at all the record
        # keeps its prompt: its id marks it done for resuming and the reader counts it as skipped.
        kept = h[: last + 1] if last is not None else h
        # The ids sit beside the text they decode to; readers keep them, and tokenisation uses them.
        messages = [{**m, "token_ids": self.token_ids[k]} if k in self.token_ids else m for k, m in enumerate(kept)]
        self.record = {"id": self.id, "messages": messages}
        if self.on_done is not None:
            self.on_done(self.record)


def first_turn_prompt(tokenizer: Any, conversation: Conversation, harmony: HarmonyRenderer | None = None) -> list[int]:
    """Prompt ids of the conversation up to its first user turn, ready for the answer ([] if the
    chat template cannot render it)."""
    turns = []
    for m in conversation.messages:
        turns.append(m)
        if m["role"] == "user":
            break
    try:
        if harmony is not None:
            return harmony.prompt_ids(turns)
        return list(
            tokenizer(render(tokenizer, turns, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        )
    except TemplateFailure:
        return []
