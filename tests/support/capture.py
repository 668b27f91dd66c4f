"""Captures for tests: in-process (`capture` of in-memory conversations) and through the
`eagle-capture` CLI in a subprocess, and a bitwise comparison of two capture folders."""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle.capture.runner import FeatureSource, capture_splits
from eagle.capture.store import read_manifest
from eagle.config import CaptureConfig
from eagle.target.loading import TargetInfo
from tests.support.cli import ROOT, cli_env


# --------------------------------------------------------------------------------------- in process
@dataclass
class Conv:  # stand-in with the fields capture reads from eagle.data.TokenizedConversation
    id: str
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False


def make_convs(n: int, seed: int = 0, vocab: int = 300, prefix: str = "c") -> list[Conv]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = rng.randint(3, 40)
        out.append(
            Conv(f"{prefix}{i}", [rng.randrange(vocab) for _ in range(t)], [rng.randint(0, 1) for _ in range(t)])
        )
    return out


def info_for(model, fingerprint: str = "tiny-llama-0") -> TargetInfo:
    c = model.config
    return TargetInfo("tiny", "tiny", fingerprint, c.model_type, c.num_hidden_layers, c.hidden_size, c.vocab_size)


DATA = {"fingerprint": "data-0", "config": {"source": "test"}}


def capture(model, splits, out, algorithm="eagle3", aux=None, fingerprint="tiny-llama-0", data=DATA, **cap):
    cfg = CaptureConfig(**{"shard_size": 4, "batch_tokens": 64, **cap})
    return capture_splits(
        FeatureSource.in_process(model, info_for(model, fingerprint)),
        splits,
        out,
        cfg,
        algorithm,
        aux,
        data,
        progress=False,
        log=lambda s: None,
    )


# --------------------------------------------------------------------------------------- CLI
def cli_args(target: Path, data: Path, out: Path, n: int, shard_size: int, *extra: str) -> list[str]:
    """`eagle-capture` arguments for a local conversation file."""
    return [
        f"target.path={target}",
        "data=local",
        f"data.path={data}",
        f"data.max_conversations={n}",
        "data.dedup_against=[]",
        "data.heldout_fraction=0.2",
        f"capture.shard_size={shard_size}",
        "capture.batch_tokens=256",
        f"output_dir={out}",
        *extra,
    ]


def run_cli(args: list[str], launcher: list[str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m eagle.cli.capture ARGS` (or under `launcher`, e.g. torch.distributed.run)."""
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
        m["target"].pop("shard", None)  # how the run held the target (target.shard): the same features either way
    assert {k: v for k, v in ma.items() if k != "shards"} == {k: v for k, v in mb.items() if k != "shards"}
