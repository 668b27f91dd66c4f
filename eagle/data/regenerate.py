"""Self-distillation: replace every assistant turn with the target's own answer.

Multi-turn conversations are regenerated turn by turn: answer k is generated from the regenerated
answers 0..k-1, so the training data is what the target would produce in that conversation
(`ConversationJob`). A backend runs the jobs; `regenerate()` only sees its records:
  * `local` (`LocalBackend`, here): an HF model in this process, with one of two engines:
    `continuous` (default; `eagle.decode.continuous`: a slot freed by a finished conversation takes the
    next one at once, conversations in order of prompt length) or `generate` (a batch advances one
    assistant turn per round with left-padded HF `generate` calls);
  * `server` (`eagle.data.server.ServerBackend`): OpenAI-compatible servers answering raw completions
    of the prompts rendered here.
Each assistant message holds its text (the ids' decoding, stripped) and, where the ids are known (the
local engines; servers whose engine returns them), the generated ids (`"token_ids"`, end-of-turn token
excluded). Training tokenises an answer as these ids, not as a re-tokenisation of its text, which
differs for many answers (`eagle.data.template`).

Reasoning targets (`regenerate.reasoning`): the thinking the target writes before its `</think>` is split
off its answer and stored as `reasoning_content` (keep), left out (drop), or not asked for (off: the
prompt rendered with the template's `enable_thinking=False`). A split answer keeps no token ids (its
ids hold both parts; training tokenises the rendered text). Tool calls and results of the source
conversation are replayed as they are (never executed: a tool-calling turn is kept verbatim with its
results); the answers after them are regenerated.

Output: JSONL, one `{"id", "messages"}` record (OpenAI format) per conversation, readable by
`data=local data.path=...`, in the order conversations finish. Resumable: records are appended as
they finish with flush+fsync;
a restart skips ids already written, drops a torn last line left by a hard kill, and refuses to mix
outputs of different targets, backends, served models, generation settings or data (recorded in
`<output>.meta.json`; each differing key is named with both values). A changed selection
(`data.max_conversations`, `data.dedup_against`) is allowed and noted: it adds or leaves out
conversations, not other answers.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from tqdm.auto import tqdm

from eagle.artifacts import regeneration_meta
from eagle.config import DataConfig, RegenerateConfig
from eagle.data.records import Conversation
from eagle.data.template import TemplateFailure, end_of_turn_ids, render
from eagle.decode.continuous import ContinuousGenerator, Job, Sampling, slot_attention_enabled
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
            raise DataError(
                f"{path}: line {lineno} is not a regenerated record; the file is corrupt. "
                "Delete it (or set regenerate.output to a new file) and run again"
            )
        done.add(record["id"])
    return done


# Data settings that decide which conversations are regenerated and what their prompts are.
DATA_IDENTITY = (
    "source",
    "path",
    "hub_split",
    "hub_subset",
    "format",
    "system_prompt",
    "max_conversations",
    "dedup_against",
)
# Settings that may change on resume: they select more or fewer conversations, not other answers
# (ids already written are skipped either way). The serving engine of one served model is like the
# local engine (continuous / generate): it changes how answers are computed, not which.
_FREE = frozenset({"data.max_conversations", "data.dedup_against", "server_engine"})
# Settings left out of the meta file: how the work is spread (slots, engine, server list, concurrency,
# timeouts) does not change the answers; the backend records what does (`RegenerationBackend.start`).
_NOT_RECORDED = frozenset(
    {
        "output",
        "batch_size",
        "engine",
        "backend",
        "servers",
        "model",
        "requests_per_server",
        "request_timeout",
        "server_engine",
    }
)


def data_identity(data: DataConfig) -> dict[str, Any]:
    """The data settings a regenerated file records (local paths made absolute)."""
    out = {k: v for k, v in asdict(data).items() if k in DATA_IDENTITY}
    if isinstance(out.get("path"), str) and os.path.exists(out["path"]):
        out["path"] = os.path.realpath(out["path"])
    return out


def _settings(
    cfg: RegenerateConfig, target_fingerprint: str, data: dict[str, Any] | None = None, dtype: str | None = None
) -> dict[str, Any]:
    # Slots and engine change how answers are computed, not which (up to low-precision numerics).
    keep = {k: v for k, v in asdict(cfg).items() if k not in _NOT_RECORDED}
    return {
        "target": target_fingerprint,
        **({"dtype": dtype} if dtype else {}),
        **keep,
        **({"data": data} if data is not None else {}),
    }


def _flat(settings: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in settings.items() if k != "data"}
    out.update({f"data.{k}": v for k, v in (settings.get("data") or {}).items()})
    return out


def _check_meta(path: Path, settings: dict[str, Any]) -> None:
    """Refuse to append to `path` under settings that change the answers (naming each key, old and
    new value); allow and note a changed selection; record the settings in `<path>.meta.json`."""
    meta = regeneration_meta(path)
    if meta.exists():
        # A file from before backends existed was written by the local one.
        old = {"backend": "local", **json.loads(meta.read_text())}
        if old == settings:
            return
        a, b = _flat(old), _flat(settings)
        # A key one side lacks (an older eagle wrote the meta file) cannot be compared.
        diff = [k for k in sorted(set(a) & set(b)) if a[k] != b[k]]
        refused = [k for k in diff if k not in _FREE]
        if refused:
            lines = "\n".join(f"  {k}: {a[k]!r} -> {b[k]!r}" for k in refused)
            raise DataError(
                f"{path} was written with different settings (file -> this run):\n{lines}\n"
                "resuming would mix answers of both in one file. Either write to a new file (another "
                f"regenerate.output or output_dir), or move {path} away to regenerate from scratch there"
            )
        if diff:
            print(
                f"eagle-regenerate: resuming {path} with another selection: "
                + "; ".join(f"{k}: {a[k]!r} -> {b[k]!r}" for k in diff),
                file=sys.stderr,
            )
    tmp = meta.with_name(meta.name + ".tmp")
    tmp.write_text(json.dumps(settings, indent=2, sort_keys=True))
    os.replace(tmp, meta)


THINK_END = "</think>"  # where a reasoning model's thinking ends (Qwen3, DeepSeek-R1, ...)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(thinking, answer) of a generated text: thinking is what comes before the first `</think>` (an
    opening `<think>` removed), None when there is none."""
    if THINK_END not in text:
        return None, text
    thinking, answer = text.split(THINK_END, 1)
    return thinking.replace("<think>", "", 1).strip(), answer.strip()


