"""The server backend's requests, records, scheduling and failover against in-process fake servers
(fast edge cases); tests/test_regenerate_server.py runs it against a real `transformers serve`."""

from __future__ import annotations

import concurrent.futures
import json
from dataclasses import replace

import pytest

from eagle.config import ConfigError, DataConfig, RegenerateConfig, RootConfig, validate
from eagle.data.dataset import load_conversations
from eagle.data.records import Conversation
from eagle.data.template import end_of_turn_ids, render
from eagle.errors import DataError, ServerError
from eagle.regenerate.engines import detect_engine
from eagle.regenerate.output import recover_output
from eagle.regenerate.runner import regenerate
from eagle.regenerate.server import ServerBackend, base_url, text_prompt
from tests.support.data import CONVS
from tests.support.servers import FakeServer, free_port
from tests.tiny_models import make_tokenizer

WORDS = ["sea", "blue", "fox", "dog", "quick", "brown", "poem", "tokens"]
CFG = RegenerateConfig(backend="server", max_new_tokens=8, requests_per_server=2, request_timeout=10)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer("qwen2")


def _conversations(n: int) -> list[Conversation]:
    return [
        Conversation(
            f"c{i}", [{"role": "user", "content": f"{WORDS[i % 8]} {i}"}, {"role": "assistant", "content": "ORIGINAL"}]
        )
        for i in range(n)
    ]


@pytest.fixture
def serve(tok):
    """Start fake servers whose answers are a function of the prompt (so every server answers alike)."""
    started = []
    stop = end_of_turn_ids(tok)[0]

    def reply(body):
        prompt = body["prompt"] if isinstance(body["prompt"], list) else tok(body["prompt"])["input_ids"]
        text = " ".join(WORDS[(sum(prompt) + k) % 8] for k in range(3))
        return text, list(tok(text, add_special_tokens=False)["input_ids"]) + [stop]  # engines return the stop id

    def start(**kw) -> FakeServer:
        started.append(FakeServer(reply, **kw))
        return started[-1]

    yield start
    for s in started:
        s.close()


def _run(tok, servers, out, convs=CONVS, **kw):
    cfg = replace(CFG, servers=[s if isinstance(s, str) else s.url for s in servers], **kw)
    return regenerate(ServerBackend(cfg), tok, convs, cfg, out, target_fingerprint="t", progress=False)


def _records(out):
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_vllm_requests_and_records_hold_the_token_ids(tok, serve, tmp_path):
    server = serve(owned_by="vllm")
    out = _run(tok, [server], tmp_path / "r.jsonl")
    records = {r["id"]: r for r in _records(out)}
    assert sorted(records) == ["a", "b", "c"]
    stop = end_of_turn_ids(tok)
    a = records["a"]["messages"]
    assert [m["role"] for m in a] == ["system", "user", "assistant", "user", "assistant"]
    for m in a:
        if m["role"] == "assistant":  # the ids decode to the text; the stop id is not kept
            assert m["token_ids"] and m["token_ids"][-1] not in stop
            assert m["content"] == tok.decode(m["token_ids"], skip_special_tokens=True).strip()
        else:
            assert "token_ids" not in m
    bodies = server.completions()
    assert len(bodies) == 4  # a: 2 turns, b and c: 1
    second = next(b for b in bodies if "Write a poem" in tok.decode(b["prompt"]))
    history = [{k: m[k] for k in ("role", "content")} for m in a[:4]]  # turn 2's prompt holds the new answer 1
    assert second["prompt"] == tok(render(tok, history, True), add_special_tokens=False)["input_ids"]
    assert second["stop_token_ids"] == stop and second["return_token_ids"] is True
    assert second["max_tokens"] == 8 and second["temperature"] == 0.0 and second["top_k"] == -1
    meta = json.loads((tmp_path / "r.jsonl.meta.json").read_text())
    assert meta["backend"] == "server" and meta["served_model"] == "tiny" and meta["server_engine"] == "vllm"
    assert "servers" not in meta and "requests_per_server" not in meta  # they may change on resume
    # The records read back as training data, ids included (tokenisation uses them).
    convs, stats = load_conversations(DataConfig(source="local", path=str(out), dedup_against=[]))
    assert {c.id: c.messages for c in convs}["a"] == a


