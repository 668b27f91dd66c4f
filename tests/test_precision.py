"""target.dtype resolution: auto per stage and machine; dtypes the CPU cannot run natively refused."""

from __future__ import annotations

import pytest
import torch

from eagle import precision
from eagle.errors import TargetError


@pytest.fixture
def flags(monkeypatch):
    def set_flags(*names: str) -> None:
        monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset(names))

    return set_flags


def test_auto_is_bf16_for_decoding_on_a_native_bf16_cpu(flags):
    flags("avx512f", "avx512_bf16")
    assert precision.resolve_dtype("auto", "cpu", "decode") == torch.bfloat16
    assert precision.resolve_dtype("auto", "cpu", "capture") == torch.float32  # features keep full precision
    assert precision.resolve_dtype("auto", "cpu", "train") == torch.float32


def test_auto_is_fp32_without_native_bf16(flags):
    flags("avx2")
    assert precision.resolve_dtype("auto", "cpu", "decode") == torch.float32


def test_explicit_bf16_without_the_flag_is_refused_naming_it(flags):
    flags("avx2")
    with pytest.raises(TargetError, match=r"avx512_bf16 / amx_bf16.*target.dtype=float32"):
        precision.resolve_dtype("bfloat16", "cpu")
    with pytest.raises(TargetError, match="avx512_fp16"):
        precision.resolve_dtype("float16", "cpu")
    assert precision.resolve_dtype("float32", "cpu") == torch.float32


def test_amx_counts_as_native(flags):
    flags("amx_bf16")
    assert precision.resolve_dtype("bfloat16", "cpu") == torch.bfloat16


def test_eval_loads_target_and_head_in_the_resolved_dtype(tiny_target_dir, flags, tmp_path):
    """The decode path: target loaded in bf16 under auto, the head cast to it by the generator."""
    from eagle.config import DecodeConfig, TargetConfig
    from eagle.decode import SpeculativeGenerator
    from eagle.targets import load_target
    from tests.support.decode import random_head

    flags("avx512_bf16")
    model, tok, info = load_target(TargetConfig(path=str(tiny_target_dir)), stage="decode")
    assert info.dtype == "bfloat16" and next(model.parameters()).dtype == torch.bfloat16
    head = random_head(load_target(TargetConfig(path=str(tiny_target_dir), dtype="float32"))[0], "eagle3",
                       draft_vocab_size=100)
    gen = SpeculativeGenerator(model, head, tok, DecodeConfig(tree="dynamic", max_new_tokens=4))
    assert next(gen.head.parameters()).dtype == torch.bfloat16
    assert len(gen.generate([1, 2, 3]).tokens) >= 1


# --------------------------------------------------------------------------------------- training
def test_mixed_precision_auto_follows_the_cpu(flags):
    flags("avx512f", "avx512_bf16")
    assert precision.resolve_mixed_precision("auto", "cpu") == "bf16"
    flags("avx2")
    assert precision.resolve_mixed_precision("auto", "cpu") == "no"
    assert precision.resolve_mixed_precision("no", "cpu") == "no"


def test_explicit_bf16_training_without_the_flag_is_refused_naming_it(flags):
    flags("avx2")
    with pytest.raises(TargetError, match=r"train.mixed_precision=bf16 on cpu: .*avx512_bf16.*mixed_precision=auto"):
        precision.resolve_mixed_precision("bf16", "cpu")
    with pytest.raises(TargetError, match="not one of"):
        precision.resolve_mixed_precision("bfloat16", "cpu")
