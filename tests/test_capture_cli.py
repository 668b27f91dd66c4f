"""`eagle-capture` end to end: CLI contract, 2-process capture == 1-process capture."""

from __future__ import annotations

import socket
import sys

import pytest

from eagle.capture.reader import CaptureDataset, check_compatible
from eagle.capture.store import read_manifest
from eagle.config import TargetConfig
from eagle.target.loading import load_target
from tests.support.capture import cli_args, run_cli, same_capture
from tests.support.data import write_word_salad
from tests.tiny_models import save_model

# Every test runs eagle-capture in a subprocess: make test, not make test-fast.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("capture-cli")
    target = save_model("qwen2", base / "tiny-qwen2")
    data = write_word_salad(base / "data.jsonl", 16)
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


def test_two_processes_equal_one(setup):
    base, target, data, single, _ = setup
    double = base / "double"
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
    ]
    r = run_cli(cli_args(target, data, double, 14, 3), launcher=launcher)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "capture[0/2]" in r.stderr  # really ran as two ranks
    assert not list(double.glob("manifest.rank*.json"))
    same_capture(single, double)
