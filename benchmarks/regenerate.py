"""Self-distillation throughput: continuous batching vs padded-batch and one-at-a-time `generate`.

    python -m benchmarks regenerate [--conversations 64] [--baseline-conversations 6] \
        [--slots 32 64] [--padded-batch 32] [eagle config overrides ...]

In one process, same target, dtype and threads, over the same ShareGPT first turns (training data:
MT-bench / HumanEval are removed as for training), at `regenerate.max_new_tokens` (default 256), greedy:
  * one-at-a-time: `regenerate.engine=generate batch_size=1` (HF `generate`, one conversation per call)
    over the first --baseline-conversations,
  * padded batch: `regenerate.engine=generate batch_size=--padded-batch` (left-padded HF `generate`),
  * continuous: `regenerate.engine=continuous` with each --slots value.
Each runs the real `regenerate()` (file writes included) into a temporary file. Prints conversations
per minute, answer tokens/s (answers re-tokenised, identically for every mode) and the ratio to the
one-at-a-time baseline, and, for greedy, how many answers equal the padded batch's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from eagle.cli.app import compose
from eagle.data.dataset import load_conversations
from eagle.regenerate.runner import regenerate
from eagle.target.loading import load_target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="eagle config overrides, e.g. target.dtype=float32")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--baseline-conversations", type=int, default=6)
    parser.add_argument("--slots", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--padded-batch", type=int, default=32, help="0 skips the padded-batch run")
    args = parser.parse_args(argv)

    cfg = compose(["regenerate.max_turns=1", f"data.max_conversations={args.conversations}", *args.overrides])
    model, tokenizer, info = load_target(cfg.target, stage="regenerate")
    conversations, _ = load_conversations(cfg.data)
    print(
        f"target {info.source} dtype {info.dtype}, threads {torch.get_num_threads()}, "
        f"{len(conversations)} conversations, max_new_tokens {cfg.regenerate.max_new_tokens}"
    )

    def run(name: str, convs: list, **changes) -> dict:
        rcfg = replace(cfg.regenerate, **changes)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.jsonl"
            start = time.perf_counter()
            regenerate(model, tokenizer, convs, rcfg, out, progress=False)
            seconds = time.perf_counter() - start
            records = {r["id"]: r for r in map(json.loads, out.read_text(encoding="utf-8").split("\n")[:-1])}
        answers = {
            i: "".join(m["content"] for m in r["messages"] if m["role"] == "assistant") for i, r in records.items()
        }
        tokens = sum(len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers.values())
        row = {
            "mode": name,
            "conversations": len(records),
            "seconds": seconds,
            "conv_per_min": 60 * len(records) / seconds,
            "tok_per_s": tokens / seconds,
            "answers": answers,
        }
        print(
            f"{name:>24}: {len(records):4d} conv in {seconds:7.1f} s = {row['conv_per_min']:6.1f} conv/min, "
            f"{row['tok_per_s']:6.1f} answer tok/s",
            flush=True,
        )
        return row

    base = run("one-at-a-time generate", conversations[: args.baseline_conversations], engine="generate", batch_size=1)
    rows = [base]
    padded = None
    if args.padded_batch:
        padded = run(
            f"padded generate x{args.padded_batch}", conversations, engine="generate", batch_size=args.padded_batch
        )
        rows.append(padded)
    for slots in args.slots:
        rows.append(run(f"continuous x{slots}", conversations, engine="continuous", batch_size=slots))

    print("\n| mode | conversations | conv/min | answer tok/s | vs one-at-a-time | greedy answers = padded |")
    print("|---|---:|---:|---:|---:|---|")
    for row in rows:
        same = ""
        if padded is not None and cfg.regenerate.temperature == 0 and row is not base and row is not padded:
            common = [i for i in row["answers"] if i in padded["answers"]]
            same = f"{sum(row['answers'][i] == padded['answers'][i] for i in common)}/{len(common)}"
        print(
            f"| {row['mode']} | {row['conversations']} | {row['conv_per_min']:.1f} | {row['tok_per_s']:.1f} | "
            f"{row['tok_per_s'] / base['tok_per_s']:.2f}x | {same} |"
        )


if __name__ == "__main__":
    main()
