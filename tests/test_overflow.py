"""A target whose activations pass float16's range (65504): capture refuses to store inf, the reader
refuses shards that hold it (captures made before that check), and training never calls a run that
learnt nothing "trained"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle.cli.app import compose
from eagle.errors import CaptureError, TrainingError
from tests.support.data import write_conversations
from tests.support.train import base_overrides, train_overrides
from tests.tiny_models import make_model


def _loud_target(folder: Path) -> Path:
    """A tiny Llama whose embeddings are scaled so the residual stream reaches ~1e6 (RMSNorm keeps
    the model itself finite in float32; the post-norm final state stays small)."""
    model, tok = make_model("llama", seed=0)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1e6)
    folder.mkdir(parents=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def loud(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("loud")
    base = base_overrides(_loud_target(root / "target"), write_conversations(root / "c.jsonl", 12), "eagle3")
    return [o for o in base if not o.startswith("capture.dtype=")]


def _capture(base: list[str], out: Path, dtype: str) -> None:
    from eagle.capture.runner import run_capture

    run_capture(compose(base + [f"capture.dtype={dtype}", f"output_dir={out}"]))


def test_capture_refuses_float16_overflow_naming_layer_and_fix(loud, tmp_path):
    with pytest.raises(CaptureError) as e:
        _capture(loud, tmp_path / "f16", "float16")
    msg = str(e.value)
    assert "aux layer" in msg and "capture.dtype=bfloat16" in msg and "largest magnitude" in msg
    # no shard with inf was written
    assert not list((tmp_path / "f16").rglob("*.safetensors"))


def test_bfloat16_capture_of_the_same_target_is_finite(loud, tmp_path):
    from eagle.capture.reader import CaptureDataset

    _capture(loud, tmp_path / "bf16", "bfloat16")
    ds = CaptureDataset(tmp_path / "bf16", "train")
    item = ds[0]
    assert item["aux_hidden"].dtype == torch.bfloat16
    assert float(item["aux_hidden"].float().abs().max()) > 65504 and bool(torch.isfinite(item["aux_hidden"]).all())


@pytest.fixture(scope="module")
def inf_capture(loud, tmp_path_factory) -> Path:
    """What an older eagle-capture wrote for the loud target in float16: shards holding inf."""
    from eagle.capture import runner

    out = tmp_path_factory.mktemp("legacy") / "capture"
    mp = pytest.MonkeyPatch()
    mp.setattr(runner, "check_finite_features", lambda *a, **k: None)
    try:
        _capture(loud, out, "float16")
    finally:
        mp.undo()
    return out


def test_reader_refuses_a_shard_with_inf_by_name(inf_capture):
    from eagle.capture.reader import CaptureDataset

    ds = CaptureDataset(inf_capture, "train")
    with pytest.raises(CaptureError, match=r"shard-.*non-finite.*capture.dtype=bfloat16"):
        ds[0]


def test_training_on_nonfinite_heldout_metrics_is_an_error(loud, inf_capture, tmp_path, monkeypatch):
    from eagle.capture.reader import CaptureDataset
    from eagle.train.trainer import train

    monkeypatch.setattr(CaptureDataset, "_check_finite", lambda *a, **k: None)
    with pytest.raises(TrainingError, match="not finite"):
        train(compose(loud + ["capture.dtype=float16"] + train_overrides(tmp_path / "o", inf_capture, steps=2)))


def test_training_where_every_step_is_skipped_is_an_error(loud, inf_capture, tmp_path, monkeypatch):
    from eagle.capture.reader import CaptureDataset
    from eagle.train import heldout, trainer

    monkeypatch.setattr(CaptureDataset, "_check_finite", lambda *a, **k: None)
    monkeypatch.setattr(heldout, "check_heldout_finite", lambda *a, **k: None)
    with pytest.raises(TrainingError, match="every one of the 2 optimizer steps"):
        trainer.train(compose(loud + ["capture.dtype=float16"] + train_overrides(tmp_path / "o", inf_capture, steps=2)))
