"""`eagle-regenerate` killed with SIGKILL mid-run, then re-run, ends with the uninterrupted output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tiny_models import save_model

PROMPTS = [
    "hello!",
    "The quick brown fox",
    "def add(a, b):",
    "Write a short poem about the sea.",
    "Explain relativity",
    "import torch",
    "Numbers 0 1 2 3",
    "What is speculative decoding?",
]


def _command(target: Path, data: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "eagle.cli.regenerate",
        f"target.path={target}",
        "data=local",
        f"data.path={data}",
        "data.dedup_against=[]",
        "regenerate.batch_size=2",
        "regenerate.max_new_tokens=12",
        f"output_dir={out}",
    ]


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
    target = save_model("qwen2", tmp_path / "target", seed=1)
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"c{i}",
                    "messages": [{"role": "user", "content": p}, {"role": "assistant", "content": "original"}],
                }
            )
            + "\n"
            for i, p in enumerate(PROMPTS)
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    reference = tmp_path / "reference"
    subprocess.run(_command(target, data, reference), check=True, env=env, capture_output=True, timeout=600)
    expected = (reference / "regenerated.jsonl").read_text()
    assert len(expected.splitlines()) == len(PROMPTS)

    killed = tmp_path / "killed"
    out = killed / "regenerated.jsonl"
    proc = subprocess.Popen(
        _command(target, data, killed),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 2:  # at least one batch written
            break
        time.sleep(0.05)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    with open(out, "a") as f:  # what a kill during a write leaves: a torn last line
        f.write('{"id": "c7", "messa')
    assert out.read_text().count("\n") < len(PROMPTS) or proc.returncode == 0

    subprocess.run(_command(target, data, killed), check=True, env=env, capture_output=True, timeout=600)
    got = out.read_text()
    key = lambda text: sorted(text.splitlines())  # noqa: E731 - resumed batches may land in another order
    assert key(got) == key(expected)
