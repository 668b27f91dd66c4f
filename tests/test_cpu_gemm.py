"""`target.cpu_gemm`: the W @ x^T kernel computes the same linears (parameters untouched), applies
only where it is meant to, and speculative decoding through it stays token-identical."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eagle.config import ConfigError
from eagle.decode import SpeculativeGenerator, autoregressive_generate
from eagle.errors import EagleError
from eagle.target.cpu_gemm import MAX_ROWS, SmallBatchLinear, apply_cpu_gemm, transposed_linear
from tests.support.decode import decode_cfg, hf_greedy, prompt_ids, random_head
from tests.tiny_models import make_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("shape", [(2, 24), (1, 8, 24), (3, 5, 24), (MAX_ROWS, 24), (1, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_transposed_linear_equals_f_linear(shape, bias):
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(40, 24, generator=gen), torch.randn(*shape, generator=gen)
    b = torch.randn(40, generator=gen) if bias else None
    got = transposed_linear(x, w, b)
    assert got.shape == (*shape[:-1], 40) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_small_batch_linear_takes_its_kernel_only_for_2_to_max_rows_of_cpu_float32(monkeypatch):
    lin = nn.Linear(16, 8)
    lin.__class__ = SmallBatchLinear
    calls = []
    monkeypatch.setattr("eagle.target.cpu_gemm.transposed_linear", lambda *a: calls.append(a[0].shape) or F.linear(*a))
    for rows in (1, 2, MAX_ROWS, MAX_ROWS + 1):
        lin(torch.randn(rows, 16))
    lin.to(torch.bfloat16)(torch.randn(4, 16, dtype=torch.bfloat16))
    assert calls == [(2, 16), (MAX_ROWS, 16)]


def test_apply_cpu_gemm_swaps_class_not_parameters():
    model, _ = make_model("llama")
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert apply_cpu_gemm(model, "transposed")["kernel"] == "transposed"
    assert all(type(m) is SmallBatchLinear for m in linears)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
    assert apply_cpu_gemm(model, "stock")["kernel"] == "stock"
    assert all(type(m) is nn.Linear for m in linears)
    with pytest.raises(EagleError, match="target.cpu_gemm='fast'"):
        apply_cpu_gemm(model, "fast")


def test_auto_probes_and_records_the_timings_and_skips_other_dtypes():
    model, _ = make_model("llama")
    got = apply_cpu_gemm(model, "auto")
    assert got["kernel"] in ("stock", "transposed") and got["stock_ms"] > 0 and got["transposed_ms"] > 0
    largest = max((m for m in model.modules() if isinstance(m, nn.Linear)), key=lambda m: m.weight.numel())
    assert got["probe_shape"] == list(largest.weight.shape)
    half, _ = make_model("llama")
    half.to(torch.bfloat16)
    assert apply_cpu_gemm(half, "transposed")["kernel"] == "stock"  # only float32 linears change
    assert not any(type(m) is SmallBatchLinear for m in half.modules())


def test_config_refuses_an_unknown_kernel():
    from eagle.cli.app import compose

    with pytest.raises(ConfigError, match="target.cpu_gemm"):
        compose(["target.cpu_gemm=fast"])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_speculative_greedy_through_the_transposed_kernel_equals_hf_generate(family):
    model, tok = make_model(family)
    ids = prompt_ids(tok, "Write a short poem about the sea.")
    ref = hf_greedy(model, ids, 24)  # torch's kernel everywhere
    apply_cpu_gemm(model, "transposed")
    assert autoregressive_generate(model, tok, ids, decode_cfg(max_new_tokens=24)).tokens == ref
    res = SpeculativeGenerator(
        model, random_head(model, "eagle3", draft_vocab_size=200), tok, decode_cfg(max_new_tokens=24)
    ).generate(ids)
    assert res.tokens == ref


def test_load_target_sets_the_kernel_for_decoding_and_regeneration_only(tiny_target_dir):
    from eagle.config import TargetConfig
    from eagle.target.loading import load_target

    cfg = TargetConfig(path=str(tiny_target_dir), dtype="float32", cpu_gemm="transposed")
    for stage, kernel in (
        ("decode", "transposed"),
        ("regenerate", "transposed"),
        ("capture", "stock"),
        ("train", "stock"),
    ):
        model, _, info = load_target(cfg, stage=stage)
        assert info.gemm == kernel, stage
        assert any(type(m) is SmallBatchLinear for m in model.modules()) == (kernel == "transposed"), stage
