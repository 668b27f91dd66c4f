"""target.dtype resolution: auto per stage and machine; dtypes the CPU cannot run natively refused."""

from __future__ import annotations

import pytest
import torch

from eagle.errors import TargetError
from eagle.target import precision


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
    from eagle.target.loading import load_target
    from tests.support.decode import random_head

    flags("avx512_bf16")
    model, tok, info = load_target(TargetConfig(path=str(tiny_target_dir)), stage="decode")
    assert info.dtype == "bfloat16" and next(model.parameters()).dtype == torch.bfloat16
    head = random_head(
        load_target(TargetConfig(path=str(tiny_target_dir), dtype="float32"))[0], "eagle3", draft_vocab_size=100
    )
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


# ------------------------------------------------------------------------------ the draft head
def test_draft_dtype_auto_is_bf16_where_native_whatever_the_target(flags):
    flags("avx512_bf16")
    assert precision.resolve_draft_dtype("auto", torch.float32, "cpu") == torch.bfloat16
    assert precision.resolve_draft_dtype("target", torch.float32, "cpu") == torch.float32
    assert precision.resolve_draft_weights("auto", torch.bfloat16, "cpu") == "int8"
    flags("avx2")
    assert precision.resolve_draft_dtype("auto", torch.float32, "cpu") == torch.float32
    with pytest.raises(TargetError, match=r"decode.draft_dtype=bfloat16 on cpu: .*avx512_bf16"):
        precision.resolve_draft_dtype("bfloat16", torch.float32, "cpu")
    with pytest.raises(
        TargetError, match="decode.draft_weights='int4' is not one of auto, full, int8, int8_weight_only"
    ):
        precision.resolve_draft_weights("int4", torch.bfloat16, "cpu")


def test_draft_weights_int8_for_float32_heads_where_fbgemm_is_there(monkeypatch):
    assert precision.dynamic_int8_available()  # every x86 / arm CPU build of torch has it
    assert precision.resolve_draft_weights("auto", torch.float32, "cpu") == "int8"
    assert precision.resolve_draft_weights("auto", torch.float32, "cuda") == "full"
    assert precision.resolve_draft_weights("auto", torch.float16, "cpu") == "full"
    with pytest.raises(
        TargetError,
        match=r"decode.draft_weights=int8: int8 draft weights need a bfloat16 or "
        r"float32 head \(here: float16\); set decode.draft_weights=full",
    ):
        precision.resolve_draft_weights("int8", torch.float16, "cpu")
    assert precision.resolve_draft_weights("int8_weight_only", torch.bfloat16, "cpu") == "int8_weight_only"
    with pytest.raises(
        TargetError,
        match=r"decode.draft_weights=int8_weight_only: the weight-only int8 kernel "
        r"needs a bfloat16 head \(here: float32\)",
    ):
        precision.resolve_draft_weights("int8_weight_only", torch.float32, "cpu")
    with pytest.raises(TargetError, match=r"int8 draft weights run on a CPU \(here: cuda\)"):
        precision.resolve_draft_weights("int8", torch.bfloat16, "cuda")
    monkeypatch.setattr(precision, "dynamic_int8_available", lambda: False)
    assert precision.resolve_draft_weights("auto", torch.float32, "cpu") == "full"
    with pytest.raises(TargetError, match="no fbgemm dynamic int8 linear for a float32 head"):
        precision.resolve_draft_weights("int8", torch.float32, "cpu")
    # a bfloat16 head without fbgemm falls back to the weight-only kernel, and says so in its result
    assert precision.resolve_draft_weights("int8", torch.bfloat16, "cpu") == "int8_weight_only"
    assert precision.resolve_draft_weights("auto", torch.bfloat16, "cpu") == "int8_weight_only"


