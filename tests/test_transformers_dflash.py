"""DFlash heads in transformers' own `generate` (`format=transformers`): the folder loads with plain
`AutoModel.from_pretrained` as transformers' DFlash drafter (`MuseGlimmerAssistantModel`), every block it
drafts inside `generate(..., assistant_model=drafter, speculation_type="dflash")` is the law eagle's head
gives for the same context (so acceptance per position is eagle's), the output is greedy identical to plain
`generate` on every tiny family and on the bundled SmolLM2, and folders that do not fit are refused by name."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from transformers import AutoModel
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

from eagle.algorithms.dflash.drafting import block_log_probs
from eagle.algorithms.dflash.head import DFlashHead
from eagle.decode.generator import SpeculativeGenerator
from eagle.errors import ExportError
from eagle.export import check_folder, export_head
from eagle.export.hf_assistant import load_dflash_assistant
from eagle.export.registry import FORMATS
from tests.support.decode import decode_cfg, hf_greedy, prompt_ids, random_head
from tests.support.heads import randomise
from tests.tiny_models import FAMILIES, make_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ("Write a short poem about the sea.", "Numbers 0 1 2 3")


def _head(model: Any, seed: int = 0, **options: Any) -> DFlashHead:
    head = random_head(model, "dflash", seed=seed, **{"block_size": 5, "num_layers": 2, **options})
    randomise(head, seed)  # norms and all: unit norms would hide a misplaced one
    return head.eval()


def _repeating_head(model: Any, tok: Any, seed: int = 0) -> DFlashHead:
    """A head that drafts the first token the tiny random Gemma3 target emits (it repeats it 9 times, then
    another), so whole blocks, a partial run and rejections all occur in one `generate`: the block's mask
    token is that token (the target ties its embeddings, so the LM head reads an embedding as its own token),
    the final norm a plain rescale, the layers' outputs scaled down so that the block stays near the mask's
    embedding while the context still moves every logit."""
    ref = hf_greedy(model, prompt_ids(tok, PROMPTS[0]), 24)
    head = _head(model, seed)
    with torch.no_grad():
        head.norm.weight.fill_(1.0)
        for layer in head.layers:
            layer.self_attn.o_proj.weight.mul_(0.02)
            layer.mlp.down_proj.weight.mul_(0.02)
    head.config.mask_token_id = ref[0]
    return head


class Recorder:
    """Every (context ids, candidate logits) transformers' DFlash generator drafts during one `generate`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[list[int], torch.Tensor]] = []
        original = DFlashTokenCandidateGenerator.get_candidates

        def record(gen: Any, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            ids, logits = original(gen, input_ids, *args, **kwargs)
            if logits is not None:
                self.calls.append((input_ids[0].tolist(), logits[0].float()))
            return ids, logits

        monkeypatch.setattr(DFlashTokenCandidateGenerator, "get_candidates", record)


def _eagle_block(model: Any, head: DFlashHead, ids: list[int]) -> torch.Tensor:
    """[Q - 1, V] eagle's block law after context `ids` (its last token the anchor)."""
    with torch.no_grad():
        states = model(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states
    feats = torch.stack([states[i][0] for i in head.config.aux_layer_ids], dim=1)  # [S, k, H]
    cache = head.new_draft_cache()
    head.commit(cache, torch.tensor(ids[:-1]), feats, torch.arange(len(ids) - 1))
    return block_log_probs(head, cache, ids[-1], len(ids) - 1)


def _hf_generate(model: Any, drafter: Any, ids: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]),
        assistant_model=drafter,
        speculation_type="dflash",
        do_sample=False,
        max_new_tokens=n,
        pad_token_id=model.config.pad_token_id,
    )
    return out[0, len(ids) :].tolist()


def test_the_format_is_registered_with_its_library():
    assert FORMATS["transformers"].library == "transformers"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_is_the_targets_own_in_transformers_generate(family, tmp_path):
    model, tok = make_model(family)
    model.eval()
    head = _head(model, aux_layer_ids=[1, 2, 3])
    export_head(head, tmp_path / "d", "transformers", dtype="float32")
    drafter = AutoModel.from_pretrained(str(tmp_path / "d"))
    assert type(drafter).__name__ == "MuseGlimmerAssistantModel"
    for text in PROMPTS:
        ids = prompt_ids(tok, text)
        assert _hf_generate(model, drafter, ids, 24) == hf_greedy(model, ids, 24), text


