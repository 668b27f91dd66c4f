"""eagle-export: every format's folder has exactly the loader's keys and config fields, validates,
round-trips to identical head outputs, and broken folders are rejected with a clear ExportError."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle.algorithms.head_io import build_head, head_config_from_target, save_head
from eagle.config import DraftConfig
from eagle.errors import ExportError
from eagle.export import check_folder, export_head, load_exported_head, write_export
from eagle.export.formats import EXPORT_META_KEY
from eagle.fileio import safetensors_bytes
from tests.support.export import E3_LAYER, E3_TOP, LAYER, head_outputs
from tests.support.heads import randomise
from tests.tiny_models import make_model

DRAFT_VOCAB = 200


@pytest.fixture(scope="module")
def target():
    model, _ = make_model("llama")
    return model


@pytest.fixture(scope="module")
def heads(target):
    e3_cfg = head_config_from_target(target.config, DraftConfig(algorithm="eagle3", draft_vocab_size=DRAFT_VOCAB))
    counts = torch.arange(e3_cfg.vocab_size, dtype=torch.float).flip(0) % 37  # a non-trivial draft vocabulary
    e3 = build_head(e3_cfg, target, vocab_counts=counts)
    e1 = build_head(head_config_from_target(target.config, DraftConfig(algorithm="eagle1")), target)
    randomise(e3, 1)
    randomise(e1, 2)
    return {"eagle3": e3.eval(), "eagle1": e1.eval()}


def _outputs(head, seed: int = 0) -> torch.Tensor:
    return head_outputs(head, seed)


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _keys(folder: Path) -> set[str]:
    return set(load_file(str(folder / "model.safetensors")))


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators", "hf"])
def test_eagle3_export_has_exact_keys_config_and_round_trips(fmt, heads, target, tmp_path):
    head = heads["eagle3"]
    aux = head.config.aux_layer_ids
    out = export_head(head, tmp_path / fmt, fmt, dtype="float32", target_path="org/target-model")
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    # Only speculators folders carry the target's embedding (the speculators library needs it).
    embed = {"embed_tokens.weight"} if fmt == "speculators" else set()
    assert _keys(tmp_path / fmt) == set(E3_TOP) | {prefix + k for k in E3_LAYER} | embed
    cfg = _config(tmp_path / fmt)
    if fmt == "speculators":
        assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
        assert cfg["eagle_aux_hidden_state_layer_ids"] == aux
        assert cfg["norm_before_residual"] is False  # vLLM's speculators path defaults it to true
        layer = cfg["transformer_layer_config"]
        assert layer["num_hidden_layers"] == 1 and layer["vocab_size"] == head.config.vocab_size
        sc = cfg["speculators_config"]
        assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
        assert sc["proposal_methods"][0]["speculative_tokens"] >= 1
        assert sc["verifier"]["name_or_path"] == "org/target-model"
        stored = load_file(str(tmp_path / fmt / "model.safetensors"))["embed_tokens.weight"]
        assert torch.equal(stored, target.get_input_embeddings().weight.detach())
    else:
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert cfg["tie_word_embeddings"] is False  # SGLang would tie lm_head to the embedding otherwise
        assert cfg["norm_before_residual"] is False
        layer = cfg
        if fmt == "sglang":  # SGLang captures layer id + 1
            assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in aux]
            assert "eagle_aux_hidden_state_layer_ids" not in cfg
        else:
            assert cfg["eagle_aux_hidden_state_layer_ids"] == aux
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB
    assert cfg["target_hidden_size"] == head.config.target_hidden_size
    assert layer["hidden_size"] == head.config.hidden_size
    assert (tmp_path / fmt / "head_config.json").is_file() == (fmt == "hf")
    assert out.format == fmt
    loaded = load_exported_head(tmp_path / fmt, target)
    assert torch.equal(_outputs(loaded), _outputs(head))
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "hf"])
def test_eagle1_export_keys_and_round_trip(fmt, heads, target, tmp_path):
    head = heads["eagle1"]
    if fmt == "vllm":
        # vLLM's EagleLlamaForCausalLM has no fc bias: a non-zero bias must not be dropped silently.
        with pytest.raises(ExportError, match="fc.bias"):
            export_head(head, tmp_path / "x", fmt, dtype="float32")
        head = build_head(head.config, target)
        randomise(head, 3)
        with torch.no_grad():
            head.fc.bias.zero_()
    export_head(head, tmp_path / fmt, fmt, dtype="float32")
    want = {"fc.weight"} | {"layers.0." + k for k in LAYER} | ({"fc.bias"} if fmt != "vllm" else set())
    assert _keys(tmp_path / fmt) == want
    cfg = _config(tmp_path / fmt)
    assert cfg["architectures"] == [
        {"vllm": "EagleLlamaForCausalLM", "sglang": "LlamaForCausalLMEagle", "hf": "EagleLlamaForCausalLM"}[fmt]
    ]
    assert torch.equal(_outputs(load_exported_head(tmp_path / fmt, target)), _outputs(head))


def test_speculators_rejects_eagle1(heads, tmp_path):
    with pytest.raises(
        ExportError,
        match=r"format=speculators cannot express an EAGLE-1 head \(speculators 0\.9\.0 "
        r"has no EAGLE-1 model.*\); export it with format=vllm \| sglang \| hf$",
    ):
        export_head(heads["eagle1"], tmp_path / "s", "speculators")
    assert not (tmp_path / "s").exists()


def test_float16_export_dtypes_and_close_outputs(heads, target, tmp_path):
    head = heads["eagle3"]
    export_head(head, tmp_path / "f16", "vllm")  # default dtype float16
    stored = load_file(str(tmp_path / "f16" / "model.safetensors"))
    assert {t.dtype for k, t in stored.items() if k not in ("d2t", "t2d")} == {torch.float16}
    assert stored["d2t"].dtype == torch.int64 and stored["t2d"].dtype == torch.bool
    assert _config(tmp_path / "f16")["torch_dtype"] == "float16"
    check_folder(tmp_path / "f16", dtype="float16")
    with pytest.raises(ExportError, match="export dtype is bfloat16"):
        check_folder(tmp_path / "f16", dtype="bfloat16")
    loaded = load_exported_head(tmp_path / "f16", target)
    torch.testing.assert_close(_outputs(loaded), _outputs(head), atol=5e-2, rtol=5e-2)


def _rewrite_tensors(folder: Path, fn) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _rewrite_config(folder: Path, fn) -> None:
    cfg = _config(folder)
    fn(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "breakage, message",
    [
        (
            lambda f: _rewrite_tensors(f, lambda t: t.pop("midlayer.hidden_norm.weight")),
            "missing: midlayer.hidden_norm",
        ),
        (
            lambda f: _rewrite_tensors(
                f, lambda t: t.update({"fc.weight": torch.zeros(t["fc.weight"].shape[0], 7, dtype=torch.float16)})
            ),
            "fc.weight has shape",
        ),
        (lambda f: _rewrite_tensors(f, lambda t: t.update({"extra.weight": torch.zeros(2)})), "unexpected tensors"),
        (lambda f: _rewrite_tensors(f, lambda t: t.update({"d2t": t["d2t"].flip(0).contiguous()})), "d2t"),
        (lambda f: _rewrite_config(f, lambda c: c.update(architectures=["LlamaForCausalLM"])), "'architectures'"),
        (
            lambda f: _rewrite_config(
                f, lambda c: (c.pop(EXPORT_META_KEY), c.update(architectures=["LlamaForCausalLM"]))
            ),
            "not an EAGLE draft head",
        ),
        (
            lambda f: _rewrite_config(f, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2])),
            "eagle_aux_hidden_state_layer_ids",
        ),
        (lambda f: _rewrite_config(f, lambda c: c.update(tie_word_embeddings=True)), "tie_word_embeddings"),
        (
            lambda f: _rewrite_config(f, lambda c: c[EXPORT_META_KEY]["head_config"].update(hidden_size=32)),
            "fc.weight has shape .* the config implies",
        ),
        (lambda f: (f / "config.json").write_text("{not json"), "not valid JSON"),
        (lambda f: (f / "model.safetensors").unlink(), "no model.safetensors"),
    ],
)
def test_check_rejects_broken_folders(breakage, message, heads, tmp_path):
    folder = tmp_path / "vllm"
    export_head(heads["eagle3"], folder, "vllm")
    check_folder(folder)
    breakage(folder)
    with pytest.raises(ExportError, match=message):
        check_folder(folder)


def test_third_party_vllm_style_folder_loads(heads, target, tmp_path):
    """A folder made elsewhere: layers.0.* names, a stored embedding, no aux ids, no eagle metadata."""
    head = heads["eagle3"]
    folder = tmp_path / "third"
    folder.mkdir()
    state = {
        k.replace("midlayer.", "layers.0."): v.clone().contiguous() for k, v in head.trainable_state_dict().items()
    }
    state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    save_file(state, str(folder / "model.safetensors"))
    c = head.config
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "model_type": "llama",
                "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size,
                "num_hidden_layers": 1,
                "num_attention_heads": c.num_attention_heads,
                "num_key_value_heads": c.num_key_value_heads,
                "head_dim": c.head_dim,
                "rms_norm_eps": c.rms_norm_eps,
                "vocab_size": c.vocab_size,
                "draft_vocab_size": c.draft_vocab_size,
                "max_position_embeddings": 1024,
                "rope_theta": c.rope_parameters["rope_theta"],
                "hidden_act": "silu",
                "tie_word_embeddings": False,
            }
        )
    )
    checked = check_folder(folder)
    assert checked.format == "third-party" and "embed_tokens.weight" in checked.borrowed
    loaded = load_exported_head(folder, target)
    assert loaded.config.aux_layer_ids == c.aux_layer_ids  # the runtimes' default for this depth
    assert torch.equal(_outputs(loaded), _outputs(head))
    # SGLang-style ids in eagle_config mean "output of layer k": loading adds 1.
    _rewrite_config(folder, lambda cfg: cfg.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}))
    assert load_exported_head(folder, target).config.aux_layer_ids == [1, 2, 3]


def test_load_rejects_other_target(heads, tmp_path):
    export_head(heads["eagle3"], tmp_path / "e", "vllm")
    other, _ = make_model("qwen2", hidden=32)
    with pytest.raises(ExportError, match="does not fit this target"):
        load_exported_head(tmp_path / "e", other)


def test_cli_check_flag_and_export_from_training_dir(heads, tiny_target_dir, tmp_path, monkeypatch, capsys):
    from eagle.cli import export as cli
    from eagle.cli.app import compose, save_resolved_config

    assert cli.rewrite_check_flag(["--check", "D", "x=1"]) == ["export.check=D", "x=1"]
    assert cli.rewrite_check_flag(["--check=D"]) == ["export.check=D"]
    # A training output dir: best/ + the resolved train_config.yaml naming the target.
    run = tmp_path / "run"
    save_head(heads["eagle3"], run / "best")
    save_resolved_config(compose([f"output_dir={run}", f"target.path={tiny_target_dir}"]), "train")
    out = tmp_path / "spec"
    monkeypatch.setattr(sys, "argv", ["eagle-export", f"draft.path={run}", "format=speculators", f"output_dir={out}"])
    cli.main()
    verifier = _config(out)["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(tiny_target_dir), "architectures": ["LlamaForCausalLM"]}
    monkeypatch.setattr(sys, "argv", ["eagle-export", "--check", str(out), f"output_dir={tmp_path / 'c'}"])
    cli.main()
    assert "OK:" in capsys.readouterr().out
    _rewrite_tensors(out, lambda t: t.pop("norm.weight"))
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 2
    assert "required tensors missing: norm.weight" in capsys.readouterr().err


def test_write_export_keeps_previous_folder_when_validation_fails(heads, tmp_path):
    folder = tmp_path / "e"
    export_head(heads["eagle3"], folder, "sglang")
    before = (folder / "model.safetensors").read_bytes()
    bad = dict(heads["eagle3"].trainable_state_dict())
    bad["fc.weight"] = bad["fc.weight"].clone()
    bad["fc.weight"][0, 0] = float("nan")
    with pytest.raises(ExportError, match="NaN"):
        write_export(heads["eagle3"].config, bad, folder, "sglang")
    assert (folder / "model.safetensors").read_bytes() == before
    assert not [p for p in folder.iterdir() if p.name.startswith(".export-")]


def test_speculators_embedding_from_target_folder_and_verifier_choices(heads, tiny_target_dir, tmp_path):
    """Without a live target the embedding is read from target.path's safetensors; export.verifier picks
    what speculators_config.verifier names (default: the local target folder)."""
    from eagle.export.exporter import verifier_info

    head = heads["eagle3"]
    state = head.trainable_state_dict()
    want = load_file(str(tiny_target_dir / "model.safetensors"))["model.embed_tokens.weight"]
    out = write_export(
        head.config, state, tmp_path / "a", "speculators", dtype="float16", target_path=str(tiny_target_dir)
    )
    assert torch.equal(out.borrowed["embed_tokens.weight"], want.to(torch.float16))
    assert out.raw_config["speculators_config"]["verifier"] == {
        "name_or_path": str(tiny_target_dir.resolve()),
        "architectures": ["LlamaForCausalLM"],
    }
    hub = write_export(
        head.config,
        state,
        tmp_path / "b",
        "speculators",
        target_path=str(tiny_target_dir),
        verifier="org/published-target",
    )
    assert hub.raw_config["speculators_config"]["verifier"]["name_or_path"] == "org/published-target"
    assert verifier_info("org/some-model")["name_or_path"] == "org/some-model"  # a Hub-id target stays one
    assert verifier_info(str(tiny_target_dir), "hub")["name_or_path"] == str(tiny_target_dir)
    with pytest.raises(ExportError, match="export.verifier=local"):
        verifier_info("org/not-local", "local")
    with pytest.raises(ExportError, match="input embedding"):
        write_export(head.config, state, tmp_path / "c", "speculators", target_path=None, verifier="org/x")
    other, _ = make_model("llama", hidden=32)  # a different target: its embedding does not fit the head
    with pytest.raises(ExportError, match="not the head's target"):
        write_export(
            head.config,
            state,
            tmp_path / "d",
            "speculators",
            embed_tokens=other.get_input_embeddings().weight.detach(),
            verifier="org/x",
        )


def test_old_speculators_export_without_embedding_still_checks(heads, target, tmp_path):
    folder = tmp_path / "old"
    export_head(heads["eagle3"], folder, "speculators", dtype="float32", target_path="org/target-model")
    _rewrite_tensors(folder, lambda t: t.pop("embed_tokens.weight"))
    old = check_folder(folder)
    assert any("all-zero input embedding" in n for n in old.notes)
    assert torch.equal(_outputs(load_exported_head(folder, target)), _outputs(heads["eagle3"]))
    _rewrite_tensors(
        folder,
        lambda t: t.update(
            {"embed_tokens.weight": torch.zeros(heads["eagle3"].config.vocab_size, heads["eagle3"].config.hidden_size)}
        ),
    )
    with pytest.raises(ExportError, match="all zeros"):
        check_folder(folder)


@pytest.fixture(scope="module")
def eagle31(target):
    cfg = head_config_from_target(
        target.config, DraftConfig(algorithm="eagle3", draft_vocab_size=DRAFT_VOCAB, fc_norm=True, norm_output=True)
    )
    head = build_head(cfg, target, vocab_counts=torch.arange(cfg.vocab_size, dtype=torch.float) % 13)
    randomise(head, 3)
    return head.eval()


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators", "hf"])
def test_eagle31_head_exports_its_norms_and_round_trips(fmt, eagle31, target, tmp_path):
    export_head(eagle31, tmp_path / fmt, fmt, dtype="float32", target_path="org/target-model")
    cfg = _config(tmp_path / fmt)
    # The names vLLM's Eagle3LlamaForCausalLM, SGLang's LlamaForCausalLMEagle3 (0.5.23) and speculators'
    # Eagle3SpeculatorConfig (0.9.0) read: top-level config keys, fc_norm.{i}.weight tensors.
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= _keys(tmp_path / fmt)
    loaded = load_exported_head(tmp_path / fmt, target)
    assert loaded.config.fc_norm and loaded.config.norm_output
    assert torch.equal(_outputs(loaded), _outputs(eagle31))
    # A vLLM-style folder written elsewhere (no eagle block) is read with the same options.
    raw = {k: v for k, v in cfg.items() if k != EXPORT_META_KEY}
    from eagle.export.formats import head_config_from_config

    third, _ = head_config_from_config(raw, "x")
    assert third.fc_norm and third.norm_output


def test_eagle31_head_is_refused_by_llamacpp(eagle31, tmp_path):
    with pytest.raises(
        ExportError,
        match=r"format=llamacpp cannot serve this head: fc_norm=true: llama\.cpp b11434 .*; "
        r"norm_output=true: llama\.cpp b11434 .*; export it with format=vllm \| "
        r"sglang \| speculators \| hf$",
    ):
        export_head(eagle31, tmp_path / "l", "llamacpp", dtype="float32", target_path="org/target-model")
    assert not (tmp_path / "l").exists()


def test_plain_eagle3_exports_do_not_name_the_eagle31_options(heads, tmp_path):
    export_head(heads["eagle3"], tmp_path / "v", "vllm", dtype="float32", target_path="org/target-model")
    cfg = _config(tmp_path / "v")
    assert "fc_norm" not in cfg and "norm_output" not in cfg  # so older exports still pass --check


def test_safetensors_bytes_are_canonical_across_processes(tmp_path):
    # safetensors orders `__metadata__` by a per-process hash seed: two processes exporting the same
    # head wrote different bytes (sha256). Five metadata keys make a chance match 1 in 120.
    code = (
        "import sys, torch; from eagle.fileio import safetensors_bytes; "
        "t = {f'w{i}': torch.arange(6, dtype=torch.float32) * i for i in range(4)}; "
        "m = {k: k * 2 for k in ('format', 'eagle_format', 'eagle_algorithm', 'x', 'y')}; "
        "open(sys.argv[1], 'wb').write(safetensors_bytes(t, m))"
    )
    paths = [tmp_path / f"{i}.safetensors" for i in range(2)]
    for p in paths:
        subprocess.run([sys.executable, "-c", code, str(p)], check=True)
    assert paths[0].read_bytes() == paths[1].read_bytes()
    back = load_file(str(paths[0]))
    assert sorted(back) == [f"w{i}" for i in range(4)]
    torch.testing.assert_close(back["w3"], torch.arange(6, dtype=torch.float32) * 3)
    with safe_open(str(paths[0]), framework="pt") as f:
        assert f.metadata() == {k: k * 2 for k in ("format", "eagle_format", "eagle_algorithm", "x", "y")}
    one = {"a": torch.ones(3, dtype=torch.float16)}
    assert safetensors_bytes(one, {"format": "pt"})[8:].startswith(b"{")
