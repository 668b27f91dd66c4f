"""Every head through transformers' own `generate`: a `format=hf` export holds `custom_generate/`, and
`target.generate(custom_generate=FOLDER, trust_remote_code=True, ...)` decodes with the head in eagle's
lossless decoder: greedy identical to plain `generate` for every algorithm and tiny family, and on the bundled
SmolLM2 with the shipped EAGLE-3 head, accepting exactly what eagle's own decoder accepts. A head of another
target, a batch, or a stub written for the Hub without `eagle_head=` are refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from eagle.config import DecodeConfig
from eagle.decode.generator import GenerationResult, SpeculativeGenerator
from eagle.errors import ExportError
from eagle.export import check_folder, export_head, write_export
from eagle.export.hf_generate import GENERATE_FILE, REQUIREMENTS_FILE, decode_config
from eagle.export.loader import load_exported_head
from tests.support.decode import hf_greedy, prompt_ids, random_head
from tests.tiny_models import FAMILIES, make_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "heads" / "smollm2-135m-instruct-eagle3"
PROMPT = "Write a short poem about the sea."
OPTIONS = {  # per algorithm: a small head on the tiny 4-layer targets
    "eagle3": {"aux_layer_ids": [1, 2, 3], "draft_vocab_size": 64},
    "eagle1": {},
    "peagle": {"aux_layer_ids": [1, 2, 3], "draft_vocab_size": 64, "parallel_tokens": 3},
    "dflash": {"aux_layer_ids": [1, 2, 3], "block_size": 4},
}


def _custom(model: Any, folder: Path, ids: list[int], n: int, **kwargs: Any) -> list[int]:
    out = model.generate(
        torch.tensor([ids]),
        custom_generate=str(folder),
        trust_remote_code=True,
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=model.config.pad_token_id,
        **kwargs,
    )
    return out[0, len(ids) :].tolist()


class Spy:
    """The results eagle's decoder returned inside `generate(custom_generate=...)`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.results: list[GenerationResult] = []
        original = SpeculativeGenerator.generate

        def spy(gen: SpeculativeGenerator, *args: Any, **kwargs: Any) -> GenerationResult:
            self.results.append(original(gen, *args, **kwargs))
            return self.results[-1]

        monkeypatch.setattr(SpeculativeGenerator, "generate", spy)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_eagle3_head_decodes_in_generate_greedy_identical(family, tmp_path, monkeypatch):
    model, tok = make_model(family)
    model.eval()
    export_head(random_head(model, "eagle3", **OPTIONS["eagle3"]), tmp_path / "h", "hf", dtype="float32")
    assert (tmp_path / "h" / REQUIREMENTS_FILE).read_text() == "eagle\n"
    spy = Spy(monkeypatch)
    ids = prompt_ids(tok, PROMPT)
    assert _custom(model, tmp_path / "h", ids, 24) == hf_greedy(model, ids, 24)
    assert len(spy.results) == 1  # eagle's decoder ran, not transformers' own loop


@pytest.mark.parametrize("algorithm", ["eagle1", "peagle", "dflash"])
def test_every_algorithm_decodes_in_generate_greedy_identical(algorithm, tmp_path):
    model, tok = make_model("qwen3")
    model.eval()
    export_head(random_head(model, algorithm, **OPTIONS[algorithm]), tmp_path / "h", "hf", dtype="float32")
    ids = prompt_ids(tok, PROMPT)
    assert _custom(model, tmp_path / "h", ids, 20) == hf_greedy(model, ids, 20)


def test_generate_options_become_eagles_decode_options():
    model, _ = make_model("llama")
    cfg, _ = decode_config(model, None, 10, {"max_new_tokens": 7, "do_sample": True, "temperature": 0.7, "top_k": 5})
    assert (cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p) == (7, 0.7, 5, 1.0)
    cfg, _ = decode_config(model, None, 10, {"max_length": 30, "eagle_decode": {"tree_depth": 2}})
    assert (cfg.max_new_tokens, cfg.temperature, cfg.tree_depth) == (20, 0.0, 2)
    with pytest.raises(ExportError, match="num_beams"):
        decode_config(model, None, 10, {"num_beams": 2})