@pytest.mark.parametrize("in_features", [64, 40, 7])  # 40 and 7: not a multiple of the kernel's 16
def test_int8_linear_equals_its_reference_and_stays_near_the_float_layer(in_features):
    from eagle.heads.quantize import Int8Linear, int8_linear_reference, quantize_rows

    torch.manual_seed(0)
    layer = torch.nn.Linear(in_features, 24, bias=True)
    x = torch.randn(2, 3, in_features).to(torch.bfloat16)
    q, scales = quantize_rows(layer.weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    y = Int8Linear.from_linear(layer)(x)  # [2, 3, 24]
    assert y.shape == (2, 3, 24) and y.dtype == torch.bfloat16
    ref = int8_linear_reference(x, q, scales.to(torch.bfloat16), layer.bias.to(torch.bfloat16))
    assert torch.allclose(y.float(), ref, atol=2e-2, rtol=1e-2)
    exact = layer(x.float())
    assert (y.float() - exact).abs().max() < 0.02 * exact.abs().max()


@pytest.mark.parametrize("in_features", [64, 40, 7])
def test_dynamic_int8_linear_stays_near_its_reference(in_features):
    """The float32 path: same int8 weights as the reference maths; the activations' 7-bit dynamic
    quantisation adds an error of about 1% of the largest output (measured 0.8-1.6% here)."""
    import copy

    from eagle.heads.quantize import DynamicInt8Linear, int8_linear_reference, quantize_rows

    torch.manual_seed(0)
    layer = torch.nn.Linear(in_features, 24, bias=True)
    x = torch.randn(2, 3, in_features)
    q, scales = quantize_rows(layer.weight)
    quantized = DynamicInt8Linear.from_linear(layer)
    assert torch.equal(quantized.qweight, q)
    y = quantized(x)  # [2, 3, 24]
    assert y.shape == (2, 3, 24) and y.dtype == torch.float32
    ref = int8_linear_reference(x, q, scales, layer.bias)
    assert (y - ref).abs().max() < 0.03 * ref.abs().max()
    assert (y - layer(x)).abs().max() < 0.03 * layer(x).abs().max()
    assert torch.equal(copy.deepcopy(quantized)(x), y)  # the packed weights are rebuilt on a copy
    # a bfloat16 head: the same float32 product on the bf16 input, returned in bfloat16
    xb = x.to(torch.bfloat16)
    yb = quantized(xb)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, quantized(xb.float()).to(torch.bfloat16))
    assert (yb.float() - ref).abs().max() < 0.04 * ref.abs().max()


def test_int8_head_is_a_copy_with_quantized_layer_and_lm_head(tiny_target_dir):
    from eagle.config import TargetConfig
    from eagle.heads.quantize import DynamicInt8Linear, Int8Linear, quantize_head_int8
    from eagle.target.loading import load_target
    from tests.support.decode import random_head

    target = load_target(TargetConfig(path=str(tiny_target_dir), dtype="float32"))[0]
    head = random_head(target, "eagle3", draft_vocab_size=100)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    ids = torch.randint(0, 100, (1, 6))
    feats = torch.randn(1, 6, 3, target.config.hidden_size)
    pos = torch.arange(1, 7)[None]
    with torch.inference_mode():
        full = head.logits(head(ids, head.project_features(feats), pos))  # [1, 6, Vd]
    with pytest.raises(ValueError, match="weight-only int8 kernel needs a bfloat16 head"):
        quantize_head_int8(head, torch.float32, weight_only=True)
    for weight_only, kind in ((True, Int8Linear), (False, DynamicInt8Linear)):
        q = quantize_head_int8(head, torch.bfloat16, weight_only=weight_only)
        assert all(torch.equal(v, head.state_dict()[k]) for k, v in before.items())  # the caller's head is untouched
        assert isinstance(head.lm_head, torch.nn.Linear) and head.fc.weight.dtype == torch.float32
        assert isinstance(q.lm_head, kind) and isinstance(q.midlayer.self_attn.qkv_proj, kind)  # fused
        assert isinstance(q.midlayer.mlp.gate_up_proj, kind) and isinstance(q.midlayer.mlp.down_proj, kind)
        assert isinstance(q.fc, torch.nn.Linear) and q.fc.weight.dtype == torch.bfloat16  # once per step: full
        assert q.target_embed_tokens is head.target_embed_tokens  # borrowed from the target, not copied
        with torch.inference_mode():
            out = q(ids, q.project_features(feats), pos)
            small = q.logits(out)
        assert out.dtype == small.dtype == torch.bfloat16  # the dynamic kernel's float32 product comes back in bf16
        assert (small.float() - full).abs().max() < 0.05 * full.abs().max()


def test_dynamic_int8_linear_of_fused_rows_equals_the_parts_exactly():
    """Fusing q/k/v (or gate/up) before quantising changes nothing: rows keep their own scales and one
    call quantises the shared input once, with the scale each part's own call would use."""
    from eagle.heads.layers import fuse_linears
    from eagle.heads.quantize import DynamicInt8Linear

    torch.manual_seed(0)
    parts = [torch.nn.Linear(96, n, bias=False) for n in (48, 16, 16)]
    fused = DynamicInt8Linear.from_linear(fuse_linears(parts))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 96).to(dtype)
        with torch.inference_mode():
            want = torch.cat([DynamicInt8Linear.from_linear(p)(x) for p in parts], dim=-1)
            got = fused(x)
        assert got.dtype == dtype and torch.equal(got, want)