def check_reasoning_setting(tokenizer: Any, cfg: RegenerateConfig) -> None:
    """regenerate.reasoning=off needs a template with a thinking switch; refused at start otherwise."""
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
    Asking for the same turn again (after a server failed) renders the same prompt."""

    def __init__(
        self,
        conversation: Conversation,
        tokenizer: Any,
        cfg: RegenerateConfig,
        on_done: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.id = conversation.id
        self.tokenizer, self.cfg, self.on_done = tokenizer, cfg, on_done
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
                switch = {"enable_thinking": False} if self.cfg.reasoning == "off" else {}
                text = render(self.tokenizer, self.history, add_generation_prompt=True, **switch)
                ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
                self.prompt_text = text
            except TemplateFailure:
                ids = []
            # A longer prompt ends the conversation here: training truncates at data.max_length anyway.
            ids = ids if len(ids) <= self.cfg.max_prompt_tokens else []
        if ids:
            return ids
        self._finish()
        return None

    def finish_answer(self, tokens: list[int], keep_ids: bool = True) -> None:
        """The answer as generated token ids (stop token excluded); `keep_ids` stores them in the record
        beside the text, so that training reads the ids the target generated (`eagle.data.template`)."""
        self.finish_text(self.tokenizer.decode(tokens, skip_special_tokens=True), list(tokens) if keep_ids else None)

    def finish_text(self, text: str, token_ids: list[int] | None = None) -> None:
        """The answer as text (the ids' decoding, special tokens skipped), with its ids where known."""
        self.pending.pop(0)  # the original answer is replaced
        thinking, reply = split_reasoning(text.strip())
        message: dict[str, Any] = {"role": "assistant", "content": reply}
        if thinking is not None and self.cfg.reasoning == "keep":
            message["reasoning_content"] = thinking
        if reply:
            self.history.append(message)
            if token_ids is not None and thinking is None:
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


def _batch_seed(seed: int, batch: list[Conversation]) -> int:
    """Seed from the batch's ids, so a resumed run samples what an uninterrupted one would have."""
    digest = hashlib.sha256(f"{seed}\x00".encode() + "\x00".join(c.id for c in batch).encode()).digest()
    return int.from_bytes(digest[:4], "big")


@torch.no_grad()
def generate_replies(
    model: Any, tokenizer: Any, prompts: list[list[int]], cfg: RegenerateConfig, stop_ids: list[int]
) -> list[list[int]]:
    """Answer tokens (stop token excluded) per prompt, by one left-padded batched `generate` call."""
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    # Generation appends on the right, so prompts are left-padded to end together.
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # [B, T]
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sample = cfg.temperature > 0
    kwargs: dict[str, Any] = dict(
        do_sample=sample, max_new_tokens=cfg.max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad
    )
    if sample:
        kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or None)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)  # [B, T + new]
    stops = set(stop_ids)
    answers = []
    for row in out[:, width:].tolist():
        answers.append(row[: next((k for k, t in enumerate(row) if t in stops), len(row))])
    return answers


