"""eagle-publish: the Hub folder (weights + config + model card with measured figures and provenance),
the Hub calls (monkeypatched, no network), and that the token never reaches a file or a log."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

from eagle.algorithms.head_io import build_head, head_config_from_target, save_head
from eagle.cli.app import compose, save_resolved_config
from eagle.config import DraftConfig
from eagle.errors import EagleError
from eagle.export import check_folder
from eagle.export.publish import PublishError, run_publish
from tests.tiny_models import make_model

SECRET = "hf_SECRETtoken1234567890abcdef"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_target_dir) -> Path:
    """A training output dir (best/ + train_config.yaml + capture manifest) and an eval report."""
    root = tmp_path_factory.mktemp("pub")
    model, _ = make_model("llama")
    cfg = head_config_from_target(model.config, DraftConfig(algorithm="eagle3", draft_vocab_size=None))
    head = build_head(cfg, model)
    run = root / "run"
    save_head(head, run / "best")
    data_dir = root / "capture"
    data_dir.mkdir()
    (data_dir / "manifest.json").write_text(
        json.dumps({"num_conversations": 321, "num_tokens": 45678, "output_dir": "/home/someone/private"})
    )
    save_resolved_config(
        compose(
            [
                f"output_dir={run}",
                f"target.path={tiny_target_dir}",
                "data.max_conversations=321",
                f"train.data_dir={data_dir}",
                "train.max_steps=77",
            ]
        ),
        "train",
    )
    ev = root / "eval"
    ev.mkdir()
    (ev / "report.json").write_text(
        json.dumps(
            {
                "num_prompts": 80,
                "tau": 2.7125,
                "speedup": 1.8512,
                "speedup_vs_autoregressive": 2.0433,
                "settings": {
                    "prompts": "mt_bench",
                    "temperature": 0.0,
                    "dtype": "bfloat16",
                    "tree": {"kind": "dynamic", "total_tokens": 16},
                    "hardware": {"cpu": "Test CPU 9000", "device": "cpu", "torch_threads": 2},
                },
            }
        )
    )
    return root


def _cfg(run_dir: Path, out: Path, *extra: str):
    return compose(
        [f"draft.path={run_dir / 'run'}", f"output_dir={out}", f"publish.reports=[{run_dir / 'eval'}]", *extra]
    )


def _card(hub: Path) -> tuple[dict, str]:
    text = (hub / "README.md").read_text()
    _, front, body = text.split("---\n", 2)
    return yaml.safe_load(front), body


def test_dry_run_writes_card_with_figures_and_provenance(run_dir, tiny_target_dir, tmp_path):
    hub = run_publish(_cfg(run_dir, tmp_path / "out", "publish.dry_run=true", "format=vllm"))
    assert hub == tmp_path / "out" / "hub"
    check_folder(hub, expect_format="vllm", dtype="float16")
    meta, body = _card(hub)
    assert meta["base_model"] == str(tiny_target_dir)
    assert meta["license"] == "apache-2.0" and meta["library_name"] == "vllm"
    assert {"eagle", "eagle3", "speculative-decoding"} <= set(meta["tags"])
    assert meta["datasets"] == ["anon8231489123/ShareGPT_Vicuna_unfiltered"]
    row = next(line for line in body.splitlines() if line.startswith("| mt_bench"))
    assert "| 80 |" in row and "2.71" in row and "1.85x" in row and "2.04x" in row
    assert "| `eval` |" in row  # the report by the name it was given, not this machine's path
    # One report: its machine is the subsection, every setting is in the line above the table, none in the row.
    assert "### Test CPU 9000, 2 torch threads\n" in body
    line = next(line for line in body.splitlines() if line.startswith("Settings of every row below:"))
    assert "dtype=bfloat16," in line and "temperature=0.00" in line and "kind=dynamic, total_tokens=16" in line
    assert "bfloat16" not in row and "dynamic" not in row and "Test CPU" not in row
    assert "num_conversations=321" in body and "num_tokens=45678" in body
    assert "/home/someone/private" not in body  # paths from the manifest stay out of the card
    assert f"eagle-train target.path={tiny_target_dir}" in body and "train.max_steps=77" in body
    assert "vllm serve" in body


def test_upload_calls_hub_and_never_writes_or_logs_the_token(run_dir, tmp_path, monkeypatch, capsys, caplog):
    import huggingface_hub

    monkeypatch.setenv("HF_TOKEN", SECRET)
    calls = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, **kw: calls.append(("create_repo", kw)))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, **kw: calls.append(("upload_folder", kw)))
    caplog.set_level(logging.DEBUG)
    out = tmp_path / "out"
    hub = run_publish(
        _cfg(run_dir, out, "publish.repo_id=me/tiny-eagle3", "publish.private=true", "format=speculators")
    )
    assert [c[0] for c in calls] == ["create_repo", "upload_folder"]
    assert calls[0][1] == {"repo_id": "me/tiny-eagle3", "private": True, "exist_ok": True, "repo_type": "model"}
    assert calls[1][1]["repo_id"] == "me/tiny-eagle3" and calls[1][1]["folder_path"] == str(hub)
    assert calls[1][1]["commit_message"] == "Upload EAGLE draft head"
    _, body = _card(hub)
    assert '"model": "me/tiny-eagle3"' in body
    captured = capsys.readouterr()
    assert SECRET not in captured.out + captured.err + caplog.text
    for f in [p for p in tmp_path.rglob("*") if p.is_file()] + [p for p in run_dir.rglob("*") if p.is_file()]:
        assert SECRET.encode() not in f.read_bytes(), f


def test_upload_failure_is_a_clear_error_without_token(run_dir, tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setenv("HF_TOKEN", SECRET)

    def deny(self, **kw):
        raise RuntimeError("403 Forbidden: no write access")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", deny)
    with pytest.raises(PublishError, match="no write access") as e:
        run_publish(_cfg(run_dir, tmp_path / "out", "publish.repo_id=me/x"))
    assert SECRET not in str(e.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([], "publish.repo_id"),
        (["publish.dry_run=true", "publish.reports=[/nonexistent/eval]"], "/nonexistent/eval not found"),
    ],
)
def test_publish_input_errors(run_dir, tmp_path, overrides, message):
    with pytest.raises(EagleError, match=message):
        run_publish(_cfg(run_dir, tmp_path / "out", *overrides))


def test_report_without_tau_is_rejected(run_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "report.json").write_text(json.dumps({"speedup": 2.0}))
    with pytest.raises(PublishError, match="not an eagle-eval report"):
        run_publish(_cfg(run_dir, tmp_path / "out", "publish.dry_run=true", f"publish.reports=[{bad}]"))


def test_cli_dry_run(run_dir, tmp_path, monkeypatch):
    import sys

    from eagle.cli import publish as cli

    out = tmp_path / "cli"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "eagle-publish",
            f"draft.path={run_dir / 'run'}",
            f"output_dir={out}",
            "publish.dry_run=true",
            "export.dtype=bfloat16",
        ],
    )
    cli.main()
    head = check_folder(out / "hub", expect_format="hf", dtype="bfloat16")
    assert head.tensors["fc.weight"].dtype == torch.bfloat16
    assert "No evaluation reports" in (out / "hub" / "README.md").read_text()


def test_speculators_card_names_verifier_and_stored_embedding(run_dir, tiny_target_dir, tmp_path):
    hub = run_publish(
        _cfg(
            run_dir,
            tmp_path / "out",
            "publish.dry_run=true",
            "format=speculators",
            "publish.repo_id=me/tiny-eagle3",
            "export.verifier=org/tiny-target",
        )
    )
    head = check_folder(hub, expect_format="speculators", dtype="float16")
    assert head.raw_config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-target"
    embed = head.borrowed["embed_tokens.weight"]  # read from the trained-on target folder
    assert embed.dtype == torch.float16 and embed.shape == (head.config.vocab_size, head.config.hidden_size)
    _, body = _card(hub)
    assert 'SpeculatorModel.from_pretrained("me/tiny-eagle3")' in body
    assert "`org/tiny-target`" in body and "export.verifier=" in body
    mib = embed.numel() * 2 / 2**20
    assert f"{head.config.vocab_size} x {head.config.hidden_size} x 2 bytes = {mib:.1f} MiB" in body


def test_llamacpp_hub_folder_has_portable_commands(run_dir, tmp_path):
    """format=llamacpp: the vLLM folder + LLAMACPP.md; a folder for the Hub names placeholders, never this
    machine's paths (the output folder, the target's converted folder)."""
    hub = run_publish(
        _cfg(run_dir, tmp_path / "out", "publish.dry_run=true", "format=llamacpp", "export.speculative_tokens=3")
    )
    check_folder(hub, expect_format="llamacpp", dtype="float16")
    guide = (hub / "LLAMACPP.md").read_text()
    assert (
        "python convert_hf_to_gguf.py HEAD_DIR --target-model-dir TARGET_HF_DIR --outtype f16 "
        "--outfile HEAD_DIR/head.gguf"
    ) in guide
    assert (
        "llama-server -m target.gguf --spec-draft-model HEAD_DIR/head.gguf --spec-type draft-eagle3 "
        "--spec-draft-n-max 3" in guide
    )
    assert str(tmp_path) not in guide
    meta, body = _card(hub)
    assert meta["library_name"] == "vllm" and "llamacpp" in meta["tags"]
    assert "[LLAMACPP.md](LLAMACPP.md)" in body and "--spec-draft-n-max 3" in body


def test_measured_chain_length_reaches_the_config_and_the_serving_command(run_dir, tmp_path):
    """export.speculative_tokens (the fastest k a vLLM check measured) is what a speculators config and the
    card's `vllm serve` line advertise; without it both follow decode.tree_depth."""
    hub = run_publish(
        _cfg(
            run_dir,
            tmp_path / "k2",
            "publish.dry_run=true",
            "format=speculators",
            "export.speculative_tokens=2",
            "decode.tree_depth=5",
        )
    )
    head = check_folder(hub, expect_format="speculators", dtype="float16")
    assert head.raw_config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    assert '"num_speculative_tokens": 2}' in _card(hub)[1]
    hub = run_publish(_cfg(run_dir, tmp_path / "depth", "publish.dry_run=true", "format=vllm", "decode.tree_depth=5"))
    assert '"num_speculative_tokens": 5}' in _card(hub)[1]


