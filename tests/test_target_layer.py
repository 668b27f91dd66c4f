"""train.init_layer_from_target: a fresh head's decoder layer copied from a target decoder layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eagle.algorithms.head_io import build_head, head_config_from_target
from eagle.config import ConfigError, DraftConfig
from eagle.heads.target_layer import copy_target_layer, pick_target_layer, target_decoder_layers
from tests.tiny_models import FAMILIES, LAYERS, make_model


@pytest.fixture(scope="module", params=FAMILIES)
def target(request):
    return request.param, make_model(request.param)[0]


def _fresh(model, algo: str):
    cfg = head_config_from_target(model.config, DraftConfig(algorithm=algo, draft_vocab_size=None))
    torch.manual_seed(0)
    return build_head(cfg, model)


def _gain(norm: nn.Module, width: int) -> torch.Tensor:
    with torch.no_grad():
        return norm(torch.ones(1, width))[0]


@pytest.mark.parametrize("algo", ["eagle1", "eagle3"])
def test_copy_puts_the_target_layer_where_the_draft_layer_reads_it(target, algo):
    family, model = target
    head, fresh = _fresh(model, algo), _fresh(model, algo)
    index, layer = pick_target_layer(model, -1)
    assert index == LAYERS - 1 and layer is target_decoder_layers(model)[-1]
    left = head.start_from_target_layer(layer)
    draft = head.midlayer if algo == "eagle3" else head.layers[0]
    before = fresh.midlayer if algo == "eagle3" else fresh.layers[0]
    src = dict(layer.named_parameters())
    h = head.config.hidden_size
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
        w = draft.get_submodule(name).weight
        if algo == "eagle3":  # [out, 2H] reads cat(embeds, hidden): the target's weights in the hidden half
            torch.testing.assert_close(w[:, h:], src[f"{name}.weight"], rtol=0, atol=0)
            torch.testing.assert_close(w[:, :h], before.get_submodule(name).weight[:, :h], rtol=0, atol=0)
        else:
            torch.testing.assert_close(w, src[f"{name}.weight"], rtol=0, atol=0)
        if f"{name}.bias" in src:  # qwen2: copied where the draft layer has biases, else reported as left out
            bias = draft.get_submodule(name).bias
            if bias is None:
                assert f"{name}.bias" in left
            else:
                torch.testing.assert_close(bias, src[f"{name}.bias"], rtol=0, atol=0)
    for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        torch.testing.assert_close(draft.get_submodule(name).weight, src[f"{name}.weight"], rtol=0, atol=0)
    modules = dict(layer.named_children())
    mlp_norm = modules.get("pre_feedforward_layernorm", modules["post_attention_layernorm"])
    # Effective gains: Gemma stores 1 + w, Llama w; both must come out as what the norm multiplies by.
    torch.testing.assert_close(draft.post_attention_layernorm.weight, _gain(mlp_norm, h))
    if algo == "eagle3":
        torch.testing.assert_close(draft.hidden_norm.weight, _gain(modules["input_layernorm"], h))
        torch.testing.assert_close(draft.input_layernorm.weight, before.input_layernorm.weight)  # embeds: untouched
        k = len(head.config.aux_layer_ids)
        expected_fc = torch.zeros(h, k * h)
        expected_fc[:, (k - 1) * h :] = torch.eye(h)
        torch.testing.assert_close(head.fc.weight, expected_fc, rtol=0, atol=0)
    else:
        torch.testing.assert_close(head.fc.weight, torch.cat((torch.zeros(h, h), torch.eye(h)), dim=1), rtol=0, atol=0)
        assert not head.fc.bias.any()
    # What the draft layer has no place for is reported, nothing else.
    assert ("input_layernorm.weight" in left) == (algo == "eagle1")
    assert not [n for n in left if n.endswith("_proj.weight")]
    if family == "qwen3":
        assert {"self_attn.q_norm.weight", "self_attn.k_norm.weight"} <= set(left)


def test_llama_copy_computes_the_target_layer_when_the_embedding_half_is_silent():
    """With the embedding half of q/k/v zeroed, the EAGLE-3 draft layer on hidden h is the target layer
    on h: the copy puts every weight and gain where the draft layer's maths reads it."""
    model = make_model("llama")[0]
    head = _fresh(model, "eagle3")
    _, layer = pick_target_layer(model, 1)
    head.start_from_target_layer(layer)
    h = head.config.hidden_size
    with torch.no_grad():
        for proj in (head.midlayer.self_attn.q_proj, head.midlayer.self_attn.k_proj, head.midlayer.self_attn.v_proj):
            proj.weight[:, :h] = 0
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 6, h, generator=g)
    embeds = torch.randn(2, 6, h, generator=g)
    pos = torch.arange(6).expand(2, 6)
    cos, sin = head.rotary_emb(pos, hidden.dtype)
    with torch.no_grad():
        ours = head.midlayer(hidden, cos, sin, embeds=embeds)
        theirs = layer(hidden, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_bad_layer_index_and_non_llama_layers_are_refused_by_name():
    model = make_model("llama")[0]
    with pytest.raises(ConfigError, match=rf"init_layer_from_target={LAYERS}.*{LAYERS} decoder layers"):
        pick_target_layer(model, LAYERS)
    with pytest.raises(ConfigError, match="outside"):
        pick_target_layer(model, -LAYERS - 1)
    assert pick_target_layer(model, -LAYERS)[0] == 0

    head = _fresh(model, "eagle3")
    odd = nn.Module()
    odd.c_attn, odd.c_proj = nn.Linear(4, 12), nn.Linear(4, 4)  # GPT-2 style names
    with pytest.raises(ConfigError, match=r"no self_attn\.q_proj\.weight.*not a Llama-style"):
        copy_target_layer(head.midlayer, odd)

    class TwoStacks(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = model.config
            self.a = nn.ModuleList(nn.Linear(2, 2) for _ in range(LAYERS))
            self.b = nn.ModuleList(nn.Linear(2, 2) for _ in range(LAYERS))

    with pytest.raises(ConfigError, match="found 2 module lists"):
        target_decoder_layers(TwoStacks())


def test_narrower_mlp_is_refused_naming_the_option():
    model = make_model("llama")[0]
    cfg = head_config_from_target(
        model.config, DraftConfig(algorithm="eagle3", draft_vocab_size=None, intermediate_size=8)
    )
    head = build_head(cfg, model)
    with pytest.raises(ConfigError, match="draft.intermediate_size"):
        head.start_from_target_layer(pick_target_layer(model, -1)[1])


def test_frozen_lm_head_reads_the_head_output_as_the_target_reads_its_last_state(target):
    """train.freeze_lm_head on a fresh EAGLE-3 head: its final norm takes the target's final-norm gain
    (Gemma's 1 + w included), so norm + lm_head compute the target's own logits from the same state;
    lm_head is out of the trainable parameters."""
    family, model = target
    final = model.get_decoder().norm
    with torch.no_grad():
        saved = final.weight.clone()
        final.weight.copy_(torch.rand_like(final.weight) + 0.5)  # not the ones a fresh norm starts from
    try:
        head = _fresh(model, "eagle3")
        h = head.config.hidden_size
        assert not torch.allclose(head.norm.weight, _gain(final, h))
        head.freeze_lm_head(model)
        torch.testing.assert_close(head.norm.weight, _gain(final, h))
        state = torch.randn(2, 5, h)  # [B, T, H]
        with torch.no_grad():
            expected = model.get_output_embeddings()(final(state))  # [B, T, V]
            torch.testing.assert_close(
                head.logits(head.norm(state) if head.config.norm_output else state), expected, rtol=1e-5, atol=1e-5
            )
        assert not any(p.requires_grad for p in head.lm_head.parameters())
        assert all(p.requires_grad for n, p in head.named_parameters() if not n.startswith("lm_head"))
    finally:
        with torch.no_grad():
            final.weight.copy_(saved)


def test_freeze_lm_head_is_refused_for_a_head_that_reads_the_targets():
    model = make_model("llama")[0]
    with pytest.raises(ConfigError, match="no LM head of its own"):
        _fresh(model, "eagle1").freeze_lm_head(model)
