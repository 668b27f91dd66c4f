"""Speculative decoding figures for SmolLM2-135M-Instruct on MT-bench, with a trained head.

    python scripts/bench_decode.py [HEAD_DIR] [--max-prompts 10] [--max-new-tokens 128] [--turns first]
                                   [--threads N] [--tree auto] [--tree-sweep 4 8 16 32] [override ...]

HEAD_DIR is anything `draft.path` accepts (training output dir, checkpoint dir, head folder or
exported folder); default: heads/smollm2-135m-instruct-eagle3 in this repository. The tree is
auto-tuned by default (verify passes timed on this machine). One `eagle-eval` run measures, on the
same prompts and with the same torch threads, the speculative decoder, the target's plain
autoregressive decoding (same cache code), HF `generate` and HF prompt-lookup decoding; this script
prints the headline numbers plus the decoder's overhead per step, and exits 1 if greedy output ever
differs from HF generate's. Full results: OUTPUT_DIR/report.json, report.md and plots.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_HEAD = REPO / "heads" / "smollm2-135m-instruct-eagle3"


def _f(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("head", nargs="?", default=None, help=f"draft head (default: {DEFAULT_HEAD})")
    parser.add_argument("overrides", nargs="*", help="further eagle config overrides, e.g. decode.temperature=0.7")
    parser.add_argument("--max-prompts", type=int, default=10, help="first N MT-bench questions (80 in all)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--turns", choices=("first", "all"), default="first")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for every method (default: torch's)")
    parser.add_argument("--tree", choices=("auto", "dynamic", "static"), default="auto")
    parser.add_argument("--tree-sweep", type=int, nargs="*", default=[], help="tree sizes for speedup_vs_tree.png")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up prompts (not measured)")
    parser.add_argument("--output-dir", default=str(REPO / "outputs" / "bench_decode"))
    args = parser.parse_args(argv)

    head = Path(args.head) if args.head else DEFAULT_HEAD
    if not head.exists():
        parser.error(f"no draft head at {head}: train one (eagle-train recipe=smollm2-135m-instruct) and pass its "
                     "output dir, or pass any head folder")

    from eagle.cli.app import compose
    from eagle.errors import EagleError
    from eagle.evaluate import evaluate

    overrides = [
        "recipe=smollm2-135m-instruct",
        f"draft.path={head}",
        "eval.prompts=mt_bench",
        f"eval.max_prompts={args.max_prompts}",
        f"eval.turns={args.turns}",
        f"eval.warmup_prompts={args.warmup}",
        f"decode.max_new_tokens={args.max_new_tokens}",
        f"decode.tree={args.tree}",
        f"output_dir={args.output_dir}",
    ]
    if args.threads:
        overrides.append(f"eval.num_threads={args.threads}")
    if args.tree_sweep:
        overrides.append(f"eval.tree_sweep=[{','.join(map(str, args.tree_sweep))}]")
    try:
        r = evaluate(compose([*overrides, *args.overrides]))
    except EagleError as e:
        print(f"bench_decode: error: {e}", file=sys.stderr)
        return 2

    s, d, hw = r["settings"], r["decoder"], r["settings"]["hardware"]
    print(f"\nSmolLM2-135M-Instruct + {s['draft_folder']} ({s['algorithm']}), MT-bench x{r['num_prompts']} "
          f"({r['num_turns']} turns), T={s['temperature']}, max_new_tokens={s['max_new_tokens']}")
    print(f"hardware: {hw['cpu']} | {hw['torch_threads']} torch threads | torch {hw['torch_version']} | {hw['device']}")
    print(f"tree: {s['tree']} | mean verified tree size {_f(r['mean_tree_size'], '.1f')}")
    if s.get("auto_verify_seconds"):
        print("verify pass ms by size: " + ", ".join(f"{k}: {1000 * v:.1f}" for k, v in s["auto_verify_seconds"].items()))
    print(f"\n{'method':<16}{'tokens':>8}{'seconds':>10}{'tok/s':>10}")
    for name, m in r["methods"].items():
        print(f"{name:<16}{m['tokens']:>8}{m['seconds']:>10.2f}{m['tokens_per_s']:>10.1f}")
    print(f"\ntau {_f(r['tau'])} | accept rate by depth {[round(x, 3) for x in r['accept_rate_by_depth']]}")
    print(f"speedup vs HF generate {_f(r['speedup'])}x | vs prompt lookup {_f(r['speedup_vs_prompt_lookup'])}x | "
          f"vs autoregressive {_f(r['speedup_vs_autoregressive'])}x | greedy match {_f(r['greedy_match'])}")
    print(f"decoder per step: verify {_f(d['verify_ms_per_step'])} ms, head {_f(d['draft_ms_per_step'])} ms, "
          f"bookkeeping {_f(d['bookkeeping_ms_per_step'])} ms; overhead share {_f(d['decoder_overhead_share'])} "
          f"(head {_f(d['draft_share'])}, bookkeeping {_f(d['bookkeeping_share'])})")
    for row in r.get("tree_sweep", []):
        print(f"  tree {row['tree_total_tokens']:>3}: tau {_f(row['tau'])}, {row['tokens_per_s']:.1f} tok/s, "
              f"speedup {_f(row['speedup'])}x")
    print(f"\nreport: {args.output_dir}/report.json, report.md")
    if r["greedy_match"] is not None and r["greedy_match"] < 1.0:
        print("bench_decode: speculative greedy output differs from HF generate's (see per_prompt first_mismatch)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
