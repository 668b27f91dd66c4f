"""target.path resolution: local folder, Hub id (through a local HF cache, offline), GGUF, errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from eagle.config import TargetConfig
from eagle.errors import TargetError
from eagle.target.loading import load_target
from eagle.target.resolve import resolve_target_path
from eagle.target.structure import default_aux_layer_ids
from tests.tiny_models import save_model


def test_local_folder_loads_frozen(tiny_target_dir):
    model, tok, info = load_target(TargetConfig(path=str(tiny_target_dir)))
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert info.model_type == "llama" and info.num_layers == 4 and info.vocab_size == len(tok)
    assert info.fingerprint.startswith("folder:")
    # the fingerprint is content derived: same folder -> same value
    assert resolve_target_path(TargetConfig(path=str(tiny_target_dir)))[1] == info.fingerprint


def test_fingerprint_changes_with_weights(tmp_path):
    a = save_model("qwen2", tmp_path / "a", seed=0)
    b = save_model("qwen2", tmp_path / "b", seed=1)
    fa = resolve_target_path(TargetConfig(path=str(a)))[1]
    fb = resolve_target_path(TargetConfig(path=str(b)))[1]
    assert fa != fb


def test_hub_id_resolves_through_the_hf_cache(tmp_path, monkeypatch, tiny_target_dir):
    """The Hub code path (AutoModel.from_pretrained('org/name')) exercised offline on a local cache."""
    cache = tmp_path / "hub"
    snap = cache / "models--tiny-org--tiny-llama" / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_target_dir, snap)
    (cache / "models--tiny-org--tiny-llama" / "refs").mkdir(parents=True)
    (cache / "models--tiny-org--tiny-llama" / "refs" / "main").write_text(snap.name)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    model, tok, info = load_target(TargetConfig(path="tiny-org/tiny-llama"))
    assert info.fingerprint == "hub:tiny-org/tiny-llama@main"
    assert info.num_layers == 4
    ids = torch.tensor([[1, 2, 3]])
    ref, _, _ = load_target(TargetConfig(path=str(tiny_target_dir)))
    torch.testing.assert_close(model(ids).logits, ref(ids).logits)


def test_trust_remote_code_is_off_unless_asked(monkeypatch, tiny_target_dir):
    import transformers

    seen = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    load_target(TargetConfig(path=str(tiny_target_dir)))
    assert seen == [False]


@pytest.mark.parametrize(
    "path,message",
    [
        ("/nonexistent/folder", "does not exist"),
        ("./relative/missing", "does not exist"),
        ("missing.gguf", "does not exist"),
    ],
)
def test_bad_target_paths_are_clear_errors(path, message):
    with pytest.raises(TargetError, match=message):
        resolve_target_path(TargetConfig(path=path))


def test_folder_without_config_is_refused(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(TargetError, match="config.json"):
        resolve_target_path(TargetConfig(path=str(tmp_path)))


def test_chat_template_override_from_file(tmp_path, tiny_target_dir):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    _, tok, _ = load_target(TargetConfig(path=str(tiny_target_dir), chat_template=str(template)))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "[user]hi"


def test_default_aux_layers():
    assert default_aux_layer_ids(30) == [2, 15, 27]
    assert default_aux_layer_ids(32) == [2, 16, 29]
    assert default_aux_layer_ids(4) == [1, 2, 3]
    with pytest.raises(ValueError):
        default_aux_layer_ids(2)


@pytest.mark.smollm2
def test_bundled_smollm2_converts_once_and_loads_fast(tmp_path):
    cfg = TargetConfig(path="smollm2-135m-instruct")
    model, tok, info = load_target(cfg)
    assert info.model_type == "llama" and info.num_layers == 30 and info.hidden_size == 576
    assert info.vocab_size == 49152 and info.fingerprint.startswith("gguf-sha256:")
    folder = Path(info.resolved)
    assert (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    # the second resolution reuses the cached conversion (same folder, no reconversion)
    mtime = (folder / "config.json").stat().st_mtime_ns
    assert resolve_target_path(cfg)[0] == str(folder)
    assert (folder / "config.json").stat().st_mtime_ns == mtime


def _legacy_conversion(tmp_path: Path) -> tuple[Path, Path]:
    """A fake .gguf and the v1 cached folder a previous version made from it (with the GGUF
    `quantization_config` that other tools refuse)."""
    import json

    from eagle.target.resolve import cached_file_hash

    gguf = tmp_path / "models" / "tiny.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF not really: never parsed, the cached conversion is reused")
    cache = tmp_path / "cache"
    digest = cached_file_hash(gguf, cache)
    legacy = save_model("llama", cache / "gguf" / f"tiny-{digest[:16]}")
    config = json.loads((legacy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gguf", "dequantize": False, "gguf_file": "tiny.gguf"}
    (legacy / "config.json").write_text(json.dumps(config))
    (legacy / ".complete").write_text("")
    return gguf, legacy


def test_legacy_gguf_conversion_is_repaired_into_a_plain_checkpoint(tmp_path, bf16_anywhere):
    import json

    from eagle.target.resolve import GGUF_CONVERSION_VERSION

    gguf, legacy = _legacy_conversion(tmp_path)
    before = {f.name: f.read_bytes() for f in legacy.glob("*.safetensors")}
    cfg = TargetConfig(path=str(gguf), cache_dir=str(tmp_path / "cache"))
    folder, fingerprint = resolve_target_path(cfg)
    folder = Path(folder)
    assert folder.name.endswith(f"-v{GGUF_CONVERSION_VERSION}") and not legacy.exists()
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert {f.name: f.read_bytes() for f in folder.glob("*.safetensors")} == before  # weights untouched
    assert fingerprint.startswith("gguf-sha256:")
    # and it loads as an ordinary checkpoint, in another dtype too, without GGUF handling
    model, _, _ = load_target(TargetConfig(path=str(gguf), cache_dir=str(tmp_path / "cache"), dtype="bfloat16"))
    assert getattr(model.config, "quantization_config", None) is None
    assert next(model.parameters()).dtype == torch.bfloat16


@pytest.mark.smollm2
@pytest.mark.slow
def test_bundled_smollm2_conversion_is_a_dense_checkpoint_equal_to_the_gguf(smollm2):
    """The cached folder made from the GGUF: no quantization_config, dtype recorded, and the weights
    equal to what transformers dequantises from the GGUF itself."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from eagle.assets import asset_path

    _, _, info = smollm2
    folder = Path(info.resolved)
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    saved: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        saved.update(load_file(str(f)))
    gguf = asset_path("smollm2-135m-instruct")
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    ref_sd = ref.state_dict()
    assert set(saved) <= set(ref_sd) and len(saved) >= len(ref_sd) - 1  # a tied lm_head may be omitted
    for k, v in saved.items():
        assert v.dtype == torch.float32, k
        assert torch.equal(v, ref_sd[k]), k


