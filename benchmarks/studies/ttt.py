"""Time one EAGLE-3 training step (loss forward + backward + AdamW) with the training-time-test attention
structured (`UnrolledChainMask`, the default) against the dense `ttt_mask` through SDPA (the plain
definition), on the recipe's head over the bundled target, same process, same random batch.

    python -m benchmarks ttt [--lengths 256,768] [--ttt 3,5,7] [--batch-size 2] [--repeats 3]
        [--recipe smollm2-135m-instruct] [--json OUT] [override ...]

Each (length, TTT) cell runs dense and structured alternately `--repeats` times after one warm-up each
and reports the median seconds per step and the dense/structured ratio. The batch is random tokens and
features with a loss on the last 80% of each sequence (a chat answer after its prompt); timings do not
depend on the values. The two paths give the same loss (printed: largest relative difference).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from eagle.algorithms import get_algorithm
from eagle.algorithms.head_io import build_head, head_config_from_target
from eagle.cli.app import compose
from eagle.target.loading import load_target


def _batch(b: int, t: int, vocab: int, aux: int, hidden: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.ones(b, t, dtype=torch.uint8)
    loss_mask[:, : t // 5] = 0  # the prompt
    return {
        "input_ids": torch.randint(0, vocab, (b, t), generator=g),
        "attention_mask": torch.ones(b, t, dtype=torch.long),
        "loss_mask": loss_mask,
        "aux_hidden": torch.randn(b, t, aux, hidden, generator=g).half(),
        "final_hidden": torch.randn(b, t, hidden, generator=g).half(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="256,768", help="comma-separated sequence lengths")
    p.add_argument("--ttt", default="3,5,7", help="comma-separated train.ttt_steps values")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--recipe", default="smollm2-135m-instruct")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("overrides", nargs="*", help="Hydra overrides (e.g. draft.draft_vocab_size=4096)")
    args = p.parse_args(argv)

    cfg = compose([f"recipe={args.recipe}", *args.overrides])
    target, _, info = load_target(cfg.target, stage="train")
    head_cfg = head_config_from_target(target.config, cfg.draft)
    vocab_counts = torch.ones(head_cfg.vocab_size)  # the draft vocabulary's choice does not change timings
    head = build_head(head_cfg, target, vocab_counts)
    algorithm = get_algorithm(head_cfg.algorithm)
    lm_head = target.get_output_embeddings()
    label_rows = algorithm.label_rows(head, lm_head)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-5)

    def step(batch: dict, steps: int, dense: bool) -> tuple[float, float]:
        settings = replace(
            algorithm.loss_settings(cfg.draft, cfg.train, 0, training=True), steps=steps, dense_ttt_mask=dense
        )
        t0 = time.perf_counter()
        parts = algorithm.forward_loss(head, lm_head, batch, settings, None, label_rows)
        parts.objective.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, float(parts.objective.detach())

    rows = []
    print(
        f"{info.model_type} target, head {head_cfg.hidden_size} wide, draft vocab {head_cfg.draft_vocab_size}, "
        f"batch {args.batch_size}, {torch.get_num_threads()} threads, {next(head.parameters()).dtype}"
    )
    print("length  ttt   dense s/step  structured s/step  dense/structured  loss rel. diff")
    for t in (int(x) for x in args.lengths.split(",")):
        batch = _batch(
            args.batch_size, t, head_cfg.vocab_size, len(head_cfg.aux_layer_ids), head_cfg.target_hidden_size, seed=t
        )
        for steps in (int(x) for x in args.ttt.split(",")):
            times: dict[bool, list[float]] = {True: [], False: []}
            losses: dict[bool, float] = {}
            saved = {k: v.detach().clone() for k, v in head.state_dict().items()}
            for rep in range(args.repeats + 1):
                for dense in (True, False):
                    head.load_state_dict(saved)  # the same weights for both paths: equal losses
                    seconds, loss = step(batch, steps, dense)
                    losses[dense] = loss
                    if rep:  # the first round warms up both paths
                        times[dense].append(seconds)
            dense_s, fast_s = statistics.median(times[True]), statistics.median(times[False])
            diff = abs(losses[True] - losses[False]) / max(abs(losses[True]), 1e-12)
            rows.append(
                {
                    "length": t,
                    "ttt_steps": steps,
                    "dense_s": dense_s,
                    "structured_s": fast_s,
                    "ratio": dense_s / fast_s,
                    "loss_rel_diff": diff,
                    "dense_runs": times[True],
                    "structured_runs": times[False],
                }
            )
            print(
                f"{t:6d}  {steps:3d}  {dense_s:12.2f}  {fast_s:17.2f}  {dense_s / fast_s:15.2f}x  {diff:.1e}",
                flush=True,
            )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "threads": torch.get_num_threads(),
                    "batch_size": args.batch_size,
                    "recipe": args.recipe,
                    "overrides": args.overrides,
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