def test_card_describes_the_captured_self_distilled_data_and_warm_start(tiny_target_dir, tmp_path, monkeypatch):
    """Offline, the card's data and commands come from the capture (not the unused data.* of the training
    run), name the regeneration settings, the capture dtype, the warm start, and carry publish.notes."""
    monkeypatch.chdir(tmp_path)
    model, _ = make_model("llama")
    head = build_head(
        head_config_from_target(model.config, DraftConfig(algorithm="eagle3", draft_vocab_size=None)), model
    )
    save_head(head, Path("run/best"))
    Path("regen").mkdir()
    Path("regen/answers.jsonl").write_text("")
    Path("regen/answers.jsonl.meta.json").write_text(
        json.dumps(
            {
                "data": {"source": "sharegpt", "dedup_against": ["mt_bench", "humaneval"]},
                "dtype": "bfloat16",
                "max_new_tokens": 256,
                "max_turns": 1,
                "max_prompt_tokens": 512,
                "temperature": 0.0,
            }
        )
    )
    save_resolved_config(
        compose(
            [
                f"output_dir={tmp_path / 'capture'}",
                f"target.path={tiny_target_dir}",
                "data=local",
                "data.path=regen/answers.jsonl",
                "target.dtype=bfloat16",
            ]
        ),
        "capture",
    )
    Path("capture/manifest.json").write_text(
        json.dumps(
            {
                "algorithm": "eagle3",
                "dtype": "float16",
                "format": "eagle-capture",
                "output_dir": "/home/someone/private",
                "data": {
                    "config": {
                        "source": "local",
                        "path": "regen/answers.jsonl",
                        "max_conversations": None,
                        "max_length": 768,
                    },
                    "fingerprint": "abc",
                },
                "totals": {"conversations": 3356, "tokens": 1006518, "shards": 53, "bytes": 1},
                "splits": {"train": {"conversations": 3297, "tokens": 987683}, "heldout": {"conversations": 59}},
            }
        )
    )
    save_resolved_config(
        compose(
            [
                "output_dir=run",
                f"target.path={tiny_target_dir}",
                "data.max_conversations=800",
                "train.data_dir=capture",
                "train.max_steps=2500",
                "train.init_from=old-head",
            ]
        ),
        "train",
    )
    Path("notes.md").write_text("Warm-started from the v2 head.\n")
    hub = run_publish(
        compose(["draft.path=run", "output_dir=out", "publish.dry_run=true", "format=vllm", "publish.notes=notes.md"])
    )
    meta, body = _card(hub)
    assert meta["datasets"] == ["anon8231489123/ShareGPT_Vicuna_unfiltered"]  # the prompts' source
    assert (
        "self-distilled" in body and "max_new_tokens=256" in body and "dedup_against=['mt_bench', 'humaneval']" in body
    )
    assert "up to 800 conversations" not in body  # the training run's data.* was not what the head saw
    assert "conversations=3356" in body and "train_tokens=987683" in body and "target_dtype=bfloat16" in body
    assert "train.init_from=old-head" in body and "train.max_steps=2500" in body
    assert f"eagle-capture target.path={tiny_target_dir} data=local data.path=answers.jsonl" in body
    assert "target.dtype=bfloat16 output_dir=CAPTURE_DIR" in body and "train.data_dir=CAPTURE_DIR" in body
    assert "/home/someone/private" not in body and "regen/answers.jsonl" not in body
    assert body.rstrip().endswith("## Notes\n\nWarm-started from the v2 head.")
    with pytest.raises(PublishError, match="publish.notes=missing.md"):
        run_publish(compose(["draft.path=run", "output_dir=out2", "publish.dry_run=true", "publish.notes=missing.md"]))
    assert not Path("out2/hub").exists()  # refused before anything was written


