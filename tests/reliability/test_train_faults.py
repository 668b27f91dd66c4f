"""Training survives being killed: SIGKILL between steps, while a checkpoint is being written, and
between the checkpoint rename and the `latest` update; resuming gives the uninterrupted weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.train import Workspace, assert_same_weights, final_head, train_overrides

pytestmark = pytest.mark.slow  # training children killed mid-run, then resumed in process

# Runs training in a child that SIGKILLs itself at a chosen point (no cleanup, like the OOM killer).
CHILD = r"""
import os, signal, sys
import torch
torch.set_num_threads(1)
from eagle.cli.app import compose
from eagle import fileio
from eagle.train import checkpoint, trainer

mode, at = sys.argv[1], int(sys.argv[2])
cfg = compose(sys.argv[3:])
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
hooks = None
if mode == "between_steps":
    hooks = trainer.TrainHooks(on_step_end=lambda step: die() if step == at else None)
elif mode == "during_save":  # files of step `at` written into the tmp folder, not yet renamed
    real = fileio.fsync_tree
    def fsync_tree(folder):
        real(folder)
        if folder.name == f".tmp-step-{at:07d}":
            die()
    fileio.fsync_tree = fsync_tree
elif mode == "before_pointer":  # step `at` renamed into place, `latest` still names the previous one
    real_write = checkpoint.atomic_write_text
    def atomic_write_text(path, text):
        if path.name == "latest" and f"step-{at:07d}" in text:
            die()
        real_write(path, text)
    checkpoint.atomic_write_text = atomic_write_text
trainer.train(cfg, hooks)
"""


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("faults"), "llama", "eagle1")


@pytest.fixture(scope="module")
def straight(ws, tmp_path_factory) -> Path:
    from eagle.train.trainer import train

    out = tmp_path_factory.mktemp("straight") / "out"
    train(ws.cfg(out, steps=7, draft__feature_noise_std=0.2))
    return out


def _child(ws: Workspace, out: Path, mode: str, at: int) -> None:
    overrides = [*ws.base, *train_overrides(out, ws.capture, 7, draft__feature_noise_std=0.2)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(at), *overrides], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == -9, proc.stderr[-3000:]


@pytest.mark.parametrize(
    "mode,at,expect_latest",
    [
        ("between_steps", 5, "step-0000004"),  # killed after step 5; step 4 is the last checkpoint
        ("during_save", 4, "step-0000002"),  # step 4's files written but never published
        ("before_pointer", 4, "step-0000004"),  # step 4 published, `latest` still says step 2
    ],
)
def test_sigkill_then_resume_matches_uninterrupted(ws, straight, tmp_path, mode, at, expect_latest):
    from eagle.train.checkpoint import find_latest_checkpoint
    from eagle.train.trainer import train

    out = tmp_path / "out"
    _child(ws, out, mode, at)
    latest = find_latest_checkpoint(out)
    assert latest is not None and latest.name == expect_latest
    if mode == "during_save":
        assert (out / "checkpoints" / f".tmp-step-{at:07d}").is_dir()  # the torn write is still there
    result = train(ws.cfg(out, steps=7, draft__feature_noise_std=0.2))
    assert result.step == 7 and result.stopped == "max_steps"
    assert_same_weights(final_head(straight, 7), final_head(out, 7))
    assert not list((out / "checkpoints").glob(".tmp-*"))  # torn writes are cleaned up
