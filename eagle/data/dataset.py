"""Conversation selection and splits: read -> skip/dedup -> first N -> tokenise -> train/held-out.

Every conversation that does not make it into a split is counted under a reason in `DataStats`
(printed by `build_splits`), so nothing disappears silently.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm.auto import tqdm

from eagle.config import DataConfig
from eagle.data.eval_prompts import load_eval_prompts
from eagle.data.harmony import renderer_for, tokenize_harmony
from eagle.data.readers import ReadReport, iter_records
from eagle.data.records import Conversation, SkipRecord, normalise_record
from eagle.data.template import TokenizedConversation, require_chat_template, tokenize_with_reason
from eagle.errors import DataError

LONG_PROMPT_CHARS = 64  # normalised length from which containment (either way) counts as a match


@dataclass
class DataStats:
    read: int = 0  # records read from the source
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count (records and dropped conversations)
    truncated: int = 0  # cut at data.max_length (overflow=truncate)
    dropped_too_long: int = 0  # longer than data.max_length (overflow=drop)
    deduplicated: int = 0  # removed because a user turn matches an evaluation prompt
    heldout: int = 0
    train: int = 0
    fallback_turns: int = 0  # assistant turns masked by search: the template is not prefix-consistent
    id_turns: int = 0  # assistant turns tokenised as their stored token_ids (eagle.data.template)
    id_fallback_turns: int = 0  # assistant turns with token_ids whose text was tokenised instead
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        skipped = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "none"
        lines = [
            f"data: read {self.read} records; train {self.train}, held-out {self.heldout}",
            f"data: skipped {sum(self.skipped.values())} ({skipped})",
            f"data: removed as evaluation-prompt duplicates: {self.deduplicated}; "
            f"truncated: {self.truncated}; dropped as too long: {self.dropped_too_long}",
        ]
        if self.fallback_turns:
            lines.append(
                f"data: {self.fallback_turns} assistant turns masked by content search "
                "(the chat template is not prefix-consistent)"
            )
        if self.id_turns or self.id_fallback_turns:
            lines.append(
                f"data: {self.id_turns} assistant turns tokenised as the token ids stored with them"
                + (
                    f"; {self.id_fallback_turns} as their text instead (ids that do not decode to the "
                    "content, or that cannot be spliced into the template's tokens)"
                    if self.id_fallback_turns
                    else ""
                )
            )
        lines += [f"data: note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass
class DataSplits:
    train: list[TokenizedConversation]
    heldout: list[TokenizedConversation]
    stats: DataStats


def normalise_text(text: str) -> str:
    """Lower-case with runs of whitespace collapsed: the form in which prompts are compared."""
    return " ".join(text.lower().split())


class EvalPromptIndex:
    """Decides whether a user turn is (or contains, or is contained in) an evaluation prompt."""

    def __init__(self, prompts: list[str]) -> None:
        normed = sorted({normalise_text(p) for p in prompts if p.strip()})
        self.exact = set(normed)
        self.long = [p for p in normed if len(p) >= LONG_PROMPT_CHARS]
        # One string holding every prompt: a long user turn contained in any of them is found with
        # a single substring search. \x00 never occurs in normalised text between prompts.
        self.joined = "\x00".join(normed)

    def matches(self, text: str) -> bool:
        norm = normalise_text(text)
        if not norm:
            return False
        if norm in self.exact:
            return True
        if len(norm) >= LONG_PROMPT_CHARS and norm in self.joined:
            return True
        return any(p in norm for p in self.long)


def eval_prompt_index(names: list[str]) -> EvalPromptIndex:
    texts = [turn for name in names for prompt in load_eval_prompts(name) for turn in prompt.turns]
    return EvalPromptIndex(texts)


def _count(stats: DataStats, reason: str) -> None:
    stats.skipped[reason] = stats.skipped.get(reason, 0) + 1


def load_conversations(cfg: DataConfig) -> tuple[list[Conversation], DataStats]:
    """The first `cfg.max_conversations` usable conversations of the source, in source order.

    Unusable records (see `eagle.data.records`), repeated ids and conversations whose user turns
    match an evaluation prompt of `cfg.dedup_against` are counted in the stats and not returned.
    Reading stops as soon as enough conversations are found.
    """
    stats = DataStats()
    report = ReadReport()
    index = eval_prompt_index(list(cfg.dedup_against)) if cfg.dedup_against else None
    seen: set[str] = set()
    out: list[Conversation] = []
    limit = cfg.max_conversations
    for i, record in iter_records(cfg, report):
        if limit is not None and len(out) >= limit:
            break
        stats.read += 1
        try:
            conv = normalise_record(
                record, index=i, source=report.source, fmt=cfg.format, system_prompt=cfg.system_prompt
            )
        except SkipRecord as s:
            _count(stats, s.reason)
            continue
        if conv.id in seen:
            _count(stats, "duplicate_id")
            continue
        seen.add(conv.id)
        if index is not None and any(index.matches(m["content"]) for m in conv.messages if m["role"] == "user"):
            stats.deduplicated += 1
            continue
        out.append(conv)
    stats.notes.extend(report.notes)
    return out, stats


def _unit_hash(seed: int, cid: str) -> float:
    """A uniform number in [0, 1) from (seed, id): the split of a conversation never depends on
    which other conversations were selected."""
    digest = hashlib.sha256(f"{seed}\x00{cid}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_heldout(cfg: DataConfig, cid: str) -> bool:
    return _unit_hash(cfg.split_seed, cid) < cfg.heldout_fraction


def build_splits(cfg: DataConfig, tokenizer: Any, progress: bool = True) -> DataSplits:
    """Load, tokenise and split `cfg`'s conversations; prints the stats summary.

    With a positive `heldout_fraction` and at least two conversations the held-out split is never
    empty: if the hash split leaves it empty, the conversation with the smallest hash is moved there.
    """
    harmony = renderer_for(cfg.renderer, tokenizer)  # fail before reading anything
    if harmony is None:
        require_chat_template(tokenizer)
    convs, stats = load_conversations(cfg)
    tokenized: list[TokenizedConversation] = []
    for conv in tqdm(convs, desc="tokenize", unit="conv", disable=not progress):
        if harmony is not None:
            tc, reason = tokenize_harmony(conv, harmony, cfg.max_length, cfg.overflow, cfg.train_on_reasoning)
        else:
            tc, reason = tokenize_with_reason(
                conv, tokenizer, cfg.max_length, cfg.overflow, train_on_reasoning=cfg.train_on_reasoning
            )
        if tc is None:
            if reason == "too_long":
                stats.dropped_too_long += 1
            else:
                _count(stats, str(reason))
            continue
        stats.truncated += int(tc.truncated)
        stats.fallback_turns += tc.fallback_turns
        stats.id_turns += tc.id_turns
        stats.id_fallback_turns += tc.id_fallback_turns
        tokenized.append(tc)
    if not tokenized:
        raise DataError(
            f"no usable conversations in data.source={cfg.source} data.path={cfg.path}:\n"
            f"{stats.summary()}\nCheck the format/roles of the file and data.max_length"
        )
    heldout = [tc for tc in tokenized if is_heldout(cfg, tc.id)]
    if cfg.heldout_fraction > 0 and not heldout and len(tokenized) >= 2:
        heldout = [min(tokenized, key=lambda tc: _unit_hash(cfg.split_seed, tc.id))]
    held_ids = {tc.id for tc in heldout}
    train = [tc for tc in tokenized if tc.id not in held_ids]
    if cfg.pack:  # after the split: a pack never mixes training and held-out conversations
        train, heldout = pack_conversations(train, cfg.max_length), pack_conversations(heldout, cfg.max_length)
        stats.notes.append(
            f"data.pack: {len(tokenized)} conversations packed into {len(train) + len(heldout)} "
            f"sequences of up to {cfg.max_length} tokens"
        )
    stats.train, stats.heldout = len(train), len(heldout)
    print(stats.summary(), file=sys.stderr)
    return DataSplits(train=train, heldout=heldout, stats=stats)


def pack_conversations(convs: list[TokenizedConversation], max_length: int) -> list[TokenizedConversation]:
    """Consecutive conversations joined into sequences of at most `max_length` tokens (greedy, in order):
    `data.pack`, for training on long contexts. A conversation attends to the ones before it in its pack
    (causal, positions continuing), as in pretraining's packing; loss masks are each conversation's own.
    A pack's id is its first conversation's id and how many follow (`pack:ID+N`)."""
    packs: list[TokenizedConversation] = []
    group: list[TokenizedConversation] = []

    def close() -> None:
        if group:
            ids = [t for c in group for t in c.input_ids]
            mask = [m for c in group for m in c.loss_mask]
            packs.append(
                TokenizedConversation(
                    f"pack:{group[0].id}+{len(group) - 1}",
                    ids,
                    mask,
                    any(c.truncated for c in group),
                    images=tuple(ref for c in group for ref in c.images),  # in sequence order, as their tokens
                )
            )
            group.clear()

    for conv in convs:
        if group and sum(len(c.input_ids) for c in group) + len(conv.input_ids) > max_length:
            close()
        group.append(conv)
    close()
    return packs


FINGERPRINT_FIELDS = (
    "source",
    "path",
    "hub_split",
    "hub_subset",
    "format",
    "max_conversations",
    "max_length",
    "overflow",
    "system_prompt",
    "heldout_fraction",
    "split_seed",
    "dedup_against",
)


def data_fingerprint(cfg: DataConfig, splits: DataSplits) -> str:
    """sha256 over the selection-relevant config fields and every token id and mask of both splits."""
    h = hashlib.sha256()
    fields = {k: v for k, v in asdict(cfg).items() if k in FINGERPRINT_FIELDS}
    h.update(json.dumps(fields, sort_keys=True, default=str).encode())
    for name, part in (("train", splits.train), ("heldout", splits.heldout)):
        h.update(f"\x00{name}:{len(part)}".encode())
        for tc in part:
            # Images by reference (a vision-language target's); text-only data hashes as it always did.
            h.update(
                json.dumps([tc.id, tc.input_ids, tc.loss_mask] + ([list(tc.images)] if tc.images else [])).encode()
            )
    return h.hexdigest()
