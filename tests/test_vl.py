"""Vision-language targets, text-only heads (issue #51): tiny random Qwen3-VL and Gemma 3 (tests/tiny_models.
make_vl_model, their processors built locally) through every stage with images in the conversations and the prompts.
Every test runs on each of VL_FAMILIES: Qwen3-VL (M-RoPE, images as runs of `<|image_pad|>`) and Gemma 3 (1-D
RoPE, `<start_of_image>` expanded by its processor into `\n\n<start_of_image>`, soft tokens, `<end_of_image>\n\n`,
and attention both ways inside an image in the prefill).

  * data: OpenAI `image_url` parts and ShareGPT `images` lists become image parts; the rendering holds each
    image's tokens (as many as the processor says), masked from the loss; where the whole processor loads
    (Gemma 3's) the ids are its own;
  * capture and online training run the target with the image inputs (features at every position);
  * decoding gives the target the prompt's image inputs, positions and prefill masks: greedy output identical to
    HF `generate` in float32, for the speculative decoder and the plain one;
  * export for vLLM names `Eagle3Qwen3vlForCausalLM` and keeps the M-RoPE fields for Qwen3-VL, the plain
    `Eagle3LlamaForCausalLM` for Gemma 3; `eagle-export --check` passes;
  * bad input (a missing image, one that does not decode, images for a text-only target) stops with a message
    naming the record, exit status 2.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from eagle.algorithms.head_io import load_head
from eagle.capture.runner import run_capture
from eagle.cli.app import compose
from eagle.config import TargetConfig
from eagle.data.dataset import build_splits
from eagle.data.eval_prompts import EvalPrompt, load_eval_prompts
from eagle.data.images import open_image
from eagle.data.records import normalise_record
from eagle.data.template import render, tokenize_with_reason
from eagle.decode import SpeculativeGenerator, autoregressive_generate
from eagle.decode.multimodal import VisionTarget
from eagle.decode.target import new_cache, target_forward, verify_plan
from eagle.errors import DataError, TargetError
from eagle.evaluate import evaluate
from eagle.evaluate.baselines import hf_generate
from eagle.evaluate.runner import prompt_vision, turn_inputs, user_message
from eagle.export import export_head
from eagle.export.validate import check_folder
from eagle.regenerate.runner import run_regenerate
from eagle.target.loading import load_target
from eagle.target.multimodal import VisionProcessor, builds_image_masks, load_vision_processor
from eagle.train.trainer import train
from tests.support.decode import decode_cfg, random_head
from tests.support.train import train_overrides
from tests.tiny_models import VL_FAMILIES, save_model, save_vl_model, write_images

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUESTIONS = ["What is in this picture?", "Describe the colours.", "Is it a photograph?", "Count the objects."]


# Per family: image tokens of image0 (40 x 60) and image2 (90 x 50), the vLLM draft architecture, draft settings.
# Qwen3-VL resizes to 16-px patches merged 2 x 2 (32 x 64: 2 tokens; 96 x 48: 6); Gemma 3 to 32 x 32, 4 tokens.
FACTS = {
    "qwen3_vl": {"tokens": (2, 6), "vllm": "Eagle3Qwen3vlForCausalLM", "draft": []},
    # vLLM and SGLang build draft layers with SiLU only; Gemma's MLP is GELU (format=vllm refuses that head).
    "gemma3_vl": {"tokens": (4, 4), "vllm": "LlamaForCausalLMEagle3", "draft": ["draft.hidden_act=silu"]},
}


def _vision(vl) -> VisionProcessor:
    vision = load_vision_processor(str(vl["target"]))
    assert vision is not None
    return vision


@pytest.fixture(scope="module", params=VL_FAMILIES)
def vl(request, tmp_path_factory) -> dict[str, Path]:
    """A saved tiny vision-language target of each family, three images, a conversation file with images in both
    shapes (and text-only conversations), and its capture."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    target = save_vl_model(root / "target", family=family)
    images = write_images(root / "images")
    convs = root / "convs.jsonl"
    with open(convs, "w") as f:
        for i in range(12):
            img = images[i % len(images)]
            answer = f"The quick brown fox {i} jumps over the lazy dog."
            if i % 3 == 0:  # OpenAI parts, image as a path relative to the data file
                user = [
                    {"type": "image_url", "image_url": {"url": f"images/{img.name}"}},
                    {"type": "text", "text": QUESTIONS[i % 4]},
                ]
                rec = {
                    "id": f"o{i}",
                    "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
                }
            elif i % 3 == 1:  # ShareGPT with an `<image>` placeholder
                turns = [{"from": "human", "value": f"<image>\n{QUESTIONS[i % 4]}"}, {"from": "gpt", "value": answer}]
                rec = {"id": f"s{i}", "conversations": turns, "images": [str(img)]}
            else:  # text only: a vision-language target trains on those too
                turns = [{"from": "human", "value": f"Explain relativity {i}"}, {"from": "gpt", "value": answer}]
                rec = {"id": f"t{i}", "conversations": turns}
            f.write(json.dumps(rec) + "\n")
    base = [
        f"target.path={target}",
        "data=local",
        f"data.path={convs}",
        "data.heldout_fraction=0.25",
        "data.dedup_against=[]",
        "data.max_length=96",
        "capture.dtype=float32",
        "capture.shard_size=4",
        "draft.algorithm=eagle3",
        "draft.draft_vocab_size=128",
        *FACTS[family]["draft"],
        "device=cpu",
    ]
    run_capture(compose([*base, f"output_dir={root / 'capture'}"]))
    return {"root": root, "target": target, "images": images[0].parent, "convs": convs, "base": base, "family": family}  # type: ignore[dict-item]