def test_card_rows_give_acceptance_by_depth_and_losslessness(run_dir, tmp_path):
    ev = tmp_path / "eval"
    ev.mkdir()
    (ev / "report.json").write_text(
        json.dumps(
            {
                "num_prompts": 80,
                "num_turns": 80,
                "tau": 2.0,
                "speedup": 1.5,
                "speedup_vs_prompt_lookup": 1.25,
                "speedup_vs_autoregressive": 1.4,
                "tokens_per_s": 40.0,
                "baseline_tokens_per_s": 26.7,
                "accept_rate_by_depth": [0.6, 0.5, 0.4, 0.3],
                "greedy_match": 0.25,
                "divergence": {"turns": 80, "divergent_turns": 60, "all_numeric": True, "max_margin": 0.18},
                "settings": {"prompts": "mt_bench", "temperature": 0.0, "dtype": "bfloat16"},
            }
        )
    )
    sampled = tmp_path / "sampled"
    sampled.mkdir()
    (sampled / "report.json").write_text(
        json.dumps(
            {
                "num_prompts": 20,
                "tau": 1.7,
                "greedy_match": None,
                "settings": {"prompts": "mt_bench", "temperature": 1.0},
            }
        )
    )
    hub = run_publish(_cfg(run_dir, tmp_path / "out", "publish.dry_run=true", f"publish.reports=[{ev},{sampled}]"))
    _, body = _card(hub)
    rows = [line for line in body.splitlines() if line.startswith("| mt_bench")]
    assert "| 0.60 / 0.50 / 0.40 / 0.30 |" in rows[0] and "| 40.0 (26.7) |" in rows[0] and "| 1.25x |" in rows[0]
    assert "20 of 80 identical; 60 diverge, all numeric (max fp32 margin 0.18)" in rows[0]
    assert "sampled (no greedy comparison)" in rows[1]
    assert "| bfloat16 |" in rows[0]  # target and head alike: one dtype


