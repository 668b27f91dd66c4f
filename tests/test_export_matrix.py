"""Every export format x head option (docs/serving.md): served under the names its engine reads, or refused
naming the option and the engine, with nothing written.

Engines read (see docs/serving.md for files and lines): vLLM 0.32 `llama_eagle3.py`, SGLang 0.5.23
`llama_eagle3.py`, speculators 0.9.0 `models/eagle3/{config,core}.py`, llama.cpp b11434
`convert_hf_to_gguf.py` (conversion/llama.py) and `src/models/eagle3.cpp`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle.algorithms.head_io import build_head, head_config_from_target
from eagle.config import DraftConfig
from eagle.errors import ExportError
from eagle.export import check_folder, export_head, load_exported_head, write_export
from eagle.export.registry import FORMATS
from tests.support.export import E3_LAYER, E3_TOP, LAYER, head_outputs
from tests.support.heads import randomise
from tests.tiny_models import make_model

FC_NORMS = {f"fc_norm.{i}.weight" for i in range(3)}  # vLLM / SGLang / speculators: model.fc_norm[i]
VARIANTS = {
    "eagle3": {},
    "fc_norm": {"fc_norm": True},
    "norm_output": {"norm_output": True},
    "both": {"fc_norm": True, "norm_output": True},
    "eagle1": {},
}

# (format, variant) -> what the refusal must say: the format, each option and the engine. Anything else is served.
REFUSED = {
    ("llamacpp", "fc_norm"): [r"format=llamacpp cannot serve this head: fc_norm=true: llama\.cpp b11434"],
    ("llamacpp", "norm_output"): [r"format=llamacpp cannot serve this head: norm_output=true: llama\.cpp b11434"],
    ("llamacpp", "both"): [
        r"fc_norm=true: llama\.cpp b11434",
        r"norm_output=true: llama\.cpp b11434",
        r"export it with format=vllm \| sglang \| speculators \| hf$",
    ],
    ("speculators", "eagle1"): [
        r"format=speculators cannot express an EAGLE-1 head \(speculators 0\.9\.0 has no "
        r"EAGLE-1 model"
    ],
    ("llamacpp", "eagle1"): [r"format=llamacpp cannot express an EAGLE-1 head \(llama\.cpp b11434 has no EAGLE-1"],
    # transformers' generate has a drafter class for DFlash only (tests/test_transformers_dflash.py).
    **{("transformers", v): [r"format=transformers cannot express an EAGLE-(3|1) head"] for v in VARIANTS},
}
CASES = [(fmt, variant) for fmt in FORMATS for variant in VARIANTS]


@pytest.fixture(scope="module")
def target():
    model, _ = make_model("llama")
    return model


@pytest.fixture(scope="module")
def heads(target):
    out = {}
    for seed, (name, options) in enumerate(VARIANTS.items()):
        algorithm = "eagle1" if name == "eagle1" else "eagle3"
        draft = DraftConfig(algorithm=algorithm, draft_vocab_size=200 if algorithm == "eagle3" else None, **options)
        cfg = head_config_from_target(target.config, draft)
        counts = torch.arange(cfg.vocab_size, dtype=torch.float) % 11
        head = build_head(cfg, target, vocab_counts=counts if algorithm == "eagle3" else None)
        randomise(head, seed)
        if algorithm == "eagle1":
            with torch.no_grad():
                head.fc.bias.zero_()  # vLLM's EAGLE-1 has no fc bias (test_export covers a non-zero one)
        out[name] = head.eval()
    return out


def _outputs(head, seed: int = 0) -> torch.Tensor:
    return head_outputs(head, seed, t=5, steps=2)  # the second step reads the first's output


def _expected_keys(fmt: str, variant: str) -> set[str]:
    """The tensor names each engine's loader reads for this head."""
    if variant == "eagle1":
        return {"fc.weight"} | {"layers.0." + k for k in LAYER} | (set() if fmt == "vllm" else {"fc.bias"})
    prefix = "layers.0." if fmt == "speculators" else "midlayer."  # llama.cpp renames both (conversion/llama.py)
    keys = E3_TOP | {prefix + k for k in E3_LAYER}
    if fmt == "speculators":
        keys |= {"embed_tokens.weight"}
    if VARIANTS[variant].get("fc_norm"):
        keys |= FC_NORMS
    return keys