def _messages_with_image(path: Path, text: str) -> dict:
    return {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": str(path)}}, {"type": "text", "text": text}],
            },
            {"role": "assistant", "content": "ok"},
        ]
    }


def test_image_parts_are_rendered_as_image_tokens_masked_from_the_loss(vl):
    cfg = compose(vl["base"]).data
    tok = AutoTokenizer.from_pretrained(vl["target"])
    splits = build_splits(cfg, tok, progress=False)
    convs = {c.id: c for c in (*splits.train, *splits.heldout)}
    image_id = _vision(vl).image_token_id
    for cid, c in convs.items():
        n_image = sum(t == image_id for t in c.input_ids)
        assert bool(c.images) == (cid[0] in "os") and (n_image > 0) == bool(c.images)
        assert all(m == 0 for t, m in zip(c.input_ids, c.loss_mask, strict=True) if t == image_id)
    # The first image is 40 x 60 (FACTS: its image tokens, as the processor resizes it).
    assert sum(t == image_id for t in convs["o0"].input_ids) == FACTS[vl["family"]]["tokens"][0]
    # A data URL is an image too; the same ids as the file.
    data_url = "data:image/png;base64," + base64.b64encode((vl["images"] / "image0.png").read_bytes()).decode()
    a = normalise_record(_messages_with_image(vl["images"] / "image0.png", "hi"), index=0, source="x")
    b = normalise_record(_messages_with_image(data_url, "hi"), index=1, source="x")  # type: ignore[arg-type]
    assert a.messages[0]["content"] == b.messages[0]["content"] == "hi"
    assert [p["type"] for p in b.messages[0]["parts"]] == ["image", "text"]


