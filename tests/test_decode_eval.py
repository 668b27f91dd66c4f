"""Real acceptance while training (`train.eval_decode_every`, eagle/train/decode_eval.py) on tiny targets:
tau_real logged beside tau_sim at the right steps in every mode, equal to eagle-eval's decoder on the same
head and prompts, best/ by tau_real, training unchanged by the decoding, bad settings refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle.cli.app import compose
from eagle.config import ConfigError
from eagle.train import decode_eval
from eagle.train.trainer import format_result, train
from tests.support.train import Workspace, assert_same_weights, final_head

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Small decodes: two held-out prompts, eight new tokens each.
DECODE = dict(train__eval_decode_prompts=2, train__eval_decode_max_new_tokens=8, target__dtype="float32")


def _records(out: Path, split: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


@pytest.mark.parametrize("online", [False, True], ids=["offline", "online"])
def test_tau_real_is_logged_beside_tau_sim_at_its_steps_and_summarised(ws3, tmp_path, online, capsys):
    out = tmp_path / "out"
    result = train(ws3.cfg(out, online=online, steps=5, train__eval_decode_every=2, **DECODE))
    decoded = _records(out, "eval_decode")
    assert [r["step"] for r in decoded] == [2, 4, 5]  # every 2 steps, and the final head
    held = {r["step"]: r["tau_sim"] for r in _records(out, "eval")}
    for r in decoded:  # beside the held-out tau_sim of the same head (an evaluation added where none was due)
        assert r["tau_sim"] == held[r["step"]] and r["tau_gap"] == pytest.approx(r["tau_sim"] - r["tau_real"])
        assert r["tau_real"] >= 1.0 and r["verify_passes"] > 0 and 0.0 <= r["accept_d1"] <= 1.0
    summary = json.loads((out / "train_summary.json").read_text())["decode_eval"]
    assert summary["step"] == 5 and summary["tau_real"] == decoded[-1]["tau_real"] and summary["prompts"] == 2
    assert summary["gap_last"] == pytest.approx(decoded[-1]["tau_gap"])
    assert summary["gap_mean"] == pytest.approx(sum(r["tau_gap"] for r in decoded) / 3)
    assert summary["select_by"] == "tau_sim" and result.best_metric == max(held.values())  # today's default
    assert "[eval_decode 2] tau_real=" in capsys.readouterr().out
    assert "tau_real=" in format_result(result) and "tau_sim - tau_real: last" in format_result(result)


def test_stream_mode_logs_tau_real_as_the_others_do(ws3, tmp_path):
    """train.mode=stream (features from a fake vLLM server): the same decoding evaluations, the same figures
    as online mode, which computes the same features in the process."""
    from transformers import AutoModelForCausalLM

    from eagle.target.shard import load_placed_target
    from eagle.train.stream.launch import recipe_for
    from tests.support.stream_server import FakeStatesServer

    storage = tmp_path / "states"
    extra = dict(train__eval_decode_every=2, **DECODE)
    probe = ws3.cfg(tmp_path / "probe", online=True, train__mode="stream", train__stream__urls="[http://x]")
    target, _tok, info = load_placed_target(probe.target, device=torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(ws3.target, torch_dtype=torch.float32)
    server = FakeStatesServer(model, recipe_for(probe, info, target.config), storage)
    try:
        stream = dict(train__mode="stream", train__stream__urls=f"[{server.url}]", train__stream__storage_dir=storage)
        train(ws3.cfg(tmp_path / "stream", online=True, steps=4, **stream, **extra))
    finally:
        server.close()
    train(ws3.cfg(tmp_path / "online", online=True, steps=4, **extra))
    streamed, online = _records(tmp_path / "stream", "eval_decode"), _records(tmp_path / "online", "eval_decode")
    assert [r["step"] for r in streamed] == [2, 4]
    assert [r["tau_real"] for r in streamed] == pytest.approx([r["tau_real"] for r in online])


def test_tau_real_equals_eagle_evals_decoder_and_picks_best(ws3, tmp_path):
    """The final tau_real and acceptance by depth are what eagle-eval's decoder and metrics give for the
    saved head on the same prompts; select_by=tau_real keeps the step with the highest tau_real."""
    from eagle import spec_metrics as metrics
    from eagle.decode import SpeculativeGenerator
    from eagle.evaluate.runner import speculative_runner
    from eagle.export import load_draft
    from eagle.target.loading import load_target
    from eagle.train.batches import OfflineSplit

    out = tmp_path / "out"
    cfg = ws3.cfg(out, steps=4, train__eval_decode_every=2, train__select_by="tau_real", **DECODE)
    result = train(cfg)
    decoded = _records(out, "eval_decode")
    assert [r["step"] for r in decoded] == [2, 4]
    best = max(decoded, key=lambda r: r["tau_real"])  # the first of equals: a later tie does not replace it
    assert (result.best_step, result.best_metric) == (best["step"], best["tau_real"])
    assert_same_weights(out / "best", final_head(out, best["step"]))
    # eagle-eval's decoder on the step-4 head with the settings it would read (tree=auto decodes as dynamic)
    # (target.cpu_gemm=stock: the kernel the trainer's target computes with; eagle-eval may pick another)
    settings = ["target.dtype=float32", "target.cpu_gemm=stock", "decode.tree=dynamic", "decode.max_new_tokens=8"]
    eval_cfg = compose([*ws3.base, *settings])
    target, tok, _ = load_target(eval_cfg.target, stage="decode")
    head, _ = load_draft(str(final_head(out, 4)), target)
    run = speculative_runner(SpeculativeGenerator(target, head, tok, eval_cfg.decode), eval_cfg.decode)
    prompts = decode_eval.heldout_prompts(OfflineSplit(ws3.capture, "heldout"), 2)
    outs = [run(ids[None]) for ids in prompts]
    lengths = [n for o in outs for n in o["accept_lengths"]]
    assert decoded[-1]["tau_real"] == pytest.approx(metrics.tau(lengths, sum(o["target_forwards"] for o in outs)))
    depth = max(eval_cfg.decode.tree_depth, eval_cfg.decode.lookup_tokens)  # eagle-eval's for an EAGLE head
    rates = metrics.accept_rate_by_depth(lengths, depth)
    assert [decoded[-1][f"accept_d{d}"] for d in range(1, len(rates) + 1)] == pytest.approx(rates)
    assert f"accept_d{len(rates) + 1}" not in decoded[-1]


def test_select_by_tau_real_keeps_the_checkpoint_with_the_highest_tau_real(ws3, tmp_path, monkeypatch):
    """Scripted figures: the head of step 4 (tau_real 2.5) is best/, though later heads follow."""
    taus = iter([1.5, 2.5, 2.0])

    def scripted(*args, **kwargs):
        return {
            "tau_real": next(taus),
            "accept_rate_by_depth": [0.5],
            "verify_passes": 1,
            "new_tokens": 2,
            "seconds": 0,
        }

    monkeypatch.setattr(decode_eval, "measure", scripted)
    out = tmp_path / "out"
    result = train(ws3.cfg(out, steps=6, train__eval_decode_every=2, train__select_by="tau_real", **DECODE))
    assert (result.best_step, result.best_metric) == (4, 2.5)
    assert_same_weights(out / "best", final_head(out, 4))
    from eagle.algorithms.head_io import read_head_extra

    extra = read_head_extra(out / "best")
    assert extra["step"] == 4 and extra["select_by"] == "tau_real" and extra["eval_decode_tau_real"] == 2.5
    assert "best head:" in format_result(result) and "(tau_real=2.500 at step 4)" in format_result(result)


def test_decoding_leaves_the_training_random_streams_alone(tmp_path):
    """EAGLE-1 with feature noise draws random numbers every step; decoding every step (sampled, T=1)
    between them changes no loss and no weight."""
    ws = Workspace(tmp_path / "ws", "llama", "eagle1")
    noisy = dict(draft__feature_noise_std=0.1, train__eval_every=100, **DECODE)
    train(ws.cfg(tmp_path / "plain", steps=4, **noisy))
    train(ws.cfg(tmp_path / "decoded", steps=4, train__eval_decode_every=1, decode__temperature=1.0, **noisy))
    assert len(_records(tmp_path / "decoded", "eval_decode")) == 4

    def losses(out: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if "loss" in k or "acc" in k} for r in _records(out, "train")]

    assert losses(tmp_path / "plain") == losses(tmp_path / "decoded")
    assert_same_weights(final_head(tmp_path / "plain", 4), final_head(tmp_path / "decoded", 4))


def test_measure_restores_the_random_streams_and_the_heads_mode(ws3, monkeypatch):
    from eagle.target.loading import load_target
    from tests.support.decode import random_head

    target, tok, _ = load_target(compose(ws3.base).target)
    head = random_head(target, "eagle3", draft_vocab_size=128).train()
    real_generate = decode_eval.SpeculativeGenerator.generate

    def drawing(self, ids):  # a decoder that also drew from the global streams
        torch.rand(3)
        return real_generate(self, ids)

    monkeypatch.setattr(decode_eval.SpeculativeGenerator, "generate", drawing)
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    cfg = decode_eval.decode_settings(compose(ws3.base).decode, 4)
    measured = decode_eval.measure(target, head, tok, [torch.tensor([1, 5, 9])], cfg, "cpu")
    assert torch.equal(torch.rand(4), expected) and head.training and measured["verify_passes"] > 0


def test_no_held_out_split_is_refused_at_setup(ws3, tmp_path):
    cfg = ws3.cfg(tmp_path / "out", online=True, steps=2, train__eval_decode_every=1, data__heldout_fraction=0.0)
    with pytest.raises(ConfigError, match=r"train.eval_decode_every=1 decodes held-out prompts.*no held-out split"):
        train(cfg)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.eval_decode_every=-1"], r"train.eval_decode_every=-1 must be >= 0 \(0 or null = off\)"),
        (["train.select_by=tau_real"], r"train.select_by=tau_real .* train.eval_decode_every=N"),
        (["train.select_by=tau_real", "train.eval_decode_every=0"], r"only train.eval_decode_every=N measures"),
        (["train.select_by=loss"], r"train.select_by"),
        (["train.eval_decode_every=5", "train.eval_decode_prompts=0"], r"train.eval_decode_prompts=0 must be > 0"),
        (["train.eval_decode_max_new_tokens=0"], r"train.eval_decode_max_new_tokens=0 must be > 0"),
        (["train.eval_decode_every=5", "target.shard=fsdp"], r"whole target in one process; target.shard=fsdp"),
    ],
)
def test_bad_eval_decode_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose(overrides)


def test_off_by_default_and_null_is_off():
    t = compose([]).train
    assert (t.eval_decode_every, t.select_by) == (0, "tau_sim")
    assert compose(["train.eval_decode_every=null"]).train.eval_decode_every is None


def test_prompts_are_the_tokens_before_the_first_trained_token():
    class Split:
        items = [
            {"input_ids": torch.arange(6), "loss_mask": torch.tensor([0, 0, 0, 1, 1, 0])},
            {"input_ids": torch.arange(4), "loss_mask": torch.tensor([1, 1, 0, 0])},  # no prompt: skipped
            {"input_ids": torch.arange(5), "loss_mask": torch.tensor([0, 1, 1, 1, 1])},
            {"input_ids": torch.arange(3), "loss_mask": torch.tensor([0, 0, 1])},
        ]

        def __len__(self) -> int:
            return len(self.items)

        def item(self, i: int) -> dict:
            return self.items[i]

    prompts = decode_eval.heldout_prompts(Split(), 2)
    assert [p.tolist() for p in prompts] == [[0, 1, 2], [0]]


@pytest.mark.slow  # two processes under accelerate launch
def test_two_processes_decode_on_rank_0_and_agree_on_best(ws3, tmp_path):
    """DDP over gloo: rank 0 decodes while rank 1 waits; both continue, and best/ is the tau_real best."""
    import subprocess

    from tests.support.cli import BIN, cli_env
    from tests.support.train import train_overrides

    out = tmp_path / "two"
    extra = dict(train__eval_decode_every=2, train__select_by="tau_real", **DECODE)
    launch = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    launch += ["--mixed_precision", "no", "--dynamo_backend", "no", "-m", "eagle.cli.train"]
    proc = subprocess.run(
        [*launch, *ws3.base, *train_overrides(out, ws3.capture, 4, **extra)],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    decoded = _records(out, "eval_decode")
    assert [r["step"] for r in decoded] == [2, 4] and "real acceptance (2 held-out prompts)" in proc.stdout
    best = max(decoded, key=lambda r: r["tau_real"])
    summary = json.loads((out / "train_summary.json").read_text())
    assert (summary["best_step"], summary["best_metric"]) == (best["step"], best["tau_real"])
    assert (out / "checkpoints" / "step-0000004" / "rng" / "rank-00001.pt").is_file()  # really two ranks
