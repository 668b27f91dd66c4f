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

Stored token ids. An assistant message may hold `token_ids`: the ids the target generated for it
(`eagle-regenerate` writes them). Re-tokenising the answer's text often gives other ids (the record's
content is stripped of whitespace the target generated; BPE splits a decoded text canonically, not as
the target sampled it), so the ids win: they replace the tokens of the answer's text (`_plan_splices`).
  * The ids must decode (special tokens skipped, stripped) to the message's content; otherwise they
    are not this answer's (an edited text, another tokenizer's ids) and the turn's text is tokenised.
  * On a turn located exactly, the replaced text runs from the end of the prompt (where the target
    started generating) to the template's end-of-turn token, when what the template renders there
    besides the content is whitespace (Llama-2's ' ' before the answer) or is in the ids too (a think
    block the target generated): the turn is then prompt + ids + end-of-turn, as it was generated.
    Otherwise (and on a turn located by search, where the ids must then be the content alone) only
    the content's text is replaced; the template's text around it stays.
  * Whitespace the record stripped comes back with the ids: an answer cut at max_new_tokens after a
    newline ends `...\n<|im_end|>` where the template renders `...<|im_end|>`. The template's tokens
    after it (end of turn, next turn) stay as rendered. The next answer was generated after a prompt
    holding the stripped text, so its context here differs from the one the target saw by that
    whitespace; kept so because the masked tokens must be what the target generated, and capture runs
    the target over this very sequence (features and labels agree).
  * Token boundaries: the rendering is tokenised whole, as without ids, and the tokens of the replaced
    text (by offsets) are swapped for the ids; the mask covers the ids as it covered those tokens. A
    token straddling the start (template text and answer merged) is re-tokenised as its template part
    alone, as the prompt was when the target answered, where the tokenizer gives that token for its
    text alone (no prepended space or normalisation). A token straddling the end, or a failed check,
    leaves that turn's text tokenised and counted (`id_fallback_turns`), never a wrong splice. Without
    offsets (slow tokenizers) the pieces between boundaries are tokenised apart, as for the mask.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from eagle.data.images import (
    image_size,
    keep_whole_images,
    message_images,
    open_image,
    template_content,
)
from eagle.data.records import Conversation
from eagle.errors import DataError, TargetError
from eagle.target.multimodal import VisionInputs, VisionProcessor, load_vision_processor


