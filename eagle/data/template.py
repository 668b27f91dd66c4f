"""Chat-template rendering and the assistant loss mask, derived from the template itself.

No per-family strings or offsets: for assistant turn i the template renders
    P_i = messages[:i]   with add_generation_prompt=True   (what the model sees before it answers)
    F_i = messages[:i+1] without a generation prompt       (the same history plus the answer)
and the answer is F_i[len(P_i):] -- the content plus whatever the template emits around it (a
think block, the end-of-turn token). The span ends after the last special token of that tail, so
`<|im_end|>`, `<|eot_id|>`, `</s>`, `<end_of_turn>` are learnt (the model must learn to stop) but
the newline a template puts between turns is not. This is exact when the template is
prefix-consistent (P_i prefixes F_i, and F_i prefixes the full rendering). Templates that rewrite
history (e.g. Qwen3 dropping earlier think blocks) fail that check; then the turn's content is
located in the full rendering by search and masked together with the special tokens right after
it, and the turn is counted as a fallback.

Character spans become token masks through the fast tokenizer's offsets (a token is an answer
token when it starts inside the span), or, for tokenizers without offsets, by tokenising the text
piecewise at span boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle.data.records import Conversation
from eagle.errors import TargetError


@dataclass
class TokenizedConversation:
    """A rendered conversation: token ids and a mask that is 1 on tokens the assistant produced."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 = assistant token (a training target), 0 = prompt / template glue
    truncated: bool
    fallback_turns: int = 0  # assistant turns located by search (template not prefix-consistent)


class TemplateFailure(Exception):
    """The template raised on this conversation (e.g. it rejects a role); counted as a skip."""


def require_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise TargetError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; give one with "
            "target.chat_template='<jinja string>' or target.chat_template=PATH/TO/template.jinja"
        )


def render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """The chat template's text for `messages` (no tokenisation)."""
    require_chat_template(tokenizer)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except TargetError:
        raise
    except Exception as e:  # jinja's TemplateError from raise_exception(), or anything a template does
        raise TemplateFailure(f"chat template failed: {e}") from e
    if not isinstance(text, str):
        raise TemplateFailure(f"chat template returned {type(text).__name__}, not text")
    return text


def special_token_strings(tokenizer: Any) -> list[str]:
    """Special-token texts, longest first (so a longer token wins a prefix match)."""
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok.content))
    return sorted((s for s in specials if s), key=len, reverse=True)


def _end_of_tail(tail: str, specials: list[str]) -> int:
    """Length of the part of `tail` (text after the content) that belongs to the answer: through the
    last special token, or all of it if the template ends turns without a special token."""
    end = -1
    for s in specials:
        k = tail.rfind(s)
        if k >= 0:
            end = max(end, k + len(s))
    return end if end >= 0 else len(tail)


def _specials_right_after(text: str, pos: int, specials: list[str]) -> int:
    """Position after the run of special tokens starting exactly at `pos`."""
    moved = True
    while moved:
        moved = False
        for s in specials:
            if text.startswith(s, pos):
                pos += len(s)
                moved = True
                break
    return pos


def assistant_char_spans(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]], int]:
    """(full rendering, character spans of the assistant answers, number of fallback turns)."""
    full = render(tokenizer, messages, add_generation_prompt=False)
    specials = special_token_strings(tokenizer)
    spans: list[tuple[int, int]] = []
    fallbacks = 0
    cursor = 0  # search start for fallback turns, so repeated contents map to successive turns
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            # Step the fallback search past this turn, so an answer that repeats the question
            # is found after it, not inside it.
            k = full.find(m["content"].strip(), cursor)
            cursor = k + len(m["content"].strip()) if k >= 0 else cursor
            continue
        content = m["content"].strip()  # templates often trim; the stripped text must still appear
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        found = upto.rfind(content, len(prompt)) if upto.startswith(prompt) else -1
        if found >= 0 and full.startswith(upto):
            content_end = found + len(content)
            end = content_end + _end_of_tail(upto[content_end:], specials)
            spans.append((len(prompt), end))
            cursor = end
            continue
        fallbacks += 1
        found = full.find(content, cursor)
        if found < 0:
            continue  # the template rewrote the content: this turn stays unmasked (and is counted)
        end = _specials_right_after(full, found + len(content), specials)
        spans.append((found, end))
        cursor = end
    return full, spans, fallbacks


