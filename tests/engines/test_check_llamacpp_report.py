"""tests/engines/check_llamacpp.sh / .py without llama.cpp: the report's verdicts (PASS / FAIL) on hand-made results,
the verify-cost arithmetic, and the script's refusal of a llama-server built without EAGLE-3 drafting."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "engines" / "check_llamacpp.py"


def _run(
    label: str, n: int, outputs: dict[str, list[int]], tok_s: float, steps: int = 0, per_pos: list[int] | None = None
) -> dict:
    per_pos = per_pos or []
    return {
        "label": label,
        "n": n,
        "threads": 1,
        "startup_s": 1.0,
        "outputs": outputs,
        "predicted_n": 100,
        "predicted_ms": 1000.0 * 100 / tok_s,
        "tokens_per_s": tok_s,
        "verify_steps": steps,
        "drafted": steps * n,
        "accepted": sum(per_pos),
        "accepted_per_pos": per_pos,
    }


def _report(
    tmp: Path, spec_outputs: dict[str, list[int]], per_pos: list[int], ours: list[float], verify: dict | None = None
) -> subprocess.CompletedProcess:
    base = {"a": [1, 2, 3], "b": [4, 5, 6]}
    (tmp / "prepared.json").write_text(
        json.dumps(
            {
                "gguf": "t.gguf",
                "hf_dir": "t",
                "spec_type": "draft-eagle3",
                "block_drafts": None,
                "prompts": [{"id": "a"}, {"id": "b"}],
            }
        )
    )
    runs = [
        _run("n0-before", 0, base, 50.0),
        _run("n2", 2, spec_outputs, 30.0, 400, per_pos),
        _run("n0-after", 0, base, 54.0),
    ]
    (tmp / "runs.json").write_text(json.dumps({"threads": 1, "max_new_tokens": 64, "runs": runs}))
    # eagle-eval's report: the fractions padded to its tree depth, one histogram count per verify pass
    (tmp / "ours.json").write_text(
        json.dumps(
            {"accept_fraction_by_depth": ours + [0.0, 0.0], "accept_length_histogram": {"0": 250, "1": 100, "2": 50}}
        )
    )
    cmd = [
        sys.executable,
        str(SCRIPT),
        "report",
        "--prepared",
        str(tmp / "prepared.json"),
        "--runs",
        str(tmp / "runs.json"),
        "--ours",
        str(tmp / "ours.json"),
    ]
    if verify is not None:
        (tmp / "verify.json").write_text(json.dumps(verify))
        cmd += ["--verify", str(tmp / "verify.json")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)


def test_report_passes_lossless_output_with_predicted_acceptance(tmp_path: Path) -> None:
    done = _report(tmp_path, {"a": [1, 2, 3], "b": [4, 5, 6]}, [152, 60], [0.38, 0.14])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS: llama.cpp check" in done.stdout
    # the row for n=2: tok/s against the mean of the two runs without the head (52), per-position rates
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 2 |"))
    assert "| 30.0 | 0.58 | 0.38 / 0.15 | 0.38 / 0.14 | 1.53 | 2/2 |" in row


def test_report_fails_when_output_changes(tmp_path: Path) -> None:
    done = _report(tmp_path, {"a": [1, 2, 3], "b": [4, 9, 6]}, [150, 60], [0.38, 0.14])
    assert done.returncode == 1
    assert "FAIL: llama.cpp check" in done.stdout
    assert "prompt b at new token 1" in done.stdout


def test_report_fails_when_acceptance_is_far_from_our_prediction(tmp_path: Path) -> None:
    # 0.10 against a predicted 0.38 over 400 and 400 steps: far outside 3 standard errors + the margin
    done = _report(tmp_path, {"a": [1, 2, 3], "b": [4, 5, 6]}, [40, 10], [0.38, 0.14])
    assert done.returncode == 1
    assert "position 1: llama.cpp accepts 0.100, our decoder 0.380" in done.stdout


def test_verify_cost_table(tmp_path: Path) -> None:
    rows = [
        {"tokens": n, "threads": t, "depth": 256, "tokens_per_s": tps, "stddev_ts": 0.0}
        for (n, t, tps) in [(1, 1, 50.0), (2, 1, 80.0), (4, 1, 100.0), (1, 2, 100.0), (2, 2, 100.0), (4, 2, 160.0)]
    ]
    done = _report(
        tmp_path,
        {"a": [1, 2, 3], "b": [4, 5, 6]},
        [150, 60],
        [0.38, 0.14],
        verify={"depth": 256, "command": [], "rows": rows},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # cost of an n-token pass in one-token passes = n / tps(n) * tps(1)
    assert "| 2 | 1.25 (80) | 2.00 (100) |" in done.stdout
    assert "| 4 | 2.00 (100) | 2.50 (160) |" in done.stdout


@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "python").is_file(), reason="the script needs the repo's .venv")
def test_script_refuses_a_llama_server_without_eagle3_drafting(tmp_path: Path) -> None:
    fake = tmp_path / "llama-server"
    fake.write_text(
        "#!/bin/sh\necho 'usage: llama-server [options]'\necho '--spec-type [none|ngram-cache|draft-simple]'\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, LLAMA_SERVER=str(fake), CHECK_DIR=str(tmp_path / "work"))
    done = subprocess.run(
        ["bash", str(REPO / "tests" / "engines" / "check_llamacpp.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    assert done.returncode != 0
    assert f"FAIL: {fake} has no --spec-type draft-eagle3" in done.stdout
