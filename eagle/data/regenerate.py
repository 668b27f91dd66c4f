"""Self-distillation: replace every assistant turn with the target's own answer.

Multi-turn conversations are regenerated turn by turn: answer k is generated from the regenerated
answers 0..k-1, so the training data is what the target would produce in that conversation. A batch
of conversations advances one assistant turn per round with left-padded `generate` calls.

Output: JSONL, one `{"id", "messages"}` record (OpenAI format) per conversation, readable by
`data=local data.path=...`. Resumable: records are appended per finished batch with flush+fsync;
a restart skips ids already written, drops a torn last line left by a hard kill, and refuses to mix
outputs of different targets, generation settings or data (recorded in `<output>.meta.json`; each
differing key is named with both values). A changed selection (`data.max_conversations`,
`data.dedup_against`) is allowed and noted: it adds or leaves out conversations, not other answers.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from eagle.config import DataConfig, RegenerateConfig
from eagle.data.records import Conversation
from eagle.data.template import TemplateFailure, end_of_turn_ids, render
from eagle.errors import DataError


def default_output(output_dir: str | Path, cfg: RegenerateConfig) -> Path:
    return Path(cfg.output) if cfg.output else Path(output_dir) / "regenerated.jsonl"


def recover_output(path: Path) -> set[str]:
    """Ids already written to `path`.

    Records are written as whole lines, so text after the last newline is a torn write from a hard
    kill: it is cut off the file (that conversation is simply regenerated). A line before it that is
    not a record means the file is corrupt (or not ours) and raises `DataError`.
    """
    if not path.exists():
        return set()
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1  # 0 when there is no complete line at all
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    done: set[str] = set()
    for lineno, raw in enumerate(data[:keep].split(b"\n")[:-1], start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("id"), str):
            raise DataError(f"{path}: line {lineno} is not a regenerated record; the file is corrupt. "
                            "Delete it (or set regenerate.output to a new file) and run again")
        done.add(record["id"])
    return done


# Data settings that decide which conversations are regenerated and what their prompts are.
DATA_IDENTITY = ("source", "path", "hub_split", "hub_subset", "format", "system_prompt", "max_conversations",
                 "dedup_against")
# Settings that may change on resume: they select more or fewer conversations, not other answers
# (ids already written are skipped either way).
_FREE = frozenset({"data.max_conversations", "data.dedup_against"})


def data_identity(data: DataConfig) -> dict[str, Any]:
    """The data settings a regenerated file records (local paths made absolute)."""
    out = {k: v for k, v in asdict(data).items() if k in DATA_IDENTITY}
    if isinstance(out.get("path"), str) and os.path.exists(out["path"]):
        out["path"] = os.path.realpath(out["path"])
    return out


def _settings(cfg: RegenerateConfig, target_fingerprint: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
    keep = {k: v for k, v in asdict(cfg).items() if k not in ("output", "batch_size")}
    return {"target": target_fingerprint, **keep, **({"data": data} if data is not None else {})}


def _flat(settings: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in settings.items() if k != "data"}
    out.update({f"data.{k}": v for k, v in (settings.get("data") or {}).items()})
    return out


def _check_meta(path: Path, settings: dict[str, Any]) -> None:
    """Refuse to append to `path` under settings that change the answers (naming each key, old and
    new value); allow and note a changed selection; record the settings in `<path>.meta.json`."""
    meta = path.with_name(path.name + ".meta.json")
    if meta.exists():
        old = json.loads(meta.read_text())
        if old == settings:
            return
        a, b = _flat(old), _flat(settings)
        # A key one side lacks (an older eagle wrote the meta file) cannot be compared.
        diff = [k for k in sorted(set(a) & set(b)) if a[k] != b[k]]
        refused = [k for k in diff if k not in _FREE]
        if refused:
            lines = "\n".join(f"  {k}: {a[k]!r} -> {b[k]!r}" for k in refused)
            raise DataError(f"{path} was written with different settings (file -> this run):\n{lines}\n"
                            "resuming would mix answers of both in one file. Either write to a new file (another "
                            f"regenerate.output or output_dir), or move {path} away to regenerate from scratch there")
        if diff:
            print(f"eagle-regenerate: resuming {path} with another selection: "
                  + "; ".join(f"{k}: {a[k]!r} -> {b[k]!r}" for k in diff), file=sys.stderr)
    tmp = meta.with_name(meta.name + ".tmp")
    tmp.write_text(json.dumps(settings, indent=2, sort_keys=True))
    os.replace(tmp, meta)


def _batches(items: list[Conversation], size: int) -> Iterator[list[Conversation]]:
    for k in range(0, len(items), size):
        yield items[k:k + size]


def _batch_seed(seed: int, batch: list[Conversation]) -> int:
    """Seed from the batch's ids, so a resumed run samples what an uninterrupted one would have."""
    digest = hashlib.sha256(f"{seed}\x00".encode() + "\x00".join(c.id for c in batch).encode()).digest()
    return int.from_bytes(digest[:4], "big")


