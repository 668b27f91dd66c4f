"""scripts/gpu_train.sh runs only where a GPU is lent, rarely and on a budget: here it runs end to end
on the CPU with a tiny target, so a broken script is found before it spends GPU minutes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.data import write_conversations
from tests.tiny_models import save_model

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_train_script_trains_to_its_budget_and_packs_the_best_head(tmp_path):
    target = save_model("llama", tmp_path / "target")
    data = write_conversations(tmp_path / "convs.jsonl", n=40)
    out, work = tmp_path / "out", tmp_path / "work"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "OUT": str(out),
        "WORK": str(work),
        "TARGET": str(target),
        "DATA": str(data),
        "DTYPE": "float32",
        "MP": "no",
        "BATCH": "4",
        "VOCAB": "128",
        "TTT": "3",
        "EVAL_EVERY": "4",
        "BUDGET_S": "60",
        "PACK_S": "5",
        "TRAIN_ARGS": "draft.aux_layer_ids=null data.dedup_against=[] data.heldout_fraction=0.2 device=cpu "
        "train.warmup_steps=2",
    }
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_train.sh")], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "== train at batch 4 for" in log
    summary = json.loads((out / "train_summary.json").read_text())
    # One run that ended with its wall-clock budget (schedule_over=minutes), not at a guessed step count.
    assert summary["step"] >= 3 and summary["stopped"] == "max_minutes", summary
    lrs = [r["lr"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "lr" in r]
    assert lrs[-1] < max(lrs)  # past warm-up the lr decayed over the budget
    parts = sorted(out.glob("best-model.safetensors.part-*"))
    assert parts and all(p.stat().st_size <= 15 * 2**20 for p in parts)
    weights = b"".join(p.read_bytes() for p in parts)
    assert hashlib.sha256(weights).hexdigest() == (out / "best-model.sha256").read_text().strip()
    assert weights == (work / "train" / "best" / "model.safetensors").read_bytes()
    config = json.loads((out / "head_config.json").read_text())
    # the recipe's head: plain EAGLE-3 (no EAGLE-3.1 norms since the 2026-12-07 norm study)
    assert config["fc_norm"] is False and config["norm_output"] is False and config["draft_vocab_size"] == 128
    assert "held-out tau_sim" in log