@pytest.mark.parametrize("fmt, variant", CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_format_option_matrix(fmt, variant, heads, target, tiny_target_dir, tmp_path):
    head = heads[variant]
    out = tmp_path / "out"
    if (fmt, variant) in REFUSED:
        with pytest.raises(ExportError) as e:
            export_head(head, out, fmt, dtype="float32", target_path=str(tiny_target_dir))
        for pattern in REFUSED[fmt, variant]:
            assert re.search(pattern, str(e.value)), (pattern, str(e.value))
        assert not out.exists()  # refused before anything was written
        return
    export_head(head, out, fmt, dtype="float32", target_path=str(tiny_target_dir))
    assert set(load_file(str(out / "model.safetensors"))) == _expected_keys(fmt, variant)
    cfg = json.loads((out / "config.json").read_text())
    options = VARIANTS[variant]
    if fmt == "speculators":
        # Eagle3SpeculatorConfig fields; norm_before_fc must stay off (exclusive with fc_norm there).
        assert cfg["fc_norm"] is bool(options.get("fc_norm")) and cfg["norm_output"] is bool(options.get("norm_output"))
        assert cfg["norm_before_fc"] is False and cfg["norm_before_residual"] is False
    elif variant != "eagle1":
        # vLLM / SGLang / llama.cpp's converter read top-level keys (getattr(config, "fc_norm", False)); a plain
        # head writes none, so older exports still pass --check.
        assert {k: cfg[k] for k in ("fc_norm", "norm_output") if k in cfg} == {k: True for k in options}
    if fmt == "llamacpp":
        # What convert_hf_to_gguf.py keys on: an EAGLE-3 architecture, draft_vocab_size and one layer.
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
        assert cfg["draft_vocab_size"] == 200 and cfg["eagle_aux_hidden_state_layer_ids"] == head.config.aux_layer_ids
        assert cfg["norm_before_residual"] is False and "norm_before_fc" not in cfg
    checked = check_folder(out, expect_format=fmt, dtype="float32")
    assert checked.config == head.config
    assert torch.equal(_outputs(load_exported_head(out, target)), _outputs(head))


def test_refusal_leaves_an_earlier_export_untouched(heads, tiny_target_dir, tmp_path):
    out = tmp_path / "out"
    export_head(heads["eagle3"], out, "llamacpp", dtype="float32", target_path=str(tiny_target_dir))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ExportError, match="norm_output=true: llama.cpp"):
        export_head(heads["norm_output"], out, "llamacpp", dtype="float32", target_path=str(tiny_target_dir))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize(
    "fmt, change, message",
    [
        (
            "llamacpp",
            {"hidden_act": "gelu_pytorch_tanh"},
            r"hidden_act=gelu_pytorch_tanh: llama\.cpp b11434's .* SiLU .*; export it with format=speculators \| hf$",
        ),
        (
            "vllm",
            {"hidden_act": "gelu_pytorch_tanh"},
            r"hidden_act=gelu_pytorch_tanh: vLLM 0\.32's LlamaMLP accepts only",
        ),
        ("sglang", {"hidden_act": "gelu"}, r"hidden_act=gelu: SGLang 0\.5\.23's LlamaMLP accepts only silu"),
        ("llamacpp", {"attention_bias": True}, r"attention_bias=true: llama\.cpp b11434's .* no q/k/v/o biases"),
        (
            "speculators",
            {"target_hidden_size": 1000},
            r"target_hidden_size=1000 != hidden_size=\d+: speculators 0\.9\.0",
        ),
    ],
)
def test_other_head_properties_an_engine_cannot_express(fmt, change, message, heads, tmp_path):
    head = heads["eagle3"]
    cfg = dataclasses.replace(head.config, **change)
    # Refused from the config alone, before the tensors (which would not fit the changed config) are read.
    with pytest.raises(ExportError, match=message):
        write_export(cfg, head.trainable_state_dict(), tmp_path / "x", fmt, target_path="org/target")
    assert not (tmp_path / "x").exists()