def test_image_text_is_the_processors_own(vl):
    """Where the whole processor loads (Gemma 3's; Qwen3-VL's needs torchvision), the ids of a training
    conversation and of an evaluation prompt are exactly what it makes of the template's rendering: the text
    around each image's tokens included (Gemma 3: `\n\n<start_of_image>` ... `<end_of_image>\n\n`), tokenised
    with its neighbours as the processor tokenises it."""
    vision = _vision(vl)
    if vision.processor is None:
        assert vl["family"] == "qwen3_vl", vision.no_processor  # images as runs of the image token alone
        return
    tok = AutoTokenizer.from_pretrained(vl["target"])
    image = vl["images"] / "image0.png"
    conv = normalise_record(_messages_with_image(image, "What is in this picture?"), index=0, source="x")
    ours, _ = tokenize_with_reason(conv, tok, 512, "truncate")
    assert ours is not None and any(ours.loss_mask)
    text = render(tok, conv.messages, add_generation_prompt=False)
    expected = vision.processor(text=[text], images=[[open_image(str(image), "x")]])["input_ids"][0]
    assert ours.input_ids == list(expected)
    assert "\n\n" in vision.before and vision.before.endswith("<start_of_image>")
    prompt = EvalPrompt("p", ["<image>\nWhat is in this picture?"], images=[str(image)])
    text = render(tok, [user_message(prompt, 0)], add_generation_prompt=True)
    expected = vision.processor(text=[text], images=[[open_image(str(image), "x")]])["input_ids"][0]
    assert turn_inputs(tok, prompt, [])[0][0].tolist() == list(expected)


def test_a_processor_that_does_not_load(vl, tmp_path):
    """Without its whole processor, a family whose config names a begin-of-image token (Gemma 3) is refused, naming
    the folder: only that processor says the text around an image's tokens. Qwen3-VL's images are runs of its image
    token alone, read without it (its processor needs torchvision)."""
    folder = Path(shutil.copytree(vl["target"], tmp_path / "target"))
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "NoSuchProcessor"}))
    tokenizer_config = folder / "tokenizer_config.json"
    tokenizer_config.write_text(tokenizer_config.read_text().replace('"Gemma3Processor"', '"NoSuchProcessor"'))
    if vl["family"] == "gemma3_vl":
        with pytest.raises(TargetError, match=f"{folder} \\(gemma3\\) does not load.*begin-of-image"):
            load_vision_processor(str(folder))
    else:
        vision = load_vision_processor(str(folder))
        assert vision is not None and vision.processor is None and vision.placeholder is None


def test_capture_holds_features_at_image_positions(vl):
    manifest = json.loads((vl["root"] / "capture" / "manifest.json").read_text())
    assert manifest["complete"]
    shard = next((vl["root"] / "capture").rglob("*.safetensors"))
    tensors = load_file(shard)
    assert torch.isfinite(tensors["aux_hidden"]).all() and torch.isfinite(tensors["final_hidden"]).all()


