"""A vision-language target's heads read the target's own position rows, as vLLM gives them to its draft (#51).

A Qwen-VL target numbers its tokens with three M-RoPE rows (time, height, width) that inside an image differ
from the sequence index and after it run `delta` behind it. vLLM hands an M-RoPE draft (its
`Eagle3Qwen3vlForCausalLM`) those rows, advanced by one in every row per drafted token, and a 1-D draft
(DFlash, P-EAGLE: vLLM refuses M-RoPE when drafting in parallel) their time row. Held here:

  * the head's rotary equals transformers' M-RoPE rotaries (Qwen3-VL interleaved, Qwen2-VL contiguous);
  * capture stores each token's rows (the target's `get_rope_index` for the batch), padding included;
  * training and decoding give a head the same positions: the TTT step-0 output at the prompt's last index
    equals what the decoder's prefill commit returns, and differs with sequence positions (the rows matter);
  * DFlash and P-EAGLE heads of a VL target have no M-RoPE fields, and decode losslessly with images.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from eagle.algorithms.base import aligned_inputs, target_positions
from eagle.algorithms.ttt import ttt_forward
from eagle.capture.features import extract_features, vision_batch
from eagle.capture.reader import CaptureDataset, collate
from eagle.capture.runner import run_capture
from eagle.cli.app import compose
from eagle.config import ConfigError, TargetConfig
from eagle.data.eval_prompts import EvalPrompt
from eagle.decode import SpeculativeGenerator
from eagle.evaluate.baselines import hf_generate
from eagle.evaluate.runner import prompt_vision, turn_inputs
from eagle.export import export_head
from eagle.export.validate import check_folder
from eagle.heads.base import HeadConfig
from eagle.heads.layers import RotaryEmbedding
from eagle.target.loading import load_target
from eagle.target.multimodal import mrope_positions
from eagle.train.trainer import train
from tests.support.decode import decode_cfg, random_head
from tests.support.train import train_overrides
from tests.tiny_models import MROPE_ONLY_VL_FAMILIES, save_vl_model, write_images

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _head_config(head_dim: int, rope: dict) -> HeadConfig:
    return HeadConfig(
        algorithm="eagle3",
        hidden_size=4 * head_dim,
        target_hidden_size=4 * head_dim,
        vocab_size=32,
        draft_vocab_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        intermediate_size=8 * head_dim,
        rope_parameters=rope,
    )


@pytest.mark.parametrize("interleaved", [True, False])
def test_head_rotary_is_the_targets_mrope(interleaved):
    head_dim, theta = 32, 10000.0
    section = [4, 6, 6] if interleaved else [6, 5, 5]
    rope = {"rope_type": "default", "rope_theta": theta, "mrope_section": section}
    if interleaved:
        rope["mrope_interleaved"] = True
        text = Qwen3VLTextConfig(hidden_size=128, num_attention_heads=4, head_dim=head_dim, rope_parameters=rope)
        reference = Qwen3VLTextRotaryEmbedding(text)
    else:
        text = Qwen2VLTextConfig(hidden_size=128, num_attention_heads=4, rope_parameters=rope)
        reference = Qwen2VLRotaryEmbedding(text)
    rows = torch.randint(0, 300, (3, 2, 9))  # [3, B, T], rows unlike each other
    want_cos, want_sin = reference(torch.zeros(1, dtype=torch.float32), rows)  # [B, T, D]
    ours = RotaryEmbedding(_head_config(head_dim, rope))
    cos, sin = ours(rows, torch.float32)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=1e-6)
    # Equal rows are plain RoPE; a head without M-RoPE reads the time row.
    plain = RotaryEmbedding(_head_config(head_dim, {"rope_type": "default", "rope_theta": theta}))
    torch.testing.assert_close(ours(rows[0], torch.float32)[0], plain(rows[0], torch.float32)[0])
    torch.testing.assert_close(plain(rows, torch.float32)[1], plain(rows[0], torch.float32)[1])
    assert not torch.allclose(cos, plain(rows[0], torch.float32)[0])


@pytest.fixture(scope="module", params=["qwen3_vl", *MROPE_ONLY_VL_FAMILIES])
def vl(tmp_path_factory, request):
    """A saved tiny M-RoPE target: Qwen3-VL (interleaved sections) and Qwen2.5-VL (contiguous)."""
    root = tmp_path_factory.mktemp(f"vl_positions_{request.param}")
    target = save_vl_model(root / "target", family=request.param)
    images = write_images(root / "images")
    model, tok, _ = load_target(TargetConfig(path=str(target), dtype="float32"), stage="decode")
    prompt = EvalPrompt("p", ["<image>\nWrite a short poem about the sea."], images=[str(images[1])])
    return {"model": model, "tok": tok, "prompt": prompt, "images": images, "target": target, "family": request.param}


def _prompt(vl) -> tuple[torch.Tensor, object]:
    ids = turn_inputs(vl["tok"], vl["prompt"], [])[0]  # [1, n]
    return ids, prompt_vision(vl["tok"], vl["prompt"])


def test_capture_stores_the_targets_rows(vl):
    model, tok = vl["model"], vl["tok"]
    ids, _ = _prompt(vl)
    text = torch.tensor(tok("A text-only row, a bit longer.")["input_ids"])
    n, m = ids.shape[1], text.numel()
    batch = torch.zeros(3, max(n, m), dtype=torch.long)
    mask = torch.zeros_like(batch)
    batch[0, :n], batch[1, :m], batch[2, :n] = ids[0], text, ids[0]
    mask[0, :n], mask[1, :m], mask[2, :n] = 1, 1, 1
    images = [(vl["prompt"].images[0],), (), (vl["prompt"].images[0],)]
    vision = vision_batch(model, images, "cpu")
    feats = extract_features(model, batch, mask, [1, 2, 3], vision)
    pos = feats["positions"]  # [B, T, 3]
    assert pos.shape == (3, batch.shape[1], 3) and not pos.is_floating_point()
    one = vision_batch(model, [images[0]], "cpu")
    rows, delta = mrope_positions(model, ids[0], one)  # [3, n]: what the decoder gives the target
    assert delta < 0  # the image's tokens advance the positions by less than their count
    torch.testing.assert_close(pos[0, :n].T, rows)
    torch.testing.assert_close(pos[2, :n].T, rows)
    torch.testing.assert_close(pos[1, :m].T, torch.arange(m).expand(3, m))


def test_training_and_decoding_give_the_head_the_same_positions(vl):
    model, tok = vl["model"], vl["tok"]
    ids, vision = _prompt(vl)
    n = ids.shape[1]
    head = random_head(model, "eagle3", draft_vocab_size=128)
    gen = SpeculativeGenerator(model, head, tok, decode_cfg(max_new_tokens=4, draft_dtype="float32", tree_top_k=1))
    res = gen.generate(ids[0], vision)
    ref = hf_generate(model, tok, ids, decode_cfg(temperature=0.0, max_new_tokens=4), vision=vision).tokens
    assert res.tokens == ref  # lossless with the M-RoPE head on this layout
    root = res.tokens[0]
    # The decoder's prefill commit, again on a fresh cache: the hidden state that drafts the first step.
    seq = torch.cat([ids[0], torch.tensor([root])])  # prompt + the first token
    vision_in = vision_batch(model, [tuple(vl["prompt"].images)], "cpu")
    feats = extract_features(
        model, seq[None], torch.ones(1, n + 1, dtype=torch.long), head.config.aux_layer_ids, vision_in
    )
    commit_positions = gen._head_positions(0, n)
    assert commit_positions.shape == (3, n)
    with torch.inference_mode():
        decoded = gen.head.commit(gen.head.new_draft_cache(), seq[1:], feats["aux_hidden"][0, :n], commit_positions)
    # Training's step 0 over the same sequence, positions from the batch's rows.
    batch = {
        "input_ids": seq[None],
        "attention_mask": torch.ones(1, n + 1, dtype=torch.bool),
        "loss_mask": torch.ones(1, n + 1, dtype=torch.bool),
        "positions": feats["positions"],
    }
    a = aligned_inputs(batch, 0)
    torch.testing.assert_close(a["positions"][:, 0, :n], commit_positions + 1)
    with torch.inference_mode():
        hidden0 = head.project_features(feats["aux_hidden"])
        trained = ttt_forward(head, a["input_ids"], hidden0, a["valid"], 1, position_ids=a["positions"])[0]
        by_index = ttt_forward(head, a["input_ids"], hidden0, a["valid"], 1)[0]
    torch.testing.assert_close(trained[0, n - 1], decoded, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(by_index[0, n - 1], decoded, rtol=1e-3, atol=1e-3)  # the rows reach the rotary


@pytest.mark.parametrize("algorithm", ["dflash", "peagle"])
def test_parallel_drafters_read_the_time_row_and_stay_lossless(vl, algorithm):
    model, tok = vl["model"], vl["tok"]
    ids, vision = _prompt(vl)
    head = random_head(model, algorithm)
    assert "mrope_section" not in head.config.rope_parameters  # vLLM refuses an M-RoPE parallel drafter
    ref = hf_generate(model, tok, ids, decode_cfg(temperature=0.0, max_new_tokens=12), vision=vision).tokens
    gen = SpeculativeGenerator(model, head, tok, decode_cfg(max_new_tokens=12, draft_dtype="float32", tree="auto"))
    assert gen.generate(ids, vision).tokens == ref
    assert gen._head_positions(0, ids.shape[1]).shape == (ids.shape[1],)


def test_eagle_heads_of_a_vl_target_keep_its_mrope(vl, tmp_path):
    for algorithm in ("eagle3", "eagle1"):
        rope = random_head(vl["model"], algorithm, draft_vocab_size=128 if algorithm == "eagle3" else None)
        assert rope.config.rope_parameters["mrope_section"] == [2, 3, 3], algorithm
        interleaved = vl["family"] == "qwen3_vl"  # Qwen2.5-VL: contiguous sections
        assert bool(rope.config.rope_parameters.get("mrope_interleaved")) is interleaved
    # vLLM builds the draft's M-RoPE rotary from the exported fields, under its VL draft name.
    head = random_head(vl["model"], "eagle3", draft_vocab_size=128)
    export_head(head, tmp_path / "vllm", "vllm", dtype="float32", target_path=str(vl["target"]))
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    name = {"qwen3_vl": "Eagle3Qwen3vlForCausalLM", "qwen2_5_vl": "Eagle3Qwen2_5vlForCausalLM"}[vl["family"]]
    assert config["architectures"] == [name]
    assert config["rope_scaling"]["mrope_section"] == [2, 3, 3]
    assert bool(config["rope_scaling"].get("mrope_interleaved")) is (vl["family"] == "qwen3_vl")
    check_folder(tmp_path / "vllm", expect_format="vllm", num_target_layers=4)


def _image_data(vl, folder, with_image: list[bool]) -> list[str]:
    """Overrides for a conversation file of len(with_image) records, c0, c1, ..., record i holding the second image
    where with_image[i]: the target, the data and a small draft vocabulary."""
    convs = folder / "convs.jsonl"
    image = str(vl["images"][1])
    rows = [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": ("<image>\n" if has else "") + f"What is it {i}?"},
                {"from": "gpt", "value": "A picture of the sea."},
            ],
            **({"images": [image]} if has else {}),
        }
        for i, has in enumerate(with_image)
    ]
    convs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        f"target.path={vl['target']}",
        "data=local",
        f"data.path={convs}",
        "data.heldout_fraction=0",
        "data.dedup_against=[]",
        "draft.draft_vocab_size=128",
        "device=cpu",
    ]


def test_stream_mode_refuses_conversations_with_images(vl, tmp_path):
    """vLLM is sent token ids in stream mode: an image's pixels would never reach the target."""
    overrides = [
        *_image_data(vl, tmp_path, [True] * 4),
        *train_overrides(
            tmp_path / "out", None, steps=1, train__mode="stream", train__stream__urls="[http://127.0.0.1:9]"
        ),
    ]
    with pytest.raises(ConfigError, match=r"4 conversation\(s\) .* hold images \(first: 'c"):
        train(compose(overrides))


def test_a_capture_keeps_the_rows_for_offline_training(vl, tmp_path):
    image = str(vl["images"][1])
    overrides = _image_data(vl, tmp_path, [i % 2 == 0 for i in range(4)])
    cfg = compose([*overrides, "capture.dtype=bfloat16", f"output_dir={tmp_path / 'capture'}"])
    run_capture(cfg)
    assert json.loads((tmp_path / "capture" / "manifest.json").read_text())["features"]["positions"] == [3]
    data = CaptureDataset(tmp_path / "capture")
    items = [data[i] for i in range(len(data))]
    model = vl["model"]
    for it in items:
        assert it["positions"].dtype == torch.int32  # exact, whatever capture.dtype is
        images = [image] if it["id"].endswith(("0", "2")) else []
        vision = vision_batch(model, [tuple(images)], "cpu") if images else None
        want, _ = mrope_positions(model, it["input_ids"], vision)  # [3, T]
        torch.testing.assert_close(it["positions"].long().T, want)
    batch = collate(items)
    assert batch["positions"].shape == (4, batch["input_ids"].shape[1], 3)
    rows_of = target_positions(batch)
    assert rows_of is not None and rows_of.shape == (3, 4, batch["input_ids"].shape[1])
