"""One conversation record (ShareGPT or OpenAI format) -> a normalised `Conversation`.

Policy for bad records, decided per error class:
  * schema errors (a record that is not an object, no `conversations`/`messages` list, a turn without
    role/content keys, non-string content, an unknown role) raise `DataError`: they mean the file is
    not what the user thinks it is, and silently skipping would hide that.
  * content problems that real scraped data has in bulk (ShareGPT: conversations split mid-way that
    start with the assistant, empty turns, no assistant reply) raise `SkipRecord` with a short reason;
    callers count them per reason and print the counts.

An assistant message of an OpenAI-format record may carry `"token_ids"`: the ids the target generated
for it (`eagle-regenerate` writes them). They are kept on the normalised message, and tokenisation
uses them in place of a re-tokenisation of the text (`eagle.data.template`). A value other than a
non-empty list of non-negative integers (or null, for "none") is a schema error.

Reasoning and tools, in either format (OpenAI field names; ShareGPT dumps of tool-using models write
them the same way):
  * an assistant turn's `reasoning_content` (or `reasoning`, vLLM's newer name): its thinking, a string;
  * an assistant turn's `tool_calls`: a list of `{"type": "function", "function": {"name", "arguments"}}`
    (or the flat `{"name", "arguments"}`), arguments an object or a JSON string of one. Stored in the
    OpenAI shape with arguments as an object, which is what chat templates render;
  * `tool` turns (also `function`, `observation`, `ipython`): a tool's result, with optional
    `tool_call_id` / `name`. Results are rendered by the template as the target saw them, never run;
  * a ShareGPT `function_call` turn: an assistant turn whose value is the JSON of one call.
A malformed field is a schema error naming the record, the turn and the field. The chat template decides
how (and whether: Qwen3 drops earlier turns' thinking) each is rendered; the loss mask follows the
rendering (`eagle.data.template`), `data.train_on_reasoning` says whether thinking tokens are trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle.data.images import attach_record_images, content_parts, has_images
from eagle.errors import DataError

# Role names seen in ShareGPT-style dumps and OpenAI-style records, mapped to the three roles that
# chat templates understand.
ROLE_MAP: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
    "function_call": "assistant",  # ShareGPT tool-call turn: the value is the call's JSON
}


@dataclass
class Conversation:
    """A conversation in the toolkit's normalised form: roles are system | user | assistant.

    Each message has `role` (system | user | assistant | tool) and `content`; a user message with images also
    `parts` (its text and images in order, `eagle.data.images`); an assistant message may
    also hold `token_ids` (the ids the target generated for it), `reasoning_content` and `tool_calls`, a
    tool message `tool_call_id` and `name` (see the module docstring)."""

    id: str
    messages: list[dict[str, Any]]


class SkipRecord(Exception):
    """A record is well formed but unusable for training; `reason` is the counter key."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _text_of(content: Any, where: str) -> str:
    """A turn's text: a string, or OpenAI content parts that are all text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise DataError(
                    f"{where}: content part {str(part)[:80]!r} is not a text part "
                    "({'type': 'text', 'text': ...}) nor an image part ({'type': 'image_url', 'image_url': "
                    "{'url': PATH or data URL}}); those are the parts eagle reads"
                )
        return "".join(parts)
    raise DataError(
        f"{where}: content must be a string, got {type(content).__name__} "
        f"({str(content)[:60]!r}); fix or remove this record"
    )


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _token_ids_of(value: Any, where: str) -> list[int]:
    """An assistant message's `token_ids`: a non-empty list of non-negative ints (bools are not ids)."""
    if isinstance(value, list) and value and all(map(_is_id, value)):
        return list(value)
    if not isinstance(value, list):
        found = f"{type(value).__name__} {str(value)[:60]!r}"
    elif not value:
        found = "an empty list"
    else:
        k, bad = next((k, t) for k, t in enumerate(value) if not _is_id(t))
        found = f"element {k} = {str(bad)[:60]!r} ({type(bad).__name__})"
    raise DataError(
        f"{where}: field 'token_ids' must be a non-empty list of token ids (non-negative integers); "
        f"found {found}. Fix or drop the field (without it the content's text is tokenised)"
    )


def _reasoning_of(turn: dict[str, Any], where: str) -> str | None:
    """An assistant turn's thinking: `reasoning_content` or `reasoning` (a string; null = none)."""
    for key in ("reasoning_content", "reasoning"):
        value = turn.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise DataError(
                f"{where}: field {key!r} must be a string (the turn's thinking), got "
                f"{type(value).__name__} {str(value)[:60]!r}; fix or drop the field"
            )
        return value
    return None


