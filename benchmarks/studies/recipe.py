"""Which training settings learn most in a fixed CPU budget: one run per variant, same capture,
same wall-clock budget, held-out acc@k / tau_sim at the end. All in one process, one after another.

    python -m benchmarks recipe --capture outputs/ref/capture --minutes 20 \
        [--variants old,recipe,lr-3e-4,...] [--eval-batches 24] [--workdir DIR] [--json OUT] [override ...]
    python -m benchmarks recipe --capture outputs/ref/capture --steps 400 --seeds 0,1 \
        --variants recipe,eagle3.0 ...

`--steps N` (accounting "steps") trains every variant for N steps instead of a wall-clock budget, each
with every seed in `--seeds`: for variants that cost the same per step (the EAGLE-3.1 norms add two
RMSNorms to a decoder layer) the comparison is then the same as a budget's, but does not depend on
what else the machine runs; the seeds (same seed = same batches and initialisation in both variants)
show the noise of the comparison. s/step is still printed, to show the per-step costs are equal.

With --json the file is rewritten after every variant; the same command run again skips the variants
it already holds (same budget, capture and overrides), so a study can span sessions.

Each variant trains for the budget's wall time with its lr schedule spread over those minutes
(`train.schedule_over=minutes`: warm-up, then the cosine decay ends when the budget does), starting
with the untrained held-out evaluation (inside the budget) and evaluated once more at the end (after
it). Variants that cost more per step (longer TTT unroll, larger draft vocabulary) get fewer steps:
that is the trade being measured.
The held-out figures are on the capture's held-out split (`--eval-batches` x batch 2 conversations).

`old` is the recipe before the training issue (float32, random batches, no EAGLE-3.1 norms, TTT 5); `recipe`
is recipes/smollm2-135m-instruct.yaml as it stands (bf16 autocast where native, length grouping, TTT 3;
the EAGLE-3.1 norms were on from 2026-12-04 to the 2026-12-07 norm study, off since); other variants
change one thing of `recipe`. The ratio
column is acc@0 against `old`.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.studies._study import study_parser
from eagle.cli.app import compose
from eagle.train.trainer import train

VARIANTS: dict[str, list[str]] = {
    # The recipe before the training issue: float32, random batches, plain EAGLE-3.
    "old": [
        "train.mixed_precision=no",
        "train.group_by_length=false",
        "draft.fc_norm=false",
        "draft.norm_output=false",
        "train.ttt_steps=5",
    ],
    "recipe": [],
    # The pair of the 2026-12-07 norm study (docs/benchmarks.md): plain EAGLE-3 (the recipe since) and EAGLE-3.1.
    "eagle3.0": ["draft.fc_norm=false", "draft.norm_output=false"],
    "lr-3e-4": ["train.lr=3e-4"],
    "lr-1.2e-3": ["train.lr=1.2e-3"],
    "warmup-200": ["train.warmup_steps=200"],
    "ttt-3": ["train.ttt_steps=3"],  # the recipe's own setting since the 2026-12-06 study (accounting 3)
    "ttt-5": ["train.ttt_steps=5"],  # the recipe's setting before it
    "ttt-7": ["train.ttt_steps=7"],
    "vocab-4096": ["draft.draft_vocab_size=4096"],
    "vocab-16384": ["draft.draft_vocab_size=16384"],
    # SpecForge / speculators / vLLM norms: the recipe's own setting since the study, kept as a name
    # so that the study's command (docs/benchmarks.md, History) still reproduces its rows.
    "eagle3.1": ["draft.fc_norm=true", "draft.norm_output=true"],
    # The decoder layer copied from the target's last layer, fc a pass-through of the highest aux layer.
    # 2026-12-06, AVX2 CPU, float32, 800-conversation capture, accounting 1: acc@0 0.280 vs recipe 0.304.
    "target-layer": ["train.init_layer_from_target=-1"],
    # lm_head fixed at the target's rows (the labels' own), the final norm from the target's.
    "freeze-lm-head": ["train.freeze_lm_head=true"],
    # Block drafters (#43's study), on the same capture as the EAGLE-3 recipe: acc@j is block position j + 1
    # (DFlash) or depth j (P-EAGLE), each drafted in one pass; `recipe` is the EAGLE-3 head they are against.
    "dflash-b8": ["draft=dflash", "draft.block_size=8", "draft.aux_layer_ids=[2,15,27]"],
    "dflash-b16": ["draft=dflash", "draft.block_size=16", "draft.aux_layer_ids=[2,15,27]"],
    "dflash-b8-l2": ["draft=dflash", "draft.block_size=8", "draft.num_layers=2", "draft.aux_layer_ids=[2,15,27]"],
    "peagle-k4": [
        "draft=peagle",
        "draft.parallel_tokens=4",
        "draft.aux_layer_ids=[2,15,27]",
        "draft.draft_vocab_size=8192",
    ],
    "peagle-k8": [
        "draft=peagle",
        "draft.parallel_tokens=8",
        "draft.aux_layer_ids=[2,15,27]",
        "draft.draft_vocab_size=8192",
    ],
    "recipe-lk": ["train.loss=lk_hybrid"],
    "peagle-k4-lk": [
        "draft=peagle",
        "draft.parallel_tokens=4",
        "draft.aux_layer_ids=[2,15,27]",
        "draft.draft_vocab_size=8192",
        "train.loss=lk_hybrid",
    ],
    "dflash-b8-lk": ["draft=dflash", "draft.block_size=8", "draft.aux_layer_ids=[2,15,27]", "train.loss=lk_hybrid"],
}


def _train(overrides: list[str]):
    return train(compose(overrides))


def run_variant(
    name: str, base: list[str], work: Path, minutes: float, steps: int | None = None, seed: int | None = None
) -> dict:
    extra = VARIANTS[name]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if steps is not None:  # accounting "steps": the lr schedule runs over the steps, no wall-clock cap
        budget = [f"output_dir={work / f'{name}-seed{seed}-{stamp}'}", f"train.max_steps={steps}", f"train.seed={seed}"]
    else:
        # The lr decays over the budget's wall time (train.schedule_over=minutes), so every variant ends its
        # schedule when its minutes end, whatever its step time; max_steps only caps. The budget includes
        # setup and the untrained held-out evaluation; the final evaluation runs after it.
        budget = [
            f"output_dir={work / f'{name}-{stamp}'}",
            "train.max_steps=1000000",
            f"train.max_minutes={minutes}",
            "train.schedule_over=minutes",
        ]
    t0 = time.perf_counter()
    result = _train(base + extra + budget + ["train.eval_every=1000000", "train.save_every=50", "train.resume=false"])
    return {
        "variant": name,
        "seed": seed,
        "overrides": extra,
        "steps": result.step,
        "stopped": result.stopped,
        "wall_s": time.perf_counter() - t0,
        "tokens_per_s": result.train_metrics.get("tokens_per_s"),
        "timings": result.timings,
        "heldout": result.eval_metrics,
        "best_tau_sim": result.best_metric,
        "best_step": result.best_step,
        "output_dir": str(result.output_dir),
    }


def _settings_sha256(base: list[str]) -> str:
    """sha256 of the resolved config the base overrides compose (the `recipe` variant's settings)."""
    text = json.dumps(asdict(compose(base)), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _finished_runs(path: Path | None, report: dict) -> dict[str, dict]:
    """Variants already measured in `path` under the same budget, capture and base settings."""
    if path is None or not path.is_file():
        return {}
    old = json.loads(path.read_text())
    if any(
        old.get(k) != report.get(k) for k in ("minutes", "steps", "capture", "base", "accounting", "settings_sha256")
    ):
        print(
            f"{path}: another budget, capture, base settings, resolved settings or budget accounting; measuring every variant "
            "again",
            flush=True,
        )
        return {}
    return {(r["variant"], r.get("seed")): r for r in old.get("runs", [])}


def main(argv: list[str] | None = None) -> int:
    p = study_parser(__doc__, "an eagle-capture output_dir (recipe settings)", "Hydra overrides for every variant")
    p.add_argument("--minutes", type=float, default=20.0, help="wall-clock budget per variant")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="train each variant for this many steps (accounting 'steps') instead of --minutes; only then does "
        "each of --seeds make a run per variant",
    )
    p.add_argument("--variants", default="old,recipe", help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        p.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if not (args.capture / "manifest.json").is_file():
        p.error(f"--capture {args.capture}: no manifest.json (run eagle-capture recipe={args.recipe} first)")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-recipe-"))
    base = [
        f"recipe={args.recipe}",
        f"train.data_dir={args.capture}",
        f"train.eval_batches={args.eval_batches}",
        "train.log_every=10",
        *args.overrides,
    ]
    # accounting 3: the lr decays over the budget's minutes and the only held-out evaluation inside it is
    # the untrained one. Earlier studies planned max_steps from a short probe (off by up to 1.6x, so a
    # schedule ended early or was cut) and evaluated 10 times (30-50% of a budget); rows of another
    # accounting are not comparable and are measured again.
    # Changed settings (the recipe's values or a code default) change what `recipe` and every variant
    # built on it mean: measured again. The composed config is hashed, so a comment in the YAML is not.
    report = {
        "minutes": None if args.steps else args.minutes,
        "steps": args.steps,
        "capture": str(args.capture),
        "base": base,
        "accounting": "steps" if args.steps else 3,
        "settings_sha256": _settings_sha256(base),
        "runs": [],
    }
    done = _finished_runs(args.json, report)
    # Seeds only in the steps accounting: a wall-clock run is one per variant (seed None), as before.
    seeds = [int(s) for s in args.seeds.split(",")] if args.steps else [None]
    # Seed-major order: each seed's pair finishes before the next seed starts, so a study cut short
    # still holds complete pairs.
    jobs = [(name, seed) for seed in seeds for name in variants]
    rows = []
    for name, seed in jobs:
        if (name, seed) in done:  # a study cut short (a session's end) goes on where it stopped
            print(f"{name} seed {seed}: reusing the finished run in {args.json}", flush=True)
            rows.append(done[(name, seed)])
        else:
            rows.append(run_variant(name, base, work, args.minutes, args.steps, seed))
            print(json.dumps(rows[-1], default=str), flush=True)  # each variant's result as soon as it exists
        if args.json:  # written after every variant, so a stopped study keeps what it measured
            report["runs"] = rows + [r for key, r in done.items() if key not in jobs]
            args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    old_by_seed = {r.get("seed"): r for r in rows if r["variant"] == "old"}
    budget = f"{args.steps} steps" if args.steps else f"{args.minutes:g} minutes"
    print(f"\n{budget} per variant on {args.capture}")
    print("variant        seed  steps  s/step  tok/s   acc@0  acc@1  acc@2  tau_sim  acc@0 vs old")
    for r in rows:
        m = r["heldout"] or {}
        old = old_by_seed.get(r.get("seed"))
        ratio = (
            f"{m['acc_0'] / old['heldout']['acc_0']:.2f}x"
            if old and old["heldout"] and old["heldout"].get("acc_0") and "acc_0" in m
            else "-"
        )
        seed = "-" if r.get("seed") is None else str(r["seed"])
        print(
            f"{r['variant']:<14} {seed:>4}  {r['steps']:5d}  {r['wall_s'] / max(r['steps'], 1):6.2f}  {r['tokens_per_s'] or 0:5.0f}  "
            f"{m.get('acc_0', float('nan')):.3f}  {m.get('acc_1', float('nan')):.3f}  {m.get('acc_2', float('nan')):.3f}"
            f"  {m.get('tau_sim', float('nan')):7.3f}  {ratio}"
        )
    if len(seeds) > 1 and len(variants) > 1:  # paired by seed: same batches and initialisation
        first = {r.get("seed"): r for r in rows if r["variant"] == variants[0]}
        for name in variants[1:]:
            diffs = [
                r["heldout"]["acc_0"] - first[r.get("seed")]["heldout"]["acc_0"]
                for r in rows
                if r["variant"] == name and r.get("seed") in first and r["heldout"] and first[r.get("seed")]["heldout"]
            ]
            if diffs:
                print(
                    f"acc@0 {name} - {variants[0]}, per seed: {', '.join(f'{d:+.3f}' for d in diffs)}; "
                    f"mean {sum(diffs) / len(diffs):+.3f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