def test_aux_layer_ids_have_one_valid_range_everywhere():
    """Config, capture and head loading refuse the same ids: each must be the input of a decoder layer."""
    from eagle.algorithms.head_io import check_head_fits_target, head_config_from_target
    from eagle.capture.features import check_layer_ids
    from eagle.config import ConfigError, DraftConfig
    from eagle.errors import CaptureError, CheckpointError
    from eagle.target.structure import aux_layer_problem
    from tests.tiny_models import make_model

    assert aux_layer_problem([0, 2, 3], 4) is None
    for bad in ([0, 2, 4], [-1, 1, 2], [1, 2]):
        assert "must be 3 layer ids in [0, 3]" in aux_layer_problem(bad, 4)
        with pytest.raises(CaptureError, match=r"\[0, 3\]"):
            check_layer_ids(bad, 4)
    model, _ = make_model("llama")  # 4 layers
    with pytest.raises(ConfigError, match=r"\[0, 3\]"):
        head_config_from_target(
            model.config, DraftConfig(algorithm="eagle3", aux_layer_ids=[1, 2, 4], draft_vocab_size=None)
        )
    head_cfg = head_config_from_target(
        model.config, DraftConfig(algorithm="eagle3", aux_layer_ids=[1, 2, 3], draft_vocab_size=None)
    )
    check_head_fits_target(head_cfg, model)
    head_cfg.aux_layer_ids = [1, 2, 4]  # e.g. a head written by an older eagle that allowed id L
    with pytest.raises(CheckpointError, match=r"outside the target's \[0, 3\]"):
        check_head_fits_target(head_cfg, model)


def test_config_token_ids_reads_lists_in_order_without_repeats():
    from types import SimpleNamespace

    from eagle.target.structure import config_token_ids

    gen = SimpleNamespace(eos_token_id=[7, 2], bos_token_id=1)
    tok = SimpleNamespace(eos_token_id=2, pad_token_id=None)
    assert config_token_ids(("eos_token_id",), gen, tok) == [7, 2]
    assert config_token_ids(("eos_token_id", "bos_token_id", "pad_token_id"), tok, None, gen) == [2, 7, 1]
    assert config_token_ids(("eos_token_id",), None) == []


def test_concurrent_gguf_conversions_take_turns(tmp_path, monkeypatch):
    """Two processes (here: threads with their own lock handles) converting the same GGUF file at once:
    one converts while the other waits, then finds the finished folder (no replacement under a reader)."""
    import threading
    import time

    import eagle.target.resolve as targets

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    events: list[str] = []

    def fake_convert(gguf_path, digest, out, cache_dir):
        if (out / ".complete").is_file():
            events.append("found")
            return out
        events.append("start")
        time.sleep(0.3)  # long enough for the other thread to reach the lock
        out.mkdir(parents=True)
        (out / ".complete").write_text("")
        events.append("end")
        return out

    monkeypatch.setattr(targets, "_convert_gguf_locked", fake_convert)
    results: list = []
    threads = [
        threading.Thread(target=lambda: results.append(targets.convert_gguf(gguf, tmp_path / "cache")))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert events == ["start", "end", "found"]
    assert len(set(results)) == 1
