"""`eagle-capture` end to end: CLI contract, 2-process capture == 1-process capture."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle.capture.reader import CaptureDataset, check_compatible
from eagle.capture.store import read_manifest
from eagle.config import TargetConfig
from eagle.targets import load_target
from tests.tiny_models import save_model

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over lazy dog speculative decoding drafts several tokens and verifies".split()


def write_conversations(path: Path, n: int, seed: int = 0, max_words: int = 40) -> Path:
    """A small ShareGPT-format JSONL of random word salad."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            turns = [
                {"from": "human", "value": " ".join(rng.choices(WORDS, k=rng.randint(3, max_words)))},
                {"from": "gpt", "value": " ".join(rng.choices(WORDS, k=rng.randint(3, max_words)))},
            ]
            f.write(json.dumps({"id": f"conv{i}", "conversations": turns}) + "\n")
    return path


def cli_args(target: Path, data: Path, out: Path, n: int, shard_size: int, *extra: str) -> list[str]:
    return [
        f"target.path={target}", "data=local", f"data.path={data}", f"data.max_conversations={n}",
        "data.dedup_against=[]", "data.heldout_fraction=0.2", f"capture.shard_size={shard_size}",
        "capture.batch_tokens=256", f"output_dir={out}", *extra,
    ]


def cli_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_cli(args: list[str], launcher: list[str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [*(launcher or [sys.executable]), "-m", "eagle.cli.capture", *args]
    return subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=timeout)


def same_capture(a: Path, b: Path) -> None:
    """Two captures hold identical shards (bitwise) and identical manifests up to the data path."""
    ma, mb = read_manifest(a), read_manifest(b)
    assert ma["complete"] and mb["complete"]
    assert [(e["file"], e["sha256"], e["bytes"]) for e in ma["shards"]] == [
        (e["file"], e["sha256"], e["bytes"]) for e in mb["shards"]
    ]
    for e in ma["shards"]:
        ta, tb = load_file(a / e["file"]), load_file(b / e["file"])
        assert ta.keys() == tb.keys()
        for k in ta:
            assert torch.equal(ta[k], tb[k]), (e["file"], k)
    for m in (ma, mb):
        m["data"]["config"].pop("path")
    assert {k: v for k, v in ma.items() if k != "shards"} == {k: v for k, v in mb.items() if k != "shards"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("capture-cli")
    target = save_model("qwen2", base / "tiny-qwen2")
    data = write_conversations(base / "data.jsonl", 16)
    single = base / "single"
    r = run_cli(cli_args(target, data, single, 14, 3))
    assert r.returncode == 0, r.stderr[-3000:]
    return base, target, data, single, r


def test_cli_single_process_capture(setup):
    base, target, data, single, r = setup
    m = read_manifest(single)
    assert m["complete"] and m["algorithm"] == "eagle3" and m["aux_layer_ids"] == [1, 2, 3]
    assert m["target"]["model_type"] == "qwen2" and m["target"]["hidden_size"] == 64
    assert m["totals"]["conversations"] == 14
    assert m["splits"]["heldout"]["conversations"] >= 1
    assert "bytes/token" in r.stdout and "estimated size" in r.stdout
    assert (single / "capture_config.yaml").is_file()
    _, _, info = load_target(TargetConfig(path=str(target)))
    check_compatible(m, info, "eagle3")
    train, held = CaptureDataset(single, "train"), CaptureDataset(single, "heldout")
    assert len(train) + len(held) == 14
    assert train[0]["aux_hidden"].shape[1:] == (3, 64)


def test_cli_refuses_other_layers_with_exit_2(setup):
    base, target, data, single, _ = setup
    before = (single / "manifest.json").read_text()
    r = run_cli(cli_args(target, data, single, 14, 3, "draft.aux_layer_ids=[0,1,2]"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "aux_layer_ids" in r.stderr and "output_dir" in r.stderr and "Traceback" not in r.stderr
    assert (single / "manifest.json").read_text() == before


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one(setup):
    base, target, data, single, _ = setup
    double = base / "double"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(_free_port())]
    r = run_cli(cli_args(target, data, double, 14, 3), launcher=launcher)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "capture[0/2]" in r.stderr  # really ran as two ranks
    assert not list(double.glob("manifest.rank*.json"))
    same_capture(single, double)
