"""Does the capture's storage dtype cost held-out accuracy? float16 vs bfloat16 features, same
conversations, same training run otherwise.

    python -m benchmarks capture_dtype --capture outputs/study/capture-float32 --steps 800 \
        [--dtypes float16,bfloat16] [--seeds 0] [--json OUT] [--workdir DIR] [override ...]

`--capture` is a float32 capture (`eagle-capture ... capture.dtype=float32`). Each storage dtype gets a
copy of it with every feature rounded to that dtype (`<capture>-as-<dtype>`): exactly what a capture
in that dtype stores, since capture computes in the target's dtype and rounds once when it writes. The
script prints, per dtype and feature, the largest relative rounding error and how many values overflow
(become inf), then trains the recipe for a fixed number of steps on each copy (same seed, so the same
batches and initialisation: the features' rounding is the only difference) and reads held-out acc@k and
tau_sim at the end. A fixed step count, not a wall-clock budget, because both dtypes cost the same per
step: the comparison then does not depend on what else the machine is doing. `--seeds 0,1` repeats the
pair with another training seed, which shows the noise of the comparison.

With --json the file is rewritten after every run; the same command skips runs it already holds.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from benchmarks.studies._study import study_parser
from eagle.capture.store import (
    MANIFEST,
    SHARD_METADATA_KEY,
    assemble_manifest,
    read_manifest,
    write_shard,
)
from eagle.cli.app import compose
from eagle.fileio import atomic_write_text
from eagle.target.precision import DTYPES
from eagle.train.trainer import train

FEATURES = ("final_hidden", "aux_hidden")


def recast(source: Path, dtype: str) -> tuple[Path, dict[str, dict[str, float]]]:
    """A copy of the float32 capture `source` with features stored in `dtype` (reused if complete), and
    per feature the largest relative rounding error (|x - round(x)| / max|x|) and the overflow count."""
    manifest = read_manifest(source)
    if manifest["dtype"] != "float32":
        raise SystemExit(f"--capture {source}: stored in {manifest['dtype']}; capture with capture.dtype=float32")
    out = source.parent / f"{source.name}-as-{dtype}"
    errors: dict[str, dict[str, float]] = {}
    shards = {}
    done = (out / MANIFEST).is_file() and read_manifest(out).get("complete")
    for entry in manifest["shards"]:
        with safe_open(source / entry["file"], "pt") as f:
            meta = json.loads(f.metadata()[SHARD_METADATA_KEY])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        for name in FEATURES:
            if name not in tensors:
                continue
            x = tensors[name]  # [N, ...] float32
            rounded = x.to(DTYPES[dtype]).float()
            finite = torch.isfinite(rounded)
            scale = x.abs().max().clamp_min(1e-30)
            stat = errors.setdefault(name, {"max_rel_error": 0.0, "overflows": 0, "max_abs": 0.0})
            stat["max_rel_error"] = max(stat["max_rel_error"], float((x - rounded)[finite].abs().max() / scale))
            stat["overflows"] += int((~finite).sum())
            stat["max_abs"] = max(stat["max_abs"], float(scale))
        if done:
            continue
        offsets = tensors["offsets"].tolist()
        cuts = list(zip(offsets[:-1], offsets[1:], strict=True))
        shards[(entry["split"], entry["index"])] = write_shard(
            out,
            entry["split"],
            entry["index"],
            meta["ids"],
            [tensors["input_ids"][a:b].tolist() for a, b in cuts],
            [tensors["loss_mask"][a:b].tolist() for a, b in cuts],
            {name: [tensors[name]] for name in FEATURES if name in tensors},
            dtype,
        )
    if not done:
        header = {k: v for k, v in manifest.items() if k not in ("shards", "totals", "complete")}
        atomic_write_text(out / MANIFEST, json.dumps(assemble_manifest({**header, "dtype": dtype}, shards), indent=2))
    return out, errors


def run(capture: Path, steps: int, seed: int, base: list[str], work: Path) -> dict:
    t0 = time.perf_counter()
    result = train(
        compose(
            base
            + [
                f"train.data_dir={capture}",
                f"train.max_steps={steps}",
                f"train.seed={seed}",
                f"output_dir={work / f'{capture.name}-seed{seed}'}",
                "train.eval_every=1000000",
                "train.save_every=100",
                "train.resume=auto",
            ]
        )
    )
    return {
        "steps": result.step,
        "wall_s": time.perf_counter() - t0,
        "heldout": result.eval_metrics,
        "tokens_per_s": result.train_metrics.get("tokens_per_s"),
    }


def main(argv: list[str] | None = None) -> int:
    p = study_parser(__doc__, "a float32 eagle-capture output_dir", "Hydra overrides for every run")
    p.add_argument("--steps", type=int, default=800, help="training steps per run (the 20-minute study's ~800)")
    p.add_argument("--dtypes", default="float16,bfloat16")
    args = p.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-capture-dtype-"))
    base = [f"recipe={args.recipe}", f"train.eval_batches={args.eval_batches}", "train.log_every=50", *args.overrides]
    report = {"capture": str(args.capture), "steps": args.steps, "base": base, "rounding": {}, "runs": []}
    if args.json and args.json.is_file():
        old = json.loads(args.json.read_text())
        if all(old.get(k) == report[k] for k in ("capture", "steps", "base")):
            report["runs"] = old.get("runs", [])
    for dtype in args.dtypes.split(","):
        copy, report["rounding"][dtype] = recast(args.capture, dtype)
        print(f"{dtype}: {json.dumps(report['rounding'][dtype])}", flush=True)
        for seed in map(int, args.seeds.split(",")):
            if any(r["dtype"] == dtype and r["seed"] == seed for r in report["runs"]):
                continue
            report["runs"].append({"dtype": dtype, "seed": seed, **run(copy, args.steps, seed, base, work)})
            print(json.dumps(report["runs"][-1], default=str), flush=True)
            if args.json:
                atomic_write_text(args.json, json.dumps(report, indent=2, default=str) + "\n")
    print(f"\n{args.steps} steps per run on copies of {args.capture}")
    print("dtype      seed  max rel. rounding (final / aux)  overflows  acc@0  acc@1  acc@2  tau_sim")
    for r in report["runs"]:
        m, e = r["heldout"] or {}, report["rounding"].get(r["dtype"], {})
        rel = " / ".join(f"{e[f]['max_rel_error']:.1e}" for f in FEATURES if f in e)
        print(
            f"{r['dtype']:<10} {r['seed']:4d}  {rel:>30}  {sum(v['overflows'] for v in e.values()):9d}  "
            f"{m.get('acc_0', float('nan')):.3f}  {m.get('acc_1', float('nan')):.3f}  {m.get('acc_2', float('nan')):.3f}"
            f"  {m.get('tau_sim', float('nan')):7.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
