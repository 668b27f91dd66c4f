"""train.mode=stream against FAKE vLLM servers (tests/support/stream_server.py): the same training as offline
from a capture, servers killed mid-run, every server gone, unservable samples, servers started otherwise,
resume after a crash, the disk bound, and the launcher's command. The real vLLM: tests/engines/check_vllm_stream.sh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle.capture.reader import collate
from eagle.cli.app import compose
from eagle.config import RootConfig
from eagle.errors import EagleError, ServerError, TrainingError
from eagle.target.shard import load_placed_target
from eagle.train.batches import BatchStream, ConversationSplit
from eagle.train.stream.client import StreamRecipe
from eagle.train.stream.launch import recipe_for, server_command
from eagle.train.stream.transport import SharedFileTransport, TransportGone
from tests.support.cli import cli_env
from tests.support.servers import free_port
from tests.support.stream_server import FakeStatesServer
from tests.support.train import SGD_STEP, assert_same_weights, final_head, head_weights, train_overrides

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _stream_overrides(ws, out: Path, urls: list[str], storage: Path, steps: int = 4, **extra: object) -> list[str]:
    """ws's small-run training overrides in train.mode=stream against `urls`."""
    stream = {
        "train__mode": "stream",
        "train__stream__urls": "[" + ",".join(urls) + "]",
        "train__stream__storage_dir": storage,
        "train__stream__prefetch": 4,
        "train__stream__requests_per_server": 2,
        "train__stream__request_timeout": 20,
        "train__stream__wait_s": 1,
    }
    return ws.base + train_overrides(out, None, steps, **{**stream, **extra})


def _stream_cfg(ws, out: Path, urls: list[str], storage: Path, steps: int = 4, **extra: object) -> RootConfig:
    return compose(_stream_overrides(ws, out, urls, storage, steps, **extra))


@pytest.fixture(scope="module")
def served(ws3, tmp_path_factory):
    """(the recipe a default stream run of ws3 needs, the tiny target, a storage folder)."""
    cfg = _stream_cfg(ws3, tmp_path_factory.mktemp("probe"), ["http://x"], Path("/tmp/unused"))
    target, _tok, info = load_placed_target(cfg.target, device=torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(ws3.target, torch_dtype=torch.float32)
    return recipe_for(cfg, info, target.config), model


@pytest.fixture
def servers(served, tmp_path):
    """start(n) -> n fake servers writing into tmp_path/states; all closed afterwards."""
    recipe, model = served
    started: list[FakeStatesServer] = []

    def start(n: int = 2, **kw) -> list[FakeStatesServer]:
        for _ in range(n):
            started.append(FakeStatesServer(model, recipe, tmp_path / "states", **kw))
        return started[-n:]

    yield start
    for s in started:
        s.close()


def _train_losses(out: Path) -> list[float]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if r["split"] == "train"]


def _summary(out: Path) -> dict:
    return json.loads((out / "train_summary.json").read_text())


# --------------------------------------------------------------------------------------- same as offline
def test_stream_trains_what_offline_trains_from_a_capture(ws3, servers, tmp_path):
    """Same conversations, seed and steps: the same losses step by step and held-out accuracy as offline
    training on the workspace's float32 capture; states files are all deleted, at most the in-flight held."""
    from eagle.train.trainer import train

    a, b = servers(2)
    storage = tmp_path / "states"
    off = train(ws3.cfg(tmp_path / "off", steps=4))
    on = train(_stream_cfg(ws3, tmp_path / "on", [a.url, b.url], storage, steps=4))
    assert _train_losses(tmp_path / "on") == pytest.approx(_train_losses(tmp_path / "off"), rel=1e-5)
    assert on.eval_metrics["acc_0"] == pytest.approx(off.eval_metrics["acc_0"], abs=1e-6)
    assert sum(on.stream["served"].values()) > 0 and len(on.stream["served"]) == 2
    assert on.stream["unservable"] == {} and on.stream["requeued"] == 0
    assert list(storage.glob("*.safetensors")) == [] and list(storage.glob("*.lock")) == []
    # prefetch 4 + a batch's rows (4) taken at once; each server writes one file per request in flight
    assert max(a.most_files, b.most_files) <= 4 + 4
    # Nothing requested past max_steps: 4 steps x 4 conversations, plus the 3 held-out evaluations' 2 each.
    assert sum(on.stream["served"].values()) == 4 * 4 + 3 * 2