def test_transformers_serve_gets_text_and_a_generation_config(tok, serve, tmp_path):
    server = serve(owned_by="local", status=True, models=("/models/tiny",))
    out = _run(tok, [server], tmp_path / "r.jsonl", temperature=0.7, top_k=5)
    body = server.completions()[0]
    # Its request schema refuses unknown keys: only OpenAI fields and its generation_config.
    assert set(body) <= {"model", "prompt", "max_tokens", "seed", "generation_config", "temperature", "top_p"}
    assert isinstance(body["prompt"], str) and body["model"] == "/models/tiny"
    generation = json.loads(body["generation_config"])
    assert generation["eos_token_id"] == end_of_turn_ids(tok) and generation["top_k"] == 5
    assert generation["do_sample"] is True and generation["max_new_tokens"] == 8
    records = _records(out)
    assert all("token_ids" not in m for r in records for m in r["messages"])  # it returns text only
    assert json.loads((tmp_path / "r.jsonl.meta.json").read_text())["server_engine"] == "transformers"


def test_llama_cpp_native_completion_returns_tokens(tok, serve, tmp_path):
    server = serve(owned_by="llamacpp")
    out = _run(tok, [server], tmp_path / "r.jsonl")
    body = server.completions()[0]
    assert server.requests[-1][0] == "/completion" and body["return_tokens"] is True
    assert isinstance(body["prompt"], list) and body["n_predict"] == 8 and body["min_p"] == 0.0
    assert all("token_ids" in m for r in _records(out) for m in r["messages"] if m["role"] == "assistant")


def test_engine_detection_and_urls():
    assert detect_engine({"owned_by": "vllm"}) == "vllm"
    assert detect_engine({"owned_by": "sglang"}) == "sglang"
    assert detect_engine({"owned_by": "llamacpp", "status": {}}) == "llama.cpp"
    assert detect_engine({"owned_by": "local", "status": {"value": "loaded"}}) == "transformers"
    assert detect_engine({"owned_by": "openai"}) == "openai"
    assert base_url("http://h:8000/v1/") == base_url("http://h:8000") == "http://h:8000"


def test_text_prompt_drops_a_bos_the_server_would_add_again():
    class AddsBos:
        bos_token = "<s>"

        def __call__(self, text):
            ids = [ord(c) for c in text.replace("<s>", "\x01")]
            return {"input_ids": [1] + ids}

    tok = AddsBos()
    assert text_prompt(tok, "<s>hi", [1, ord("h"), ord("i")]) == "hi"
    with pytest.raises(Exception, match="token ids"):
        text_prompt(tok, "hi", [ord("h"), ord("i")])


def test_a_reset_server_hands_its_conversations_to_the_others(tok, serve, tmp_path):
    convs = _conversations(12)
    reference = _records(_run(tok, [serve()], tmp_path / "ref.jsonl", convs))
    a, b = serve(), serve()
    b.fault, b.fail_after = "reset", 2  # crashes after two answers, with turns in flight
    out = _run(tok, [a, b], tmp_path / "r.jsonl", convs)
    got = _records(out)
    assert sorted(r["id"] for r in got) == sorted(c.id for c in convs)  # each exactly once
    key = lambda rs: sorted(rs, key=lambda r: r["id"])  # noqa: E731
    assert key(got) == key(reference)
    assert b.answered == 2 and len(a.completions()) >= 10


@pytest.mark.parametrize("fault", ["reset", 503, "hang"])
def test_every_server_gone_stops_with_their_errors_then_the_same_call_resumes(tok, serve, tmp_path, fault):
    convs = _conversations(10)
    a, b = serve(), serve()
    for s in (a, b):
        s.fault, s.fail_after = fault, 2
    out = tmp_path / "r.jsonl"
    # One request at a time per server: each has answered exactly two turns when it fails.
    kw = {"request_timeout": 1.0} if fault == "hang" else {}
    with pytest.raises(ServerError, match="every server stopped answering") as e:
        _run(tok, [a, b], out, convs, requests_per_server=1, **kw)
    assert a.url in str(e.value) and b.url in str(e.value)
    assert {"reset": "connection", 503: "http 503", "hang": "no answer within 1 s"}[fault] in str(e.value).lower()
    written = [r["id"] for r in _records(out)]
    assert len(written) == len(set(written)) == 4  # the answered turns were written, once
    a.fault = b.fault = None  # the servers are back
    _run(tok, [a, b], out, convs)
    ids = [r["id"] for r in _records(out)]
    assert sorted(ids) == sorted(c.id for c in convs)


