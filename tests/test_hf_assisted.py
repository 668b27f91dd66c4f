"""`eval.baselines=[..., hf_assisted]`: eagle-eval times the same DFlash head in transformers' own assisted
generation beside eagle's decoder and plain `generate`; its output is the target's greedy output and the
report gives its tokens/s, tau and our speedup against it. An EAGLE-3 head is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from eagle.algorithms.head_io import save_head
from eagle.cli.app import compose
from eagle.config import ConfigError, DecodeConfig
from eagle.evaluate.assisted import assisted_runner
from eagle.evaluate.runner import evaluate
from tests.support.decode import hf_greedy, prompt_ids, random_head
from tests.tiny_models import make_model, save_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _eval(tmp_path, algorithm: str, **options):
    target = save_model("qwen3", tmp_path / "target")
    model, _ = make_model("qwen3")
    save_head(random_head(model, algorithm, aux_layer_ids=[1, 2, 3], **options), tmp_path / algorithm)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(["Hi", "1 2 3"])))
    cfg = compose(
        [
            f"target.path={target}",
            f"draft.path={tmp_path / algorithm}",
            f"eval.prompts={prompts}",
            "eval.warmup_prompts=0",
            "eval.baselines=[hf_generate,hf_assisted]",
            "decode.max_new_tokens=12",
            "decode.temperature=0",
            "target.dtype=float32",
            f"output_dir={tmp_path / 'eval'}",
        ]
    )
    return evaluate(cfg)


def test_a_dflash_head_is_timed_in_transformers_assisted_generation(tmp_path):
    report = _eval(tmp_path, "dflash", block_size=4)
    assisted = report["methods"]["hf_assisted"]
    assert assisted["tokens"] == report["methods"]["hf_generate"]["tokens"] > 0
    assert assisted["tau"] is not None and assisted["tau"] >= 1.0 and report["speedup_vs_hf_assisted"] > 0
    for prompt in report["per_prompt"]:
        assert prompt["tokens_by_method"]["hf_assisted"] == prompt["tokens_by_method"]["hf_generate"]
    assert "| hf_assisted |" in (tmp_path / "eval" / "report.md").read_text()


def test_an_eagle3_head_is_refused_for_hf_assisted(tmp_path):
    with pytest.raises(ConfigError, match=r"eval.baselines=hf_assisted .* DFlash heads only .*eagle3 head"):
        _eval(tmp_path, "eagle3", draft_vocab_size=64)


def test_the_config_takes_hf_assisted():
    assert compose(["eval.baselines=[hf_assisted]"]).eval.baselines == ["hf_assisted"]


def test_the_assisted_runner_is_greedy_identical_and_counts_its_passes():
    model, tok = make_model("gemma3")
    model.eval()
    head = random_head(model, "dflash", aux_layer_ids=[1, 2, 3], block_size=4)
    run = assisted_runner(head, model, tok, DecodeConfig(max_new_tokens=16, temperature=0.0))
    ids = prompt_ids(tok, "Write a short poem about the sea.")
    out = run(torch.tensor([ids]))
    assert out["tokens"] == hf_greedy(model, ids, 16)
    assert out["verified_tokens"] == len(out["tokens"]) - 1 and 1 <= out["target_forwards"] <= 15