def _arguments_of(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as e:
            raise DataError(
                f"{where}: 'arguments' is a string but not JSON ({e.msg}): {value[:60]!r}; a tool "
                "call's arguments must be an object or the JSON text of one"
            ) from e
    if not isinstance(value, dict):
        raise DataError(
            f"{where}: 'arguments' must be an object (or the JSON text of one), got "
            f"{type(value).__name__} {str(value)[:60]!r}"
        )
    return value


def _tool_calls_of(value: Any, where: str) -> list[dict[str, Any]]:
    """`tool_calls` in the OpenAI shape, arguments as objects (what chat templates render)."""
    if not isinstance(value, list):
        raise DataError(f"{where}: field 'tool_calls' must be a list of calls, got {type(value).__name__}")
    calls = []
    for k, call in enumerate(value):
        at = f"{where}, tool_calls[{k}]"
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise DataError(
                f"{at}: a call needs a function name: {{'type': 'function', 'function': {{'name': ..., "
                f"'arguments': {{...}}}}}} or {{'name': ..., 'arguments': ...}}; got {str(call)[:80]!r}"
            )
        out: dict[str, Any] = {
            "type": "function",
            "function": {"name": fn["name"], "arguments": _arguments_of(fn.get("arguments", {}), at)},
        }
        if isinstance(call.get("id"), str):
            out["id"] = call["id"]
        calls.append(out)
    return calls


def _message_of(
    turn: dict[str, Any], raw_role: str, content: Any, fmt_name: str, at: str, base_dir: Path | None = None
) -> dict[str, Any]:
    """A normalised message from one turn (role already checked); `base_dir`: where relative image paths are."""
    role = ROLE_MAP[raw_role.strip().lower()]
    if role == "user" and has_images(content):  # text in `content`, the ordered parts in `parts` (eagle.data.images)
        text, parts = content_parts(content, at, base_dir)
        return {"role": role, "content": text, "parts": parts}
    if raw_role.strip().lower() == "function_call":  # ShareGPT: the value is one call's JSON, no text
        try:
            call = json.loads(content) if isinstance(content, str) else content
        except json.JSONDecodeError as e:
            raise DataError(f"{at}: a 'function_call' turn's value must be a call's JSON ({e.msg})") from e
        return {"role": "assistant", "content": "", "tool_calls": _tool_calls_of([call], at)}
    message: dict[str, Any] = {"role": role, "content": _text_of(content, at) if content is not None else ""}
    if role == "assistant":
        if fmt_name == "openai" and turn.get("token_ids") is not None:
            message["token_ids"] = _token_ids_of(turn["token_ids"], at)
        if (reasoning := _reasoning_of(turn, at)) is not None:
            message["reasoning_content"] = reasoning
        if turn.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls_of(turn["tool_calls"], at)
    elif role == "tool":
        for key in ("tool_call_id", "name"):
            if turn.get(key) is not None:
                if not isinstance(turn[key], str):
                    raise DataError(
                        f"{at}: field {key!r} of a tool turn must be a string, got {type(turn[key]).__name__}"
                    )
                message[key] = turn[key]
    return message


def detect_format(record: dict[str, Any], fmt: str, where: str) -> tuple[str, str]:
    """(format, key holding the turns) for a record, per `data.format` (auto | sharegpt | openai)."""
    if fmt == "sharegpt" or (fmt == "auto" and "conversations" in record):
        key = "conversations"
    elif fmt == "openai" or (fmt == "auto" and "messages" in record):
        key = "messages"
    else:
        raise DataError(
            f"{where}: no 'conversations' (ShareGPT) or 'messages' (OpenAI) field; keys are "
            f"{sorted(map(str, record))[:10]}; convert the file or set data.format"
        )
    if key not in record:
        raise DataError(f"{where}: data.format={fmt} needs a {key!r} field; keys are {sorted(map(str, record))[:10]}")
    return ("sharegpt" if key == "conversations" else "openai"), key


def normalise_record(
    record: Any,
    *,
    index: int,
    source: str,
    fmt: str = "auto",
    system_prompt: str | None = None,
) -> Conversation:
    """Normalise one record; raise `DataError` on schema errors, `SkipRecord` on unusable content.

    `index` is the record's position in its file (used for the id when the record has none and in
    messages), `source` names the file or data set. Trailing turns after the last assistant turn are
    dropped: nothing in them is ever a training target.
    """
    where = f"{source}: record {index}"
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object with 'conversations' or 'messages', got {type(record).__name__}")
    rid = record.get("id", record.get("conversation_id"))
    if isinstance(rid, (str, int)) and not isinstance(rid, bool) and str(rid).strip():
        cid = str(rid)
        where = f"{source}: record {index} (id {cid!r})"
    else:
        cid = f"{index}"
    fmt_name, key = detect_format(record, fmt, where)
    turns = record[key]
    base_dir = Path(source).expanduser().parent if source else None  # relative image paths: beside the data file
    if not isinstance(turns, list):
        raise DataError(f"{where}: field {key!r} must be a list of turns, got {type(turns).__name__}")
    messages: list[dict[str, Any]] = []
    for j, turn in enumerate(turns):
        at = f"{where}, turn {j}"
        if not isinstance(turn, dict):
            raise DataError(f"{at}: a turn must be an object, got {type(turn).__name__}")
        # Accept either key pair in either container: many Hub sets mix them (role/content under
        # 'conversations'), and the pairs cannot be confused.
        if "from" in turn and "value" in turn:
            raw_role, content = turn["from"], turn["value"]
        elif "role" in turn and "content" in turn:
            raw_role, content = turn["role"], turn["content"]
        else:
            raise DataError(
                f"{at}: a turn needs 'from'+'value' (ShareGPT) or 'role'+'content' (OpenAI); "
                f"keys are {sorted(map(str, turn))}"
            )
        if not isinstance(raw_role, str) or raw_role.strip().lower() not in ROLE_MAP:
            raise DataError(
                f"{at}: unknown role {raw_role!r}; supported: {', '.join(sorted(ROLE_MAP))}. "
                "Filter or rename these turns"
            )
        messages.append(_message_of(turn, raw_role, content, fmt_name, at, base_dir))

    if record.get("images") is not None:  # ShareGPT / LLaVA: the record's images, `<image>` in user turns
        attach_record_images(record["images"], messages, where, base_dir)
    record_system = record.get("system")
    if record_system is not None and not isinstance(record_system, str):
        raise DataError(f"{where}: field 'system' must be a string, got {type(record_system).__name__}")
    if not any(m["role"] == "system" for m in messages):
        extra = record_system if record_system and record_system.strip() else system_prompt
        if extra:
            messages.insert(0, {"role": "system", "content": extra})
    check_messages(messages)
    return Conversation(id=cid, messages=trim_trailing(messages))


def trim_trailing(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop turns after the last assistant turn."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[: last + 1]


def _is_empty(m: dict[str, Any]) -> bool:
    """No text, no thinking and no tool call: nothing to render or train."""
    return (
        not m["content"].strip()
        and not (m.get("reasoning_content") or "").strip()
        and not m.get("tool_calls")
        and not m.get("parts")  # an image alone is a user turn's content
    )


def check_messages(messages: list[dict[str, Any]]) -> None:
    """Raise `SkipRecord` unless: optional leading system, then turns from a user turn on where a user turn
    is followed by the assistant, the assistant by the user, or (when it called tools) by tool results,
    and tool results by more results or the assistant; no empty turn; at least one assistant turn.
    Strict alternation is what most chat templates (Mistral, Gemma, Llama-2) enforce; checking it here
    turns template exceptions into counted skips."""
    if not messages:
        raise SkipRecord("empty_conversation")
    if any(_is_empty(m) for m in messages):
        raise SkipRecord("empty_turn")
    body = messages[1:] if messages[0]["role"] == "system" else messages
    if not any(m["role"] == "assistant" for m in body):
        raise SkipRecord("no_assistant_turn")
    if body[0]["role"] != "user":
        raise SkipRecord("starts_with_assistant" if body[0]["role"] == "assistant" else "misplaced_system")
    for prev, m in zip(body, body[1:], strict=False):
        if m["role"] == "system":
            raise SkipRecord("misplaced_system")
        if m["role"] == "tool":
            ok = prev["role"] == "tool" or (prev["role"] == "assistant" and bool(prev.get("tool_calls")))
            if not ok:
                raise SkipRecord("tool_result_without_call")
        elif m["role"] == "assistant" and prev["role"] not in ("user", "tool"):
            raise SkipRecord("roles_not_alternating")
        elif m["role"] == "user" and prev["role"] != "assistant":
            raise SkipRecord("roles_not_alternating")