def test_stream_with_sgd_gives_the_offline_update(ws3, servers, tmp_path):
    from eagle.train.trainer import train
    from tests.support.train import assert_same_update

    (a,) = servers(1)
    train(ws3.cfg(tmp_path / "off", steps=1, **SGD_STEP))
    train(_stream_cfg(ws3, tmp_path / "on", [a.url], tmp_path / "states", steps=1, **SGD_STEP))
    assert_same_update(head_weights(final_head(tmp_path / "off", 1)), head_weights(final_head(tmp_path / "on", 1)))


def test_upcoming_is_the_order_next_step_takes(ws3):
    """The prefetch order is the trainer's: BatchStream.upcoming(n) lists what next_step then takes."""

    class Conv:
        def __init__(self, i: int) -> None:
            self.id, self.input_ids, self.loss_mask = f"c{i}", [1 + i % 7] * (3 + i % 5), [1] * (3 + i % 5)

    split = ConversationSplit([Conv(i) for i in range(10)], shard_size=3)
    stream = BatchStream(split, seed=1, batch_size=4, grad_accum=2, max_length=64, pad_id=0)
    ahead = stream.upcoming(12)  # three steps, across the epoch's end (10 items: 2 full batches an epoch)
    taken: list[str] = []
    for _ in range(3):
        micro, ids = stream.next_step()
        taken += ids
    assert [f"c{i}" for i in ahead] == taken
    assert collate([split.item(0)])["ids"] == ["c0"]


# --------------------------------------------------------------------------------------- faults
def test_a_server_killed_mid_run_loses_nothing(ws3, servers, tmp_path):
    """A server whose connections break after 3 answers: its samples go to the other; same losses."""
    from eagle.train.trainer import format_result, train

    a, b = servers(2)
    straight = train(_stream_cfg(ws3, tmp_path / "ok", [a.url, b.url], tmp_path / "states", steps=4))
    a.fault, a.fail_after, a.answered = "reset", 3, 0
    faulty = train(_stream_cfg(ws3, tmp_path / "bad", [a.url, b.url], tmp_path / "states", steps=4))
    assert _train_losses(tmp_path / "bad") == pytest.approx(_train_losses(tmp_path / "ok"), rel=1e-6)
    assert faulty.stream["requeued"] >= 1 and a.url in faulty.stream["dropped_servers"]
    assert faulty.stream["served"][a.url] == 1  # its 3 answers: the 2 start-up probes, then 1 sample
    assert_same_weights(final_head(tmp_path / "ok", 4), final_head(tmp_path / "bad", 4))
    assert "asked again elsewhere" in format_result(faulty) and straight.stream["requeued"] == 0


def test_every_server_gone_stops_with_a_checkpoint_that_resumes(ws3, servers, tmp_path):
    """Both servers die after step 3: backoff (train.stream.wait_s), a TrainingError naming both
    URLs, a checkpoint of the state before the failed step; new servers, the same command: the straight run's head."""
    from eagle.train.trainer import TrainHooks, train

    storage = tmp_path / "states"
    a, b = servers(2)
    train(_stream_cfg(ws3, tmp_path / "straight", [a.url, b.url], storage, steps=5))
    c, d = servers(2)

    def both_die(step: int) -> None:
        if step == 3:
            c.kill()
            d.kill()

    out = tmp_path / "cut"
    # prefetch 0: step 4's features are asked for only when step 4 needs them, after both servers died
    cut = _stream_cfg(ws3, out, [c.url, d.url], storage, steps=5, train__save_every=100)
    cut.train.stream.prefetch = 0
    with pytest.raises(TrainingError, match="every server of train.stream.urls") as err:
        train(cut, TrainHooks(on_step_end=both_die))
    message = str(err.value)
    assert c.url in message and d.url in message and "resume" in message
    saved = sorted((out / "checkpoints").glob("step-*"))
    assert saved and saved[-1].name == "step-0000003"
    e, f = servers(2)
    resumed = train(_stream_cfg(ws3, out, [e.url, f.url], storage, steps=5))
    assert resumed.step == 5
    assert_same_weights(final_head(tmp_path / "straight", 5), final_head(out, 5))


