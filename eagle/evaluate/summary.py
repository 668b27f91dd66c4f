"""The summary `make demo` ends with (scripts/demo.sh): one block per eagle-eval report, exactness first.

Greedy speculative decoding is exact where the arithmetic is: in float32 its output is token-identical
to HF `generate`. In bfloat16 a verify pass over several tokens runs other kernels than one-token steps,
so at a near-tie of the target's top two logits the argmax can flip and the outputs part ways
(eagle/evaluate/divergence.py). A bare `greedy_match=0.25` for a bf16 run reads as "not lossless", so the
summary keeps the two facts apart: first the float32 check (identical on every turn, or on how many not:
a bug), then each run's own greedy comparison, a bf16 run's divergences as near-ties with their float32
top-1/top-2 margins.

    python -m eagle.evaluate.summary OUT_DIR     # OUT_DIR as scripts/demo.sh fills it
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# scripts/demo.sh's eagle-eval output folders, in the order the summary shows them.
EVALS = ("eval", "eval-reference")
FLOAT32_CHECK = "eval-float32"  # the float32 exactness check demo.sh runs when the evals are not float32


def _turn_divergences(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [t["divergence"] for p in report.get("per_prompt", []) for t in p["turns"] if t.get("divergence")]


def _identical(report: dict[str, Any]) -> tuple[int, int] | None:
    """(identical turns, compared turns) against HF `generate`, or None when the run compared none."""
    d = report.get("divergence")
    if d and d.get("turns"):
        return d["turns"] - d["divergent_turns"], d["turns"]
    turns = [t for p in report.get("per_prompt", []) for t in p["turns"] if t.get("greedy_match") is not None]
    if not turns:
        return None
    return sum(bool(t["greedy_match"]) for t in turns), len(turns)


def float32_line(report: dict[str, Any]) -> str:
    """The exactness check: a float32 greedy run's output against HF `generate`'s, turn by turn."""
    counts = _identical(report)
    if counts is None:
        return "float32: not compared with HF generate (sampled decoding, or no hf_generate baseline)"
    same, turns = counts
    if same == turns:
        return f"float32 (exact arithmetic): identical to HF generate on every turn ({same}/{turns}): lossless"
    return f"float32 (exact arithmetic): NOT identical to HF generate on {turns - same} of {turns} turns: a decoder bug"


def greedy_line(report: dict[str, Any]) -> str:
    """A run's greedy comparison in its own dtype; in bf16 / fp16 each divergence with its float32 margin."""
    dtype = report.get("settings", {}).get("dtype", "float32")
    if dtype == "float32":
        return float32_line(report)
    counts = _identical(report)
    if counts is None:
        return f"{dtype}: not compared with HF generate (sampled decoding, or no hf_generate baseline)"
    same, turns = counts
    if same == turns:
        return f"{dtype}: identical to HF generate on every turn ({same}/{turns})"
    d = report.get("divergence") or {}
    margins = ", ".join(f"{r['margin']:.3f}" for r in sorted(_turn_divergences(report), key=lambda r: r["margin"]))
    head = f"{dtype}: identical on {same}/{turns} turns; {turns - same} part"
    if d.get("all_numeric"):
        return (
            f"{head} at float32 near-ties (top-1/top-2 margin {margins}; limit {d['margin_limit']}): "
            "rounding flips the argmax, not a decoder bug"
        )
    return f"{head} NOT all at near-ties (margins {margins}; limit {d.get('margin_limit')}): look for a decoder bug"


def speed_line(report: dict[str, Any]) -> str:
    def x(key: str) -> str:
        value = report.get(key)
        return "-" if value is None else f"{value:.2f}x"

    return (
        f"tau={report['tau']:.2f}  speedup vs HF generate={x('speedup')}  "
        f"vs prompt lookup={x('speedup_vs_prompt_lookup')}"
    )


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def demo_summary(out: Path) -> list[str]:
    """The summary's lines for a demo output folder (capture/, eval/, eval-reference/, eval-float32/,
    export-vllm/); a stage that did not run is left out. The float32 exactness line comes first: the
    float32 check when one ran, else the demo head's own run when that was float32."""
    lines = []
    manifest = _read(out / "capture" / "manifest.json")
    if manifest is not None:
        lines.append(f"capture: {out / 'capture'}  (manifest: {', '.join(k for k in manifest if k != 'shards')})")
    reports = {name: _read(out / name / "report.json") for name in (FLOAT32_CHECK, *EVALS)}
    exact = reports[FLOAT32_CHECK]
    main_run = reports["eval"]
    if exact is None and main_run is not None and main_run.get("settings", {}).get("dtype", "float32") == "float32":
        exact = main_run
    if exact is not None:
        lines.append(f"exactness, the demo head: {float32_line(exact)}")
    for name in EVALS:
        report = reports[name]
        if report is not None:
            dtype = report.get("settings", {}).get("dtype", "float32")
            lines.append(f"{name} [{dtype}]: {speed_line(report)}")
            lines.append(f"  greedy: {greedy_line(report)}")
    lines.append(f"export: {out / 'export-vllm'}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(demo_summary(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
