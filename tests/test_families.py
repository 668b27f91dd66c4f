"""The families people speculate on now (tests/tiny_models.MORE_FAMILIES): hybrid linear-attention models
(Qwen3-Next, Qwen3.5), gpt-oss (sinks, sliding layers, eager attention only) and the MoE families
(Qwen3-MoE, Mixtral, DeepSeek-V3 with MLA) through every stage with default settings: capture, offline
and online training, eagle-eval with greedy output identical to HF `generate` in float32, export.

Hybrid targets verify chains (their recurrent layers read a pass in order) and, after a partial
acceptance, put the recurrent state back and replay the accepted tokens (eagle/decode/generator.py).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from eagle.algorithms.head_io import head_config_from_target, load_head
from eagle.capture.features import extract_features
from eagle.cli.app import compose
from eagle.config import ConfigError, DraftConfig, TargetConfig
from eagle.decode import SpeculativeGenerator, autoregressive_generate
from eagle.decode.cache import StateSnapshot
from eagle.decode.target import new_cache, select_features, target_forward
from eagle.errors import EagleError, TargetError
from eagle.evaluate import evaluate
from eagle.export import export_head
from eagle.export.validate import check_folder
from eagle.target.loading import attention_implementation, load_target
from eagle.train.trainer import train
from tests.support.decode import OracleHead, decode_cfg, hf_greedy, prompt_ids, random_head
from tests.support.train import Workspace
from tests.test_accept import _sampled_law_check
from tests.tiny_models import (
    HYBRID_FAMILIES,
    MORE_FAMILIES,
    PER_LAYER_FAMILIES,
    STATE_FAMILIES,
    YEAR_FAMILIES,
    make_config,
    make_model,
    make_tokenizer,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "Write a short poem about the sea."


@pytest.mark.parametrize("family", MORE_FAMILIES + STATE_FAMILIES + YEAR_FAMILIES)
def test_greedy_output_is_the_targets_own(family):
    model, tok = make_model(family)
    ids = prompt_ids(tok, PROMPT)
    ref = hf_greedy(model, ids, 24)
    assert autoregressive_generate(model, tok, ids, decode_cfg(max_new_tokens=24)).tokens == ref
    heads = {
        "eagle3": random_head(model, "eagle3", draft_vocab_size=200),
        "oracle": OracleHead(ids + ref, len(tok)),
        "dflash": random_head(model, "dflash", block_size=4),
        "peagle": random_head(model, "peagle"),
    }
    for name, head in heads.items():
        for kw in ({}, {"tree": "auto"}, {"tree_top_k": 1}):
            res = SpeculativeGenerator(
                model, head, tok, decode_cfg(max_new_tokens=24, draft_dtype="float32", **kw)
            ).generate(ids)
            assert res.tokens == ref, (name, kw)
            assert sum(res.accept_lengths) + 1 == len(res.tokens)
            if name == "oracle":
                assert max(res.accept_lengths) >= 3  # long accepted runs really happened


@pytest.mark.parametrize("family", HYBRID_FAMILIES + STATE_FAMILIES)
def test_hybrid_targets_verify_chains_and_replay_partial_acceptances(family):
    model, tok = make_model(family)
    ids = prompt_ids(tok, PROMPT)
    ref = hf_greedy(model, ids, 30)
    gen = SpeculativeGenerator(
        model, OracleHead(ids + ref, len(tok)), tok, decode_cfg(max_new_tokens=30, tree_top_k=3, lookup_tokens=4)
    )
    assert gen.top_k == 1 and gen.lookup_stats is None  # chains, no prompt-lookup branches
    res = gen.generate(ids)
    assert res.tokens == ref
    # The oracle misses some positions (partial acceptances: replayed) and drafts long runs (full ones: not).
    assert 0 < res.replays < len(res.accept_lengths)
    with pytest.raises(EagleError, match="state that follows the sequence"):
        SpeculativeGenerator(model, random_head(model, "eagle3"), tok, decode_cfg(tree="static", static_paths=[[0]]))


def test_a_restored_snapshot_puts_the_recurrent_state_back():
    model, tok = make_model("qwen3_next")
    ids = torch.tensor(prompt_ids(tok, PROMPT))
    cache = new_cache(model.config)
    target_forward(model, ids, torch.arange(ids.numel()), cache)
    before = StateSnapshot.take(cache)
    n = ids.numel()
    target_forward(model, ids[:3], torch.arange(n, n + 3), cache)
    first = before.copies[0]
    assert not torch.equal(first.layer.recurrent_states[0], first.recurrent[0])
    before.restore()
    for copy in before.copies:
        assert torch.equal(copy.layer.conv_states[0], copy.conv[0])
        assert torch.equal(copy.layer.recurrent_states[0], copy.recurrent[0])
    with pytest.raises(
        TargetError, match="state that follows the sequence.*chain"
    ):  # a tree cannot be verified through recurrent layers
        target_forward(
            model,
            ids[:3],
            torch.tensor([n, n + 1, n + 1]),
            cache,
            torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool),
        )


@pytest.mark.parametrize("decode_kw", [{}, {"draft_choice": "sample"}], ids=["topk", "sample"])
def test_hybrid_sampled_output_follows_the_target_law(decode_kw):
    # A chain (top-1, or one sample per level) is accepted less often than the Llama test's top-3 tree.
    _sampled_law_check(2000, family="qwen3_5", min_accepted=1 / 20, **decode_kw)


def test_sampled_output_follows_the_target_law_with_attention_and_state_in_one_layer():
    """Falcon-H1: each layer keeps keys and values and a Mamba2 state (both rolled back)."""
    _sampled_law_check(1200, family="falcon_h1", min_accepted=1 / 20)  # its Mamba2 runs twice as slow as Qwen3.5


def test_auto_attention_picks_what_each_family_runs():
    assert attention_implementation("auto", make_model("gpt_oss")[0].config) == "eager"  # sinks: no sdpa path
    for family in ("qwen3_next", "deepseek_v3", "llama"):
        assert attention_implementation("auto", make_model(family)[0].config) == "sdpa"
    assert attention_implementation("eager", make_model("llama")[0].config) == "eager"  # asked for: kept
    assert compose([]).target.attn_implementation == "auto"


def test_a_target_whose_forward_fails_is_named(tmp_path):
    """A malformed config (3 key/value heads for 4 query heads: transformers loads it, its forward cannot run)
    stops capture and decoding with the target's path and the error, not a raw tensor-size traceback."""
    tok = make_tokenizer("mixtral")
    config = make_config("mixtral", len(tok))
    config.num_key_value_heads = 3
    folder = tmp_path / "target"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    model, tok, _ = load_target(TargetConfig(path=str(folder), dtype="float32"))
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(TargetError, match=f"target.path={folder}.*mixtral.*num_key_value_heads"):
        extract_features(model, ids, torch.ones_like(ids), [1, 2])
    with pytest.raises(TargetError, match=f"target.path={folder}"):
        target_forward(model, ids[0], torch.arange(3), new_cache(model.config))


