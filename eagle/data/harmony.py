"""gpt-oss's Harmony format through OpenAI's `openai-harmony` package: records -> ids + loss mask, prompts
for regeneration, and generated tokens -> (thinking, answer).

gpt-oss does not speak a chat template of the usual kind: every message is
`<|start|>{author}[ to={recipient}]<|channel|>{channel}[ <|constrain|>{type}]<|message|>{text}<|end|>`, an
assistant turn being one or more such messages (thinking on `analysis`, tool calls on `commentary` to
`functions.NAME`, the answer on `final`) and the last message of a training sequence ending `<|return|>`.
The package that defines the format renders it here (`data.renderer=harmony`; `auto` picks it for a
tokenizer with gpt-oss's special-token ids), so masks and prompts are the format's own, not a copy of it:
  * the sequence is `render_conversation_for_training`, which drops earlier turns' thinking as gpt-oss
    was trained to see it (the package decides which; the mask follows what it kept);
  * the mask covers what the model generates in an assistant turn: every assistant message after the
    `<|start|>assistant` that the prompt ends with (for a later message of the same turn, from its
    `<|start|>`); with `data.train_on_reasoning=false` the analysis messages' text is context only (its
    channel markers stay trained, as the chat-template path keeps `<think>` and `</think>`);
  * a record's `system` message becomes the developer message's instructions, as gpt-oss's chat template
    renders it; tool results are `functions.NAME` messages to the assistant, never run.
Stored `token_ids` of regenerated answers are not spliced in: a Harmony answer's ids hold its channel
markers, and the rendering of its text gives the same ids (the format has no free whitespace to lose).

The package needs the o200k_base vocabulary, downloaded on first use; offline, `TIKTOKEN_ENCODINGS_BASE`
names a folder that holds `o200k_base.tiktoken` (`load_encoding` says so when it is missing).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from typing import Any

from eagle.data.records import Conversation
from eagle.data.template import TemplateFailure, TokenizedConversation, fit_to_length
from eagle.errors import DataError, TargetError

# gpt-oss's special tokens at their o200k_harmony ids: a tokenizer with all of them is gpt-oss's.
HARMONY_TOKENS = {"<|return|>": 200002, "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007}
O200K_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
RENDERERS = ("auto", "chat_template", "harmony")


def is_harmony_tokenizer(tokenizer: Any) -> bool:
    """Whether `tokenizer` has gpt-oss's Harmony special tokens at their ids."""
    try:
        return all(tokenizer.convert_tokens_to_ids(t) == i for t, i in HARMONY_TOKENS.items())
    except (KeyError, TypeError, ValueError, AttributeError):
        return False


def load_encoding() -> Any:
    """openai-harmony's gpt-oss encoding; a clear error when the package or its vocabulary is missing."""
    # Imported here, not at the top: openai-harmony is optional (`pip install eagle[harmony]`).
    try:
        harmony = importlib.import_module("openai_harmony")
    except ImportError as e:
        raise TargetError(
            "data.renderer=harmony renders gpt-oss's Harmony format with the openai-harmony package, which is "
            "not installed: pip install openai-harmony (or eagle[harmony]), or use data.renderer=chat_template"
        ) from e
    try:
        return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as e:  # HarmonyError: the vocabulary could not be read or downloaded
        raise TargetError(
            f"openai-harmony could not load gpt-oss's vocabulary ({e}). Offline, download {O200K_URL} "
            f"(sha256 {O200K_SHA256}) into a folder and set TIKTOKEN_ENCODINGS_BASE to that folder"
        ) from e