def test_an_answer_that_arrives_with_the_last_servers_failure_is_written(tok, serve, tmp_path, monkeypatch):
    """The last server answers one conversation's only turn and fails another's in the same wait; the failure is
    taken first (the order `wait` hands them back in is arbitrary). The answered conversation is complete, so
    its record is written before the run stops: no server is needed to learn that nothing is left to ask."""

    def wait_failures_first(futures, return_when):
        done, _ = concurrent.futures.wait(futures)  # both answers in hand
        return sorted(done, key=lambda f: f.exception() is None), set()

    monkeypatch.setattr("eagle.regenerate.server.wait", wait_failures_first)
    a = serve()
    a.fault, a.fail_after = 503, 1
    out = tmp_path / "r.jsonl"
    with pytest.raises(ServerError, match="every server stopped answering"):
        _run(tok, [a], out, _conversations(2), requests_per_server=2)
    assert len(_records(out)) == a.answered == 1
    a.fault = None
    _run(tok, [a], out, _conversations(2))
    assert sorted(r["id"] for r in _records(out)) == ["c0", "c1"]


@pytest.mark.parametrize("status", [400, 500])
def test_a_refused_request_stops_at_once_naming_the_server_and_its_answer(tok, serve, tmp_path, status):
    a = serve()
    a.fault, a.fault_body = status, '{"error": "This model\'s maximum context length is 64 tokens"}'
    with pytest.raises(ServerError) as e:
        _run(tok, [a], tmp_path / "r.jsonl", requests_per_server=1)
    message = str(e.value)
    assert f"{a.url}/v1/completions answered HTTP {status}" in message and "maximum context length" in message
    assert "conversation 'a'" in message
    assert len(a.completions()) == 1  # not retried


def test_start_refusals_name_the_server_before_anything_is_written(tok, serve, tmp_path):
    out = tmp_path / "r.jsonl"
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match=f"{dead} cannot be reached"):
        _run(tok, [serve(), dead], out)
    with pytest.raises(ServerError, match=r"serves 2 models \(m1, m2\); name the target's with regenerate.model"):
        _run(tok, [serve(models=("m1", "m2"))], out)
    with pytest.raises(ServerError, match="does not serve regenerate.model='m3'; it serves: m1, m2"):
        _run(tok, [serve(models=("m1", "m2"))], out, model="m3")
    with pytest.raises(ServerError, match="serve different models"):
        _run(tok, [serve(models=("m1",)), serve(models=("m2",))], out)
    with pytest.raises(ServerError, match="takes no top_k"):
        _run(tok, [serve(owned_by="someone")], out, temperature=1.0, top_k=4)
    assert not out.exists() and not (tmp_path / "r.jsonl.meta.json").exists()
    _run(tok, [serve(models=("m1", "m2"))], out, model="m2")  # a named model among several
    assert recover_output(out) == {"a", "b", "c"}


def test_resume_refuses_another_served_model_or_backend(tok, serve, tmp_path, tiny_qwen2):
    out = tmp_path / "r.jsonl"
    _run(tok, [serve(models=("m1",))], out, CONVS[:1])
    with pytest.raises(DataError, match=r"served_model: 'm1' -> 'm2'"):
        _run(tok, [serve(models=("m2",))], out)
    _run(tok, [serve(models=("m1",)), serve(models=("m1",))], out)  # other servers, same model: resumes
    assert recover_output(out) == {"a", "b", "c"}
    model, _ = tiny_qwen2
    with pytest.raises(DataError, match=r"backend: 'server' -> 'local'"):
        regenerate(model, tok, CONVS, replace(CFG, backend="local"), out, target_fingerprint="t", progress=False)


def test_config_validation():
    def check(**kw):
        return validate(RootConfig(regenerate=RegenerateConfig(**kw)))

    check(backend="server", servers=["http://127.0.0.1:8000", "https://h/v1"])
    for kw, match in [
        ({"backend": "remote"}, "regenerate.backend"),
        ({"backend": "server"}, "needs regenerate.servers"),
        ({"backend": "server", "servers": ["127.0.0.1:8000"]}, "not an http"),
        ({"requests_per_server": 0}, "requests_per_server"),
        ({"request_timeout": 0}, "request_timeout"),
        ({"server_engine": "tgi"}, "server_engine"),
    ]:
        with pytest.raises(ConfigError, match=match):
            check(**kw)


def test_server_list_from_the_command_line():
    from eagle.cli.app import compose

    cfg = compose(
        [
            "regenerate.backend=server",
            "regenerate.servers=[http://127.0.0.1:8000,http://10.0.0.2:8001/v1]",
            "regenerate.requests_per_server=4",
        ]
    )
    assert cfg.regenerate.servers == ["http://127.0.0.1:8000", "http://10.0.0.2:8001/v1"]
    assert cfg.regenerate.requests_per_server == 4


def test_a_file_from_before_backends_counts_as_local(tok, serve, tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text("")
    (tmp_path / "r.jsonl.meta.json").write_text(json.dumps({"target": "t", "max_new_tokens": 8}))
    with pytest.raises(DataError, match=r"backend: 'local' -> 'server'"):
        _run(tok, [serve()], out)
