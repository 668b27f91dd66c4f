"""Speculative decoding figures for SmolLM2-135M-Instruct on MT-bench, with a trained head.

    python -m benchmarks decode [HEAD_DIR] [--max-prompts 10] [--max-new-tokens 128] [--turns first]
                                   [--threads N] [--tree auto] [--tree-sweep 4 8 16 32]
                                   [--dtypes bfloat16 float32] [--draft-weights full int8 int8_weight_only]
                                   [--cpu-gemm stock transposed] [--lookup-tokens 0 8]
                                   [--draft-choice topk sample] [override ...]

HEAD_DIR is anything `draft.path` accepts (training output dir, checkpoint dir, head folder or
exported folder); default: heads/smollm2-135m-instruct-eagle3 in this repository. The tree is
auto-tuned by default (verify passes timed on this machine). One `eagle-eval` run measures, on the
same prompts and with the same torch threads, the speculative decoder, the target's plain
autoregressive decoding (same cache code), HF `generate` and HF prompt-lookup decoding; this script
prints the headline numbers plus the decoder's overhead per step, and exits 1 if greedy output ever
differs from HF generate's in float32 (in bf16/fp16: if a divergence is not at a float32 near-tie);
never for an approximate `decode.acceptance` (its report says `lossless: false`; the match is printed).
With several --dtypes every dtype is measured in the same process, on the same prompts and threads,
one after the other (OUTPUT_DIR/DTYPE/), and a last table compares them; --draft-weights does the same
for the head's weights (int8 linears, dynamic or weight-only, against the full-precision head), in every dtype, and
--cpu-gemm for the target's kernel for float32 products of 2-32 rows (eagle/target/cpu_gemm.py), --lookup-tokens for
prompt-lookup chains grafted onto the head's tree (decode.lookup_tokens, 0 = off), --draft-choice for how
the head drafts at temperature > 0 (decode.draft_choice: topk trees or sampled chains). Per step it also times a
verify pass against a bare causal forward of as many tokens (`model(...)` on a chain), and the
drafting cost as a share of one plain decoding step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from eagle.cli.app import compose
from eagle.decode.cache import crop_cache
from eagle.decode.target import new_cache, target_forward, verify_plan
from eagle.decode.tree import tree_mask
from eagle.errors import EagleError
from eagle.evaluate import evaluate
from eagle.export import load_draft
from eagle.target.cpu_gemm import CPU_GEMM, median_ms
from eagle.target.loading import load_target
from eagle.target.precision import DRAFT_WEIGHTS, DTYPE_NAMES

REPO = Path(__file__).resolve().parents[1]
DEFAULT_HEAD = REPO / "heads" / "smollm2-135m-instruct-eagle3"


def _f(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def _take_overrides(args: argparse.Namespace, name: str) -> list[str]:
    """The values of list option `name`, after moving the overrides it swallowed back to `args.overrides`
    (`--draft-weights full int8 eval.prompts=humaneval`: a list option takes every word after it)."""
    values = getattr(args, name) or []
    args.overrides += [v for v in values if "=" in v]
    return [v for v in values if "=" not in v]


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
    parser.add_argument(
        "--dtypes",
        nargs="*",
        default=None,
        help="measure each dtype in turn (auto | float32 | bfloat16 | float16); default: auto",
    )
    parser.add_argument(
        "--draft-weights",
        nargs="*",
        default=None,
        help="measure each head setting in turn (auto | full | int8 | int8_weight_only), for every dtype; default: the config's",
    )
    parser.add_argument(
        "--cpu-gemm",
        nargs="*",
        default=None,
        help="measure each target.cpu_gemm in turn (auto | stock | transposed); default: the config's",
    )
    parser.add_argument(
        "--lookup-tokens",
        nargs="*",
        default=None,
        help="measure each decode.lookup_tokens in turn (0 = no prompt lookup); default: the config's",
    )
    parser.add_argument(
        "--draft-choice",
        nargs="*",
        default=None,
        help="measure each decode.draft_choice in turn (auto | topk | sample; sample needs "
        "decode.temperature > 0); default: the config's",
    )
    parser.add_argument("--output-dir", default=str(REPO / "outputs" / "benchmarks" / "decode"))
    args = parser.parse_intermixed_args(argv)  # overrides may follow options: `... --max-prompts 40 eval.x=y`

    if (
        args.head and "=" in args.head
    ):  # an override, not a head folder: `python -m benchmarks decode eval.prompts=humaneval`
        args.overrides.insert(0, args.head)
        args.head = None

    for name, allowed in (("dtypes", DTYPE_NAMES), ("draft_weights", DRAFT_WEIGHTS), ("cpu_gemm", CPU_GEMM)):
        values = _take_overrides(args, name)
        if bad := [v for v in values if v not in allowed]:
            parser.error(f"--{name.replace('_', '-')}: {', '.join(bad)} is not one of {', '.join(allowed)}")
        setattr(args, name, values or None)
    lookups = _take_overrides(args, "lookup_tokens")
    if bad := [v for v in lookups if not v.isdigit()]:
        parser.error(f"--lookup-tokens: {', '.join(bad)} is not a count of tokens (0 = no prompt lookup)")
    args.lookup_tokens = [int(v) for v in lookups] or None
    choices = _take_overrides(args, "draft_choice")
    if bad := [v for v in choices if v not in ("auto", "topk", "sample")]:
        parser.error(f"--draft-choice: {', '.join(bad)} is not one of auto, topk, sample")
    args.draft_choice = choices or None
    head = Path(args.head) if args.head else DEFAULT_HEAD
    if not head.exists():
        parser.error(
            f"no draft head at {head}: train one (eagle-train recipe=smollm2-135m-instruct) and pass its "
            "output dir, or pass any head folder"
        )

    overrides = [
        "recipe=smollm2-135m-instruct",
        f"draft.path={head}",
        "eval.prompts=mt_bench",
        f"eval.max_prompts={args.max_prompts}",
        f"eval.turns={args.turns}",
        f"eval.warmup_prompts={args.warmup}",
        f"decode.max_new_tokens={args.max_new_tokens}",
        f"decode.tree={args.tree}",
    ]
    if args.threads:
        overrides.append(f"eval.num_threads={args.threads}")
    if args.tree_sweep:
        overrides.append(f"eval.tree_sweep=[{','.join(map(str, args.tree_sweep))}]")
    runs = [
        (dtype, weights, gemm, lookup, choice)
        for dtype in args.dtypes or ["auto"]
        for weights in args.draft_weights or [None]
        for gemm in args.cpu_gemm or [None]
        for lookup in args.lookup_tokens or [None]
        for choice in args.draft_choice or [None]
    ]
    reports: dict[str, dict] = {}
    status = 0
    for dtype, weights, gemm, lookup, choice in runs:
        label = "-".join(
            x
            for x in (
                dtype,
                weights,
                gemm and f"gemm-{gemm}",
                lookup is not None and f"lookup-{lookup}",
                choice and f"draft-{choice}",
            )
            if x
        )
        out = Path(args.output_dir) / label if len(runs) > 1 else Path(args.output_dir)
        setting = (
            ([] if weights is None else [f"decode.draft_weights={weights}"])
            + ([] if gemm is None else [f"target.cpu_gemm={gemm}"])
            + ([] if lookup is None else [f"decode.lookup_tokens={lookup}"])
            + ([] if choice is None else [f"decode.draft_choice={choice}"])
        )
        cfg = compose([*overrides, f"target.dtype={dtype}", *setting, f"output_dir={out}", *args.overrides])
        try:
            r = evaluate(cfg)
        except EagleError as e:
            print(f"benchmarks decode: error: {e}", file=sys.stderr)
            return 2
        r["bare_vs_verify"] = _bare_vs_verify(cfg, r)
        s = r["settings"]
        reports[
            f"{s['dtype']} (head {s['draft_dtype']}, {s['draft_weights']}; gemm {s.get('cpu_gemm', 'stock')}; "
            f"lookup {s['tree'].get('lookup_tokens', 0)}"
            + (f"; draft {s['tree']['draft_choice']}" if "draft_choice" in s["tree"] else "")
            + ")"
        ] = r
        _print_report(r, out)
        status = max(status, _lossless_status(r))
    if len(reports) > 1:
        print(
            f"\n{'target dtype (head; target gemm; lookup; draft)':<80}{'tau':>6}{'spec tok/s':>12}{'HF tok/s':>10}{'vs HF':>8}{'vs AR':>8}"
            f"{'draft/plain':>13}{'greedy':>8}"
        )
        for dt, r in reports.items():
            m = r["methods"]
            print(
                f"{dt:<80}{_f(r['tau']):>6}{m['speculative']['tokens_per_s']:>12.1f}"
                f"{m.get('hf_generate', {}).get('tokens_per_s', float('nan')):>10.1f}{_f(r['speedup']):>8}"
                f"{_f(r['speedup_vs_autoregressive']):>8}{_f(_draft_share_of_plain(r)):>13}{_f(r['greedy_match']):>8}"
            )
    return status


def _draft_share_of_plain(r: dict) -> float | None:
    """Head time per speculative step / seconds of one plain (autoregressive) decoding step."""
    ar = r["methods"].get("autoregressive")
    draft_ms = r["decoder"].get("draft_ms_per_step")
    if not ar or not ar["tokens"] or draft_ms is None:
        return None
    return draft_ms / (1000 * ar["seconds"] / ar["tokens"])


def _bare_vs_verify(cfg, r: dict) -> dict:
    """One verify pass (tree mask, feature layers) vs `model(...)` on a causal chain of as many tokens."""
    target, _, _ = load_target(cfg.target, stage="decode")
    head, _ = load_draft(cfg.draft.path, target)
    n = max(2, round(r.get("mean_tree_size") or 16) + 1)
    ctx, gen = 256, torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (ctx + n,), generator=gen)
    plan = verify_plan(target.config)
    cache = new_cache(target.config, plan)
    target_forward(target, ids[:ctx], torch.arange(ctx), cache, plan=plan, last_logits_only=True)
    parents = torch.arange(-1, n - 1)  # a chain: each node's parent is the previous one
    parents[n // 2 + 1 :] = torch.arange(n // 2, n - 1) - n // 2  # second half branches off the root's subtree

    mask, depth = tree_mask(parents), torch.zeros(n, dtype=torch.long)
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1

    def bare() -> None:
        with torch.inference_mode():
            target(
                input_ids=ids[None, ctx:],
                position_ids=torch.arange(ctx, ctx + n)[None],
                past_key_values=cache,
                use_cache=True,
            )
        crop_cache(cache, ctx)

    def verify() -> None:
        target_forward(
            target,
            ids[ctx:],
            ctx + depth,
            cache,
            mask,
            feature_layer_ids=list(head.feature_layer_ids()),
            plan=plan,
        )
        crop_cache(cache, ctx)

    bare_ms, verify_ms = median_ms(bare, reps=7), median_ms(verify, reps=7)
    return {"tokens": n, "context": ctx, "bare_ms": bare_ms, "verify_ms": verify_ms, "ratio": verify_ms / bare_ms}


def _lossless_status(r: dict) -> int:
    if r.get("lossless") is False:  # an approximate acceptance rule: the match is reported, never a failure
        return 0
    if r["greedy_match"] is None or r["greedy_match"] >= 1.0:
        return 0
    d = r.get("divergence") or {}
    if r["settings"]["dtype"] != "float32" and d.get("all_numeric"):
        return 0
    print(
        f"benchmarks decode: speculative greedy output differs from HF generate's in {r['settings']['dtype']} "
        "beyond numerics (see per_prompt divergence)",
        file=sys.stderr,
    )
    return 1


def _print_report(r: dict, out: Path) -> None:
    s, d, hw = r["settings"], r["decoder"], r["settings"]["hardware"]
    print(
        f"\nSmolLM2-135M-Instruct + {s['draft_folder']} ({s['algorithm']}), {s['prompts']} x{r['num_prompts']} "
        f"({r['num_turns']} turns), T={s['temperature']}, max_new_tokens={s['max_new_tokens']}, dtype {s['dtype']} "
        f"(head {s['draft_dtype']}, {s['draft_weights']} weights), target gemm {s.get('cpu_gemm', 'stock')}"
    )
    print(f"hardware: {hw['cpu']} | {hw['torch_threads']} torch threads | torch {hw['torch_version']} | {hw['device']}")
    print(f"tree: {s['tree']} | mean verified tree size {_f(r['mean_tree_size'], '.1f')}")
    if r.get("lookup_nodes_per_step") is not None:
        print(
            f"prompt lookup (decode.lookup_tokens={s['tree'].get('lookup_tokens')}): "
            f"{r['lookup_nodes_per_step']:.2f} grafted nodes per step, {r['lookup_accepted_share']:.3f} of the tokens"
        )
    if s.get("auto_verify_seconds"):
        print(
            "verify pass ms by size: " + ", ".join(f"{k}: {1000 * v:.1f}" for k, v in s["auto_verify_seconds"].items())
        )
    print(f"\n{'method':<16}{'tokens':>8}{'seconds':>10}{'tok/s':>10}")
    for name, m in r["methods"].items():
        print(f"{name:<16}{m['tokens']:>8}{m['seconds']:>10.2f}{m['tokens_per_s']:>10.1f}")
    print(f"\ntau {_f(r['tau'])} | accept rate by depth {[round(x, 3) for x in r['accept_rate_by_depth']]}")
    print(
        f"speedup vs HF generate {_f(r['speedup'])}x | vs prompt lookup {_f(r['speedup_vs_prompt_lookup'])}x | "
        f"vs autoregressive {_f(r['speedup_vs_autoregressive'])}x | greedy match {_f(r['greedy_match'])}"
    )
    print(
        f"decoder per step: verify {_f(d['verify_ms_per_step'])} ms, head {_f(d['draft_ms_per_step'])} ms, "
        f"bookkeeping {_f(d['bookkeeping_ms_per_step'])} ms; overhead share {_f(d['decoder_overhead_share'])} "
        f"(head {_f(d['draft_share'])}, bookkeeping {_f(d['bookkeeping_share'])}); drafting = "
        f"{_f(_draft_share_of_plain(r))} of a plain decoding step"
    )
    bv = r["bare_vs_verify"]
    print(
        f"verify pass of {bv['tokens']} tree tokens {bv['verify_ms']:.1f} ms vs bare causal forward "
        f"{bv['bare_ms']:.1f} ms (x{bv['ratio']:.2f}) after {bv['context']} cached tokens"
    )
    dv = r.get("divergence")
    if dv and dv["divergent_turns"]:
        print(
            f"greedy divergences: {dv['divergent_turns']}/{dv['turns']} turns, max fp32 margin "
            f"{_f(dv['max_margin'], '.3f')}, max gap {_f(dv['max_gap'], '.3f')} (limit {dv['margin_limit']}): "
            f"{'numeric' if dv['all_numeric'] else 'NOT all numeric'}"
        )
    for row in r.get("tree_sweep", []):
        print(
            f"  tree {row['tree_total_tokens']:>3}: tau {_f(row['tau'])}, {row['tokens_per_s']:.1f} tok/s, "
            f"speedup {_f(row['speedup'])}x"
        )
    print(f"report: {out}/report.json, report.md")


if __name__ == "__main__":
    sys.exit(main())