@pytest.mark.slow  # two trainings and an evaluation
def test_every_stage_with_image_prompts(vl, tmp_path):
    root = vl["root"]
    offline = train(compose(vl["base"] + train_overrides(tmp_path / "offline", root / "capture", steps=2)))
    assert offline.step == 2
    online = train(compose(vl["base"] + train_overrides(tmp_path / "online", None, steps=2)))
    assert online.step == 2
    prompts = root / "prompts.jsonl"  # beside images/: a relative image path is looked up there
    lines = [
        {"id": "img", "prompt": "<image>\nWhat is in this picture?", "images": [str(vl["images"] / "image2.png")]},
        {"id": "two", "turns": ["Describe it.", "And the colours?"], "images": ["images/image1.png"]},
        {"id": "text", "prompt": "Write a short poem about the sea."},
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = evaluate(
        compose(
            [
                f"target.path={vl['target']}",
                f"draft.path={tmp_path / 'offline'}",
                f"eval.prompts={prompts}",
                "eval.turns=all",
                "eval.warmup_prompts=0",
                "eval.baselines=[hf_generate]",
                "decode.max_new_tokens=12",
                "decode.temperature=0",
                "target.dtype=float32",
                f"output_dir={tmp_path / 'eval'}",
            ]
        )
    )
    assert report["greedy_match"] == 1.0
    head = load_head(tmp_path / "offline" / "best")
    export_head(head, tmp_path / "vllm", "vllm", dtype="float32", target_path=str(vl["target"]))
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["architectures"] == [FACTS[vl["family"]]["vllm"]]
    if vl["family"] == "qwen3_vl":  # M-RoPE: vLLM builds the draft's rotary from these
        assert config["rope_scaling"]["mrope_section"] == [2, 3, 3] and config["rope_scaling"]["mrope_interleaved"]
    else:  # 1-D RoPE: nothing M-RoPE in the config
        assert "mrope_section" not in json.dumps(config)
    check_folder(tmp_path / "vllm", expect_format="vllm", num_target_layers=4)


def test_the_prefill_runs_as_the_models_own_forward(vl):
    """The decoder's prefill through `VisionTarget` gives the logits of the model's own forward with the same image
    inputs at every position: Qwen3-VL's M-RoPE rows; Gemma 3's attention both ways inside an image, which plain
    causal masks would not give (the logits differ without it)."""
    model, tok, _ = load_target(TargetConfig(path=str(vl["target"]), dtype="float32"), stage="decode")
    prompt = EvalPrompt("p", ["<image>\nWrite a short poem about the sea."], images=[str(vl["images"] / "image2.png")])
    ids = turn_inputs(tok, prompt, [])[0]  # [1, T]
    vision = prompt_vision(tok, prompt)
    assert vision is not None
    kw = vision.model_kwargs(ids, _vision(vl).image_token_id)
    with torch.no_grad():
        reference = model(input_ids=ids, **kw).logits[0]  # [T, V]
    target = VisionTarget(model)
    target.begin(ids[0], vision)
    plan = verify_plan(model.config)
    ours = target_forward(target, ids[0], torch.arange(ids.shape[1]), new_cache(model.config, plan), plan=plan)
    torch.testing.assert_close(ours.logits, reference, rtol=1e-5, atol=1e-5)
    if builds_image_masks(model):  # Gemma 3: an image's tokens attend to each other both ways in the prefill
        causal = {k: v for k, v in kw.items() if k != vision.token_type_name}
        with torch.no_grad():
            assert (model(input_ids=ids, **causal).logits[0] - reference).abs().max() > 1e-2


def test_decoding_gives_the_target_its_images_and_positions(vl):
    """Greedy output is HF `generate`'s with the same pixels, for trees, auto trees and chains; without the
    images the output differs (the pixels really reach the target)."""
    model, tok, _ = load_target(TargetConfig(path=str(vl["target"]), dtype="float32"), stage="decode")
    prompt = EvalPrompt("p", ["<image>\nWrite a short poem about the sea."], images=[str(vl["images"] / "image2.png")])
    ids = turn_inputs(tok, prompt, [])[0]
    vision = prompt_vision(tok, prompt)
    assert vision is not None and vision.num_images == 1
    ref = hf_generate(model, tok, ids, decode_cfg(temperature=0.0, max_new_tokens=16), vision=vision).tokens
    assert autoregressive_generate(model, tok, ids, decode_cfg(max_new_tokens=16), vision=vision).tokens == ref
    head = random_head(model, "eagle3", draft_vocab_size=128)
    for kw in ({}, {"tree": "auto"}, {"tree_top_k": 1}):
        res = SpeculativeGenerator(
            model, head, tok, decode_cfg(max_new_tokens=16, draft_dtype="float32", **kw)
        ).generate(ids, vision)
        assert res.tokens == ref, kw
    blind = autoregressive_generate(model, tok, ids, decode_cfg(max_new_tokens=16)).tokens
    assert blind != ref


def _error_of(tmp_path: Path, record: dict, target: Path) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(record) + "\n")
    cfg = compose([f"target.path={target}", "data=local", f"data.path={path}", "data.dedup_against=[]"]).data
    with pytest.raises(DataError) as err:  # an EagleError: one message, exit status 2 (eagle.cli.app)
        build_splits(cfg, AutoTokenizer.from_pretrained(target), progress=False)
    return str(err.value)


