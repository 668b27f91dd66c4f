"""The families people speculate on now (tests/tiny_models.MORE_FAMILIES): hybrid linear-attention models
(Qwen3-Next, Qwen3.5), gpt-oss (sinks, sliding layers, eager attention only) and the MoE families
(Qwen3-MoE, Mixtral, DeepSeek-V3 with MLA) through every stage with default settings: capture, offline
and online training, eagle-eval with greedy output identical to HF `generate` in float32, export.

Hybrid targets verify chains (their recurrent layers read a pass in order) and, after a partial
acceptance, put the recurrent state back and replay the accepted tokens (eagle/decode/generator.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from eagle.algorithms.head_io import load_head
from eagle.capture.features import extract_features
from eagle.cli.app import compose
from eagle.config import TargetConfig
from eagle.decode import SpeculativeGenerator, autoregressive_generate
from eagle.decode.cache import StateSnapshot
from eagle.decode.target import new_cache, target_forward
from eagle.errors import EagleError, TargetError
from eagle.evaluate import evaluate
from eagle.export import export_head
from eagle.export.validate import check_folder
from eagle.target.loading import attention_implementation, load_target
from eagle.train.trainer import train
from tests.support.decode import OracleHead, decode_cfg, hf_greedy, prompt_ids, random_head
from tests.support.train import Workspace
from tests.test_accept import _sampled_law_check
from tests.tiny_models import HYBRID_FAMILIES, MORE_FAMILIES, make_config, make_model, make_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "Write a short poem about the sea."


@pytest.mark.parametrize("family", MORE_FAMILIES)
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


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
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
    with pytest.raises(TargetError, match="state that follows the sequence.*chain"):  # a tree cannot be verified through recurrent layers
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
@pytest.mark.parametrize("family", MORE_FAMILIES)
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
