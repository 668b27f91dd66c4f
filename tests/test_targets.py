"""target.path resolution: local folder, Hub id (through a local HF cache, offline), GGUF, errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from eagle.config import TargetConfig
from eagle.errors import TargetError
from eagle.targets import default_aux_layer_ids, load_target, resolve_target_path
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