@pytest.mark.slow
@pytest.mark.parametrize("family", MORE_FAMILIES + STATE_FAMILIES + YEAR_FAMILIES)
def test_every_stage_with_default_settings(family, tmp_path):
    ws = Workspace(tmp_path / "ws", family, "eagle3")
    assert (ws.capture / "manifest.json").is_file()
    offline = train(ws.cfg(tmp_path / "offline", steps=3))
    assert offline.step == 3
    online = train(ws.cfg(tmp_path / "online", online=True, steps=2))
    assert online.step == 2
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt": PROMPT}) + "\n")
    report = evaluate(
        compose(
            [
                f"target.path={ws.target}",
                f"draft.path={tmp_path / 'offline'}",
                f"eval.prompts={prompts}",
                "eval.warmup_prompts=0",
                "eval.baselines=[hf_generate]",
                "decode.max_new_tokens=16",
                "decode.temperature=0",
                "target.dtype=float32",
                f"output_dir={tmp_path / 'eval'}",
            ]
        )
    )
    assert report["greedy_match"] == 1.0
    model = AutoConfig.from_pretrained(ws.target)
    head = load_head(tmp_path / "offline" / "best")
    export_head(head, tmp_path / "vllm", "vllm", dtype="float32", target_path=str(ws.target))
    check_folder(tmp_path / "vllm", expect_format="vllm", num_target_layers=model.num_hidden_layers)


# --- Gemma 4 (per-layer config) and DeepSeek-V4 (hyper-connection streams), issue #51 --------------------------
# DeepSeek-V4 decodes through compressed-attention cache layers (DeepseekV4CSACache / DeepseekV4HCACache: a compressor
# state that follows the sequence), so it verifies chains, its state put back and the accepted tokens replayed after a
# partial acceptance (the oracle head below makes some).


def test_a_per_layer_config_sizes_the_head_from_its_full_attention_layers():
    """Gemma 4: sliding layers 16-wide heads with 2 KV heads, full layers 32-wide with 1; the draft attends over
    the whole context with the full layers' RoPE, so it takes their sizes."""
    config = make_config("gemma4", 384)
    head = head_config_from_target(config, DraftConfig(draft_vocab_size=None))
    full = config.per_layer_config[3]
    assert (head.num_attention_heads, head.num_key_value_heads, head.head_dim) == (4, full.num_key_value_heads, 32)
    assert head.rope_parameters["rope_type"] == "proportional"  # the full-attention RoPE
    v4 = head_config_from_target(make_config("deepseek_v4", 384), DraftConfig(draft_vocab_size=None))
    assert (v4.num_attention_heads, v4.num_key_value_heads, v4.head_dim) == (4, 1, 32)
    # The head rotates its whole head_dim; the target's partial factor would mislead an engine reading the export.
    assert "partial_rotary_factor" not in v4.rope_parameters