def test_every_drafted_block_is_eagles_and_acceptance_matches(monkeypatch, tmp_path):
    """Inside transformers' generate, each block's law is the one eagle's head gives for the same context,
    through accepted runs and rejections; eagle's decoder drafting the same chains accepts the same runs."""
    model, tok = make_model("gemma3")
    model.eval()
    head = _repeating_head(model, tok)
    export_head(head, tmp_path / "d", "transformers", dtype="float32")
    drafter = load_dflash_assistant(tmp_path / "d", model)
    rec = Recorder(monkeypatch)
    ids = prompt_ids(tok, PROMPTS[0])
    assert _hf_generate(model, drafter, ids, 24) == hf_greedy(model, ids, 24)
    assert len(rec.calls) >= 3
    for context, logits in rec.calls:
        torch.testing.assert_close(torch.log_softmax(logits, -1), _eagle_block(model, head, context), atol=2e-4, rtol=0)
    # Tokens each verify pass emitted in transformers (the next call's context grew by them) against eagle's chain.
    hf_runs = [len(b[0]) - len(a[0]) for a, b in zip(rec.calls, rec.calls[1:], strict=False)]
    chain = decode_cfg(draft_dtype="float32", tree_top_k=1, tree_depth=4, tree_total_tokens=4)
    ours = SpeculativeGenerator(model, head, tok, chain).generate(ids).accept_lengths
    assert 5 in hf_runs and any(1 < r < 5 for r in hf_runs) and 1 in hf_runs, hf_runs  # whole, partial, none
    assert hf_runs == ours[: len(hf_runs)], (hf_runs, ours)


def test_the_folder_checks_and_reads_back_as_the_same_head(tmp_path):
    model, _ = make_model("qwen3")
    head = _head(model, aux_layer_ids=[1, 2, 3])
    export_head(head, tmp_path / "d", "transformers", dtype="float32")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["model_type"] == "muse_glimmer_assistant" and config["target_layer_ids"] == [0, 1, 2]
    assert config["layer_types"] == ["full_attention", "full_attention"]
    checked = check_folder(tmp_path / "d", expect_format="transformers", dtype="float32")
    assert checked.config == head.config
    for name, t in head.trainable_state_dict().items():
        assert torch.equal(checked.tensors[name], t), name
    with pytest.raises(ExportError, match="format=transformers cannot express an EAGLE-3 head"):
        export_head(random_head(model, "eagle3", aux_layer_ids=[1, 2, 3]), tmp_path / "e", "transformers")


def test_folders_that_do_not_fit_are_refused_by_name(tmp_path):
    model, _ = make_model("qwen3")
    eagle3 = random_head(model, "eagle3", aux_layer_ids=[1, 2, 3])
    export_head(eagle3, tmp_path / "e3", "vllm", dtype="float32")
    with pytest.raises(ExportError, match=r"e3 is not a DFlash drafter .* model_type='llama'.*format=vllm"):
        load_dflash_assistant(tmp_path / "e3", model)
    export_head(_head(model, aux_layer_ids=[1, 2, 3]), tmp_path / "d", "transformers", dtype="float32")
    shallow, _ = make_model("qwen3", num_layers=2)
    with pytest.raises(ExportError, match=r"d: target_layer_ids \[2\] name decoder layers .* \(it has 2: 0..1\)"):
        load_dflash_assistant(tmp_path / "d", shallow)
    narrow, _ = make_model("qwen3", hidden=32)
    with pytest.raises(ExportError, match=r"d: hidden_size=64 but the target's is 32"):
        load_dflash_assistant(tmp_path / "d", narrow)
    with pytest.raises(ExportError, match=r"nowhere is not a folder"):
        load_dflash_assistant(tmp_path / "nowhere", model)


@pytest.mark.smollm2
def test_smollm2_greedy_output_is_its_own_in_transformers_generate(smollm2, tmp_path):
    """The bundled SmolLM2 with a DFlash head on its default layers (2, 15, 27): greedy identical to plain
    `generate` on held-out MT-bench prompts."""
    model, tok, _ = smollm2
    head = random_head(model, "dflash", block_size=8)
    export_head(head, tmp_path / "d", "transformers", dtype="float32")
    drafter = load_dflash_assistant(tmp_path / "d", model)
    for text in PROMPTS:
        ids = prompt_ids(tok, text)
        assert _hf_generate(model, drafter, ids, 32) == hf_greedy(model, ids, 32), text
