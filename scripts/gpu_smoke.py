"""Smoke check of the training path on a lent GPU, before a long run spends its budget (seconds).

On a tiny random target (the test suite's), on the default device (CUDA where there is one): capture,
offline and online EAGLE-3 training in bf16 autocast with the EAGLE-3.1 options, a resume with a raised
max_steps, a run whose lr decays over a wall-clock budget (train.schedule_over=minutes, what
scripts/gpu_train.sh runs), and the best head loading back.
Prints one line per check and exits non-zero on the first failure.

    PYTHONPATH=. python3 scripts/gpu_smoke.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle.algorithms.head_io import read_head_config  # noqa: E402
from eagle.capture.runner import run_capture  # noqa: E402
from eagle.cli.app import compose  # noqa: E402
from eagle.train.trainer import train  # noqa: E402
from tests.support.data import write_conversations  # noqa: E402
from tests.support.train import base_overrides, train_overrides  # noqa: E402
from tests.tiny_models import save_model  # noqa: E402


def check(name: str, fn) -> object:
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # report and stop: the point is to learn what breaks, fast
        print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
        raise SystemExit(1) from e
    print(f"ok   {name} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return out


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mp = "bf16" if device == "cuda" else "no"
    print(
        f"torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""),
        flush=True,
    )
    root = Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    target = save_model("llama", root / "target")
    convs = write_conversations(root / "convs.jsonl")
    base = [o for o in base_overrides(target, convs, "eagle3") if not o.startswith("device=")]
    base += [f"device={device}", "draft.fc_norm=true", "draft.norm_output=true"]
    capture = root / "capture"
    check("capture", lambda: run_capture(compose(base + [f"output_dir={capture}"])))
    extra = {"train__mixed_precision": mp, "train__group_by_length": "true"}
    off = root / "offline"
    check("offline training, bf16", lambda: train(compose(base + train_overrides(off, capture, 6, **extra))))
    on = root / "online"
    r1 = check("online training, bf16", lambda: train(compose(base + train_overrides(on, None, 4, **extra))))
    r2 = check(
        "online resume with a raised max_steps", lambda: train(compose(base + train_overrides(on, None, 8, **extra)))
    )
    assert r1.step == 4 and r2.step == 8, (r1.step, r2.step)
    budget = root / "budget"
    r3 = check(
        "online training over a 12 s budget (schedule_over=minutes)",
        lambda: train(
            compose(
                base
                + train_overrides(budget, None, 10**8, train__max_minutes=0.2, train__schedule_over="minutes", **extra)
            )
        ),
    )
    assert r3.stopped == "max_minutes" and r3.step > 0, (r3.stopped, r3.step)
    cfg = check("best head loads", lambda: read_head_config(r2.best_dir))
    assert cfg.fc_norm and cfg.norm_output, cfg
    print("SMOKE PASS", flush=True)


if __name__ == "__main__":
    main()
