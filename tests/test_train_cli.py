"""`eagle-train` as users run it: the console script, and a 2-process data-parallel run (`accelerate launch --multi_gpu` falls back to gloo on CPU;
`--cpu --num_processes 2` would start ONE process)
that must train the same head as one process on the same global batch."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.cli import BIN, cli_env
from tests.support.train import SGD_STEP, assert_same_update, head_weights, train_overrides

# Every test runs eagle-train (or accelerate launch) in subprocesses: make test, not make test-fast.
pytestmark = pytest.mark.slow


def _run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_cli_trains_and_prints_heldout_metrics(ws3, tmp_path):
    out = tmp_path / "one"
    proc = _run([str(BIN / "eagle-train"), *ws3.base, *train_overrides(out, ws3.capture, steps=4)])
    assert "held-out:" in proc.stdout and "acc@0=" in proc.stdout and "tau_sim=" in proc.stdout
    assert (out / "best" / "model.safetensors").is_file() and (out / "train_config.yaml").is_file()


def test_cli_refuses_a_missing_capture(ws3, tmp_path):
    proc = subprocess.run(
        [str(BIN / "eagle-train"), *ws3.base, *train_overrides(tmp_path / "o", tmp_path / "nope", steps=2)],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=300,
    )
    assert proc.returncode == 2 and "manifest.json does not exist" in proc.stderr


def test_two_gloo_processes_match_one_process(ws3, tmp_path):
    """Global batch 4: 1 process x 4 vs 2 processes x 2 (DDP over gloo) -> the same SGD updates up to
    float summation order, because each micro-batch loss is normalised by the GLOBAL token count
    (a rank normalising by its own count would roughly double every update)."""
    steps = 2
    sgd = {**SGD_STEP, "train__lr": 0.5}
    one, two = tmp_path / "one", tmp_path / "two"
    _run([str(BIN / "eagle-train"), *ws3.base, *train_overrides(one, ws3.capture, steps, **sgd)])
    _run(
        [
            str(BIN / "accelerate"),
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "-m",
            "eagle.cli.train",
            *ws3.base,
            *train_overrides(two, ws3.capture, steps, **sgd),
        ],
        timeout=600,
    )
    ck = Path("checkpoints") / f"step-{steps:07d}"
    assert (two / ck / "rng" / "rank-00001.pt").is_file()  # really two ranks
    assert_same_update(head_weights(one / ck / "head"), head_weights(two / ck / "head"))
