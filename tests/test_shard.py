"""`target.shard=fsdp` (eagle/target/shard.py): the frozen target as FSDP2 shards over the processes of a launch.

Fast tests: the config name, the refusals, resume / capture identity rules, and the lockstep counts
(every rank runs the target's forward equally often). Slow tests (marked): 2 gloo processes under
`torch.distributed.run` on CPU, each bounded by a timeout that ends the whole launch:
  - features of every tiny family, sharded == whole, bitwise;
  - `eagle-capture` sharded over 2 processes == one process, bitwise, with uneven work per rank;
  - 2 SGD steps of online training, sharded over 2 processes == one process, with uneven held-out work.
Bitwise equality is expected for features: a gathered layer holds exactly the weights of the whole one,
and each process runs the same kernels on the same shapes. Training compares within float32 summation
error, as the DDP test does (the ranks' gradients are averaged in another order).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eagle.capture import runner
from eagle.capture.runner import build_header, forwards_per_rank, plan_shards
from eagle.capture.store import check_same_capture, read_manifest
from eagle.cli.app import compose
from eagle.config import CaptureConfig, ConfigError, TargetConfig
from eagle.target.loading import load_target
from eagle.target.shard import load_placed_target
from eagle.train.batches import eval_batch_count, eval_batches
from eagle.train.resume import compare, run_record
from tests.support.capture import DATA, cli_args, info_for, make_convs, same_capture
from tests.support.cli import ROOT, cli_env
from tests.support.data import write_conversations, write_word_salad
from tests.support.train import SGD_STEP, assert_same_update, base_overrides, head_weights, train_overrides
from tests.tiny_models import FAMILIES, MORE_FAMILIES, make_model, save_model

LAUNCH_TIMEOUT_S = 240  # one 2-process launch on the tiny targets takes 15-30 s on 2 busy cores


# --------------------------------------------------------------------------------------- helpers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(module: str, *args: str, timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc_per_node 2 -m MODULE ARGS`, ended as a whole after
    `timeout` seconds (a deadlocked collective would otherwise wait forever): the launcher runs in a
    session of its own and gets SIGTERM (it stops its workers), then the session SIGKILL."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        "-m",
        module,
        *args,
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(
            f"{module} on 2 processes did not finish in {timeout} s (a collective out of step?):\n{err[-3000:]}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class FakeRank:
    """A `ProcessState` for rank `process_index` of `num_processes`, without a process group."""

    def __init__(self, process_index: int, num_processes: int) -> None:
        self.process_index, self.num_processes = process_index, num_processes
        self.is_main_process = True  # each fake rank writes into its own folder and merges it

    def wait_for_everyone(self) -> None:
        return None


# --------------------------------------------------------------------------------------- config and refusals
def test_default_is_none_and_other_values_are_refused():
    assert TargetConfig().shard == "none"
    assert compose(["target.shard=fsdp"]).target.shard == "fsdp"
    with pytest.raises(ConfigError, match="target.shard='ddp' is not one of none, fsdp"):
        compose(["target.shard=ddp"])


@pytest.mark.parametrize("stage, tool", [("decode", "eagle-eval"), ("regenerate", "eagle-regenerate")])
def test_decoding_stages_refuse_a_sharded_target_naming_the_stage(stage, tool, tiny_target_dir):
    with pytest.raises(ConfigError, match=rf"target.shard=fsdp: {tool} .* Set target.shard=none"):
        load_target(TargetConfig(path=str(tiny_target_dir), shard="fsdp"), stage=stage)


def test_a_single_process_refuses_fsdp_naming_the_launchers(tiny_target_dir):
    with pytest.raises(ConfigError, match=r"single process: start N > 1 processes \(torchrun"):
        load_placed_target(TargetConfig(path=str(tiny_target_dir), shard="fsdp"), device="cpu", stage="capture")


def test_resume_allows_another_shard_setting(tmp_path):
    """Like the number of processes, target.shard moves no feature and no update: a free change."""
    cfg = compose([f"output_dir={tmp_path}", "train.mode=online"])
    changes = compare(run_record(cfg), run_record(replace(cfg, target=replace(cfg.target, shard="fsdp"))))
    assert [(c.key, c.old, c.new, c.kind) for c in changes] == [("target.shard", "none", "fsdp", "free")]


def test_capture_manifest_records_shard_outside_the_identity(tmp_path):
    model, _ = make_model("llama")
    jobs = plan_shards({"train": make_convs(5), "heldout": make_convs(2, prefix="h")}, 2)
    header = {}
    for shard in ("none", "fsdp"):
        info = replace(info_for(model), shard=shard)
        header[shard] = build_header(info, DATA, "eagle3", [1, 2, 3], CaptureConfig(shard_size=2), jobs)
    assert header["fsdp"]["target"]["shard"] == "fsdp"
    check_same_capture(header["fsdp"], header["none"], tmp_path)  # no refusal: a resume may change it


# --------------------------------------------------------------------------------------- lockstep counts
class _Items:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def item(self, index: int) -> dict:
        return {"input_ids": torch.tensor([1, 2]), "loss_mask": torch.tensor([True, True]), "id": str(index)}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_eval_batch_count_is_the_busiest_ranks(world):
    for size in range(0, 9):
        for num_items in (1, 4, 8):
            for micro in (1, 2, 3):
                counts = [
                    len(list(eval_batches(_Items(size), num_items, micro, 64, 0, r, world))) for r in range(world)
                ]
                assert eval_batch_count(num_items, size, micro, world) == max(counts), (size, num_items, micro, counts)


def test_capture_ranks_run_the_same_number_of_target_forwards(monkeypatch, tmp_path):
    """Uneven work (3 shards on rank 0, 2 on rank 1; shards of other lengths) and still as many target
    forwards on each rank: the sharded target's all-gathers pair up. Counted on a whole model told it
    is sharded, each fake rank capturing into a folder of its own."""
    model, _ = make_model("llama")
    splits = {"train": make_convs(11, seed=1), "heldout": make_convs(3, seed=2, prefix="h")}
    cap = CaptureConfig(shard_size=3, batch_tokens=64)
    counts = forwards_per_rank(plan_shards(splits, cap.shard_size), 2, cap.batch_tokens)
    assert counts[0] != counts[1]  # the case the idle forwards exist for
    calls: list[str] = []
    monkeypatch.setattr(runner, "is_sharded", lambda m: True)
    monkeypatch.setattr(runner, "idle_forward", lambda m, device: calls.append("idle"))
    real = runner.extract_features
    monkeypatch.setattr(runner, "extract_features", lambda *a, **k: calls.append("real") or real(*a, **k))
    forwards = []
    for rank in (0, 1):
        calls.clear()
        runner.capture_splits(
            runner.FeatureSource.in_process(model, info_for(model)),
            splits,
            tmp_path / f"rank{rank}",
            cap,
            "eagle3",
            None,
            DATA,
            state=FakeRank(rank, 2),
            progress=False,
            log=lambda s: None,
        )
        assert calls.count("real") == counts[rank]
        forwards.append(len(calls))
    assert forwards == [max(counts)] * 2


# --------------------------------------------------------------------------------------- 2 processes (slow)
@pytest.mark.slow
def test_sharded_features_equal_the_whole_target_for_every_family(tmp_path):
    """Each family's decoder sharded over 2 gloo processes gives bitwise the features of the whole target
    (EAGLE-3 aux layers included); a layer gathered outside a forward equals the whole one; the layers
    are really split; tied embeddings stay tied and the LM head stays whole."""
    families = FAMILIES + MORE_FAMILIES  # hybrid linear-attention, sinks, MoE and MLA decoders too
    for family in families:
        save_model(family, tmp_path / "targets" / family)
    out = tmp_path / "out"
    out.mkdir()
    r = launch("tests.support.shard_worker", str(tmp_path / "targets"), str(out), *families)
    assert r.returncode == 0, r.stderr[-3000:]
    # Bitwise for every family but Qwen3-Next, whose grouped expert products over the gathered weights
    # round differently from the whole model's (3.6e-7 at the final norm): equal within float32 rounding.
    rounding_only = {("qwen3_next", "features_equal"), ("qwen3_next", "features_equal_after_gather")}
    for rank in (0, 1):
        results = json.loads((out / f"rank-{rank}.json").read_text())
        failed = {(family, check) for family, checks in results.items() for check, ok in checks.items() if not ok}
        assert set(results) == set(families) and failed <= rounding_only, (rank, failed)


@pytest.mark.slow
def test_sharded_capture_on_two_processes_equals_one_process(tmp_path):
    """eagle-capture with target.shard=fsdp over 2 processes writes bitwise the shards of a one-process
    capture. The work is uneven (5 shards: 3 on rank 0, 2 on rank 1, of other lengths), so rank 1 runs
    idle forwards; without them it would wait in an all-gather until the timeout. A later run with
    target.shard=none resumes the folder (same capture) and records its own setting."""
    from eagle.capture.runner import run_capture

    target = save_model("qwen2", tmp_path / "tiny-qwen2")  # untied embeddings: LM head and embeddings apart
    data = write_word_salad(tmp_path / "data.jsonl", 16)
    single, double = tmp_path / "single", tmp_path / "double"
    run_capture(compose(cli_args(target, data, single, 14, 3)))
    r = launch("eagle.cli.capture", *cli_args(target, data, double, 14, 3, "target.shard=fsdp"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "capture[0/2]" in r.stderr  # really two ranks
    manifest = read_manifest(double)
    assert manifest["target"]["shard"] == "fsdp" and manifest["splits"]["train"]["num_shards"] == 4
    same_capture(single, double)
    before = {e["file"]: e["sha256"] for e in manifest["shards"]}
    resumed = run_capture(compose(cli_args(target, data, double, 14, 3)))  # target.shard=none, one process
    assert resumed["target"]["shard"] == "none" and {e["file"]: e["sha256"] for e in resumed["shards"]} == before


@pytest.mark.slow
def test_cli_refuses_fsdp_in_one_process_with_exit_2(tmp_path):
    target = save_model("qwen2", tmp_path / "tiny-qwen2")
    data = write_word_salad(tmp_path / "data.jsonl", 4)
    cmd = [
        sys.executable,
        "-m",
        "eagle.cli.capture",
        *cli_args(target, data, tmp_path / "out", 4, 2, "target.shard=fsdp"),
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "target.shard=fsdp" in r.stderr and "torchrun" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "algorithm, extra, family",
    [
        ("eagle3", {"train__freeze_lm_head": "true"}, "llama"),  # reads the target's LM head rows and final norm
        ("eagle1", {}, "llama"),  # reads the target's LM head at every step
        # A hybrid target, its linear-attention layers sharded too (its MoE decoder layer is no draft layer's start).
        ("eagle3", {"train__init_layer_from_target": "null"}, "qwen3_next"),
    ],
)
def test_sharded_online_training_on_two_processes_equals_one_process(algorithm, extra, family, tmp_path):
    """2 SGD steps of online training with the target sharded over 2 processes == 1 process with the
    whole target, on the same global batch (within float32 summation error, as the DDP test). The tiny
    Llama ties its embeddings to its LM head; the head's decoder layer starts from the target's last
    layer (gathered from the shards). 3 held-out conversations over 2 ranks of 1-item micro-batches:
    rank 1 runs an idle forward in each evaluation."""
    target = save_model(family, tmp_path / "target")
    base = base_overrides(target, write_conversations(tmp_path / "convs.jsonl"), algorithm)
    base += ["data.heldout_fraction=0.25"]
    steps, one, two = 2, tmp_path / "one", tmp_path / "two"
    settings = {**SGD_STEP, "train__lr": 0.5, "train__grad_accum": 2, "train__init_layer_from_target": -1, **extra}
    from eagle.train.trainer import train

    train(compose(base + train_overrides(one, None, steps, **settings)))
    r = launch("eagle.cli.train", *base, *train_overrides(two, None, steps, **settings), "target.shard=fsdp")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert re.search(r"held-out 3\b", r.stdout + r.stderr)  # 2 micro-batches on rank 0, 1 on rank 1
    ck = Path("checkpoints") / f"step-{steps:07d}"
    assert (two / ck / "rng" / "rank-00001.pt").is_file()  # really two ranks
    assert_same_update(head_weights(one / ck / "head"), head_weights(two / ck / "head"))
    ev = [json.loads((d / "train_summary.json").read_text())["eval_metrics"] for d in (one, two)]
    assert ev[0].keys() == ev[1].keys()
    for k in ev[0]:
        assert ev[0][k] == pytest.approx(ev[1][k], rel=1e-5, abs=1e-6), k
