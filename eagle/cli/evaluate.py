"""`eagle-eval`: measure a trained draft head against plain decoding on a prompt set.

    eagle-eval draft.path=outputs/train target.path=smollm2-135m-instruct eval=mt_bench \
        eval.max_prompts=10 decode.temperature=0 decode.tree=auto output_dir=outputs/eval
"""

from __future__ import annotations

from eagle.cli.app import run_app
from eagle.config import RootConfig


def _evaluate(cfg: RootConfig) -> dict:
    from eagle.evaluate.runner import evaluate  # startup: loads torch; the config is checked first

    report = evaluate(cfg)

    def fmt(x: float | None, unit: str = "") -> str:
        return "n/a" if x is None else f"{x:.2f}{unit}"  # a baseline not run has no ratio

    if not report.get("lossless", True):  # first line: an approximate run never reads as an exact one
        shift = report["distribution_shift"]
        kl = "inf" if shift["kl"] is None else f"{shift['kl']:.4f}"
        print(
            f"APPROXIMATE acceptance (decode.acceptance={report['acceptance']}): NOT lossless; emitted law vs the "
            f"target's over {shift['positions']} positions: TV {shift['tv']:.4f}, KL {kl}"
        )
    print(
        f"tau {fmt(report['tau'])} | {report['tokens_per_s']:.1f} tok/s | speedup vs HF generate "
        f"{fmt(report['speedup'], 'x')}, vs prompt lookup {fmt(report['speedup_vs_prompt_lookup'], 'x')}, "
        f"vs autoregressive {fmt(report['speedup_vs_autoregressive'], 'x')} | greedy match "
        f"{fmt(report['greedy_match'])}"
    )
    print(f"speedup baseline: {report['speedup_baseline']} (tokens/s ratio on this machine)")
    print(f"report: {cfg.output_dir}/report.json, {cfg.output_dir}/report.md")
    return report


def main() -> None:
    run_app("eval", _evaluate)


if __name__ == "__main__":
    main()