def test_check_refuses_a_folder_its_engine_cannot_serve_but_eagle_still_loads_it(
    heads, target, tmp_path, monkeypatch, capsys
):
    """A vllm folder of a non-SiLU head (written before vLLM's refusal was known, or by hand): eagle's loader
    reads the layout; `eagle-export --check` says vLLM cannot serve it."""
    out = tmp_path / "v"
    export_head(heads["eagle3"], out, "vllm", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    cfg["hidden_act"] = cfg["eagle_export"]["head_config"]["hidden_act"] = "gelu_pytorch_tanh"
    (out / "config.json").write_text(json.dumps(cfg))
    assert check_folder(out).config.hidden_act == "gelu_pytorch_tanh"
    load_exported_head(out, target)
    from eagle.cli import export as cli

    monkeypatch.setattr("sys.argv", ["eagle-export", "--check", str(out), f"output_dir={tmp_path / 'c'}"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 2
    assert "hidden_act=gelu_pytorch_tanh: vLLM 0.32's LlamaMLP accepts only silu" in capsys.readouterr().err


def test_llamacpp_folder_commands_and_check(heads, tiny_target_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "llama"
    export_head(
        heads["eagle3"], out, "llamacpp", dtype="float16", target_path=str(tiny_target_dir), speculative_tokens=3
    )
    guide = (out / "LLAMACPP.md").read_text()
    head_dir, hf_dir = out.resolve(), tiny_target_dir.resolve()
    # llama.cpp b11434: convert_hf_to_gguf.py's --target-model-dir / --outtype / --outfile, llama-server's
    # --spec-draft-model / --spec-type draft-eagle3 / --spec-draft-n-max (common/arg.cpp).
    assert (
        f"python convert_hf_to_gguf.py {head_dir} --target-model-dir {hf_dir} --outtype f16 "
        f"--outfile {head_dir}/head.gguf"
    ) in guide
    # An HF-folder target has no GGUF: the guide converts it first, then serves that file.
    assert f"python convert_hf_to_gguf.py {hf_dir} --outtype f16 --outfile target.gguf" in guide
    assert (
        f"llama-server -m target.gguf --spec-draft-model {head_dir}/head.gguf --spec-type draft-eagle3 "
        "--spec-draft-n-max 3"
    ) in guide
    from eagle.cli import export as cli

    monkeypatch.setattr("sys.argv", ["eagle-export", "--check", str(out), f"output_dir={tmp_path / 'c'}"])
    cli.main()
    printed = capsys.readouterr().out
    assert "(format llamacpp)" in printed and "LLAMACPP.md" in printed
    # A stale conversion never survives a re-export into the folder.
    (out / "head.gguf").write_bytes(b"GGUF old")
    export_head(heads["eagle3"], out, "vllm", dtype="float16")
    assert not (out / "head.gguf").exists() and not (out / "LLAMACPP.md").exists()


def test_llamacpp_check_needs_its_commands(heads, tmp_path):
    out = tmp_path / "llama"
    export_head(heads["eagle3"], out, "llamacpp", dtype="float16", target_path="org/hub-target")
    guide = (out / "LLAMACPP.md").read_text()
    assert "--target-model-dir TARGET_HF_DIR" in guide and "hf download org/hub-target" in guide
    (out / "LLAMACPP.md").unlink()
    with pytest.raises(ExportError, match="holds LLAMACPP.md"):
        check_folder(out)


def test_llamacpp_guide_for_a_gguf_target_serves_that_file(heads, tmp_path, monkeypatch):
    from eagle.export import llamacpp

    gguf = tmp_path / "target.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    converted = tmp_path / "converted"
    converted.mkdir()
    # resolve_target_path would convert the GGUF into the cache; its result is all the guide needs.
    monkeypatch.setattr(llamacpp, "resolve_target_path", lambda cfg: (str(converted), "gguf-sha256:x"))
    target = llamacpp.local_target(str(gguf))
    assert target == llamacpp.LlamaCppTarget(str(gguf), str(converted.resolve()), str(gguf.resolve()))
    guide = llamacpp.llamacpp_guide(heads["eagle3"].config, "/h", target, "bfloat16", 4)
    assert f"--target-model-dir {converted.resolve()} --outtype bf16 --outfile /h/head.gguf" in guide
    assert f"llama-server -m {gguf.resolve()} --spec-draft-model /h/head.gguf" in guide
    assert "--outfile target.gguf" not in guide  # the target's own GGUF is served


def test_docs_serving_table_matches_the_exporter():
    """docs/serving.md's matrix says served / refused for exactly the cells the exporter serves / refuses."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `format=")]
    table = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        fmt = cells[0].split("=")[1].rstrip("`")
        for variant, cell in zip(VARIANTS, cells[1:6], strict=True):
            table[fmt, variant] = cell.split()[0].rstrip(":")
    assert set(table) == set(CASES)
    assert {k for k, v in table.items() if v == "refused"} == set(REFUSED)
    assert set(table.values()) == {"served", "refused"}


def test_format_names_are_compared_only_in_the_registry():
    """Stages ask a format object (eagle/export/registry.py) instead of comparing its name: no `fmt == "vllm"`
    or `x.format in ("hf", ...)` anywhere else in the package. Algorithms keep per-format facts in tables."""
    import ast

    import eagle

    def names(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        return set()

    def is_format(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id in ("fmt", "format")) or (
            isinstance(node, ast.Attribute) and node.attr == "format"
        )

    offenders = []
    for path in Path(eagle.__file__).parent.rglob("*.py"):
        if path.name == "registry.py" and path.parent.name == "export":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(is_format(s) for s in sides) and any(names(s) & set(FORMATS) for s in sides):
                    offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []
