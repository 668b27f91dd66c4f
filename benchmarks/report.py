"""The record every benchmark run leaves: what ran, where, and what it printed (one shape for all)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

# CPU flags that decide which kernels run (bf16 matmuls need AVX512-BF16 or AMX; AVX2-only machines upcast).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def machine() -> dict[str, Any]:
    """This machine as a figure needs it named: CPU model and flags, cores, torch and its threads, GPU if any."""
    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return {
        "cpu": model,
        "cpu_flags": [f for f in FLAGS if f in flags],
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def git_commit(repo: Path) -> str | None:
    """The checked-out commit, with `+dirty` when the tree has changes; None outside a git checkout."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def write_record(
    path: Path, name: str, argv: list[str], started: float, exit_code: int, output: str, repo: Path
) -> dict[str, Any]:
    """Write (atomically) and return the record of one run of benchmark `name`."""
    record = {
        "benchmark": name,
        "command": " ".join(["python -m benchmarks", name, *argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "seconds": round(time.time() - started, 3),
        "exit_code": exit_code,
        "git": git_commit(repo),
        "machine": machine(),
        "output": output,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)
    return record
