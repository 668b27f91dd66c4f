"""`regenerate.backend=server` against a real `transformers serve` (a subprocess on a loopback port)
serving a tiny random Qwen2 folder in float32: greedy answers equal the local engine's (the tiny
model's x8 output scale leaves wide top-1 margins, so no near-tie can flip), resume, refusals.
Scheduling and failover edge cases run against fake servers in tests/test_server_backend.py; killed
servers in tests/reliability/test_regenerate_server_faults.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from eagle.config import RegenerateConfig, TargetConfig
from eagle.data.records import Conversation
from eagle.errors import DataError, ServerError
from eagle.regenerate.runner import regenerate
from eagle.regenerate.server import ServerBackend
from eagle.target.loading import load_target, load_tokenizer
from tests.support.data import CONVS
from tests.support.servers import ServedModel, free_port, serve_available
from tests.tiny_models import save_model

pytestmark = pytest.mark.skipif(
    not serve_available(), reason="transformers serve cannot be imported: pip install 'transformers[serving]'"
)

# CONVS (one of them two turns long, one with a system prompt) and five one-turn conversations.
CONVERSATIONS = CONVS + [
    Conversation(f"c{i}", [{"role": "user", "content": p}, {"role": "assistant", "content": "x"}])
    for i, p in enumerate(
        [
            "Explain relativity",
            "import torch",
            "Numbers 0 1 2 3",
            "What is speculative decoding?",
            "Write a short poem about the sea.",
        ]
    )
]
REGEN = RegenerateConfig(max_new_tokens=12, requests_per_server=2, request_timeout=120)


def _by_id(path: Path) -> dict[str, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == len({r["id"] for r in records}), "a conversation was written twice"
    return {r["id"]: r for r in records}


def _texts(records: dict[str, dict]) -> dict[str, list[dict]]:
    """Role and content of every message: `transformers serve` returns no token ids, the local engine keeps
    them (tests/test_regenerate.py checks those)."""
    return {cid: [{"role": m["role"], "content": m["content"]} for m in r["messages"]] for cid, r in records.items()}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return save_model("qwen2", tmp_path_factory.mktemp("served") / "tiny-qwen2")


@pytest.fixture(scope="module")
def served(target, tmp_path_factory):
    server = ServedModel(target, tmp_path_factory.mktemp("logs") / "serve.log").start()
    try:
        yield server.wait_ready()
    finally:
        server.kill()


@pytest.fixture(scope="module")
def local_records(target, tmp_path_factory) -> dict[str, dict]:
    """What the local greedy engine writes for CONVERSATIONS, same folder, float32."""
    model, tok, info = load_target(
        TargetConfig(path=str(target), dtype="float32", cpu_gemm="stock"), stage="regenerate"
    )
    out = tmp_path_factory.mktemp("local") / "local.jsonl"
    regenerate(model, tok, CONVERSATIONS, REGEN, out, target_fingerprint=info.fingerprint, progress=False)
    return _by_id(out)


def test_cli_through_transformers_serve_writes_what_the_local_engine_writes(served, target, local_records, tmp_path):
    from eagle.cli.app import compose
    from eagle.cli.regenerate import regenerate_stage

    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in CONVERSATIONS))
    cfg = compose(
        [
            f"target.path={target}",
            "data=local",
            f"data.path={data}",
            "data.dedup_against=[]",
            f"output_dir={tmp_path / 'run'}",
            "regenerate.max_new_tokens=12",
            "regenerate.backend=server",
            f"regenerate.servers=[{served.url}]",
            "regenerate.requests_per_server=2",
        ]
    )
    regenerate_stage(cfg)
    out = tmp_path / "run" / "regenerated.jsonl"
    got = _by_id(out)
    assert _texts(got) == _texts(local_records)  # every turn; the two-turn conversation's 2nd prompt holds answer 1
    assert [m["role"] for m in got["a"]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    # transformers serve returns text only: no token ids in the records (the local engine's hold them).
    assert all("token_ids" not in m for r in got.values() for m in r["messages"])
    assert all("token_ids" in m for r in local_records.values() for m in r["messages"] if m["role"] == "assistant")
    meta = json.loads((tmp_path / "run" / "regenerated.jsonl.meta.json").read_text())
    assert (meta["backend"], meta["served_model"], meta["server_engine"]) == ("server", str(target), "transformers")


def test_resume_adds_the_missing_conversations_once(served, target, local_records, tmp_path):
    tok = load_tokenizer(TargetConfig(path=str(target)))
    cfg = replace(REGEN, backend="server", servers=[served.url])
    out = tmp_path / "r.jsonl"
    regenerate(ServerBackend(cfg), tok, CONVERSATIONS[:3], cfg, out, target_fingerprint="t", progress=False)
    with open(out, "a") as f:  # what a run killed mid-write leaves
        f.write('{"id": "c0", "messa')
    regenerate(ServerBackend(cfg), tok, CONVERSATIONS, cfg, out, target_fingerprint="t", progress=False)
    assert _texts(_by_id(out)) == _texts(local_records)


def test_refusals_name_the_url_or_both_models(served, target, tmp_path):
    tok = load_tokenizer(TargetConfig(path=str(target)))
    out = tmp_path / "r.jsonl"
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = replace(REGEN, backend="server", servers=[served.url, dead])
    with pytest.raises(ServerError, match=f"{dead} cannot be reached .*Nothing was written"):
        regenerate(ServerBackend(cfg), tok, CONVERSATIONS, cfg, out, target_fingerprint="t", progress=False)
    assert not out.exists()
    cfg = replace(cfg, servers=[served.url], model="other/model")
    with pytest.raises(ServerError, match=f"does not serve regenerate.model='other/model'; it serves: {target}"):
        regenerate(ServerBackend(cfg), tok, CONVERSATIONS, cfg, out, target_fingerprint="t", progress=False)
    cfg = replace(cfg, model=None)
    regenerate(ServerBackend(cfg), tok, CONVERSATIONS[1:2], cfg, out, target_fingerprint="t", progress=False)
    # The file was written by another served model (as a server of another model would have it).
    meta = tmp_path / "r.jsonl.meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "served_model": "other/model"}))
    with pytest.raises(DataError, match=f"served_model: 'other/model' -> '{target}'"):
        regenerate(ServerBackend(cfg), tok, CONVERSATIONS, cfg, out, target_fingerprint="t", progress=False)