def test_calls_that_do_not_fit_are_refused_by_name(tmp_path):
    model, tok = make_model("qwen3")
    export_head(random_head(model, "eagle3", **OPTIONS["eagle3"]), tmp_path / "h", "hf", dtype="float32")
    ids = prompt_ids(tok, PROMPT)
    other, _ = make_model("qwen3", hidden=32)
    with pytest.raises(ExportError, match=rf"{tmp_path / 'h'}.*hidden"):
        _custom(other, tmp_path / "h", ids, 4)
    with pytest.raises(ExportError, match=r"batch size 1"):
        model.generate(torch.tensor([ids, ids]), custom_generate=str(tmp_path / "h"), trust_remote_code=True)
    head = check_folder(tmp_path / "h")
    write_export(head.config, head.tensors, tmp_path / "hub", "hf", dtype="float32", local_paths=False)
    assert "HEAD = None" in (tmp_path / "hub" / GENERATE_FILE).read_text()
    with pytest.raises(ExportError, match=r"pass eagle_head=FOLDER"):
        _custom(model, tmp_path / "hub", ids, 4)
    assert _custom(model, tmp_path / "hub", ids, 8, eagle_head=str(tmp_path / "h")) == hf_greedy(model, ids, 8)
    # Another export into the same folder leaves no stale custom_generate/ behind.
    export_head(random_head(model, "eagle3", **OPTIONS["eagle3"]), tmp_path / "h", "vllm", dtype="float32")
    assert not (tmp_path / "h" / "custom_generate").exists()


@pytest.mark.smollm2
def test_the_shipped_head_in_generate_is_greedy_identical_with_eagles_acceptance(smollm2, tmp_path, monkeypatch):
    """SmolLM2 with the shipped EAGLE-3 head: transformers' generate through custom_generate gives plain
    generate's tokens, and its verify passes accept what eagle's decoder accepts on the same prompt (tau)."""
    model, tok, _ = smollm2
    source = check_folder(SHIPPED)
    write_export(source.config, source.tensors, tmp_path / "h", "hf", dtype="float32")
    spy = Spy(monkeypatch)
    for text in (PROMPT, "Give me three tips for staying healthy."):
        ids = prompt_ids(tok, text)
        assert _custom(model, tmp_path / "h", ids, 32) == hf_greedy(model, ids, 32), text
    monkeypatch.undo()
    greedy = DecodeConfig(max_new_tokens=32)  # what the call above decoded with: generate's defaults, greedy
    direct = SpeculativeGenerator(model, load_exported_head(tmp_path / "h", model), tok, greedy)
    ours = direct.generate(prompt_ids(tok, "Give me three tips for staying healthy."))
    assert spy.results[-1].accept_lengths == ours.accept_lengths
    assert sum(ours.accept_lengths) / len(ours.accept_lengths) > 1.2  # the head's drafts are accepted


def test_sampled_generate_is_eagles_sampler(tmp_path):
    """do_sample=True: the call draws exactly what eagle's decoder draws with the same settings and seed (whose
    output follows the target's law: tests/test_accept.py), transformers' sampling defaults included."""
    model, tok = make_model("mistral")  # its greedy output varies; tiny Qwen3 repeats one token
    model.eval()
    head = random_head(model, "eagle3", **OPTIONS["eagle3"])
    export_head(head, tmp_path / "h", "hf", dtype="float32")
    ids = prompt_ids(tok, PROMPT)
    out = model.generate(
        torch.tensor([ids]),
        custom_generate=str(tmp_path / "h"),
        trust_remote_code=True,
        max_new_tokens=16,
        do_sample=True,
        temperature=1.5,
        eagle_decode={"seed": 3},
    )[0, len(ids) :].tolist()
    sampled = DecodeConfig(max_new_tokens=16, temperature=1.5, seed=3)  # no top-k: generate's default is None
    ours = SpeculativeGenerator(model, load_exported_head(tmp_path / "h", model), tok, sampled).generate(ids)
    assert out == ours.tokens and out != hf_greedy(model, ids, 16)  # sampled, not greedy
