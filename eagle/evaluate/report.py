"""Aggregate per-turn measurements into `report.json` / `report.md` (both written atomically).

Per-turn records (built by the runner) look like
  {"turn": 0, "prompt_tokens": 41,
   "methods": {"speculative": {"tokens": [...], "seconds": 0.8, "target_forwards": 12,
                               "accept_lengths": [...], "timings": {...}, "stop_reason": "eos"},
               "hf_generate": {"tokens": [...], "seconds": 1.9}, ...},
   "greedy_match": true | None, "first_mismatch": None | int}
and are grouped per prompt. Everything in the report is recomputable from `per_prompt`.

A report says how its tokens were accepted: `acceptance` (exact | typical | lenient), `lossless` (true
only for exact) and `distribution_shift` (TV and KL of the emitted law from the target's, 0 for exact)
lead report.json, and an approximate rule is named in report.md's first line.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

from eagle import spec_metrics as metrics
from eagle.artifacts import REPORT
from eagle.decode.approximate import acceptance_label
from eagle.fileio import atomic_write_text

SPEC = "speculative"
# What every `speedup` is measured against, in those words and no more: not vLLM, SGLang or llama.cpp.
SPEEDUP_BASELINE = "HF transformers generate (PyTorch eager)"
SHIFT_KEYS = ("positions", "tv", "kl", "kl_infinite")
VERIFIED = ("verified_tokens", "target_forwards")  # what a peer decoder's method reports for its tau


# The CPU features that change which kernels run (and so the timings): a report names the ones present.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def hardware_info(device: torch.device | str) -> dict[str, Any]:
    """What the timings were measured on: CPU model and its kernel-relevant flags, torch threads, library
    versions, accelerator."""
    model: str | None = None
    present: set[str] | None = None
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux: the platform's name, no flags
        lines = []
    for line in lines:  # the first core's entries (every core lists the same)
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and present is None:
            present = set(value.split())
    flags = [f for f in CPU_FLAGS if f in (present or set())]
    info: dict[str, Any] = {
        "cpu": model or platform.processor() or platform.machine(),
        "cpu_flags": flags,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python": platform.python_version(),
        "device": str(device),
    }
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["accelerator"] = torch.cuda.get_device_name(torch.device(device))
    return info


def prompt_record(prompt_id: str, category: str | None, turns: list[dict[str, Any]]) -> dict[str, Any]:
    """One `per_prompt` entry: totals over the prompt's turns plus the per-turn details."""
    spec = [t["methods"][SPEC] for t in turns]
    matches = [t["greedy_match"] for t in turns]
    methods = sorted({m for t in turns for m in t["methods"]})
    return {
        "id": prompt_id,
        "category": category,
        "new_tokens": sum(len(s["tokens"]) for s in spec),
        "target_forwards": sum(int(s["target_forwards"]) for s in spec),
        "accept_lengths": [int(n) for s in spec for n in s["accept_lengths"]],
        "context_lengths": [int(n) for s in spec for n in s.get("context_lengths", [])],
        "tree_sizes": [int(n) for s in spec for n in s.get("tree_sizes", [])],
        "lookup_nodes": [int(n) for s in spec for n in s.get("lookup_nodes", [])],
        "lookup_accepted": [int(n) for s in spec for n in s.get("lookup_accepted", [])],
        "seconds": {m: sum(t["methods"][m]["seconds"] for t in turns if m in t["methods"]) for m in methods},
        "tokens_by_method": {
            m: sum(len(t["methods"][m]["tokens"]) for t in turns if m in t["methods"]) for m in methods
        },
        # A peer decoder's verify passes and the tokens they emitted (hf_assisted): its tau beside ours.
        "verified_by_method": {
            m: [sum(int(t["methods"][m][k]) for t in turns if m in t["methods"]) for k in VERIFIED]
            for m in methods
            if all(k in t["methods"][m] for t in turns if m in t["methods"] for k in VERIFIED)
        },
        "greedy_match": None if any(x is None for x in matches) else all(matches),
        # Sums over the turns' verified positions (eagle.decode.approximate.ShiftStats); absent: exact.
        "shift": {k: sum((s.get("shift") or {}).get(k, 0) for s in spec) for k in SHIFT_KEYS},
        "turns": [
            {
                "turn": t["turn"],
                "prompt_tokens": t["prompt_tokens"],
                "new_tokens": len(t["methods"][SPEC]["tokens"]),
                "target_forwards": int(t["methods"][SPEC]["target_forwards"]),
                "stop_reason": t["methods"][SPEC].get("stop_reason"),
                "greedy_match": t["greedy_match"],
                "first_mismatch": t.get("first_mismatch"),
                "divergence": t.get("divergence"),
                "timings": t["methods"][SPEC].get("timings", {}),
                "answer": t.get("answer", ""),
                "hf_generate_answer": t.get("hf_generate_answer"),
            }
            for t in turns
        ],
    }