def regenerate_batch(
    model: Any, tokenizer: Any, batch: list[Conversation], cfg: RegenerateConfig, stop_ids: list[int]
) -> list[dict[str, Any]]:
    """`regenerate.engine=generate`: a batch of conversations advances one assistant turn per round
    with left-padded `generate` calls. Records in the batch's order."""
    jobs = [ConversationJob(c, tokenizer, cfg) for c in batch]
    asking = [(j, p) for j in jobs if (p := j.next_prompt()) is not None]
    while asking:
        answers = generate_replies(model, tokenizer, [p for _, p in asking], cfg, stop_ids)
        for (job, _), answer in zip(asking, answers, strict=True):
            job.finish_answer(answer)
        asking = [(j, p) for j, _ in asking if (p := j.next_prompt()) is not None]
    return [j.record for j in jobs]


def _continuous(
    model: Any,
    tokenizer: Any,
    todo: list[Conversation],
    cfg: RegenerateConfig,
    stop_ids: list[int],
    write: Callable[[list[dict[str, Any]]], None],
    bar: Any,
) -> None:
    """`regenerate.engine=continuous`: conversations sorted by first-prompt length (slots that run
    together attend over similar lengths), each record written as soon as it is done."""

    def on_done(record: dict[str, Any]) -> None:
        write([record])

    jobs = [ConversationJob(c, tokenizer, cfg, on_done) for c in todo]
    firsts = {j.id: len(first_turn_prompt(tokenizer, c)) for j, c in zip(jobs, todo, strict=True)}
    jobs.sort(key=lambda j: firsts[j.id])
    sampling = Sampling(
        temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed
    )
    engine = ContinuousGenerator(model, cfg.batch_size, cfg.max_prompt_tokens + cfg.max_new_tokens, stop_ids, sampling)
    start = time.perf_counter()

    def progress(e: ContinuousGenerator) -> None:
        if e.forwards % 16 == 0:
            bar.set_postfix_str(f"{e.generated_tokens / (time.perf_counter() - start):.0f} tok/s", refresh=False)

    with slot_attention_enabled(model):
        engine.run(iter(jobs), on_step=progress)


