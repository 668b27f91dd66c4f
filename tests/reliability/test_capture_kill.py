"""A capture killed with SIGKILL mid-run resumes to exactly the uninterrupted result."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from eagle.capture.store import MANIFEST, shard_file
from tests.support.capture import cli_args, run_cli, same_capture
from tests.support.cli import ROOT, cli_env
from tests.support.data import write_word_salad
from tests.tiny_models import save_model

N = 120  # one conversation per shard: enough shards that the kill lands mid-run


def _recorded(out) -> list[dict]:
    try:
        return json.loads((out / MANIFEST).read_text()).get("shards", [])
    except (OSError, json.JSONDecodeError):
        return []


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
    target = save_model("llama", tmp_path / "tiny-llama")
    data = write_word_salad(tmp_path / "data.jsonl", N, seed=3, max_words=120)
    killed, clean = tmp_path / "killed", tmp_path / "clean"

    proc = subprocess.Popen(
        [sys.executable, "-m", "eagle.cli.capture", *cli_args(target, data, killed, N, 1)],
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not _recorded(killed) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"capture ended before the kill (rc={proc.returncode}): {err[-2000:]}"
    state = json.loads((killed / MANIFEST).read_text())  # always whole JSON: written atomically
    done = len(state["shards"])
    assert 1 <= done and not state["complete"], "the kill did not land mid-run; raise N"

    # What a kill can leave besides: a half-written temporary file, and a shard file renamed into
    # place whose manifest entry was never written (here: garbage). Neither may be read as a shard.
    (killed / "train" / ".shard-00000.safetensors.x1y2.tmp").write_bytes(b"\0" * 100)
    recorded = {e["file"] for e in state["shards"]}
    orphan = next(shard_file("train", i) for i in range(N) if shard_file("train", i) not in recorded)
    (killed / orphan).parent.mkdir(parents=True, exist_ok=True)
    (killed / orphan).write_bytes(b"not a safetensors file")

    r = run_cli(cli_args(target, data, killed, N, 1))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"({done} done)" in r.stdout or f"({len(_recorded(killed))} done)" in r.stdout
    assert not list(killed.glob("**/*.tmp"))

    r = run_cli(cli_args(target, data, clean, N, 1))
    assert r.returncode == 0, r.stderr[-3000:]
    same_capture(killed, clean)
