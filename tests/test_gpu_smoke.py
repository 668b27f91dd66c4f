"""The training path on a lent GPU, in seconds, before a long run spends its budget (skipped without CUDA):

    python -m pytest -v tests/test_gpu_smoke.py

On a tiny random target: capture, offline and online EAGLE-3 training in bf16 autocast with the EAGLE-3.1
options, a resume with a raised max_steps, a run whose lr decays over a wall-clock budget
(train.schedule_over=minutes, what scripts/gpu_train.sh runs), and the best head loading back. The same
paths run on the CPU in the rest of the suite; this is the one place they run on CUDA."""

from __future__ import annotations

import pytest
import torch

from eagle.algorithms.head_io import read_head_config
from eagle.capture.runner import run_capture
from eagle.cli.app import compose
from eagle.train.trainer import train
from tests.support.data import write_conversations
from tests.support.train import base_overrides, train_overrides
from tests.tiny_models import save_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
BF16 = {"train__mixed_precision": "bf16", "train__group_by_length": "true"}


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-smoke")
    target = save_model("llama", root / "target")
    convs = write_conversations(root / "convs.jsonl")
    base = [o for o in base_overrides(target, convs, "eagle3") if not o.startswith("device=")]
    base += ["device=cuda", "draft.fc_norm=true", "draft.norm_output=true"]
    run_capture(compose(base + [f"output_dir={root / 'capture'}"]))
    return root, base


def test_offline_training_in_bf16(gpu_run):
    root, base = gpu_run
    result = train(compose(base + train_overrides(root / "offline", root / "capture", 6, **BF16)))
    assert result.step == 6


def test_online_training_resumes_with_a_raised_max_steps_and_the_best_head_loads(gpu_run):
    root, base = gpu_run
    first = train(compose(base + train_overrides(root / "online", None, 4, **BF16)))
    resumed = train(compose(base + train_overrides(root / "online", None, 8, **BF16)))
    assert (first.step, resumed.step) == (4, 8)
    cfg = read_head_config(resumed.best_dir)
    assert cfg.fc_norm and cfg.norm_output


def test_a_wall_clock_budget_ends_the_schedule(gpu_run):
    root, base = gpu_run
    budget = {"train__max_minutes": 0.2, "train__schedule_over": "minutes", **BF16}
    result = train(compose(base + train_overrides(root / "budget", None, 10**8, **budget)))
    assert result.stopped == "max_minutes" and result.step > 0