def _overhead(per_prompt: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Where the speculative decoder's time goes, summed over all turns.

    `decoder_overhead_share` is everything speculative decoding adds on top of the target's own
    forwards (head forwards + tree building, acceptance and cache bookkeeping), as a share of the
    decoder's total time; `draft_share` and `bookkeeping_share` split it.
    """
    totals: dict[str, float] = {}
    for p in per_prompt:
        for t in p["turns"]:
            for k, v in (t.get("timings") or {}).items():
                totals[k] = totals.get(k, 0.0) + float(v)
    steps = sum(len(p["accept_lengths"]) for p in per_prompt)
    total, target = totals.get("total_s", 0.0), totals.get("target_s", 0.0)
    draft, prefill = totals.get("draft_s", 0.0), totals.get("prefill_s", 0.0)
    bookkeeping = max(0.0, total - target - draft)

    def share(x: float) -> float | None:
        return x / total if total > 0 else None

    def per_step_ms(x: float) -> float | None:
        return 1000.0 * x / steps if steps else None

    return {
        "phase_seconds": totals,
        "steps": steps,
        "decoder_overhead_share": share(total - target),
        "draft_share": share(draft),
        "bookkeeping_share": share(bookkeeping),
        "target_share": share(target),
        "verify_ms_per_step": per_step_ms(target - prefill),
        "draft_ms_per_step": per_step_ms(draft),
        "bookkeeping_ms_per_step": per_step_ms(bookkeeping),
        "overhead_ms_per_step": per_step_ms(draft + bookkeeping),
    }


def distribution_shift(per_prompt: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean TV(p, q) and KL(q || p) over the verified positions, p the target's processed law and q the
    law the acceptance rule emitted with (exactly 0 under exact acceptance). `kl` is None (infinite)
    when some position gave mass to a token the target's law gives 0 (`kl_infinite` of them)."""
    total = {k: sum((p.get("shift") or {}).get(k, 0) for p in per_prompt) for k in SHIFT_KEYS}
    n = total["positions"]
    return {
        "tv": total["tv"] / n if n else 0.0,
        "kl": None if total["kl_infinite"] else (total["kl"] / n if n else 0.0),
        "kl_infinite": total["kl_infinite"],
        "positions": n,
    }


def _by_context(per_prompt: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    if any(len(p.get("context_lengths", [])) != len(p["accept_lengths"]) for p in per_prompt):
        return []
    return metrics.by_context(
        [n for p in per_prompt for n in p["accept_lengths"]], [c for p in per_prompt for c in p["context_lengths"]]
    )


def aggregate(
    per_prompt: Sequence[dict[str, Any]],
    temperature: float,
    tree_depth: int | None = None,
    acceptance: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The headline numbers of a report, all recomputable from `per_prompt`. `acceptance`: the rule and
    its thresholds (`AcceptanceRule.settings()`); None = exact."""
    acceptance = dict(acceptance or {"rule": "exact"})
    lengths = [n for p in per_prompt for n in p["accept_lengths"]]
    forwards = sum(p["target_forwards"] for p in per_prompt)
    methods = sorted({m for p in per_prompt for m in p["seconds"]})
    by_method = {}
    for m in methods:
        seconds = sum(p["seconds"].get(m, 0.0) for p in per_prompt)
        tokens = sum(p["tokens_by_method"].get(m, 0) for p in per_prompt)
        by_method[m] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": metrics.throughput(tokens, seconds)}
        verified = [p.get("verified_by_method", {}).get(m) for p in per_prompt]
        if verified and all(v is not None for v in verified):  # a peer decoder's tau (ours is report["tau"])
            emitted, passes = sum(v[0] for v in verified), sum(v[1] for v in verified)
            by_method[m]["tau"] = emitted / passes if passes else None
    spec_tps = by_method.get(SPEC, {}).get("tokens_per_s", 0.0)

    def ratio(baseline: str) -> float | None:
        # Throughput ratio: equal to baseline time / speculative time when both emit the same tokens
        # (always so at temperature 0), and still fair when sampled outputs differ in length.
        base = by_method.get(baseline, {}).get("tokens_per_s", 0.0)
        return spec_tps / base if base > 0 and spec_tps > 0 else None

    matches = [p["greedy_match"] for p in per_prompt]
    greedy = None
    if temperature == 0 and matches and all(m is not None for m in matches):
        greedy = sum(1 for m in matches if m) / len(matches)
    rates = metrics.accept_rate_by_depth(lengths, tree_depth)
    sizes = [n for p in per_prompt for n in p.get("tree_sizes", [])]
    decoder = _overhead(per_prompt)
    grafted = [n for p in per_prompt for n in p.get("lookup_nodes", [])]
    grafted_accepted = sum(n for p in per_prompt for n in p.get("lookup_accepted", []))
    report = {
        # First in report.json: how the tokens were accepted, and whether the output is the target's own law.
        "acceptance": acceptance["rule"],
        "lossless": acceptance["rule"] == "exact",
        "acceptance_settings": acceptance,
        "distribution_shift": distribution_shift(per_prompt),
        "num_prompts": len(per_prompt),
        "num_turns": sum(len(p["turns"]) for p in per_prompt),
        "new_tokens": sum(p["new_tokens"] for p in per_prompt),
        "target_forwards": forwards,
        "tau": metrics.tau(lengths, forwards),
        "accept_rate_by_depth": rates,
        "accept_fraction_by_depth": metrics.accept_fraction_by_depth(lengths, tree_depth),
        "accept_length_histogram": {str(k): v for k, v in metrics.histogram(lengths).items()},
        # tau and acceptance per context bucket (prompt + generated so far before each step); reports written
        # before the buckets existed hold no context lengths and get none.
        "by_context": _by_context(per_prompt),
        "mean_tree_size": sum(sizes) / len(sizes) if sizes else None,
        # decode.lookup_tokens: prompt-lookup nodes grafted per step, and the share of the emitted
        # tokens that only those nodes drafted (tokens the head's own tree did not contain).
        "lookup_nodes_per_step": sum(grafted) / len(grafted) if grafted else None,
        "lookup_accepted_share": grafted_accepted / max(1, sum(p["new_tokens"] for p in per_prompt))
        if grafted
        else None,
        "tokens_per_s": spec_tps,
        "baseline_tokens_per_s": by_method.get("hf_generate", {}).get("tokens_per_s"),
        "speedup": ratio("hf_generate"),
        "speedup_vs_prompt_lookup": ratio("prompt_lookup"),
        "speedup_vs_autoregressive": ratio("autoregressive"),
        "speedup_vs_hf_assisted": ratio("hf_assisted"),
        "speedup_basis": "tokens/s ratio (= baseline time / speculative time when outputs are equal)",
        "speedup_baseline": SPEEDUP_BASELINE,
        "greedy_match": greedy,
        "methods": by_method,
        "decoder": decoder,
        "decoder_overhead_share": decoder["decoder_overhead_share"],
    }
    return report


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def markdown(report: dict[str, Any]) -> str:
    """A short human-readable summary of `report` (what a model card or PR description needs)."""
    s = report["settings"]
    label = acceptance_label(report.get("acceptance_settings") or report.get("acceptance"))
    lines = [
        f"# {label + ' | ' if label else ''}eagle-eval: {s['target']} + {s['draft_path']}",
        "",
        f"Prompts: {s['prompts']} ({report['num_prompts']} prompts, {report['num_turns']} turns, turns={s['turns']}), "
        f"temperature {s['temperature']}, max_new_tokens {s['max_new_tokens']}, tree {s['tree']}.",
        f"Hardware: {s['hardware']['cpu']}, {s['hardware']['torch_threads']} torch threads, device "
        f"{s['hardware']['device']}, torch {s['hardware']['torch_version']}. Every figure is for dtype "
        f"**{s.get('dtype', 'float32')}** (the target, every method alike); the draft head computes in "
        f"{s.get('draft_dtype', s.get('dtype', 'float32'))} with {s.get('draft_weights', 'full')} weights; the "
        f"target's float32 products of 2-32 rows use the {s.get('cpu_gemm', 'stock')} kernel (target.cpu_gemm).",
        "",
        "| method | tokens | seconds | tokens/s | speculative speedup |",
        "|---|---:|---:|---:|---:|",
    ]
    key = {
        "hf_generate": "speedup",
        "prompt_lookup": "speedup_vs_prompt_lookup",
        "autoregressive": "speedup_vs_autoregressive",
        "hf_assisted": "speedup_vs_hf_assisted",
    }
    for name, m in report["methods"].items():
        sp = "-" if name == SPEC else _fmt(report.get(key.get(name, ""))) + "x"
        lines.append(f"| {name} | {m['tokens']} | {_fmt(m['seconds'])} | {_fmt(m['tokens_per_s'], 1)} | {sp} |")
    dec = report["decoder"]
    greedy_note = (
        " (reported, not checked: the approximate rule changes the output by design)"
        if label and report.get("greedy_match") is not None
        else ""
    )
    lines += [
        "",
        f"Speedup baseline: {report.get('speedup_baseline', SPEEDUP_BASELINE)}, tokens/s ratio on this machine "
        "(not a serving engine such as vLLM, SGLang or llama.cpp).",
        "",
        f"- tau (tokens per target forward, bonus included): **{_fmt(report['tau'])}**",
        f"- acceptance rate by depth: {', '.join(_fmt(r) for r in report['accept_rate_by_depth']) or 'n/a'}",
        *_shift_lines(report),
        f"- greedy match with HF generate: {_fmt(report['greedy_match'])}{greedy_note}",
        *_divergence_lines(report.get("divergence")),
        f"- decoder overhead (share of speculative time outside target forwards): "
        f"{_fmt(dec.get('decoder_overhead_share'))} = head {_fmt(dec.get('draft_share'))} + bookkeeping "
        f"{_fmt(dec.get('bookkeeping_share'))}; per step: verify {_fmt(dec.get('verify_ms_per_step'))} ms, "
        f"head {_fmt(dec.get('draft_ms_per_step'))} ms, bookkeeping {_fmt(dec.get('bookkeeping_ms_per_step'))} ms",
        f"- mean verified tree size: {_fmt(report.get('mean_tree_size'), 1)}",
    ]
    if report.get("lookup_nodes_per_step") is not None:
        lines.append(
            f"- prompt lookup: {_fmt(report['lookup_nodes_per_step'], 2)} grafted nodes per step; "
            f"{_fmt(report.get('lookup_accepted_share'))} of the emitted tokens came from them"
        )
    if report.get("by_context"):
        lines += [
            "",
            "| context (prompt + generated) | verify steps | tau | acceptance rate by depth |",
            "|---|---:|---:|---|",
        ]
        for row in report["by_context"]:
            rates = ", ".join(_fmt(r) for r in row["accept_rate_by_depth"]) or "n/a"
            lines.append(f"| {row['context']} | {row['steps']} | {_fmt(row['tau'])} | {rates} |")
    if report.get("tree_sweep"):
        lines += ["", "| tree size | tau | tokens/s | speedup vs HF generate |", "|---:|---:|---:|---:|"]
        for row in report["tree_sweep"]:
            lines.append(
                f"| {row['tree_total_tokens']} | {_fmt(row['tau'])} | {_fmt(row['tokens_per_s'], 1)} | "
                f"{_fmt(row['speedup'])}x |"
            )
    if report.get("plots"):
        lines += ["", *[f"![{Path(p).stem}]({Path(p).name})" for p in report["plots"].values()]]
    return "\n".join(lines) + "\n"


def _shift_lines(report: dict[str, Any]) -> list[str]:
    d = report.get("distribution_shift")
    if not d:
        return []
    rule = report.get("acceptance", "exact")
    kl = "inf" if d["kl"] is None else _fmt(d["kl"], 4)
    why = (
        " (lossless: 0 by construction)"
        if rule == "exact"
        else f"; KL is infinite at {d['kl_infinite']} positions, where the rule emitted a token the target's law gives 0"
        if d["kl_infinite"]
        else ""
    )
    return [
        f"- acceptance rule **{rule}**; shift of the emitted law from the target's, mean over {d['positions']} "
        f"verified positions: TV {_fmt(d['tv'], 4)}, KL(emitted || target) {kl}{why}"
    ]


def _divergence_lines(d: dict[str, Any] | None) -> list[str]:
    if not d or not d["divergent_turns"]:
        return []
    verdict = (
        "all at float32 near-ties (numeric argmax flips)"
        if d["all_numeric"]
        else "**not all at near-ties: look for a decoder bug**"
    )
    return [
        f"- greedy divergences in {d['dtype']}: {d['divergent_turns']} of {d['turns']} turns; largest float32 "
        f"top-1/top-2 margin {_fmt(d['max_margin'], 3)}, largest gap between the two chosen tokens "
        f"{_fmt(d['max_gap'], 3)} (limit {d['margin_limit']}): {verdict}"
    ]


def write_atomic(path: Path, text: str) -> Path:
    atomic_write_text(path, text)
    return path


def write_report(report: dict[str, Any], output_dir: Path) -> tuple[Path, Path]:
    """`report.json` and `report.md` in `output_dir`."""
    output_dir = Path(output_dir)
    j = write_atomic(output_dir / REPORT, json.dumps(report, indent=2, default=str) + "\n")
    m = write_atomic(output_dir / "report.md", markdown(report))
    return j, m