def _mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    mask = [0] * len(offsets)
    k = 0
    for j, (start, _end) in enumerate(offsets):
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        if k < len(spans) and spans[k][0] <= start < spans[k][1]:
            mask[j] = 1
    return mask


def tokenize_with_mask(tokenizer: Any, text: str, spans: list[tuple[int, int]],
                       use_offsets: bool | None = None) -> tuple[list[int], list[int]]:
    """Token ids of `text` and a 0/1 mask of the tokens that start inside `spans` (sorted, disjoint)."""
    if use_offsets is None:
        use_offsets = bool(getattr(tokenizer, "is_fast", False))
    if use_offsets:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        return ids, _mask_from_offsets([tuple(o) for o in enc["offset_mapping"]], spans)
    # No offsets: tokenise the pieces between span boundaries separately. A token can then never
    # straddle a boundary, which is also how the prompt and the answer are split at inference.
    ids: list[int] = []
    mask: list[int] = []
    pos = 0
    for start, end in spans:
        for piece, flag in ((text[pos:start], 0), (text[start:end], 1)):
            if piece:
                piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids.extend(piece_ids)
                mask.extend([flag] * len(piece_ids))
        pos = end
    if text[pos:]:
        tail = tokenizer(text[pos:], add_special_tokens=False)["input_ids"]
        ids.extend(tail)
        mask.extend([0] * len(tail))
    return ids, mask


_CUT_MARGIN_TOKENS = 64  # tokens tokenised past max_length, so the cut of the text never shows in the kept part


def tokenize_with_reason(
    conv: Conversation, tokenizer: Any, max_length: int, overflow: str, use_offsets: bool | None = None
) -> tuple[TokenizedConversation | None, str | None]:
    """Like `tokenize_conversation`, also saying why a conversation was dropped:
    'too_long' (overflow=drop), 'empty_loss_mask', or 'template_error'."""
    try:
        text, spans, fallbacks = assistant_char_spans(tokenizer, conv.messages)
    except TemplateFailure:
        return None, "template_error"
    # ShareGPT turns run to 100k characters; with max_length in the thousands most of that text is
    # cut anyway. Tokenise a prefix of the text that yields a margin of tokens past max_length (a cut
    # only changes tokens of the last word), doubling it while it is short, instead of everything.
    limit = max_length + _CUT_MARGIN_TOKENS
    n_chars = 8 * limit
    while True:
        piece = text if n_chars >= len(text) else text[:n_chars]
        ids, mask = tokenize_with_mask(tokenizer, piece, spans, use_offsets)
        if piece is text or len(ids) > limit:
            break
        n_chars *= 2
    truncated = len(ids) > max_length
    if truncated:
        if overflow == "drop":
            return None, "too_long"
        ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        return None, "empty_loss_mask"
    return TokenizedConversation(conv.id, ids, mask, truncated, fallbacks), None


def tokenize_conversation(
    conv: Conversation, tokenizer: Any, max_length: int, overflow: str
) -> TokenizedConversation | None:
    """Render `conv` with the tokenizer's chat template and mask the assistant tokens.

    Returns None when the conversation is dropped: longer than `max_length` with overflow='drop',
    no assistant token left (e.g. truncated before the first answer), or the template rejected it.
    `eagle.data.dataset.build_splits` counts each case.
    """
    if overflow not in ("truncate", "drop"):
        raise ValueError(f"overflow={overflow!r} is not one of truncate, drop")
    return tokenize_with_reason(conv, tokenizer, max_length, overflow)[0]


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """Token ids the template emits right after an assistant answer (plus eos): generation stops on them."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ids: list[int] = []
    try:
        text, spans, _ = assistant_char_spans(tokenizer, probe)
        if spans:
            content_end = text.find("Hello", spans[0][0]) + len("Hello")
            tail = text[content_end:spans[0][1]]
            ids = list(tokenizer(tail, add_special_tokens=False)["input_ids"]) if tail else []
            specials = set(special_token_strings(tokenizer))
            ids = [t for t in ids if tokenizer.convert_ids_to_tokens(t) in specials]
    except TemplateFailure:
        ids = []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
