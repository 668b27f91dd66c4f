"""Hydra multirun: one folder per job, a summary of the sweep, refusals recorded per job."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from eagle.sweep import build_summary, collect_records, job_dir_name, objective, summary_markdown, swept_keys
from tests.support.cli import BIN, cli_env
from tests.support.train import Workspace, head_weights, train_overrides


# --------------------------------------------------------------------------------------- names
def test_swept_keys_come_from_sweep_overrides_and_sweeper_params():
    overrides = ["recipe=x", "train.lr=1e-4,3e-4", "train.batch_size=range(2,6,2)", "+foo=interval(0,1)", "a.b=c"]
    assert swept_keys(overrides) == ["train.lr", "train.batch_size", "foo"]
    assert swept_keys(["train.lr=1e-4"], {"train.lr": "interval(1e-5,1e-3)", "draft.feature_noise_std": "0,0.1"}) == [
        "train.lr",
        "draft.feature_noise_std",
    ]


def test_job_dir_names_read_well_and_parse_back_in_hydra():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    job = ["recipe=r", "train.lr=0.0001", "train.batch_size=8", "output_dir=outputs/sweep"]
    assert job_dir_name(0, job, ["train.lr"]) == "0_lr-0.0001"
    assert job_dir_name(3, job, ["train.lr", "train.batch_size"]) == "3_lr-0.0001_batch_size-8"
    # Two keys with the same last component keep their full names; paths keep their last part.
    both = ["train.max_length=64", "data.max_length=128", "data.path=/x/y/convs.jsonl"]
    assert (
        job_dir_name(1, both, ["train.max_length", "data.max_length", "data.path"])
        == "1_train.max_length-64_data.max_length-128_path-convs.jsonl"
    )
    assert job_dir_name(2, job, []) == "2"  # swept keys unknown (a sweeper's own search space)
    name = job_dir_name(0, ["x.y=a b/c=d,e"], ["x.y"])
    assert "=" not in name and "," not in name and " " not in name
    parsed = OverridesParser.create().parse_overrides([f"draft.path=outputs/sweep/{name},outputs/sweep/1_lr-0.0003"])
    assert parsed[0].is_sweep_override()


# --------------------------------------------------------------------------------------- summary
def _record(
    tmp: Path,
    num: int,
    lr: str,
    status: str = "ok",
    tau: float | None = 1.2,
    stage: str = "train",
    sweep_id: str = "s1",
) -> dict:
    folder = tmp / f"{num}_lr-{lr}"
    folder.mkdir(parents=True, exist_ok=True)
    figures = (
        {
            "step": 10,
            "best_step": 10,
            "tau_sim": tau,
            "acc": [0.3, 0.2],
            "untrained_tau_sim": 1.0,
            "curve": [[0, 1.0], [10, tau]],
        }
        if stage == "train"
        else {"tau": tau, "speedup": 0.9}
    )
    rec = {
        "sweep_id": sweep_id,
        "num": num,
        "stage": stage,
        "overrides": ["recipe=r", f"train.lr={lr}"],
        "status": status,
        "error": None if status == "ok" else "bad\nsecond line",
        "wall_s": 135.0,
        "figures": figures if status == "ok" else {},
    }
    (folder / "sweep_job.json").write_text(json.dumps(rec))
    return rec


def test_summary_rows_best_job_and_markdown(tmp_path):
    _record(tmp_path, 0, "0.0001", tau=1.1)
    _record(tmp_path, 1, "0.0003", tau=1.3)
    _record(tmp_path, 2, "0.001", status="failed")
    _record(tmp_path, 0, "0.01", sweep_id="older")  # another sweep into the same root: left out
    records = collect_records(tmp_path, "s1")
    assert [r["dir"] for r in records] == ["0_lr-0.0001", "1_lr-0.0003", "2_lr-0.001"]
    summary = build_summary(records, ["train.lr"])
    assert summary["jobs"] == 3 and summary["ok"] == 2 and summary["failed"] == 1
    assert summary["swept_keys"] == ["train.lr"] and summary["common_overrides"] == {"recipe": "r"}
    assert summary["best"] == {"num": 1, "dir": "1_lr-0.0003", "tau_sim": 1.3}
    text = summary_markdown(summary, tmp_path)
    assert "| job | overrides | status | steps | acc@0 | acc@1 | tau_sim |" in text
    assert "| [1](1_lr-0.0003) | train.lr=0.0003 | ok | 10 | 0.300 | 0.200 | 1.300 | 10 | 1.000 | 2 min 15 s |" in text
    assert "- job 2 (`2_lr-0.001`): bad\n  second line" in text
    assert len(collect_records(tmp_path)) == 4  # without a sweep id: every record


def test_eval_summary_and_objectives(tmp_path):
    _record(tmp_path, 0, "0.0001", stage="eval", tau=1.4)
    summary = build_summary(collect_records(tmp_path), [])
    assert summary["objective"] == "tau" and summary["best"]["tau"] == 1.4
    assert "| [0](0_lr-0.0001) | - | ok | 1.40 | 0.90 |" in summary_markdown(summary, tmp_path)

    class Result:
        best_metric = 1.25

    assert objective("train", Result()) == 1.25 and objective("eval", {"tau": 2.0}) == 2.0
    assert objective("train", None) is None  # a failed trial for optimising sweepers (Optuna)
    assert objective("export", None) is None


def test_eval_summary_labels_approximate_jobs(tmp_path):
    from eagle.sweep import job_figures

    assert job_figures("eval", {"tau": 2.0, "acceptance": "typical"}, tmp_path)["acceptance"] == "typical"
    assert job_figures("eval", {"tau": 2.0}, tmp_path)["acceptance"] == "exact"  # reports before the field
    _record(tmp_path, 0, "0.0001", stage="eval", tau=1.4)
    rec = _record(tmp_path, 1, "0.0003", stage="eval", tau=1.9)
    rec["figures"]["acceptance"] = "lenient"
    (tmp_path / "1_lr-0.0003" / "sweep_job.json").write_text(json.dumps(rec))
    text = summary_markdown(build_summary(collect_records(tmp_path), []), tmp_path)
    assert "| 1.40 | 0.90 |" in text
    assert "| 1.90 (APPROXIMATE: lenient, not lossless) | 0.90 (APPROXIMATE: lenient, not lossless) |" in text
    assert "1.900 (APPROXIMATE: lenient, not lossless)." in text  # the best job too


# --------------------------------------------------------------------------------------- multirun CLI
def _sweep(ws: Workspace, root: Path, *extra: str) -> subprocess.CompletedProcess:
    replaced = {"train.lr", *(e.split("=", 1)[0] for e in extra)}
    ov = [
        o
        for o in train_overrides(root, ws.capture, steps=2, train__eval_every=2, train__save_every=2)
        if o.split("=", 1)[0] not in replaced
    ]
    return subprocess.run(
        [str(BIN / "eagle-train"), "-m", *ws.base, *ov, "train.lr=1e-3,1e-2", *extra],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=600,
    )


@pytest.mark.slow  # two eagle-train multiruns in subprocesses
def test_two_job_multirun_gives_two_heads_and_a_summary(ws3, tmp_path):
    root = tmp_path / "sweep"
    proc = _sweep(ws3, root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert jobs == ["0_lr-0.001", "1_lr-0.01"]
    assert {p.name for p in root.iterdir() if p.is_file()} == {
        "multirun.yaml",
        "sweep_summary.md",
        "sweep_summary.json",
        "sweep_tau_sim.png",
    }
    for job in jobs:  # every artifact of the job in its own folder
        assert (root / job / "best" / "model.safetensors").is_file() and (root / job / "train_config.yaml").is_file()
        assert f"output_dir: {root / job}" in (root / job / "train_config.yaml").read_text()
    wa, wb = head_weights(root / jobs[0] / "best"), head_weights(root / jobs[1] / "best")
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)  # two runs, not one claimed twice
    summary = json.loads((root / "sweep_summary.json").read_text())
    assert summary["jobs"] == 2 and summary["ok"] == 2 and summary["swept_keys"] == ["train.lr"]
    assert [r["overrides"] for r in summary["rows"]] == [{"train.lr": "0.001"}, {"train.lr": "0.01"}]
    assert all(r["step"] == 2 and r["tau_sim"] is not None and len(r["acc"]) == 3 for r in summary["rows"])
    table = (root / "sweep_summary.md").read_text()
    assert table.count("| ok |") == 2 and "acc@0" in table and "tau_sim" in table
    assert "# Sweep summary: eagle-train, 2 jobs (2 ok, 0 failed)" in proc.stdout

    # The same sweep with another batch size: both jobs refuse to resume, the sweep says so and exits 2,
    # and each folder keeps the config of the run it holds.
    before = (root / jobs[0] / "train_config.yaml").read_text()
    proc = _sweep(ws3, root, "train.batch_size=2")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.count("train.batch_size: 4 -> 2") == 2
    assert (root / jobs[0] / "train_config.yaml").read_text() == before
    summary = json.loads((root / "sweep_summary.json").read_text())
    assert summary["failed"] == 2 and all("train.batch_size" in r["error"] for r in summary["rows"])