def test_every_server_gone_during_an_evaluation_saves_the_state_after_the_step(ws3, servers, tmp_path):
    """The servers break on the held-out conversations (the untrained head's evaluation, before step 1): the run
    stops naming them with a checkpoint at step 0, and resumes to the straight run's head."""
    from eagle.data.dataset import build_splits
    from eagle.target.loading import load_tokenizer
    from eagle.train.trainer import train

    storage = tmp_path / "states"
    a, b = servers(2)
    train(_stream_cfg(ws3, tmp_path / "straight", [a.url, b.url], storage, steps=3))
    cfg = _stream_cfg(ws3, tmp_path / "cut", [a.url, b.url], storage, steps=3)
    held = {tuple(c.input_ids) for c in build_splits(cfg.data, load_tokenizer(cfg.target)).heldout}
    c, d = servers(2)
    for s in (c, d):
        s.fatal_prompts = held
    with pytest.raises(TrainingError, match="after step 0 is saved"):
        train(_stream_cfg(ws3, tmp_path / "cut", [c.url, d.url], storage, steps=3))
    assert (tmp_path / "cut" / "checkpoints" / "step-0000000").is_dir()
    train(_stream_cfg(ws3, tmp_path / "cut", [a.url, b.url], storage, steps=3))
    assert_same_weights(final_head(tmp_path / "straight", 3), final_head(tmp_path / "cut", 3))


def test_a_sample_that_breaks_every_server_it_meets_is_unservable_not_retried_forever(ws3, servers, tmp_path):
    """The servers' connections break on one conversation (each server lives on): after MAX_SAMPLE_DROPS broken
    requests it is unservable, reported, and the run ends."""
    from eagle.data.dataset import build_splits
    from eagle.target.loading import load_tokenizer
    from eagle.train.stream.pool import MAX_SAMPLE_DROPS
    from eagle.train.trainer import train

    a, b = servers(2)
    cfg = _stream_cfg(ws3, tmp_path / "o", [a.url, b.url], tmp_path / "states", steps=6)
    poison = build_splits(cfg.data, load_tokenizer(cfg.target)).train[-1]
    for s in (a, b):
        s.reset_prompts = {tuple(poison.input_ids)}
    result = train(cfg)
    assert result.step == 6
    assert f"{MAX_SAMPLE_DROPS} server(s) stopped answering" in result.stream["unservable"][str(poison.id)]


def test_a_crash_resumes_with_the_same_sample_order(ws3, servers, tmp_path):
    """Killed after step 3 (checkpoint at 2): the resumed run re-requests the features and ends with the
    straight run's head and losses."""
    from eagle.train.trainer import TrainHooks, train

    a, b = servers(2)
    urls, storage = [a.url, b.url], tmp_path / "states"
    train(_stream_cfg(ws3, tmp_path / "a", urls, storage, steps=5))

    def crash(step: int) -> None:
        if step == 3:
            raise KeyboardInterrupt  # no checkpoint, no summary: as a kill -9 leaves it

    with pytest.raises(KeyboardInterrupt):
        train(_stream_cfg(ws3, tmp_path / "b", urls, storage, steps=5), TrainHooks(on_step_end=crash))
    train(_stream_cfg(ws3, tmp_path / "b", urls, storage, steps=5))
    assert _train_losses(tmp_path / "b") == _train_losses(tmp_path / "a")
    assert_same_weights(final_head(tmp_path / "a", 5), final_head(tmp_path / "b", 5))