def test_card_groups_rows_by_machine_with_shared_settings_above_each_table(run_dir, tmp_path):
    """One subsection per machine, in the order the reports were given; a setting every row of a machine shares
    is said once above its table, one that differs is a column of it; a figure no row has is no column."""
    cpu = {"cpu": "CPU A", "cpu_count": 2, "torch_threads": 2, "device": "cpu", "torch_version": "2.13.0"}
    gpu = {
        "cpu": "CPU B",
        "cpu_count": 16,
        "torch_threads": 4,
        "device": "cuda:0",
        "accelerator": "Test GPU",
        "torch_version": "2.13.0",
    }

    def report(name: str, hardware: dict, temperature: float, prompts: str = "mt_bench") -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "report.json").write_text(
            json.dumps(
                {
                    "num_prompts": 20,
                    "tau": 2.0 + temperature,
                    "speedup": 1.5,
                    "greedy_match": None,
                    "settings": {
                        "prompts": prompts,
                        "temperature": temperature,
                        "dtype": "float32",
                        "max_new_tokens": 128,
                        "tree": {"tree": "auto", "tree_depth": 4},
                        "hardware": hardware,
                    },
                }
            )
        )
        return folder

    given = [report("a-t0", cpu, 0.0), report("b", gpu, 0.0, "humaneval"), report("a-t1", cpu, 1.0)]
    hub = run_publish(
        _cfg(run_dir, tmp_path / "out", "publish.dry_run=true", f"publish.reports=[{','.join(str(g) for g in given)}]")
    )
    _, body = _card(hub)
    figures = body.split("## Measured figures")[1].split("## Training")[0]
    _, a, b = figures.split("\n### ")
    assert a.startswith("CPU A, 2 cores, 2 torch threads\n")
    assert b.startswith("Test GPU, host CPU B, 16 cores, 4 torch threads, device cuda:0\n")
    assert (
        "Settings of every row below: acceptance=exact (lossless), dtype=float32, max_new_tokens=128, "
        "tree=auto, tree_depth=4, torch=2.13.0."
    ) in a  # not temperature: it differs
    assert "| benchmark | prompts | temperature | tau | speedup vs HF generate | greedy output | report |" in a
    rows = [line for line in a.splitlines() if line.startswith("| mt_bench")]
    assert rows == [
        "| mt_bench | 20 | 0.00 | 2.00 | 1.50x | sampled (no greedy comparison) | `a-t0` |",
        "| mt_bench | 20 | 1.00 | 3.00 | 1.50x | sampled (no greedy comparison) | `a-t1` |",
    ]
    assert "temperature=0.00" in b and "| temperature |" not in b  # one row: every setting is shared
    assert [line for line in b.splitlines() if line.startswith("| humaneval")] == [
        "| humaneval | 20 | 2.00 | 1.50x | sampled (no greedy comparison) | `b` |"
    ]


