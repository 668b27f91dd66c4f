"""The report half of tests/engines/check_vllm.py (the engine halves need vLLM and run opt-in): it reads the
engines' results, so its verdicts (PASS / FAIL, the fastest k) are checked here on hand-made results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _phase(tok_s: float, outputs: dict[str, list[int]], drafts: int = 0, per_pos: list[int] | None = None) -> dict:
    per_pos = per_pos or []
    return {
        "wall_s": 1.0,
        "new_tokens": int(tok_s),
        "tokens_per_s": tok_s,
        "outputs": outputs,
        "drafts": drafts,
        "draft_tokens": drafts * len(per_pos),
        "accepted": sum(per_pos),
        "accepted_per_pos": per_pos,
    }


def _write(tmp: Path, name: str, obj: dict) -> str:
    path = tmp / name
    path.write_text(json.dumps(obj))
    return str(path)


def _report(tmp: Path, specs: list[dict], base_outputs: dict[str, list[int]]) -> subprocess.CompletedProcess:
    prepared = _write(
        tmp,
        "prepared.json",
        {"target": "t", "head": "h", "aux_layer_ids": [2, 15, 27], "prompts": [{"id": p} for p in base_outputs]},
    )
    base = _write(
        tmp,
        "base.json",
        {
            "mode": "base",
            "vllm": "0.32.0",
            "startup_s": 10.0,
            "k": 0,
            "max_new_tokens": 4,
            "speculative_config": None,
            "phases": {"1": _phase(10.0, base_outputs), "4": _phase(30.0, base_outputs)},
        },
    )
    files = [_write(tmp, f"spec-{i}.json", s) for i, s in enumerate(specs)]
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "engines" / "check_vllm.py"),
            "report",
            "--prepared",
            prepared,
            "--base",
            base,
            "--spec",
            *files,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _spec(k: int, tok_s_b1: float, tok_s_b4: float, outputs: dict[str, list[int]], per_pos: list[int]) -> dict:
    return {
        "mode": "spec",
        "vllm": "0.32.0",
        "startup_s": 12.0,
        "k": k,
        "max_new_tokens": 4,
        "speculative_config": {"method": "eagle3", "model": "h", "num_speculative_tokens": k},
        "phases": {"1": _phase(tok_s_b1, outputs, 100, per_pos), "4": _phase(tok_s_b4, outputs, 100, per_pos)},
    }


def test_report_rows_per_k_and_the_fastest_k_per_batch(tmp_path):
    outs = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}
    specs = [_spec(3, 9.0, 20.0, outs, [30, 12, 5]), _spec(1, 11.0, 27.0, outs, [30])]  # any order
    proc = _report(tmp_path, specs, outs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "1", "3", "3"]  # sorted by k
    assert "| 1 | 1 | 10.0 | 11.0 | 1.10x | 0.30 | 1.30 | 2/2 |" in proc.stdout
    assert "| 3 | 4 | 30.0 | 20.0 | 0.67x | 0.30 / 0.12 / 0.05 | 1.47 | 2/2 |" in proc.stdout
    assert "fastest k: batch 1 k=1 (1.10x), batch 4 k=1 (0.90x)" in proc.stdout
    assert "PASS:" in proc.stdout and "num_speculative_tokens=1, 3" in proc.stdout


def test_report_fails_naming_the_k_whose_outputs_differ(tmp_path):
    outs = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}
    wrong = {"a": [1, 2, 3, 4], "b": [5, 6, 9, 8]}
    proc = _report(tmp_path, [_spec(1, 11.0, 27.0, outs, [30]), _spec(2, 11.0, 27.0, wrong, [30, 12])], outs)
    assert proc.returncode == 1
    assert "FAIL:" in proc.stdout
    assert "k=2 batch 1: greedy outputs differ on 1/2 prompts (first: prompt b at new token 2)" in proc.stdout
    assert "k=1 batch" not in proc.stdout.split("FAIL:")[1]


def test_report_fails_when_the_head_accepts_nothing(tmp_path):
    outs = {"a": [1, 2, 3, 4]}
    proc = _report(tmp_path, [_spec(1, 10.0, 30.0, outs, [0])], outs)
    assert proc.returncode == 1
    assert "k=1 batch 1: position-1 acceptance 0.000 < 0.05" in proc.stdout
    assert "fastest k" not in proc.stdout  # one k: nothing to choose