@pytest.mark.slow
def test_a_trainer_killed_with_sigkill_resumes_with_the_same_sample_order(ws3, servers, tmp_path):
    """eagle-train in a subprocess, SIGKILLed mid-run (its requests in flight and states files abandoned); the same
    command again: the losses and head of a run never killed (the features are simply asked for again)."""
    from eagle.train.trainer import train

    a, b = servers(2)
    for s in (a, b):
        s.delay = 0.05  # slow enough that the kill lands mid-run
    urls, storage = [a.url, b.url], tmp_path / "states"
    train(_stream_cfg(ws3, tmp_path / "straight", urls, storage, steps=10))
    args = _stream_overrides(ws3, tmp_path / "killed", urls, storage, steps=10)
    cmd = [sys.executable, "-m", "eagle.cli.train", *args]
    metrics = tmp_path / "killed" / "metrics.jsonl"
    with open(tmp_path / "first.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=cli_env(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()] if metrics.is_file() else []
            if max(steps, default=0) >= 5:
                proc.kill()
                break
            time.sleep(0.05)
        proc.wait(timeout=60)
    assert proc.returncode == -9, (tmp_path / "first.log").read_text()[-3000:]
    assert not (tmp_path / "killed" / "train_summary.json").exists()
    done = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "resumed from" in done.stdout + done.stderr
    assert _train_losses(tmp_path / "killed") == _train_losses(tmp_path / "straight")
    assert_same_weights(final_head(tmp_path / "straight", 10), final_head(tmp_path / "killed", 10))


def test_an_unservable_sample_is_counted_and_reported(ws3, servers, served, tmp_path):
    """A sample every server refuses (HTTP 400) trains nothing and is named in the summary, never dropped
    silently; the run goes on."""
    from eagle.train.trainer import format_result, train

    cfg = _stream_cfg(ws3, tmp_path / "o", ["http://x"], tmp_path / "states")
    from eagle.data.dataset import build_splits
    from eagle.target.loading import load_tokenizer

    splits = build_splits(cfg.data, load_tokenizer(cfg.target))
    refused = splits.train[-1]  # the start-up probe is cut from the first
    a, b = servers(2)
    for s in (a, b):
        s.refuse_prompts = {tuple(refused.input_ids)}
    result = train(_stream_cfg(ws3, tmp_path / "o", [a.url, b.url], tmp_path / "states", steps=6))
    unservable = _summary(tmp_path / "o")["stream"]["unservable"]
    assert unservable and all("maximum context length" in why for why in unservable.values())
    assert list(unservable) == [str(refused.id)]
    assert "could not be served" in format_result(result)
    assert (tmp_path / "o" / "stream_unservable.jsonl").is_file()


# --------------------------------------------------------------------------------------- refused servers
@pytest.mark.parametrize(
    "setup, match",
    [
        (lambda s, r: setattr(s, "served_name", r.served_name.replace("float32", "bfloat16")), "dtype: bfloat16 there"),
        (lambda s, r: setattr(s, "served_name", "SmolLM2"), "none was started by eagle's launcher"),
        (lambda s, r: setattr(s, "fault", "no_states"), "does not extract hidden states"),
        (lambda s, r: setattr(s, "fault", "wrong_tokens"), "other token ids than were sent"),
        (lambda s, r: setattr(s, "prefix_caching", True), "prefix caching is on"),
        (lambda s, r: setattr(s, "wrong_layers", True), "differs from this target's"),
    ],
    ids=["dtype", "not-ours", "no-extraction", "tokens", "prefix-caching", "layers"],
)
def test_a_server_started_otherwise_is_refused(ws3, servers, served, tmp_path, setup, match):
    from eagle.train.trainer import train

    good, bad = servers(2)
    setup(bad, served[0])
    with pytest.raises(ServerError, match=match) as err:
        train(_stream_cfg(ws3, tmp_path / "o", [good.url, bad.url], tmp_path / "states"))
    assert bad.url in str(err.value) and isinstance(err.value, EagleError)
    assert not (tmp_path / "o" / "checkpoints").exists()


def test_an_unreachable_url_is_refused_before_training(ws3, servers, tmp_path):
    from eagle.train.trainer import train

    (good,) = servers(1)
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    with pytest.raises(ServerError, match="cannot be used") as err:
        train(_stream_cfg(ws3, tmp_path / "o", [good.url, url], tmp_path / "states"))
    assert url in str(err.value)


def test_the_transport_reads_and_deletes_only_inside_its_folder(tmp_path):
    root, outside = tmp_path / "states", tmp_path / "precious.safetensors"
    root.mkdir()
    outside.write_bytes(b"keep me")
    transport = SharedFileTransport(root)
    with pytest.raises(TransportGone, match="outside train.stream.storage_dir"):
        transport.fetch(str(outside))
    with pytest.raises(TransportGone):
        transport.release(str(root / ".." / "precious.safetensors"))
    assert outside.read_bytes() == b"keep me"
    with pytest.raises(TransportGone, match="no file is there"):
        transport.fetch(str(root / "missing.safetensors"))
    # A killed trainer's leftovers go at the next start; a file of a request that may still be live stays.
    old, fresh = root / "old.safetensors", root / "fresh.safetensors"
    for f in (old, fresh, root / "old.safetensors.lock"):
        f.write_bytes(b"x")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    assert transport.sweep(older_than_s=600) == 1
    assert sorted(f.name for f in root.iterdir()) == ["fresh.safetensors"]


# --------------------------------------------------------------------------------------- launcher
def test_the_launcher_starts_what_the_trainer_checks(ws3, served, tmp_path):
    """The server command carries the recipe's layers, dtype, max_model_len, prefix caching off, eagle's connector
    and the served name the trainer asks for."""
    recipe: StreamRecipe = served[0]
    cfg = _stream_cfg(ws3, tmp_path / "o", ["http://x"], tmp_path / "states", train__stream__port=8123)
    argv = server_command(cfg, recipe, "/venv/bin/python")
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert "--no-enable-prefix-caching" in argv
    assert argv[argv.index("--served-model-name") + 1] == recipe.served_name
    assert argv[argv.index("--max-model-len") + 1] == str(cfg.train.max_length + 1)
    assert argv[argv.index("--dtype") + 1] == recipe.dtype == "float32"
    assert argv[argv.index("--port") + 1] == "8123"
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == recipe.layer_ids
    assert recipe.layer_ids == sorted({*recipe.aux_layer_ids, recipe.num_layers})
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "CpuHiddenStatesConnector"
    assert kv["kv_connector_module_path"] == "eagle_vllm_connector"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str((tmp_path / "states").resolve())
    assert flags["--model"] == recipe.model
    cfg.train.stream.engine_args = {"dtype": "bfloat16"}
    with pytest.raises(EagleError, match="may not set dtype"):
        server_command(cfg, recipe, "py")


def test_a_404_mid_run_stops_the_run_instead_of_masking_samples(ws3, servers, tmp_path):
    """Only 400 / 413 / 422 refuse a sample; a server that no longer serves the recipe's name (404) is an error
    naming it, not a stream of masked samples."""
    from eagle.train.trainer import TrainHooks, train

    a, b = servers(2)

    def rename(step: int) -> None:
        if step == 1:
            a.served_name = b.served_name = "something-else"

    cfg = _stream_cfg(ws3, tmp_path / "o", [a.url, b.url], tmp_path / "states")
    cfg.train.stream.prefetch = 0
    with pytest.raises(ServerError, match="HTTP 404"):
        train(cfg, TrainHooks(on_step_end=rename))


def test_serve_target_prints_the_command_the_trainer_accepts(ws3, served, tmp_path):
    """`python -m eagle.cli.serve_target` with the trainer's overrides prints a server command whose served
    name is the one the trainer checks for: the servers match the trainer by construction."""
    recipe: StreamRecipe = served[0]
    args = [*ws3.base, f"output_dir={tmp_path / 'serve'}", f"capture.vllm_python={sys.executable}"]
    done = subprocess.run(
        [sys.executable, "-m", "eagle.cli.serve_target", *args],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if "vllm.entrypoints.openai.api_server" in x)
    assert f"--served-model-name {recipe.served_name}" in line and "--no-enable-prefix-caching" in line
    assert "PYTHONPATH=" in line and "eagle_vllm_connector" in line


@pytest.mark.slow
def test_two_processes_stop_together_when_the_servers_die(ws3, servers, tmp_path):
    """DDP over gloo, the one server killed after a few answers: the run stops with the message and a
    checkpoint both ranks saved. (Each process has its own prefetch, so one may run out of samples a step
    before the other; the trainer all-reduces a flag per micro-batch so they stop together. Here both
    usually run out at the same step, so this checks the clean stop, not that timing.)"""
    import threading

    from tests.support.cli import BIN

    (server,) = servers(1)
    server.delay = 0.05

    def kill_after_answers() -> None:
        deadline = time.monotonic() + 240
        while server.answered < 14 and time.monotonic() < deadline:
            time.sleep(0.02)
        server.kill()

    threading.Thread(target=kill_after_answers, daemon=True).start()
    out = tmp_path / "two"
    args = _stream_overrides(ws3, out, [server.url], tmp_path / "states", steps=20, train__save_every=100)
    launch = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    launch += ["--mixed_precision", "no", "--dynamo_backend", "no", "-m", "eagle.cli.train"]
    done = subprocess.run([*launch, *args], env=cli_env(), capture_output=True, text=True, timeout=300)
    text = done.stdout + done.stderr
    assert done.returncode != 0 and "every server of train.stream.urls" in text, text[-3000:]
    assert "is saved in" in text and "resume" in text, text[-3000:]
    saved = sorted((out / "checkpoints").glob("step-*"))
    assert saved and (saved[-1] / "rng" / "rank-00001.pt").is_file()  # both ranks saved the same step