def first_turn_prompt(tokenizer: Any, conversation: Conversation) -> list[int]:
    """Prompt ids of the conversation up to its first user turn, ready for the answer ([] if the
    chat template cannot render it)."""
    turns = []
    for m in conversation.messages:
        turns.append(m)
        if m["role"] == "user":
            break
    try:
        return list(
            tokenizer(render(tokenizer, turns, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        )
    except TemplateFailure:
        return []


@runtime_checkable
class RegenerationBackend(Protocol):
    """Where the target runs. `regenerate()` asks it who generates (`start`, recorded in the meta file, so a
    resume elsewhere is refused) and hands it the conversations still to do (`run`, which passes every
    finished record to `write` as soon as it is done)."""

    def start(self, tokenizer: Any, cfg: RegenerateConfig) -> dict[str, Any]: ...

    def run(
        self,
        todo: list[Conversation],
        tokenizer: Any,
        cfg: RegenerateConfig,
        stop_ids: list[int],
        write: Callable[[list[dict[str, Any]]], None],
        bar: Any,
    ) -> None: ...


class LocalBackend:
    """`regenerate.backend=local`: an HF model in this process, run by `regenerate.engine`."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def start(self, tokenizer: Any, cfg: RegenerateConfig) -> dict[str, Any]:
        return {"backend": "local"}

    def run(
        self,
        todo: list[Conversation],
        tokenizer: Any,
        cfg: RegenerateConfig,
        stop_ids: list[int],
        write: Callable[[list[dict[str, Any]]], None],
        bar: Any,
    ) -> None:
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                if cfg.engine == "continuous":
                    _continuous(model, tokenizer, todo, cfg, stop_ids, write, bar)
                else:
                    for k in range(0, len(todo), cfg.batch_size):
                        batch = todo[k : k + cfg.batch_size]
                        torch.manual_seed(_batch_seed(cfg.seed, batch))
                        write(regenerate_batch(model, tokenizer, batch, cfg, stop_ids))
        finally:
            model.train(was_training)


def regenerate(
    target: Any,
    tokenizer: Any,
    conversations: list[Conversation],
    cfg: RegenerateConfig,
    output: Path,
    target_fingerprint: str = "",
    progress: bool = True,
    data: DataConfig | None = None,
    dtype: str | None = None,
) -> Path:
    """Regenerate `conversations` into `output` (JSONL), resuming from what it already holds.

    `target` is an HF model (run by `LocalBackend`) or a `RegenerationBackend` (e.g.
    `eagle.data.server.ServerBackend`). `target_fingerprint` names the target whose tokenizer and chat
    template render the prompts. `data` (the settings `conversations` were read with) is recorded too,
    so a resume on other data is refused rather than appended."""
    check_reasoning_setting(tokenizer, cfg)
    backend = target if isinstance(target, RegenerationBackend) else LocalBackend(target)
    who = backend.start(tokenizer, cfg)  # a server backend checks every server here, before anything is written
    output.parent.mkdir(parents=True, exist_ok=True)
    settings = {**_settings(cfg, target_fingerprint, data_identity(data) if data is not None else None, dtype), **who}
    _check_meta(output, settings)
    done = recover_output(output)
    todo = [c for c in conversations if c.id not in done]
    stop_ids = end_of_turn_ids(tokenizer)
    bar = tqdm(
        total=len(conversations),
        initial=len(conversations) - len(todo),
        desc="regenerate",
        unit="conv",
        disable=not progress,
    )
    try:
        with open(output, "a", encoding="utf-8") as f:

            def write(records: list[dict[str, Any]]) -> None:
                f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
                f.flush()
                os.fsync(f.fileno())
                bar.update(len(records))

            backend.run(todo, tokenizer, cfg, stop_ids, write, bar)
    finally:
        bar.close()
    return output