class HarmonyRenderer:
    """Records rendered in the Harmony format by openai-harmony (module docstring)."""

    def __init__(self, encoding: Any) -> None:
        self.encoding = encoding
        self.harmony = importlib.import_module("openai_harmony")
        self.head = len(encoding.encode("<|start|>assistant", allowed_special="all"))  # a turn's prompt tail
        self.message_token = encoding.encode("<|message|>", allowed_special="all")[0]

    def messages(self, messages: list[dict[str, Any]]) -> list[Any]:
        """Our normalised messages -> Harmony messages, with the system message gpt-oss always gets."""
        h = self.harmony
        out = [h.Message.from_role_and_content(h.Role.SYSTEM, h.SystemContent.new())]
        calls: dict[str, str] = {}  # tool_call_id -> function name, for results that name only the call
        for k, m in enumerate(messages):
            role = m["role"]
            if role == "system":
                out.append(
                    h.Message.from_role_and_content(
                        h.Role.DEVELOPER, h.DeveloperContent.new().with_instructions(m["content"])
                    )
                )
            elif role == "user":
                out.append(h.Message.from_role_and_content(h.Role.USER, m["content"]))
            elif role == "assistant":
                out += self._assistant(m, calls)
            elif role == "tool":
                name = m.get("name") or calls.get(m.get("tool_call_id", ""))
                if not name:
                    raise TemplateFailure(f"message {k}: a tool result names no function (no 'name', no known call id)")
                author = h.Author.new(h.Role.TOOL, f"functions.{name}")
                msg = h.Message.from_author_and_content(author, m["content"])
                out.append(msg.with_channel("commentary").with_recipient("assistant"))
        return out

    def _assistant(self, m: dict[str, Any], calls: dict[str, str]) -> list[Any]:
        """One assistant turn: thinking (analysis), tool calls (commentary to functions.NAME), answer (final;
        beside tool calls, a commentary preamble)."""
        h, out = self.harmony, []

        def say(text: str, channel: str) -> Any:
            return h.Message.from_role_and_content(h.Role.ASSISTANT, text).with_channel(channel)

        if m.get("reasoning_content"):
            out.append(say(m["reasoning_content"], "analysis"))
        tool_calls = m.get("tool_calls") or []
        if m.get("content") or not tool_calls:
            out.append(say(m.get("content", ""), "commentary" if tool_calls else "final"))
        for call in tool_calls:
            fn = call["function"]
            if isinstance(call.get("id"), str):
                calls[call["id"]] = fn["name"]
            msg = say(json.dumps(fn["arguments"], ensure_ascii=False), "commentary")
            out.append(msg.with_recipient(f"functions.{fn['name']}").with_content_type("<|constrain|>json"))
        return out

    def tokenize(self, messages: list[dict[str, Any]], train_on_reasoning: bool = True) -> tuple[list[int], list[int]]:
        """(ids, loss mask) of a conversation rendered for training; TemplateFailure if it cannot be."""
        h = self.harmony
        harmony_messages = self.messages(messages)
        try:
            ids = list(self.encoding.render_conversation_for_training(h.Conversation.from_messages(harmony_messages)))
        except Exception as e:  # HarmonyError: e.g. a conversation that does not end with an assistant turn
            raise TemplateFailure(f"openai-harmony cannot render it: {e}") from e
        mask = [0] * len(ids)
        pos, after_assistant = 0, False
        for msg in harmony_messages:
            piece = list(self.encoding.render(msg))
            at_end = pos + len(piece) == len(ids)
            if ids[pos : pos + len(piece)] != piece and not (at_end and ids[pos : pos + len(piece) - 1] == piece[:-1]):
                if msg.channel == "analysis":  # thinking the format drops from earlier turns
                    continue
                raise TemplateFailure("openai-harmony's rendering does not match its messages one by one")
            is_assistant = msg.author.role == h.Role.ASSISTANT
            if is_assistant:  # the turn's first message starts after the prompt's `<|start|>assistant`
                start = pos if after_assistant else pos + self.head
                mask[start : pos + len(piece)] = [1] * (pos + len(piece) - start)
                if msg.channel == "analysis" and not train_on_reasoning:  # the thinking's text is context
                    text_start = pos + piece.index(self.message_token) + 1
                    mask[text_start : pos + len(piece) - 1] = [0] * (pos + len(piece) - 1 - text_start)
            after_assistant = is_assistant
            pos += len(piece)
        if pos != len(ids):
            raise TemplateFailure("openai-harmony rendered tokens that belong to no message")
        return ids, mask

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The conversation so far, ready for the assistant's next message (ending `<|start|>assistant`)."""
        h = self.harmony
        conversation = h.Conversation.from_messages(self.messages(messages))
        return list(self.encoding.render_conversation_for_completion(conversation, h.Role.ASSISTANT))

    def parse_answer(self, tokens: list[int]) -> tuple[str | None, str]:
        """(thinking, answer) of generated tokens (after the prompt's `<|start|>assistant`, stop token
        excluded): the analysis messages' text and the final message's; ('', '') for tokens that are not
        Harmony (the caller ends the conversation, as for an empty answer)."""
        h = self.harmony
        try:
            parsed = self.encoding.parse_messages_from_completion_tokens(list(tokens), h.Role.ASSISTANT)
        except Exception:  # HarmonyError: the target did not answer in the format
            return None, ""
        text: dict[str, list[str]] = {"analysis": [], "final": []}
        for msg in parsed:
            if msg.channel in text:
                text[msg.channel].append("".join(c.text for c in msg.content))
        thinking = "\n".join(text["analysis"]).strip() or None
        return thinking, "".join(text["final"]).strip()

    def stop_ids(self) -> list[int]:
        """Tokens that end an assistant's turn: `<|return|>` (answered) and `<|call|>` (calls a tool)."""
        return list(self.encoding.stop_tokens_for_assistant_actions())


def tokenize_harmony(
    conv: Conversation, renderer: HarmonyRenderer, max_length: int, overflow: str, train_on_reasoning: bool = True
) -> tuple[TokenizedConversation | None, str | None]:
    """`eagle.data.template.tokenize_with_reason` for the Harmony renderer: the conversation or why it was
    dropped ('too_long' with overflow=drop, 'empty_loss_mask', 'template_error')."""
    try:
        ids, mask = renderer.tokenize(conv.messages, train_on_reasoning)
    except TemplateFailure:
        return None, "template_error"
    return fit_to_length(TokenizedConversation(conv.id, ids, mask, False), max_length, overflow)


def renderer_for(choice: str, tokenizer: Any) -> HarmonyRenderer | None:
    """`data.renderer`: the Harmony renderer, or None for the tokenizer's chat template. `auto` is Harmony for
    gpt-oss's tokenizer when openai-harmony is installed (otherwise gpt-oss's own chat template, which renders
    the same format as text, with a note); `harmony` insists and fails by name."""
    if choice not in RENDERERS:
        raise DataError(f"data.renderer={choice!r} is not one of {', '.join(RENDERERS)}")
    if choice == "chat_template":
        return None
    if not is_harmony_tokenizer(tokenizer):
        if choice == "harmony":
            raise DataError(
                "data.renderer=harmony needs gpt-oss's tokenizer (o200k_harmony: <|channel|> = 200005, "
                "<|start|> = 200006); this target's tokenizer has other ids: use data.renderer=chat_template"
            )
        return None
    if choice == "auto" and importlib.util.find_spec("openai_harmony") is None:
        print(
            "data: note: gpt-oss tokenizer without the openai-harmony package; rendering with its chat template "
            "(pip install openai-harmony to render with the format's own library)",
            flush=True,
        )
        return None
    return HarmonyRenderer(load_encoding())
