"""The local backend: the target in this process, with the `continuous` engine (`eagle.decode.continuous`:
a slot freed by a finished conversation takes the next one at once) or `generate` (left-padded HF `generate`,
one assistant turn per round for a batch).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import torch

from eagle.config import RegenerateConfig
from eagle.data.harmony import HarmonyRenderer
from eagle.data.records import Conversation
from eagle.decode.continuous import ContinuousGenerator, Sampling, slot_attention_enabled
from eagle.regenerate.job import ConversationJob, first_turn_prompt


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
    model: Any,
    tokenizer: Any,
    batch: list[Conversation],
    cfg: RegenerateConfig,
    stop_ids: list[int],
    harmony: HarmonyRenderer | None = None,
) -> list[dict[str, Any]]:
    """`regenerate.engine=generate`: a batch of conversations advances one assistant turn per round
    with left-padded `generate` calls. Records in the batch's order."""
    jobs = [ConversationJob(c, tokenizer, cfg, harmony=harmony) for c in batch]
    asking = [(j, p) for j in jobs if (p := j.next_prompt()) is not None]
    while asking:
        answers = generate_replies(model, tokenizer, [p for _, p in asking], cfg, stop_ids)
        for (job, _), answer in zip(asking, answers, strict=True):
            job.finish_answer(answer)
        asking = [(j, p) for j, _ in asking if (p := j.next_prompt()) is not None]
    return [j.record for j in jobs if j.record is not None]  # every job has finished: each holds its record


def _continuous(
    model: Any,
    tokenizer: Any,
    todo: list[Conversation],
    cfg: RegenerateConfig,
    stop_ids: list[int],
    write: Callable[[list[dict[str, Any]]], None],
    bar: Any,
    harmony: HarmonyRenderer | None = None,
) -> None:
    """`regenerate.engine=continuous`: conversations sorted by first-prompt length (slots that run
    together attend over similar lengths), each record written as soon as it is done."""

    def on_done(record: dict[str, Any]) -> None:
        write([record])

    jobs = [ConversationJob(c, tokenizer, cfg, on_done, harmony) for c in todo]
    firsts = {j.id: len(first_turn_prompt(tokenizer, c, harmony)) for j, c in zip(jobs, todo, strict=True)}
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
        harmony: HarmonyRenderer | None = None,
    ) -> None:
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                if cfg.engine == "continuous":
                    _continuous(model, tokenizer, todo, cfg, stop_ids, write, bar, harmony)
                else:
                    for k in range(0, len(todo), cfg.batch_size):
                        batch = todo[k : k + cfg.batch_size]
                        torch.manual_seed(_batch_seed(cfg.seed, batch))
                        write(regenerate_batch(model, tokenizer, batch, cfg, stop_ids, harmony))
        finally:
            model.train(was_training)
