"""Real `transformers serve` processes killed (SIGKILL) in the middle of `regenerate.backend=server`:
one of two -> the other takes its conversations, each written exactly once; both -> the run stops with
exit status 2 naming both URLs, and once they are back the same command completes the file."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from eagle.config import DataConfig, RegenerateConfig, TargetConfig
from eagle.data.dataset import load_conversations
from eagle.regenerate.runner import regenerate
from eagle.regenerate.server import ServerBackend
from eagle.target.loading import load_target
from tests.support.cli import cli_env
from tests.support.data import write_word_salad
from tests.support.servers import ServedModel, serve_available, start_all
from tests.tiny_models import save_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not serve_available(), reason="transformers serve cannot be imported: pip install 'transformers[serving]'"
    ),
]

N = 40  # conversations: at ~0.1 s a turn per server, a run lasts a few seconds, time enough to kill mid-way
REGEN = RegenerateConfig(backend="server", max_new_tokens=24, requests_per_server=2, request_timeout=120)


def _by_id(path: Path) -> dict[str, list[dict]]:
    """Each conversation's messages (role and content: `transformers serve` returns no token ids, the local
    engine keeps them), asserting that none was written twice."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == len({r["id"] for r in records}), "a conversation was written twice"
    return {r["id"]: [{"role": m["role"], "content": m["content"]} for m in r["messages"]] for r in records}


def _wait_for_lines(path: Path, n: int, timeout: float = 120.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().count("\n") if path.exists() else 0
        if lines >= n:
            return lines
        time.sleep(0.02)
    raise AssertionError(f"{path} did not reach {n} records within {timeout:.0f} s")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server_faults")


@pytest.fixture(scope="module")
def target(work) -> Path:
    return save_model("qwen2", work / "tiny-qwen2", seed=1)


@pytest.fixture(scope="module")
def data(work) -> DataConfig:
    return DataConfig(
        source="local", path=str(write_word_salad(work / "data.jsonl", N, max_words=12)), dedup_against=[]
    )


@pytest.fixture(scope="module")
def local(target, data, work):
    """(tokenizer, conversations, what the local greedy engine writes for them)."""
    model, tok, _ = load_target(TargetConfig(path=str(target), dtype="float32", cpu_gemm="stock"), stage="regenerate")
    conversations, _ = load_conversations(data)
    assert len(conversations) == N
    out = work / "local.jsonl"
    regenerate(model, tok, conversations, replace(REGEN, backend="local"), out, progress=False)
    return tok, conversations, _by_id(out)


@pytest.fixture(scope="module")
def pair(target, work):
    """Two servers of the target, started but not waited for: the tests ask for `pair` before `local`,
    so the servers' start-up overlaps the local reference run, and wait in `_back_up`."""
    servers = [ServedModel(target, work / f"serve{k}.log") for k in range(2)]
    try:
        for s in servers:
            s.start()
        yield servers
    finally:
        for s in servers:
            s.kill()


def _back_up(servers: list[ServedModel]) -> None:
    """Restart (on their ports) the servers a test killed, and wait until every one answers. The tests run
    in file order: the kill-all test first, whose restart leaves both up for the kill-one test."""
    start_all([s for s in servers if s.proc is None or s.proc.poll() is not None])
    for s in servers:
        s.wait_ready()


def test_every_server_killed_stops_with_status_2_then_the_same_command_completes(pair, local, target, data, tmp_path):
    _back_up(pair)
    a, b = pair
    out_dir = tmp_path / "run"
    out = out_dir / "regenerated.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "eagle.cli.regenerate",
        f"target.path={target}",
        "data=local",
        f"data.path={data.path}",
        "data.dedup_against=[]",
        f"output_dir={out_dir}",
        "regenerate.backend=server",
        f"regenerate.servers=[{a.url},{b.url}]",
        "regenerate.max_new_tokens=24",
        "regenerate.requests_per_server=2",
    ]
    proc = subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        at_kill = _wait_for_lines(out, 4)
        a.kill()
        b.kill()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 2, err[-3000:]
    assert at_kill < N, "the run ended before the kill: nothing was tested"
    assert "every server stopped answering" in err and a.url in err and b.url in err, err[-3000:]
    assert "Traceback" not in err
    written = _by_id(out)
    assert 4 <= len(written) < N

    # The same command, once the servers are back (in this process: a second interpreter start-up adds
    # nothing the first did not check).
    _back_up(pair)
    from eagle.cli.app import compose
    from eagle.cli.regenerate import regenerate_stage

    regenerate_stage(compose(cmd[3:]))
    assert _by_id(out) == local[2]


def test_a_killed_server_hands_its_conversations_to_the_other(pair, local, tmp_path, capfd):
    _back_up(pair)
    a, b = pair
    tok, conversations, expected = local
    cfg = replace(REGEN, servers=[a.url, b.url])
    out = tmp_path / "r.jsonl"
    errors: list[BaseException] = []

    def run() -> None:
        try:
            regenerate(ServerBackend(cfg), tok, conversations, cfg, out, target_fingerprint="t", progress=False)
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    at_kill = _wait_for_lines(out, 4)
    b.kill()
    thread.join(timeout=300)
    assert not thread.is_alive() and errors == []
    assert at_kill < N, "the run ended before the kill: nothing was tested"
    assert _by_id(out) == expected  # every conversation once, answers as the local engine's
    assert f"{b.url} stopped answering" in capfd.readouterr().err