def test_a_config_the_head_cannot_be_sized_from_names_the_attribute_and_family():
    # A remote-code config without attention heads, and one whose heads do not share KV heads evenly.
    bare = SimpleNamespace(
        model_type="mystery", hidden_size=64, vocab_size=300, num_hidden_layers=4, intermediate_size=8
    )
    with pytest.raises(ConfigError, match="mystery target config: num_attention_heads is None"):
        head_config_from_target(bare, DraftConfig(draft_vocab_size=None))
    uneven = SimpleNamespace(**{**vars(bare), "num_attention_heads": 4, "num_key_value_heads": 3})
    with pytest.raises(ConfigError, match="mystery target config: num_attention_heads=4 is not a multiple of num_key"):
        head_config_from_target(uneven, DraftConfig(draft_vocab_size=None))


def test_hyper_connection_features_are_each_layers_own_collapse():
    """DeepSeek-V4's hidden states carry 2 streams; capture and the decoder both hand the head [.., 3, H]: the
    input of layer i collapsed by layer i's attention hyper-connection (what that layer's attention reads)."""
    model, tok = make_model("deepseek_v4")
    ids = torch.tensor([prompt_ids(tok, PROMPT)])
    with torch.inference_mode():
        states = model.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        assert states[1].shape == (1, ids.shape[1], 2, model.config.hidden_size)  # [B, T, hc_mult, H]
        want = torch.stack([model.model.layers[i].attn_hc(states[i])[-1] for i in (1, 2, 3)], dim=2)
        decoded = select_features(model, states, [1, 2, 3, -1])
    captured = extract_features(model, ids, torch.ones_like(ids), [1, 2, 3])
    assert captured["aux_hidden"].shape == (1, ids.shape[1], 3, model.config.hidden_size)
    torch.testing.assert_close(captured["aux_hidden"], want)
    torch.testing.assert_close(decoded[:, :, :3], want)
    torch.testing.assert_close(decoded[:, :, 3], captured["final_hidden"])  # hc_head + norm, the LM head's input


@pytest.mark.parametrize("family", PER_LAYER_FAMILIES)
def test_per_layer_and_hyper_connection_targets_decode_losslessly(family):
    model, tok = make_model(family)
    ids = prompt_ids(tok, PROMPT)
    ref = hf_greedy(model, ids, 16)
    heads = {"eagle3": random_head(model, "eagle3", draft_vocab_size=200), "oracle": OracleHead(ids + ref, len(tok))}
    for name, head in heads.items():
        res = SpeculativeGenerator(model, head, tok, decode_cfg(max_new_tokens=16, draft_dtype="float32")).generate(ids)
        assert res.tokens == ref, name


@pytest.mark.parametrize("family", PER_LAYER_FAMILIES)
def test_per_layer_and_hyper_connection_targets_capture_train_and_export(family, tmp_path):
    """Capture, offline and online training and a vLLM export that `eagle-export --check` accepts. Gemma 4's head
    is trained with draft.hidden_act=silu: vLLM and SGLang run drafts with SiLU only."""
    ws = Workspace(tmp_path / "ws", family, "eagle3")
    manifest = json.loads((ws.capture / "manifest.json").read_text())
    assert manifest["complete"] and manifest["features"]["aux_hidden"] == [3, 64]  # streams collapsed: [k, H]
    act = {"draft__hidden_act": "silu"} if family == "gemma4" else {}
    assert train(ws.cfg(tmp_path / "offline", steps=2, **act)).step == 2
    assert train(ws.cfg(tmp_path / "online", online=True, steps=1, **act)).step == 1
    head = load_head(tmp_path / "offline" / "best")
    assert head.config.hidden_act == "silu"
    export_head(head, tmp_path / "vllm", "vllm", dtype="float32", target_path=str(ws.target))
    layers = AutoConfig.from_pretrained(ws.target).num_hidden_layers
    check_folder(tmp_path / "vllm", expect_format="vllm", num_target_layers=layers)


@pytest.mark.slow
@pytest.mark.parametrize("family", PER_LAYER_FAMILIES)
def test_per_layer_and_hyper_connection_targets_evaluate_greedy_identical(family, tmp_path):
    """eagle-eval with default settings on a trained head: greedy output identical to HF `generate`."""
    ws = Workspace(tmp_path / "ws", family, "eagle3")
    train(ws.cfg(tmp_path / "offline", steps=2))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt": PROMPT}) + "\n")
    overrides = [f"target.path={ws.target}", f"draft.path={tmp_path / 'offline'}", f"eval.prompts={prompts}"]
    overrides += ["eval.warmup_prompts=0", "eval.baselines=[hf_generate]", "decode.max_new_tokens=12"]
    overrides += ["decode.temperature=0", "target.dtype=float32", f"output_dir={tmp_path / 'eval'}"]
    assert evaluate(compose(overrides))["greedy_match"] == 1.0
