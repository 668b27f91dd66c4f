"""Resume only what it is: a checkpoint, capture or regenerated file continues only under settings
that keep its trajectory; other settings are refused naming each key with its old and new value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle.cli.app import compose
from eagle.errors import CaptureError, CheckpointError, DataError
from eagle.train.resume import RUN_CONFIG, compare, follow_schedule, run_record
from eagle.train.schedule import build_optimizer, build_scheduler, lr_factor
from tests.support.capture import capture, make_convs
from tests.support.data import CONVS
from tests.support.train import assert_same_optimizer_state, assert_same_weights, final_head
from tests.tiny_models import make_model


# --------------------------------------------------------------------------------------- classification
def _record(tmp_path: Path, *overrides: str):
    data = tmp_path / "capture"
    data.mkdir(exist_ok=True)
    return run_record(compose([f"output_dir={tmp_path / 'o'}", f"train.data_dir={data}", "device=cpu", *overrides]))


@pytest.mark.parametrize(
    "override",
    [
        "train.lr=1e-3",
        "train.batch_size=8",
        "train.grad_accum=2",
        "train.max_length=512",
        "train.ttt_steps=3",
        "train.ttt_decay=0.5",
        "train.warmup_steps=7",
        "train.schedule=linear",
        "train.min_lr_ratio=0.5",
        "train.weight_decay=0.1",
        "train.betas=[0.9,0.99]",
        "train.grad_clip=1.0",
        "train.mixed_precision=bf16",
        "train.seed=1",
        "train.mode=online",
        "draft.algorithm=eagle1",
        "draft.draft_vocab_size=64",
        "draft.feature_noise_std=0.1",
        "draft.aux_layer_ids=[1,2,3]",
        "target.path=/elsewhere",
        "draft.fc_norm=true",
        "draft.norm_output=true",
        "train.group_by_length=true",
    ],
)
def test_trajectory_keys_are_refused(tmp_path, override):
    changes = compare(_record(tmp_path), _record(tmp_path, override))
    key = override.split("=", 1)[0]
    assert [(c.key, c.kind) for c in changes if c.key == key] == [(key, "trajectory")], changes


@pytest.mark.parametrize(
    "override",
    [
        "train.max_steps=5000",
        "train.eval_every=7",
        "train.eval_batches=2",
        "train.save_every=9",
        "train.log_every=3",
        "train.keep_checkpoints=5",
        "train.nonfinite=stop",
        "train.resume=true",
        "data.max_conversations=10",
        "capture.shard_size=7",  # offline: the data come from train.data_dir
    ],
)
def test_free_keys_are_allowed(tmp_path, override):
    changes = compare(_record(tmp_path), _record(tmp_path, override))
    assert changes and all(c.kind == "free" for c in changes), changes


@pytest.mark.parametrize(
    "override",
    [
        "logger=wandb",
        "decode.tree_depth=2",
        "eval.max_prompts=3",
        "regenerate.max_new_tokens=9",
        "export.dtype=float32",
    ],
)
def test_other_stages_settings_are_ignored(tmp_path, override):
    assert compare(_record(tmp_path), _record(tmp_path, override)) == []


def test_online_runs_compare_their_data_and_not_the_capture_path(tmp_path):
    online = ("train.mode=online",)
    changes = compare(_record(tmp_path, *online), _record(tmp_path, *online, "data.max_length=99"))
    assert [(c.key, c.kind) for c in changes] == [("data.max_length", "trajectory")]
    other = tmp_path / "other-capture"
    other.mkdir()
    changes = compare(_record(tmp_path, *online), _record(tmp_path, *online, f"train.data_dir={other}"))
    assert [(c.key, c.kind) for c in changes] == [("train.data_dir", "free")]


def test_relative_and_absolute_paths_are_the_same(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "capture").mkdir()
    a = run_record(compose(["train.data_dir=capture", "device=cpu"]))
    b = run_record(compose([f"train.data_dir={tmp_path / 'capture'}", "device=cpu"]))
    assert compare(a, b) == []


def test_auto_dtype_compares_as_the_dtype_it_resolves_to(tmp_path):
    pytest.importorskip("eagle.target.precision")
    # Training on CPU resolves target.dtype=auto to float32.
    assert compare(_record(tmp_path, "target.dtype=float32"), _record(tmp_path, "target.dtype=auto")) == []


def test_auto_mixed_precision_compares_as_what_it_resolves_to(tmp_path):
    from eagle.target.precision import resolve_mixed_precision

    resolved = resolve_mixed_precision("auto", "cpu")
    assert (
        compare(_record(tmp_path, f"train.mixed_precision={resolved}"), _record(tmp_path, "train.mixed_precision=auto"))
        == []
    )


def test_keys_an_older_record_lacks_compare_with_their_default(tmp_path):
    old = _record(tmp_path)
    for key in ("train.group_by_length", "train.mixed_precision"):
        del old["config"][key]  # written before these options existed
    old["config"]["train.removed_option"] = 3  # an option since removed: skipped
    assert compare(old, _record(tmp_path)) == []
    changes = compare(old, _record(tmp_path, "train.group_by_length=true"))
    assert [(c.key, c.old, c.new, c.kind) for c in changes] == [("train.group_by_length", False, True, "trajectory")]
    assert "older eagle" in changes[0].note


def test_follow_schedule_applies_a_new_max_steps_from_the_next_update():
    cfg4 = compose(["train.max_steps=4", "train.warmup_steps=1", "train.schedule=cosine"]).train
    cfg8 = compose(["train.max_steps=8", "train.warmup_steps=1", "train.schedule=cosine"]).train
    param = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([param], cfg4)
    sched = build_scheduler(opt, cfg4)
    for _ in range(2):
        opt.step()
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()

    def restored(cfg):
        p = torch.nn.Parameter(torch.zeros(2))
        o = build_optimizer([p], cfg)
        s = build_scheduler(o, cfg)
        o.load_state_dict(saved_opt)
        s.load_state_dict(saved_sched)
        follow_schedule(o, s)
        return o.param_groups[0]["lr"]

    base = cfg4.lr
    # Same max_steps: exactly the saved lr (bit for bit); raised: the new schedule's lr for update 3.
    assert (
        restored(cfg4) == saved_opt["param_groups"][0]["lr"] == base * lr_factor(2, 1, 4, "cosine", cfg4.min_lr_ratio)
    )
    assert restored(cfg8) == base * lr_factor(2, 1, 8, "cosine", cfg8.min_lr_ratio)
    assert restored(cfg8) > restored(cfg4)


# --------------------------------------------------------------------------------------- training
# Training runs of 2-4 steps each, ~30 s together with the workspace: marked slow (make test runs them).
@pytest.mark.slow
def test_resume_with_a_changed_lr_is_refused_naming_the_key(ws3, tmp_path):
    from eagle.train.trainer import train

    out = tmp_path / "o"
    train(ws3.cfg(out, steps=2))
    record = json.loads((out / "checkpoints" / "step-0000002" / RUN_CONFIG).read_text())
    assert record["config"]["train.lr"] == 3e-3
    with pytest.raises(CheckpointError) as e:
        train(ws3.cfg(out, steps=4, train__lr=1e-3, train__ttt_steps=2))
    message = str(e.value)
    assert "train.lr: 0.003 -> 0.001" in message and "train.ttt_steps: 3 -> 2" in message
    assert "train.max_steps" not in message  # allowed: not among the refused keys
    assert "new output_dir" in message and "train.resume=false" in message
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-0000002"]  # nothing trained or written


@pytest.mark.slow
def test_raised_max_steps_continues_bit_exactly(ws3, tmp_path, capsys):
    """2 steps, then resumed to 4 with another eval cadence == 4 steps straight (constant schedule, so
    max_steps does not shape the lr); the allowed changes are logged."""
    from eagle.train.trainer import train

    const = {"train__schedule": "constant"}
    straight = train(ws3.cfg(tmp_path / "a", steps=4, **const))
    train(ws3.cfg(tmp_path / "b", steps=2, **const))
    capsys.readouterr()
    resumed = train(ws3.cfg(tmp_path / "b", steps=4, train__eval_every=2, **const))
    log = capsys.readouterr().out
    assert "train.max_steps: 2 -> 4" in log and "train.eval_every: 3 -> 2" in log
    assert resumed.step == straight.step == 4
    assert_same_weights(final_head(tmp_path / "a", 4), final_head(tmp_path / "b", 4))
    assert_same_optimizer_state(tmp_path / "a", tmp_path / "b", 4)


@pytest.mark.slow
def test_raised_max_steps_with_cosine_says_what_changes(ws3, tmp_path, capsys):
    from eagle.train.trainer import train

    train(ws3.cfg(tmp_path / "o", steps=2))
    capsys.readouterr()
    result = train(ws3.cfg(tmp_path / "o", steps=3))
    assert result.step == 3
    log = capsys.readouterr().out
    assert "the cosine schedule now decays to step 3: updates 3.. follow it, updates 1..2 ran under the old one" in log


@pytest.mark.slow
def test_checkpoint_of_an_older_eagle_resumes_with_a_note(ws3, tmp_path, capsys):
    from eagle.train.trainer import train

    out = tmp_path / "o"
    train(ws3.cfg(out, steps=2))
    (out / "checkpoints" / "step-0000002" / RUN_CONFIG).unlink()
    capsys.readouterr()
    assert train(ws3.cfg(out, steps=3, train__lr=1e-3)).step == 3
    assert f"records no {RUN_CONFIG}" in capsys.readouterr().out


# --------------------------------------------------------------------------------------- capture
def test_capture_refusal_names_every_differing_key(tmp_path):
    model, _ = make_model("llama")
    small = {"train": make_convs(3), "heldout": []}
    data = {"fingerprint": "d" * 64, "config": {"max_conversations": 3, "path": "a.jsonl"}}
    capture(model, small, tmp_path, data=data)
    other = {"fingerprint": "e" * 64, "config": {"max_conversations": 5, "path": "a.jsonl"}}
    with pytest.raises(CaptureError) as e:
        capture(model, small, tmp_path, data=other, shard_size=5, dtype="float16")
    message = str(e.value)
    assert "shard_size (capture.shard_size): 4 -> 5" in message
    assert "dtype (capture.dtype): 'bfloat16' -> 'float16'" in message
    assert "data.max_conversations: 3 -> 5" in message
    assert "new output_dir" in message and "move" in message


# --------------------------------------------------------------------------------------- regeneration
def test_regeneration_resume_names_keys_and_checks_the_data(tiny_qwen2, tmp_path, capsys):
    from eagle.config import DataConfig, RegenerateConfig
    from eagle.regenerate.runner import regenerate

    model, tok = tiny_qwen2
    cfg = RegenerateConfig(batch_size=2, max_new_tokens=4)
    out = tmp_path / "regen.jsonl"
    data = DataConfig(source="local", path=str(tmp_path / "in.jsonl"), max_conversations=1)
    regenerate(model, tok, CONVS[:1], cfg, out, target_fingerprint="t", progress=False, data=data)
    with pytest.raises(DataError) as e:
        regenerate(
            model,
            tok,
            CONVS,
            RegenerateConfig(batch_size=2, max_new_tokens=4, temperature=0.7),
            out,
            target_fingerprint="t",
            progress=False,
            data=data,
        )
    assert "temperature: 0.0 -> 0.7" in str(e.value) and "new file" in str(e.value)
    with pytest.raises(DataError, match="data.path: .*in.jsonl' -> .*other.jsonl'"):
        regenerate(
            model,
            tok,
            CONVS,
            cfg,
            out,
            target_fingerprint="t",
            progress=False,
            data=DataConfig(source="local", path=str(tmp_path / "other.jsonl"), max_conversations=1),
        )
    # More conversations of the same data: allowed and noted; the file grows.
    capsys.readouterr()
    regenerate(
        model,
        tok,
        CONVS,
        cfg,
        out,
        target_fingerprint="t",
        progress=False,
        data=DataConfig(source="local", path=str(tmp_path / "in.jsonl"), max_conversations=3),
    )
    assert "data.max_conversations: 1 -> 3" in capsys.readouterr().err
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["a", "b", "c"]