@torch.no_grad()
def generate_replies(model: Any, tokenizer: Any, histories: list[list[dict[str, str]]], cfg: RegenerateConfig,
                     stop_ids: list[int]) -> list[str]:
    """One assistant answer per history (which ends with a user turn), by left-padded batched `generate`."""
    prompts = [render(tokenizer, h, add_generation_prompt=True) for h in histories]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # generation appends on the right: prompts must end together
    try:
        enc = tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
    finally:
        tokenizer.padding_side = side
    device = next(model.parameters()).device
    input_ids = enc["input_ids"].to(device)  # [B, T]
    attention_mask = enc["attention_mask"].to(device)  # [B, T]
    sample = cfg.temperature > 0
    kwargs: dict[str, Any] = dict(do_sample=sample, max_new_tokens=cfg.max_new_tokens,
                                  eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id)
    if sample:
        kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or None)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)  # [B, T + new]
    replies = []
    stops = set(stop_ids)
    for row in out[:, input_ids.shape[1]:].tolist():
        cut = next((k for k, t in enumerate(row) if t in stops), len(row))  # answer ends before the stop token
        replies.append(tokenizer.decode(row[:cut], skip_special_tokens=True).strip())
    return replies


def _prompt_tokens(tokenizer: Any, history: list[dict[str, str]]) -> int:
    try:
        text = render(tokenizer, history, add_generation_prompt=True)
    except TemplateFailure:
        return 0  # the generation call reports template failures itself
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def regenerate_batch(model: Any, tokenizer: Any, batch: list[Conversation], cfg: RegenerateConfig,
                     stop_ids: list[int]) -> list[dict[str, Any]]:
    """Regenerated records for a batch: one round per assistant turn index. A conversation whose
    answer comes back empty (or whose prompt the template rejects) ends before that turn."""
    # Per conversation: the turns still to replay, and the regenerated history so far.
    pending = [list(c.messages) for c in batch]
    history: list[list[dict[str, str]]] = [[] for _ in batch]
    active = list(range(len(batch)))
    answered = [0] * len(batch)
    while active:
        ask = []
        for b in active:
            # Move the non-assistant turns up to the next assistant turn into the history.
            while pending[b] and pending[b][0]["role"] != "assistant":
                history[b].append(pending[b].pop(0))
            if cfg.max_turns is not None and answered[b] >= cfg.max_turns:
                pending[b] = []
            elif pending[b] and _prompt_tokens(tokenizer, history[b]) > cfg.max_prompt_tokens:
                pending[b] = []  # too long to be worth a batch slot; training would truncate it
            if pending[b] and history[b] and history[b][-1]["role"] == "user":
                ask.append(b)
        if not ask:
            break
        try:
            replies = generate_replies(model, tokenizer, [history[b] for b in ask], cfg, stop_ids)
        except TemplateFailure:
            replies = [""] * len(ask)
        for b, reply in zip(ask, replies, strict=True):
            pending[b].pop(0)  # the original answer is replaced
            if reply:
                history[b].append({"role": "assistant", "content": reply})
                answered[b] += 1
            else:
                pending[b] = []  # stop this conversation here; the reader counts it if nothing is left
        active = [b for b in ask if pending[b]]
    records = []
    for c, h in zip(batch, history, strict=True):
        last = max((k for k, m in enumerate(h) if m["role"] == "assistant"), default=None)
        # A trailing user turn without a reply is no training data. With no reply at all the record
        # keeps its prompt: its id marks it done for resuming and the reader counts it as skipped.
        records.append({"id": c.id, "messages": h[: last + 1] if last is not None else h})
    return records


def regenerate(model: Any, tokenizer: Any, conversations: list[Conversation], cfg: RegenerateConfig,
               output: Path, target_fingerprint: str = "", progress: bool = True,
               data: DataConfig | None = None) -> Path:
    """Regenerate `conversations` into `output` (JSONL), resuming from what it already holds.

    `data` (the settings `conversations` were read with) is recorded too, so a resume on other data
    is refused rather than appended."""
    output.parent.mkdir(parents=True, exist_ok=True)
    _check_meta(output, _settings(cfg, target_fingerprint, data_identity(data) if data is not None else None))
    done = recover_output(output)
    todo = [c for c in conversations if c.id not in done]
    stop_ids = end_of_turn_ids(tokenizer)
    was_training = model.training
    model.eval()
    bar = tqdm(total=len(conversations), initial=len(conversations) - len(todo), desc="regenerate",
               unit="conv", disable=not progress)
    with open(output, "a", encoding="utf-8") as f:
        for batch in _batches(todo, cfg.batch_size):
            torch.manual_seed(_batch_seed(cfg.seed, batch))
            records = regenerate_batch(model, tokenizer, batch, cfg, stop_ids)
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(batch))
    bar.close()
    model.train(was_training)
    return output