def test_full_precision_draft_head_is_a_fused_copy(tiny_target_dir):
    """decode.draft_weights=full: the generator drafts with a fused copy in the draft dtype; the
    caller's head keeps its dtype and the names export writes."""
    from eagle.config import TargetConfig
    from eagle.decode import SpeculativeGenerator
    from eagle.target.loading import load_target
    from tests.support.decode import decode_cfg, hf_greedy, random_head

    model, tok, _ = load_target(TargetConfig(path=str(tiny_target_dir), dtype="float32"))
    head = random_head(model, "eagle3", draft_vocab_size=100)
    gen = SpeculativeGenerator(
        model, head, tok, decode_cfg(max_new_tokens=12, draft_dtype="target", draft_weights="full")
    )
    assert gen.head is not head and gen.head.midlayer.self_attn.qkv_proj is not None
    assert head.midlayer.self_attn.qkv_proj is None and "midlayer.self_attn.q_proj.weight" in head.state_dict()
    ids = [1, 5, 9, 14, 3, 7]
    assert gen.generate(ids).tokens == hf_greedy(model, ids, 12)


def test_a_head_quantised_by_the_caller_drafts_as_it_is_and_the_report_says_so(tiny_target_dir, caplog):
    from eagle.config import TargetConfig
    from eagle.decode import SpeculativeGenerator
    from eagle.heads.quantize import quantize_head_int8
    from eagle.target.loading import load_target
    from tests.support.decode import decode_cfg, random_head

    model, tok, _ = load_target(TargetConfig(path=str(tiny_target_dir), dtype="float32"))
    held = quantize_head_int8(random_head(model, "eagle3", draft_vocab_size=100), torch.bfloat16, weight_only=True)
    with caplog.at_level("WARNING"):
        gen = SpeculativeGenerator(model, held, tok, decode_cfg(max_new_tokens=4, draft_weights="full"))
    assert gen.head is held and (gen.draft_weights, gen.draft_dtype) == ("int8_weight_only", "bfloat16")
    assert "already holds int8_weight_only linears; decode.draft_weights=full is not applied" in caplog.text


@pytest.mark.parametrize("algorithm", ["eagle1", "eagle3"])
def test_bf16_int8_head_beside_a_float32_target_keeps_greedy_output(tiny_target_dir, flags, algorithm):
    """decode.draft_dtype/draft_weights=auto on a bf16 CPU: the head drafts in bf16 with int8 weights
    (fbgemm's dynamic product), the float32 target verifies, and the output is the float32 target's own
    greedy output; the weight-only kernel on request, with the same output."""
    from eagle.config import TargetConfig
    from eagle.decode import SpeculativeGenerator
    from eagle.heads.quantize import has_int8_linears
    from eagle.target.loading import load_target
    from tests.support.decode import decode_cfg, hf_greedy, random_head

    flags("avx512_bf16")
    model, tok, _ = load_target(TargetConfig(path=str(tiny_target_dir), dtype="float32"))
    head = random_head(model, algorithm, draft_vocab_size=100 if algorithm == "eagle3" else None)
    ids = [1, 5, 9, 14, 3, 7]
    ref = hf_greedy(model, ids, 20)
    gen = SpeculativeGenerator(
        model, head, tok, decode_cfg(max_new_tokens=20, draft_dtype="auto", draft_weights="auto")
    )
    assert (gen.draft_dtype, gen.draft_weights) == ("bfloat16", "int8") and has_int8_linears(gen.head)
    assert not has_int8_linears(head) and next(head.parameters()).dtype == torch.float32
    assert gen.generate(ids).tokens == ref
    weight_only = SpeculativeGenerator(
        model, head, tok, decode_cfg(max_new_tokens=20, draft_dtype="auto", draft_weights="int8_weight_only")
    )
    assert weight_only.draft_weights == "int8_weight_only" and weight_only.generate(ids).tokens == ref


def test_float32_int8_head_on_a_cpu_without_bf16_keeps_greedy_output(tiny_target_dir, flags):
    """decode.draft_dtype/draft_weights=auto on an AVX2-only CPU: a float32 head with dynamic int8
    linears drafts, the float32 target verifies, and the output is the target's own greedy output."""
    from eagle.config import TargetConfig
    from eagle.decode import SpeculativeGenerator
    from eagle.heads.quantize import DynamicInt8Linear, has_int8_linears
    from eagle.target.loading import load_target
    from tests.support.decode import decode_cfg, hf_greedy, random_head

    flags("avx2")
    model, tok, _ = load_target(TargetConfig(path=str(tiny_target_dir), dtype="float32"))
    head = random_head(model, "eagle3", draft_vocab_size=100)
    ids = [1, 5, 9, 14, 3, 7]
    gen = SpeculativeGenerator(
        model, head, tok, decode_cfg(max_new_tokens=20, draft_dtype="auto", draft_weights="auto")
    )
    assert (gen.draft_dtype, gen.draft_weights) == ("float32", "int8")
    assert isinstance(gen.head.lm_head, DynamicInt8Linear) and not has_int8_linears(head)
    assert gen.generate(ids).tokens == hf_greedy(model, ids, 20)
