"""Draft heads on tiny targets of every family: sizes, names, save/load, caching, errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from eagle.algorithms.head_io import (
    build_head,
    head_config_from_target,
    load_head,
    read_head_extra,
    save_head,
)
from eagle.config import ConfigError, DraftConfig
from eagle.errors import CheckpointError
from eagle.heads.base import HeadConfig
from eagle.heads.layers import Attention, RotaryEmbedding, causal_mask, fuse_for_inference, fuse_linears
from eagle.heads.vocab import count_tokens
from tests.tiny_models import FAMILIES, make_model

ALGOS = ("eagle1", "eagle3")
DRAFT_VOCAB = 100


@pytest.fixture(scope="module", params=FAMILIES)
def target(request):
    """(family, tiny target model), built once per family for this module (heads never modify it)."""
    return request.param, make_model(request.param)[0]


def _head(model, algo: str, seed: int = 0, **options):
    cfg = head_config_from_target(model.config, DraftConfig(algorithm=algo, draft_vocab_size=DRAFT_VOCAB, **options))
    counts = torch.bincount(
        torch.randint(0, cfg.vocab_size, (2000,), generator=torch.Generator().manual_seed(1)), minlength=cfg.vocab_size
    )
    torch.manual_seed(seed)
    return build_head(cfg, model, vocab_counts=counts)


def _inputs(head, b: int = 2, t: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cfg = head.config
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    feats = torch.randn(b, t, len(head.feature_layer_ids()), cfg.target_hidden_size, generator=g)
    pos = torch.arange(1, t + 1).expand(b, t)
    return ids, feats, pos


EAGLE3_NAMES = {
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}
EAGLE1_NAMES = {
    "fc.weight",
    "fc.bias",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
}


@pytest.mark.parametrize("algo", ALGOS)
def test_shapes_names_and_borrowed_modules(target, algo):
    family, model = target
    head = _head(model, algo)
    cfg = head.config
    ids, feats, pos = _inputs(head)
    hidden = head.project_features(feats)
    assert hidden.shape == (2, 7, cfg.hidden_size)
    out = head(ids, hidden, pos)
    assert out.shape == (2, 7, cfg.hidden_size)
    logits = head.logits(out)
    assert logits.shape == (2, 7, DRAFT_VOCAB if algo == "eagle3" else cfg.vocab_size)
    assert torch.isfinite(logits).all()
    names = set(head.trainable_state_dict())
    assert names == (EAGLE3_NAMES if algo == "eagle3" else EAGLE1_NAMES)
    # Borrowed target weights are never trainable parameters of the head.
    target_ids = {id(p) for p in model.parameters()}
    assert not any(id(p) in target_ids for p in head.parameters())
    shapes = {k: tuple(v.shape) for k, v in head.trainable_state_dict().items()}
    h = cfg.hidden_size
    if algo == "eagle3":
        assert shapes["fc.weight"] == (h, 3 * cfg.target_hidden_size)
        assert shapes["midlayer.self_attn.q_proj.weight"] == (cfg.num_attention_heads * cfg.head_dim, 2 * h)
        assert shapes["midlayer.self_attn.k_proj.weight"] == (cfg.num_key_value_heads * cfg.head_dim, 2 * h)
        assert shapes["lm_head.weight"] == (DRAFT_VOCAB, h)
        assert head.d2t.dtype == torch.long and head.t2d.dtype == torch.bool
        assert int(head.t2d.sum()) == DRAFT_VOCAB
        # lm_head starts from the target's LM-head rows of the draft vocabulary.
        target_ids_of_draft = head.draft_to_target(torch.arange(DRAFT_VOCAB))
        assert torch.equal(head.lm_head.weight, model.get_output_embeddings().weight[target_ids_of_draft])
    else:
        assert shapes["fc.weight"] == (h, 2 * h)
        assert head.feature_layer_ids() == [-1]
        # EAGLE-1 logits are the target's LM head applied to the predicted feature.
        assert torch.allclose(logits, model.get_output_embeddings()(out))


@pytest.mark.parametrize("algo", ALGOS)
def test_save_load_round_trip(target, algo, tmp_path):
    family, model = target
    head = _head(model, algo, seed=3)
    with torch.no_grad():  # make norms non-trivial so a lost weight would show
        for p in head.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_head(head, tmp_path / "h", extra={"step": 5})
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == ["head_config.json", "model.safetensors"]
    loaded = load_head(tmp_path / "h", target_model=model)
    assert loaded.config == head.config
    a, b = head.trainable_state_dict(), loaded.trainable_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids, feats, pos = _inputs(head)
    with torch.no_grad():
        out_a = head.logits(head(ids, head.project_features(feats), pos))
        out_b = loaded.logits(loaded(ids, loaded.project_features(feats), pos))
    assert torch.equal(out_a, out_b)
    assert read_head_extra(tmp_path / "h") == {"step": 5}


@pytest.mark.parametrize(
    "algo, options", [("eagle1", {}), ("eagle3", {}), ("eagle3", {"fc_norm": True, "norm_output": True})]
)
def test_cached_incremental_forward_matches_full(target, algo, options):
    from transformers import DynamicCache

    family, model = target
    head = _head(model, algo, **options)
    ids, feats, pos = _inputs(head, b=2, t=9)
    with torch.no_grad():
        hidden = head.project_features(feats)
        full = head(ids, hidden, pos)
        cache = DynamicCache()
        parts = [head(ids[:, :4], hidden[:, :4], pos[:, :4], past_key_values=cache)]  # prefill 4
        for t in range(4, 9):  # then one token at a time
            parts.append(head(ids[:, t : t + 1], hidden[:, t : t + 1], pos[:, t : t + 1], past_key_values=cache))
        # An explicit mask equal to causal gives the same result as None.
        explicit = head(ids, hidden, pos, attention_mask=causal_mask(9, 0, ids.device).expand(2, 1, 9, 9))
    assert cache.get_seq_length() == 9
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(explicit, full)


def test_attention_matches_transformers_llama():
    """Our GQA + RoPE attention equals transformers' LlamaAttention with the same weights."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    lcfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=1024,
        rope_parameters=rope,
        num_hidden_layers=1,
        vocab_size=32,
    )
    lcfg._attn_implementation = "sdpa"
    hcfg = HeadConfig(
        algorithm="eagle1",
        hidden_size=64,
        target_hidden_size=64,
        vocab_size=32,
        draft_vocab_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=1024,
        rope_parameters=rope,
    )
    torch.manual_seed(0)
    ours, theirs = Attention(hcfg, 64), LlamaAttention(lcfg, layer_idx=0)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 11, 64)
    pos = torch.arange(100, 111).expand(2, 11)  # beyond original_max_position_embeddings: scaling matters
    cos, sin = RotaryEmbedding(hcfg)(pos, x.dtype)
    cos_t, sin_t = LlamaRotaryEmbedding(lcfg)(x, pos)
    torch.testing.assert_close(cos, cos_t)
    torch.testing.assert_close(sin, sin_t)
    mask = causal_mask(11, 0, x.device).expand(2, 1, 11, 11)
    with torch.no_grad():
        expected = theirs(x, (cos_t, sin_t), attention_mask=mask)[0]
        got = ours(x, cos, sin, attention_mask=mask)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_rope_table_equals_the_direct_computation_at_any_position_and_after_a_cast():
    """cos / sin come from a cached table (grown on demand): the values the formula gives directly,
    in float32 frequencies even for a head cast to bf16."""
    hcfg = HeadConfig(
        algorithm="eagle1",
        hidden_size=64,
        target_hidden_size=64,
        vocab_size=32,
        draft_vocab_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    rope = RotaryEmbedding(hcfg)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))

    def direct(pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        emb = torch.cat([pos[..., None].float() * inv_freq] * 2, dim=-1)  # [B, T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    for pos in (torch.tensor([[0, 1, 7]]), torch.tensor([[3000, 3001, 5], [9, 10, 11]])):  # 3001: past the first table
        for dtype in (torch.float32, torch.bfloat16):
            cos, sin = rope(pos, dtype)
            want_cos, want_sin = direct(pos, dtype)
            assert cos.dtype == dtype and torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert rope.table(1, torch.float32, torch.device("cpu")).shape[0] == 4096  # grown to a power of two
    rope.to(torch.bfloat16)  # a cast head keeps float32 frequencies (not a buffer: never cast)
    assert rope.inv_freq.dtype == torch.float32 and "inv_freq" not in rope.state_dict()
    assert torch.equal(rope(torch.tensor([[2000]]), torch.float32)[0], direct(torch.tensor([[2000]]), torch.float32)[0])


@pytest.mark.parametrize("algo", ALGOS)
def test_fused_projections_compute_the_same_function(target, algo):
    """fuse_for_inference (decoding copies): one q/k/v and one gate/up product give the unfused
    head's output, with a cache and a tree mask; the fused copy's state dict says what changed."""
    from transformers import DynamicCache

    family, model = target
    head = _head(model, algo).eval()
    fused = fuse_for_inference(copy.deepcopy(head))
    layer = "midlayer" if algo == "eagle3" else "layers.0"
    names = set(fused.state_dict())
    assert f"{layer}.self_attn.qkv_proj.weight" in names and f"{layer}.mlp.gate_up_proj.weight" in names
    assert not any(
        n.endswith((".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".gate_proj.weight", ".up_proj.weight"))
        for n in names
    )
    assert f"{layer}.self_attn.q_proj.weight" in head.state_dict()  # the original keeps its export names
    ids, feats, pos = _inputs(head, b=1, t=6)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # two siblings below a root
    mask = torch.cat([torch.ones(3, 6, dtype=torch.bool), tree], dim=1)[None, None]  # [1, 1, 3, 9]
    outs = []
    with torch.no_grad():
        for h in (head, fused):
            cache = DynamicCache()
            prefix = h(ids, h.project_features(feats), pos, past_key_values=cache)  # [1, 6, H]
            level = h(ids[:, :3], prefix[:, :3], pos[:, :3] + 6, attention_mask=mask, past_key_values=cache)
            outs.append((prefix, h.logits(level)))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    fuse_for_inference(fused)  # fusing twice changes nothing
    assert set(fused.state_dict()) == names


def test_fuse_linears_refuses_mixed_bias_or_width():
    with pytest.raises(ValueError, match="one input width"):
        fuse_linears([torch.nn.Linear(4, 3), torch.nn.Linear(5, 3)])
    with pytest.raises(ValueError, match="all with or all without bias"):
        fuse_linears([torch.nn.Linear(4, 3), torch.nn.Linear(4, 3, bias=False)])


def test_head_config_follows_target_config(target):
    family, model = target
    text = model.config
    cfg = head_config_from_target(model.config, DraftConfig(algorithm="eagle3", draft_vocab_size=None))
    assert cfg.hidden_size == text.hidden_size and cfg.vocab_size == cfg.draft_vocab_size == text.vocab_size
    assert cfg.num_key_value_heads == text.num_key_value_heads
    assert cfg.head_dim == (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    assert cfg.aux_layer_ids == [1, 2, 3]  # default for a 4-layer target
    assert cfg.target_model_type == text.model_type
    assert "rope_theta" in cfg.rope_parameters and cfg.rope_parameters.get("rope_type")
    if family == "gemma3":
        assert cfg.hidden_act == "gelu_pytorch_tanh"
        assert cfg.rope_parameters["rope_theta"] == text.rope_parameters["full_attention"]["rope_theta"]
    HeadConfig.from_dict(json.loads(cfg.to_json()))  # serialisable


def test_config_errors():
    model, _ = make_model("llama")
    vocab = model.config.vocab_size
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        head_config_from_target(model.config, DraftConfig(algorithm="eagle3", draft_vocab_size=vocab + 1))
    with pytest.raises(ConfigError, match="aux_layer_ids"):
        head_config_from_target(
            model.config, DraftConfig(algorithm="eagle3", draft_vocab_size=None, aux_layer_ids=[0, 2, 5])
        )
    cfg = head_config_from_target(model.config, DraftConfig(algorithm="eagle3", draft_vocab_size=50))
    with pytest.raises(ConfigError, match="token counts"):
        build_head(cfg, model)
    # EAGLE-1 ignores the EAGLE-3 draft vocabulary size.
    assert head_config_from_target(model.config, DraftConfig(algorithm="eagle1")).draft_vocab_size == vocab


def test_checkpoint_errors(tmp_path):
    model, _ = make_model("llama")
    with pytest.raises(CheckpointError, match="head_config.json"):
        load_head(tmp_path / "nothing")
    head = _head(model, "eagle3")
    save_head(head, tmp_path / "h")
    with pytest.raises(CheckpointError, match="draft.algorithm=eagle1"):
        load_head(tmp_path / "h", algorithm="eagle1")
    # A head for a target of another width does not fit.
    other, _ = make_model("llama", hidden=32)
    with pytest.raises(CheckpointError, match="hidden size"):
        load_head(tmp_path / "h", target_model=other)
    with pytest.raises(CheckpointError, match="hidden size"):
        build_head(head.config, other)
    # Weights that do not match the config.
    cfg = json.loads((tmp_path / "h" / "head_config.json").read_text())
    cfg["intermediate_size"] += 8
    (tmp_path / "h" / "head_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mlp"):
        load_head(tmp_path / "h")
    (tmp_path / "h" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_head(tmp_path / "h")
    (tmp_path / "h" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="not found"):
        load_head(tmp_path / "h")
    cfg["algorithm"] = "medusa"
    (tmp_path / "h" / "head_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="medusa"):
        load_head(tmp_path / "h")


def test_draft_vocab_from_training_counts():
    model, _ = make_model("qwen2")
    cfg = head_config_from_target(model.config, DraftConfig(algorithm="eagle3", draft_vocab_size=20))
    ids = torch.tensor([[5, 5, 5, 9, 9, 300, 7, 7]])
    loss_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])  # id 7 only in the prompt: not counted
    head = build_head(cfg, model, vocab_counts=count_tokens(ids, loss_mask, cfg.vocab_size))
    kept = head.draft_to_target(torch.arange(20))
    assert {5, 9, 300, model.config.eos_token_id} <= set(kept.tolist())
    assert torch.equal(kept, kept.sort().values)


def test_deepcopy_shares_borrowed_target_modules():
    import copy

    model, _ = make_model("llama")
    head = _head(model, "eagle1")
    clone = copy.deepcopy(head)
    assert clone.target_embed_tokens is model.get_input_embeddings()
    assert clone.fc.weight is not head.fc.weight


@pytest.mark.smollm2
def test_eagle3_on_smollm2_default_config(smollm2, tmp_path):
    model, tok, info = smollm2
    cfg = head_config_from_target(model.config, DraftConfig(), info)  # defaults: eagle3, 32000 draft ids
    assert cfg.aux_layer_ids == [2, info.num_layers // 2, info.num_layers - 3]
    assert cfg.target_fingerprint == info.fingerprint
    ids = tok("Speculative decoding drafts tokens.", return_tensors="pt").input_ids
    head = build_head(cfg, model, vocab_counts=count_tokens(ids, None, cfg.vocab_size) + 1)
    assert head.draft_to_target(torch.arange(cfg.draft_vocab_size)).max() < cfg.vocab_size
    assert bool(head.t2d[tok.eos_token_id])
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
        feats = torch.stack([hs[i] for i in head.feature_layer_ids()], dim=2)  # [1, T, 3, H]
        pos = torch.arange(1, ids.shape[1] + 1)[None]
        logits = head.logits(head(ids, head.project_features(feats), pos))
    assert logits.shape == (1, ids.shape[1], 32000) and torch.isfinite(logits).all()
    save_head(head, tmp_path / "h")
    loaded = load_head(tmp_path / "h", target_model=model, algorithm="eagle3")
    assert torch.equal(loaded.d2t, head.d2t)


def test_eagle31_options_normalise_each_layer_and_feed_back_the_normed_state():
    model, _ = make_model("llama")
    head = _head(model, "eagle3", fc_norm=True, norm_output=True)
    plain = _head(model, "eagle3")
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(head.trainable_state_dict())
    assert not any(k.startswith("fc_norm.") for k in plain.trainable_state_dict())
    ids, feats, pos = _inputs(head)
    scaled = feats.clone()
    scaled[:, :, 1] *= 300.0  # one aux layer on another scale (as a deep layer's residual stream is)
    with torch.no_grad():
        torch.testing.assert_close(head.project_features(scaled), head.project_features(feats), atol=1e-4, rtol=1e-4)
        assert not torch.allclose(plain.project_features(scaled), plain.project_features(feats))
        out = head(ids, head.project_features(feats), pos)
        # norm_output: what is fed back is the final-normed state (RMS = the norm's weight, ones at init),
        # and the logits read it without normalising twice.
        torch.testing.assert_close(out.pow(2).mean(-1).sqrt(), torch.ones(out.shape[:2]), atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(head.logits(out), head.lm_head(out))


def test_eagle31_options_apply_to_eagle3_and_are_ignored_by_eagle1():
    """A recipe with fc_norm / norm_output on (the SmolLM2 one had them from 2026-12-04 to 2026-12-07) still
    builds with `draft=eagle1`; the options only shape EAGLE-3 heads."""
    from eagle.cli.app import compose

    model = make_model("llama")[0]
    # The SmolLM2 recipe trains plain EAGLE-3 heads (the norm study), which every engine serves.
    plain = compose(["recipe=smollm2-135m-instruct"]).draft
    assert not plain.fc_norm and not plain.norm_output
    for algo, expected in (("eagle3", True), ("eagle1", False)):
        draft = compose(
            ["recipe=smollm2-135m-instruct", f"draft={algo}", "draft.fc_norm=true", "draft.norm_output=true"]
        ).draft
        assert draft.fc_norm and draft.norm_output  # what the overrides ask for, whatever the algorithm
        cfg = head_config_from_target(
            model.config, DraftConfig(**{**vars(draft), "draft_vocab_size": DRAFT_VOCAB, "aux_layer_ids": None})
        )
        assert (cfg.fc_norm, cfg.norm_output) == (expected, expected), algo
        counts = torch.ones(cfg.vocab_size, dtype=torch.long)
        assert hasattr(build_head(cfg, model, vocab_counts=counts), "fc_norm") == expected