@dataclass
class TokenizedConversation:
    """A rendered conversation: token ids and a mask that is 1 on tokens the assistant produced."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 = assistant token (a training target), 0 = prompt / template glue
    truncated: bool
    fallback_turns: int = 0  # assistant turns located by search (template not prefix-consistent)
    id_turns: int = 0  # assistant turns whose stored token_ids replaced their text's tokens
    id_fallback_turns: int = 0  # assistant turns with token_ids whose text was tokenised instead (see module doc)
    images: tuple[str, ...] = ()  # the images of a vision-language target's conversation, in order (eagle.data.images)


class TemplateFailure(Exception):
    """The template raised on this conversation (e.g. it rejects a role); counted as a skip."""


def require_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise TargetError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; give one with "
            "target.chat_template='<jinja string>' or target.chat_template=PATH/TO/template.jinja"
        )


# What the template renders of a message (eagle.data.records); stored token ids are spliced in afterwards.
RENDERED_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")


def render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, **template_kwargs: Any) -> str:
    """The chat template's text for `messages` (no tokenisation); `template_kwargs` go to the template
    (e.g. enable_thinking=False)."""
    require_chat_template(tokenizer)
    # gpt-oss's template reads a turn's thinking as `thinking`, Qwen3's and most others' as `reasoning_content`.
    messages = [
        {
            **{k: m[k] for k in RENDERED_KEYS if k in m},
            **({"thinking": m["reasoning_content"]} if "reasoning_content" in m else {}),
            **({"content": template_content(m)} if "parts" in m else {}),  # text and image parts, in order
        }
        for m in messages
    ]
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
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


@dataclass(frozen=True)
class _Answer:
    """Where assistant message `index` sits in the full rendering (character positions)."""

    index: int
    span: tuple[int, int]  # the masked text: answer, template text around it, end-of-turn tokens
    content: tuple[int, int]  # the (stripped) content
    exact: bool  # located through its prompt (span[0] is where the target started generating), not by search
    end_of_turn: int  # where the special tokens after the content start (the content's end if none follow)


def _locate_answers(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[str, list[_Answer], int]:
    """(full rendering, where each located assistant answer is, number of fallback turns)."""
    full = render(tokenizer, messages, add_generation_prompt=False)
    specials = special_token_strings(tokenizer)
    answers: list[_Answer] = []
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
        if not content and found >= 0 and full.startswith(upto):
            # No text (a turn that only calls tools): the answer is all the template rendered for it.
            end = len(prompt) + _end_of_tail(upto[len(prompt) :], specials)
            answers.append(_Answer(i, (len(prompt), end), (end, end), True, end))
            cursor = end
            continue
        if found >= 0 and full.startswith(upto):
            content_end = found + len(content)
            end = content_end + _end_of_tail(upto[content_end:], specials)
            eot = min((k for sp in specials if (k := upto.find(sp, content_end, end)) >= 0), default=content_end)
            answers.append(_Answer(i, (len(prompt), end), (found, content_end), True, eot))
            cursor = end
            continue
        fallbacks += 1
        found = full.find(content, cursor) if content else -1
        if found < 0:
            continue  # the template rewrote the content (or it has none): this turn stays unmasked (and is counted)
        end = _specials_right_after(full, found + len(content), specials)
        answers.append(_Answer(i, (found, end), (found, found + len(content)), False, found + len(content)))
        cursor = end
    return full, answers, fallbacks


def without_reasoning(text: str, answers: list[_Answer], messages: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """The answers' spans with each turn's rendered thinking (its `reasoning_content`, as the template put it
    inside the answer) cut out: `data.train_on_reasoning=false`. A turn whose thinking the template did not
    render (Qwen3: earlier turns) keeps its span."""
    spans: list[tuple[int, int]] = []
    for a in answers:
        reasoning = (messages[a.index].get("reasoning_content") or "").strip()
        start, end = a.span
        k = text.find(reasoning, start, end) if reasoning else -1
        if k < 0:
            spans.append((start, end))
            continue
        spans += [piece for piece in ((start, k), (k + len(reasoning), end)) if piece[1] > piece[0]]
    return spans


def assistant_char_spans(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]], int]:
    """(full rendering, character spans of the assistant answers, number of fallback turns)."""
    full, answers, fallbacks = _locate_answers(tokenizer, messages)
    return full, [a.span for a in answers], fallbacks


@dataclass(frozen=True)
class _Splice:
    """The tokens of text[start:end] are replaced by `ids` (an answer's stored token ids)."""

    start: int
    end: int
    ids: list[int]


def _splice_range(tokenizer: Any, text: str, answer: _Answer, content: str, ids: list[int]) -> tuple[int, int] | None:
    """The characters of `text` that `ids` replace, or None when the ids cannot stand for this answer
    (the rules are in the module docstring)."""
    vocab = len(tokenizer)
    if not all(0 <= t < vocab for t in ids):
        return None  # ids of another (larger) vocabulary
    if tokenizer.decode(ids, skip_special_tokens=True).strip() != content:
        return None  # not the ids of this text: ConversationJob writes exactly this decoding, stripped
    with_specials = tokenizer.decode(ids, skip_special_tokens=False).strip()
    c_start, c_end = answer.content
    if answer.exact:
        start, end = answer.span[0], answer.end_of_turn
        glue = text[start:c_start] + text[c_end:end]
        if not glue.strip() or with_specials == text[start:end].strip():
            return start, end
    # The template's own text around the content stays: the ids must be the content alone, or a
    # think block (say) in both would be doubled.
    return answer.content if with_specials == content else None


def _plan_splices(
    tokenizer: Any, text: str, messages: list[dict[str, Any]], answers: list[_Answer]
) -> tuple[list[_Splice], int]:
    """(the splices of the assistant messages that hold token ids, in text order; how many such messages
    keep their text because their ids cannot be spliced)."""
    located = {a.index: a for a in answers}
    splices: list[_Splice] = []
    refused = 0
    for i, m in enumerate(messages):
        ids = m.get("token_ids")
        if m["role"] != "assistant" or not ids:
            continue
        where = _splice_range(tokenizer, text, located[i], m["content"].strip(), ids) if i in located else None
        if where is None:
            refused += 1
        else:
            splices.append(_Splice(where[0], where[1], list(ids)))
    return splices, refused


def _mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    mask = [0] * len(offsets)
    k = 0
    for j, (start, _end) in enumerate(offsets):
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        if k < len(spans) and spans[k][0] <= start < spans[k][1]:
            mask[j] = 1
    return mask


def tokenize_with_mask(
    tokenizer: Any, text: str, spans: list[tuple[int, int]], use_offsets: bool | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of `text` and a 0/1 mask of the tokens that start inside `spans` (sorted, disjoint)."""
    if use_offsets is None:
        use_offsets = bool(getattr(tokenizer, "is_fast", False))
    if use_offsets:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        return ids, _mask_from_offsets([tuple(o) for o in enc["offset_mapping"]], spans)
    # No offsets: tokenise the pieces between span boundaries separately. A token can then never
    # straddle a boundary, which is also how the prompt and the answer are split at inference.
    ids = []
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


def _splice_with_offsets(
    tokenizer: Any, text: str, spans: list[tuple[int, int]], splices: list[_Splice]
) -> tuple[list[int], list[int], int, int]:
    """`tokenize_with_mask` by offsets, then each splice's tokens swapped for its ids (module docstring).
    Returns (ids, mask, splices made, splices refused at a token boundary); a splice that starts past the
    end of `text` (a prefix cut for truncation) is neither."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    offsets = [tuple(o) for o in enc["offset_mapping"]]
    mask = _mask_from_offsets(offsets, spans)
    # A token's start moves back over a gap after the tokens before it, so an offset trimmed of its
    # leading whitespace (a post-processor's trim_offsets) still covers that whitespace. (Tokens holding
    # bytes of one character share its offsets: they overlap, and keep their own start.)
    starts: list[int] = []
    ends: list[int] = []
    reach = 0  # the furthest end so far
    for start, end in offsets:
        starts.append(min(start, reach))
        ends.append(max(end, starts[-1]))
        reach = max(reach, end)
    out_ids: list[int] = []
    out_mask: list[int] = []
    made = refused = 0
    j = 0  # tokens before j are in the output
    n = len(ids)
    for sp in splices:
        if sp.start >= len(text):
            break
        a = j
        while a < n and ends[a] <= sp.start:
            a += 1
        head: tuple[list[int], list[int]] = ([], [])
        if a < n and starts[a] < sp.start:
            # One token holds the end of the template's text and the start of the answer. Its template part
            # is tokenised alone (as the prompt was when the target answered), if the tokenizer gives this
            # token for its text alone: one that prepends a space or normalises pieces would not.
            x, y = starts[a], ends[a]
            if y > sp.end or list(tokenizer(text[x:y], add_special_tokens=False)["input_ids"]) != [ids[a]]:
                refused += 1
                continue
            head = tokenize_with_mask(tokenizer, text[x : sp.start], [(s - x, e - x) for s, e in spans], True)
        b = a
        while b < n and starts[b] < sp.end:
            b += 1
        if max(ends[a:b], default=sp.end) > sp.end:
            refused += 1  # a token runs from the answer into the template's text after it
            continue
        out_ids += ids[j:a] + head[0] + sp.ids
        out_mask += mask[j:a] + head[1] + [1] * len(sp.ids)
        j = b
        made += 1
    return out_ids + ids[j:], out_mask + mask[j:], made, refused


def _splice_piecewise(
    tokenizer: Any, text: str, spans: list[tuple[int, int]], splices: list[_Splice]
) -> tuple[list[int], list[int], int, int]:
    """Without offsets: the pieces between span and splice boundaries tokenised apart (as the prompt and
    the answer are at inference), each splice's ids in place of its piece. Returns as `_splice_with_offsets`."""
    ids: list[int] = []
    mask: list[int] = []

    def add(piece: str, flag: int) -> None:
        if piece:
            piece_ids = list(tokenizer(piece, add_special_tokens=False)["input_ids"])
            ids.extend(piece_ids)
            mask.extend([flag] * len(piece_ids))

    made = k = pos = 0
    for start, end in spans:
        add(text[pos:start], 0)
        pos = start
        while k < len(splices) and splices[k].start < end:  # the splices inside this span
            sp = splices[k]
            k += 1
            add(text[pos : sp.start], 1)
            if sp.start >= len(text):
                return ids, mask, made, 0
            ids.extend(sp.ids)
            mask.extend([1] * len(sp.ids))
            made += 1
            if sp.end >= len(text):  # the (cut) text ends inside this answer
                return ids, mask, made, 0
            pos = sp.end
        add(text[pos:end], 1)
        pos = end
    add(text[pos:], 0)
    return ids, mask, made, 0


def _tokenize_spliced(
    tokenizer: Any, text: str, spans: list[tuple[int, int]], splices: list[_Splice], use_offsets: bool | None
) -> tuple[list[int], list[int], int, int]:
    """(ids, mask, splices made, splices refused at a token boundary) of `text`."""
    if use_offsets is None:
        use_offsets = bool(getattr(tokenizer, "is_fast", False))
    if not splices:  # no stored ids: exactly the text's tokens
        return *tokenize_with_mask(tokenizer, text, spans, use_offsets), 0, 0
    if use_offsets:
        return _splice_with_offsets(tokenizer, text, spans, splices)
    return _splice_piecewise(tokenizer, text, spans, splices)


_CUT_MARGIN_TOKENS = 64  # tokens tokenised past max_length, so the cut of the text never shows in the kept part


def tokenize_with_reason(
    conv: Conversation,
    tokenizer: Any,
    max_length: int,
    overflow: str,
    use_offsets: bool | None = None,
    train_on_reasoning: bool = True,
) -> tuple[TokenizedConversation | None, str | None]:
    """Like `tokenize_conversation`, also saying why a conversation was dropped:
    'too_long' (overflow=drop), 'empty_loss_mask', or 'template_error'."""
    try:
        text, answers, fallbacks = _locate_answers(tokenizer, conv.messages)
    except TemplateFailure:
        return None, "template_error"
    spans = [a.span for a in answers] if train_on_reasoning else without_reasoning(text, answers, conv.messages)
    splices, unusable = _plan_splices(tokenizer, text, conv.messages, answers)
    # ShareGPT turns run to 100k characters; with max_length in the thousands most of that text is
    # cut anyway. Tokenise a prefix of the text that yields a margin of tokens past max_length (a cut
    # only changes tokens of the last word), doubling it while it is short, instead of everything.
    limit = max_length + _CUT_MARGIN_TOKENS
    n_chars = 8 * limit
    images = message_images(conv.messages)  # rendered whole: a cut text would lose image placeholders
    if images:  # a vision-language target's conversation: each placeholder becomes its image's text
        vision, counts = _image_counts(tokenizer, images, f"conversation {conv.id!r}")
        text, spans, splices = _expand_images(vision, tokenizer, text, spans, splices, counts, conv.id)
    while True:
        piece = text if n_chars >= len(text) or images else text[:n_chars]
        ids, mask, spliced, refused = _tokenize_spliced(tokenizer, piece, spans, splices, use_offsets)
        if piece is text or len(ids) > limit:
            break
        n_chars *= 2
    tc = TokenizedConversation(conv.id, ids, mask, False, fallbacks, spliced, unusable + refused)
    if images:  # a vision-language target's conversation: image tokens, whole images
        _check_image_tokens(ids, vision.image_token_id, counts, f"conversation {conv.id!r}")
        tc = replace(tc, images=tuple(images))
        return fit_images_to_length(tc, vision.image_token_id, counts, max_length, overflow)
    return fit_to_length(tc, max_length, overflow)


def _image_counts(tokenizer: Any, refs: list[str], where: str) -> tuple[VisionProcessor, list[int]]:
    """(the target's vision processor, each image's number of image tokens); `DataError` naming `where` for a
    text-only target."""
    vision = load_vision_processor(str(getattr(tokenizer, "name_or_path", "") or ""))
    if vision is None:
        name = getattr(tokenizer, "name_or_path", "") or "a tokenizer without a checkpoint folder"
        raise DataError(
            f"{where} holds {len(refs)} image(s) but the target ({name}) is text-only (no vision tower in its "
            "config): drop the images from the data or train for a vision-language target"
        )
    return vision, [vision.tokens_for(*image_size(ref, where)) for ref in refs]


def _expand_images(
    vision: VisionProcessor,
    tokenizer: Any,
    text: str,
    spans: list[tuple[int, int]],
    splices: list[_Splice],
    counts: list[int],
    conv_id: str,
) -> tuple[str, list[tuple[int, int]], list[_Splice]]:
    """The rendering with each image placeholder replaced by its image's text, as the target's processor does
    before it tokenises (`VisionProcessor.expand`: the whole text is then tokenised, so tokens merge across the
    processor's text as they do in its output), with the answers' spans and splices moved to match. Images
    sit in user turns, never inside an answer's span."""
    image_token = tokenizer.convert_ids_to_tokens(vision.image_token_id)
    expanded, found = vision.expand(text, counts, image_token, f"conversation {conv_id!r}")
    grown = [
        len(vision.before) + len(image_token) * n + len(vision.after) - (end - start)
        for (start, end), n in zip(found, counts, strict=True)
    ]

    def moved(pos: int) -> int:  # a position of `text` in `expanded`
        return pos + sum(g for (_, end), g in zip(found, grown, strict=True) if end <= pos)

    return (
        expanded,
        [(moved(a), moved(b)) for a, b in spans],
        [replace(sp, start=moved(sp.start), end=moved(sp.end)) for sp in splices],
    )


def _check_image_tokens(ids: list[int], image_id: int, counts: list[int], where: str) -> None:
    """The tokenised text holds each image's tokens (a tokenizer that splits the image token's text would not)."""
    found = sum(1 for t in ids if t == image_id)
    if found != sum(counts):
        raise DataError(
            f"{where}: {found} image tokens (id {image_id}) after tokenisation for {len(counts)} images of "
            f"{sum(counts)} tokens; the tokenizer must keep the image token whole"
        )


def encode_image_prompt(tokenizer: Any, messages: list[dict[str, Any]], where: str) -> tuple[list[int], VisionInputs]:
    """(prompt ids ready for the assistant turn, the images' pixel inputs) of `messages` holding images, for a
    vision-language target: rendered and expanded as training data is (`tokenize_with_reason`)."""
    refs = message_images(messages)
    vision = load_vision_processor(str(getattr(tokenizer, "name_or_path", "") or ""))
    if vision is None:
        name = getattr(tokenizer, "name_or_path", "") or "a tokenizer without a checkpoint folder"
        raise DataError(f"{where} holds {len(refs)} image(s) but the target ({name}) is text-only")
    try:
        text = render(tokenizer, messages, add_generation_prompt=True)
    except TemplateFailure as e:
        raise DataError(f"{where}: {e}") from e
    images = [open_image(ref, where) for ref in refs]
    counts = [vision.tokens_for(img.height, img.width) for img in images]
    text, _ = vision.expand(text, counts, tokenizer.convert_ids_to_tokens(vision.image_token_id), where)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    _check_image_tokens(ids, vision.image_token_id, counts, where)
    return ids, vision.pixels(images)


def fit_images_to_length(
    tc: TokenizedConversation, image_id: int, counts: list[int], max_length: int, overflow: str
) -> tuple[TokenizedConversation | None, str | None]:
    """`fit_to_length` for a conversation with images: a cut never splits an image (the target cannot read
    part of one), so it moves before a split image, which is dropped with its tokens."""
    fitted, reason = fit_to_length(tc, max_length, overflow)
    if fitted is None or not fitted.truncated:
        return fitted, reason
    kept, length = keep_whole_images(fitted.input_ids, image_id, counts)
    fitted = replace(
        fitted, input_ids=fitted.input_ids[:length], loss_mask=fitted.loss_mask[:length], images=tc.images[:kept]
    )
    return (fitted, None) if any(fitted.loss_mask) else (None, "empty_loss_mask")


def fit_to_length(
    tc: TokenizedConversation, max_length: int, overflow: str
) -> tuple[TokenizedConversation | None, str | None]:
    """A rendered conversation cut to `max_length` (overflow=truncate) or dropped ('too_long', overflow=drop);
    dropped as 'empty_loss_mask' when no assistant token is left. Shared by every renderer."""
    if len(tc.input_ids) > max_length:
        if overflow == "drop":
            return None, "too_long"
        tc = replace(tc, input_ids=tc.input_ids[:max_length], loss_mask=tc.loss_mask[:max_length], truncated=True)
    if not any(tc.loss_mask):
        return None, "empty_loss_mask"
    return tc, None


def tokenize_conversation(
    conv: Conversation, tokenizer: Any, max_length: int, overflow: str, train_on_reasoning: bool = True
) -> TokenizedConversation | None:
    """Render `conv` with the tokenizer's chat template and mask the assistant tokens.

    An assistant message's stored `token_ids` replace the tokens of its text (module docstring).
    Returns None when the conversation is dropped: longer than `max_length` with overflow='drop',
    no assistant token left (e.g. truncated before the first answer), or the template rejected it.
    `eagle.data.dataset.build_splits` counts each case.
    """
    if overflow not in ("truncate", "drop"):
        raise ValueError(f"overflow={overflow!r} is not one of truncate, drop")
    return tokenize_with_reason(conv, tokenizer, max_length, overflow, train_on_reasoning=train_on_reasoning)[0]


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """Token ids the template emits right after an assistant answer (plus eos): generation stops on them."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ids: list[int] = []
    try:
        text, spans, _ = assistant_char_spans(tokenizer, probe)
        if spans:
            content_end = text.find("Hello", spans[0][0]) + len("Hello")
            tail = text[content_end : spans[0][1]]
            ids = list(tokenizer(tail, add_special_tokens=False)["input_ids"]) if tail else []
            specials = set(special_token_strings(tokenizer))
            ids = [t for t in ids if tokenizer.convert_ids_to_tokens(t) in specials]
    except TemplateFailure:
        ids = []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