def test_bad_images_name_the_record(vl, tmp_path):
    missing = {"id": "r1", **_messages_with_image(tmp_path / "nope.png", "hi")}
    message = _error_of(tmp_path, missing, vl["target"])
    assert "record 0 (id 'r1')" in message and "does not exist" in message
    (tmp_path / "broken.png").write_bytes(b"not a png at all")
    broken = {"id": "r2", **_messages_with_image(tmp_path / "broken.png", "hi")}
    assert "does not decode" in _error_of(tmp_path, broken, vl["target"])
    sharegpt = {
        "id": "r3",
        "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}],
        "images": [str(tmp_path / "gone.jpg")],
    }
    assert "id 'r3'" in _error_of(tmp_path, sharegpt, vl["target"])
    text_target = save_model("qwen3", tmp_path / "text_target")
    fine = {"id": "r4", **_messages_with_image(vl["images"] / "image0.png", "hi")}
    message = _error_of(tmp_path, fine, text_target)
    assert "'r4'" in message and "text-only" in message
    # Regeneration sends text: a conversation with images is refused, not silently stripped of them.
    (tmp_path / "ok.jsonl").write_text(
        json.dumps({"id": "r5", **_messages_with_image(vl["images"] / "image0.png", "hi")})
    )
    regen = [f"target.path={vl['target']}", "data=local", f"data.path={tmp_path / 'ok.jsonl'}", "data.dedup_against=[]"]
    with pytest.raises(DataError, match="'r5' holds images: eagle-regenerate"):
        run_regenerate(compose([*regen, f"output_dir={tmp_path / 'regen'}", "device=cpu"]))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "q", "prompt": "hi", "images": ["missing.png"]}) + "\n")
    with pytest.raises(DataError, match="line 1.*does not exist"):
        load_eval_prompts(str(prompts))


@pytest.mark.slow  # a subprocess: the CLI's exit status
def test_a_bad_image_exits_with_status_2(vl, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "r9", **_messages_with_image(tmp_path / "nope.png", "hi")}) + "\n")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle.cli.capture",
            f"target.path={vl['target']}",
            "data=local",
            f"data.path={path}",
            "data.dedup_against=[]",
            f"output_dir={tmp_path / 'out'}",
            "device=cpu",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert "id 'r9'" in run.stderr and "does not exist" in run.stderr


def test_a_cut_never_splits_an_image(vl):
    """data.max_length inside an image's tokens: the cut moves before the image, which is dropped with its tokens."""
    tok = AutoTokenizer.from_pretrained(vl["target"])
    image = str(vl["images"] / "image2.png")  # 90 x 50
    n = FACTS[vl["family"]]["tokens"][1]  # its image tokens
    record = {
        "id": "cut",
        "messages": [
            {"role": "user", "content": "Explain relativity"},
            {"role": "assistant", "content": "The quick brown fox."},
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "And this?"}],
            },
            {"role": "assistant", "content": "A dog."},
        ],
    }
    conv = normalise_record(record, index=0, source="x")
    whole, _ = tokenize_with_reason(conv, tok, 512, "truncate")
    assert whole is not None and whole.images == (image,)
    image_id = _vision(vl).image_token_id
    first = whole.input_ids.index(image_id)
    assert (
        whole.input_ids[first : first + n + 1] == [image_id] * n + [whole.input_ids[first + n]] != [image_id] * (n + 1)
    )
    cut, _ = tokenize_with_reason(conv, tok, first + n // 2, "truncate")
    assert cut is not None and cut.truncated and cut.images == () and cut.input_ids == whole.input_ids[:first]
    kept, _ = tokenize_with_reason(conv, tok, first + n + 1, "truncate")
    assert kept is not None and kept.images == (image,) and len(kept.input_ids) == first + n + 1