def test_card_row_names_the_head_dtype_where_it_differs_from_the_target():
    from eagle.export.publish import dtype_text

    assert dtype_text({"dtype": "bfloat16", "draft_dtype": "bfloat16", "draft_weights": "full"}) == "bfloat16"
    assert (
        dtype_text({"dtype": "float32", "draft_dtype": "bfloat16", "draft_weights": "int8"})
        == "float32 (head bfloat16, int8)"
    )
    assert (
        dtype_text({"dtype": "bfloat16", "draft_dtype": "bfloat16", "draft_weights": "int8_weight_only"})
        == "bfloat16 (head bfloat16, int8 weight only)"
    )
    assert dtype_text({"dtype": "float32"}) == "float32"  # reports from before the head had its own dtype


def _approximate_report(folder: Path, **fields) -> Path:
    folder.mkdir()
    report = {
        "acceptance": "typical",
        "lossless": False,
        "acceptance_settings": {"rule": "typical", "typical_epsilon": 0.09, "typical_delta": 0.3},
        "distribution_shift": {"tv": 0.0312, "kl": 0.0051, "kl_infinite": 0, "positions": 900},
        "num_prompts": 20,
        "num_turns": 20,
        "tau": 2.4,
        "speedup": 1.9,
        "greedy_match": None,
        "settings": {"prompts": "mt_bench", "temperature": 1.0, "dtype": "bfloat16"},
    }
    (folder / "report.json").write_text(json.dumps({**report, **fields}))
    return folder


def test_card_never_shows_an_approximate_figure_without_its_label(run_dir, tmp_path):
    typical = _approximate_report(tmp_path / "typical")
    hub = run_publish(
        _cfg(run_dir, tmp_path / "out", "publish.dry_run=true", f"publish.reports=[{run_dir / 'eval'},{typical}]")
    )
    _, body = _card(hub)
    rows = [line for line in body.splitlines() if line.startswith("| mt_bench")]
    assert len(rows) == 2
    assert "APPROXIMATE" not in rows[0]  # the exact report (a report from before the field: exact)
    assert rows[1].startswith(
        "| mt_bench **[APPROXIMATE acceptance: typical (epsilon=0.09, delta=0.3), not lossless]** |"
    )
    assert (
        "| 2.40 |" in rows[1]
        and "NOT lossless (typical acceptance): emitted law vs the target's TV 0.0312, KL 0.0051" in rows[1]
    )
    assert "Rows marked APPROXIMATE" in body
    assert "HF transformers generate (PyTorch eager)" in body


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"lossless": True}, "only exact acceptance is lossless"),
        ({"acceptance": "exact"}, "only exact acceptance is lossless"),  # lossless false with exact
        ({"acceptance": "exact", "lossless": True, "acceptance_settings": {"rule": "exact"}}, "distribution shift"),
        ({"acceptance_settings": {"rule": "lenient"}}, "acceptance_settings"),
        ({"acceptance": "sloppy"}, "not one of"),
    ],
)
def test_report_whose_acceptance_fields_disagree_is_refused(run_dir, tmp_path, fields, message):
    bad = _approximate_report(tmp_path / "bad", **fields)
    with pytest.raises(PublishError, match=message):
        run_publish(_cfg(run_dir, tmp_path / "out", "publish.dry_run=true", f"publish.reports=[{bad}]"))
    assert not (tmp_path / "out" / "hub").exists()  # refused before anything was written
