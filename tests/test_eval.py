"""eagle-eval: report fields and their consistency, prompts, multi-turn, draft.path kinds, plots.

Real tiny targets (tests/tiny_models.py) and randomly initialised heads; nothing in the decoding
path is mocked. A random head is rarely accepted, which is fine here: these tests check that what
the report says is what was measured, and that speculative output equals HF generate's at
temperature 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from eagle import spec_metrics as metrics
from eagle.algorithms.head_io import build_head, head_config_from_target, save_head
from eagle.artifacts import resolve_draft, resolve_draft_path
from eagle.cli.app import compose
from eagle.config import DraftConfig, TargetConfig
from eagle.errors import CheckpointError
from eagle.export import load_draft
from eagle.target.loading import load_target
from tests.tiny_models import save_model

PNG = b"\x89PNG\r\n\x1a\n"


# --- metrics ---------------------------------------------------------------------------------------


def test_metrics_by_hand():
    lengths = [1, 3, 2, 4, 1]  # accepted drafts 0, 2, 1, 3, 0
    assert metrics.tau(lengths, 5) == pytest.approx(11 / 5)
    # depth 1: 3 of 5 steps; depth 2: 2 of those 3; depth 3: 1 of those 2
    assert metrics.accept_rate_by_depth(lengths) == pytest.approx([3 / 5, 2 / 3, 1 / 2])
    assert metrics.accept_fraction_by_depth(lengths, 4) == pytest.approx([3 / 5, 2 / 5, 1 / 5, 0.0])
    # a depth nobody reached has no rate (0/0): the list stops there
    assert metrics.accept_rate_by_depth([1, 1], 4) == [0.0]
    assert metrics.histogram(lengths) == {1: 2, 2: 1, 3: 1, 4: 1}
    assert metrics.tau([], 0) == 0.0 and metrics.accept_rate_by_depth([]) == []


@given(st.lists(st.integers(1, 7), min_size=1, max_size=50))
def test_depth_rates_multiply_to_fractions(lengths):
    """P(>= d accepted) is the product of the conditional rates up to d."""
    rates = metrics.accept_rate_by_depth(lengths)
    fractions = metrics.accept_fraction_by_depth(lengths)
    prod = 1.0
    for d, rate in enumerate(rates):
        prod *= rate
        assert fractions[d] == pytest.approx(prod)


# --- fixtures --------------------------------------------------------------------------------------


def _random_head(target_dir: Path, family_seed: int = 0):
    model, _, info = load_target(TargetConfig(path=str(target_dir)))
    cfg = head_config_from_target(model.config, DraftConfig(algorithm="eagle3", draft_vocab_size=None), info)
    torch.manual_seed(family_seed)
    return build_head(cfg, model), model


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny Llama target, a training-style dir holding a random head's best/, and a prompt file."""
    root = tmp_path_factory.mktemp("eval")
    target = save_model("llama", root / "target")
    head, _ = _random_head(target)
    save_head(head, root / "train" / "best")
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        json.dumps(
            {
                "id": "poem",
                "turns": ["Write a short poem about the sea.", "Now make it shorter."],
                "category": "writing",
            }
        )
        + "\n"
        + json.dumps({"id": "code", "prompt": "def add(a, b):"})
        + "\n"
        + json.dumps({"id": "unused", "prompt": "Explain relativity."})
        + "\n"
    )
    return root


def _cfg(ws: Path, out: str, *extra: str):
    return compose(
        [
            f"target.path={ws / 'target'}",
            f"draft.path={ws / 'train'}",
            f"eval.prompts={ws / 'prompts.jsonl'}",
            "eval.max_prompts=2",
            "eval.turns=all",
            "eval.warmup_prompts=1",
            "decode.max_new_tokens=12",
            "decode.temperature=0",
            "target.dtype=float32",
            f"output_dir={ws / out}",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def greedy_report(workspace):
    from eagle.evaluate import evaluate

    threads = torch.get_num_threads()
    report = evaluate(_cfg(workspace, "greedy", "eval.tree_sweep=[4,8]", "eval.num_threads=1"))
    assert torch.get_num_threads() == threads  # eval.num_threads applies inside the run only
    return report


# --- the report ------------------------------------------------------------------------------------


def test_report_fields_and_consistency(greedy_report, workspace):
    r = greedy_report
    for key in (
        "tau",
        "accept_rate_by_depth",
        "tokens_per_s",
        "baseline_tokens_per_s",
        "speedup",
        "speedup_vs_prompt_lookup",
        "speedup_vs_autoregressive",
        "greedy_match",
        "per_prompt",
        "settings",
        "decoder_overhead_share",
    ):
        assert key in r, key
    on_disk = json.loads((workspace / "greedy" / "report.json").read_text())
    assert on_disk["tau"] == r["tau"] and len(on_disk["per_prompt"]) == 2

    pp = r["per_prompt"]
    assert [p["id"] for p in pp] == ["poem", "code"]  # max_prompts=2 cuts the third
    lengths = [n for p in pp for n in p["accept_lengths"]]
    forwards = sum(p["target_forwards"] for p in pp)
    assert forwards > 0
    assert r["tau"] == pytest.approx(sum(lengths) / forwards)
    assert r["new_tokens"] == sum(p["new_tokens"] for p in pp)
    for p in pp:
        assert {"id", "new_tokens", "target_forwards", "accept_lengths"} <= set(p)
        # one verify pass per acceptance length; the prefill emits one token of each turn
        assert len(p["accept_lengths"]) == p["target_forwards"]
        assert p["new_tokens"] == sum(p["accept_lengths"]) + len(p["turns"])
        assert all(n >= 1 for n in p["accept_lengths"])
        assert set(p["seconds"]) == {"speculative", "autoregressive", "hf_generate", "prompt_lookup"}
        assert all(t["new_tokens"] <= 12 for t in p["turns"])

    m = r["methods"]
    assert r["baseline_tokens_per_s"] == pytest.approx(m["hf_generate"]["tokens_per_s"])
    assert r["speedup"] == pytest.approx(m["speculative"]["tokens_per_s"] / m["hf_generate"]["tokens_per_s"])
    assert r["speedup_vs_prompt_lookup"] == pytest.approx(
        m["speculative"]["tokens_per_s"] / m["prompt_lookup"]["tokens_per_s"]
    )
    dec = r["decoder"]
    assert 0.0 <= dec["decoder_overhead_share"] <= 1.0
    assert dec["decoder_overhead_share"] == pytest.approx(dec["draft_share"] + dec["bookkeeping_share"])
    assert len(r["accept_rate_by_depth"]) <= r["settings"]["tree"]["tree_depth"]

    s = r["settings"]
    assert s["temperature"] == 0.0 and s["draft_kind"] == "training_dir" and s["resumed_prompt_ids"] == []
    assert s["draft_folder"].endswith("best")
    assert s["hardware"]["torch_threads"] == 1 and s["hardware"]["torch_version"] == torch.__version__


def test_greedy_output_equals_hf_generate(greedy_report):
    assert greedy_report["greedy_match"] == 1.0
    for p in greedy_report["per_prompt"]:
        assert p["greedy_match"] is True
        assert all(t["greedy_match"] and t["first_mismatch"] is None for t in p["turns"])
        # every method produced the same number of tokens, as they decoded the same greedy text
        assert len(set(p["tokens_by_method"].values())) == 1


def test_multi_turn_follows_own_answer(greedy_report, workspace):
    """Turn 2 is asked after the speculative decoder's own turn-1 answer, through the chat template."""
    from eagle.data.eval_prompts import load_eval_prompts
    from eagle.evaluate.runner import turn_inputs
    from eagle.target.loading import load_tokenizer

    poem = greedy_report["per_prompt"][0]
    assert [t["turn"] for t in poem["turns"]] == [0, 1]
    assert len(greedy_report["per_prompt"][1]["turns"]) == 1  # the {"prompt"} record has one turn
    tok = load_tokenizer(TargetConfig(path=str(workspace / "target")))
    prompt = load_eval_prompts(str(workspace / "prompts.jsonl"))[0]
    answer = poem["turns"][0]["answer"]
    second = turn_inputs(tok, prompt, [answer])[1][0].tolist()
    expected = tok.apply_chat_template(
        [
            {"role": "user", "content": prompt.turns[0]},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": prompt.turns[1]},
        ],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert second == list(expected)
    assert poem["turns"][1]["prompt_tokens"] == len(second)


def test_plots_and_markdown_written(greedy_report, workspace):
    out = workspace / "greedy"
    for name in ("accept_length_hist.png", "accept_by_depth.png", "throughput.png", "speedup_vs_tree.png"):
        assert (out / name).read_bytes()[:8] == PNG, name
    assert [row["tree_total_tokens"] for row in greedy_report["tree_sweep"]] == [4, 8]
    md = (out / "report.md").read_text()
    assert "| speculative |" in md and "tau" in md and "speedup_vs_tree.png" in md
    assert not list(out.glob("*.tmp*"))  # atomic writes left nothing behind


def test_resume_reuses_finished_prompts(greedy_report, workspace):
    """A rerun with the same settings reads finished prompts from eval_progress.jsonl instead of re-timing."""
    from eagle.evaluate import evaluate

    again = evaluate(_cfg(workspace, "greedy", "eval.warmup_prompts=0", "eval.num_threads=1"))
    assert [p["seconds"] for p in again["per_prompt"]] == [p["seconds"] for p in greedy_report["per_prompt"]]
    assert again["tau"] == greedy_report["tau"]
    assert again["settings"]["resumed_prompt_ids"] == ["poem", "code"]


# --- acceptance rules: labels ----------------------------------------------------------------------------


def test_exact_report_says_lossless_and_names_its_speedup_baseline(greedy_report, workspace):
    r = greedy_report
    assert r["acceptance"] == "exact" and r["lossless"] is True
    shift = r["distribution_shift"]
    assert (
        shift["tv"] == 0.0
        and shift["kl"] == 0.0
        and shift["positions"] >= sum(n for p in r["per_prompt"] for n in p["accept_lengths"])
    )
    assert r["speedup_baseline"] == "HF transformers generate (PyTorch eager)"
    assert "divergence" in r  # greedy, exact, with HF generate: the numerics check runs
    md = (workspace / "greedy" / "report.md").read_text()
    assert md.startswith("# eagle-eval:") and "APPROXIMATE" not in md
    assert "Speedup baseline: HF transformers generate (PyTorch eager)" in md


@pytest.fixture(scope="module")
def lenient_report(workspace):
    from eagle.evaluate import evaluate

    # Any drafted child passes: the random head's drafts are accepted, and the output leaves the target's.
    # A fixed tree of depth 4 without prompt lookup (the auto tree's shape depends on timing).
    return evaluate(
        _cfg(
            workspace,
            "lenient",
            "decode.acceptance=lenient",
            "decode.lenient_top_k=1000",
            "decode.lenient_margin=100",
            "decode.tree=dynamic",
            "decode.lookup_tokens=0",
            "eval.baselines=[hf_generate]",
            "eval.warmup_prompts=0",
            "eval.turns=first",
        )
    )


def test_approximate_report_is_labelled_everywhere(lenient_report, workspace):
    r, out = lenient_report, workspace / "lenient"
    assert r["acceptance"] == "lenient" and r["lossless"] is False
    assert r["acceptance_settings"] == {"rule": "lenient", "lenient_top_k": 1000, "lenient_margin": 100.0}
    text = (out / "report.json").read_text().splitlines()
    assert text[1].strip() == '"acceptance": "lenient",' and text[2].strip() == '"lossless": false,'
    md = (out / "report.md").read_text()
    assert md.splitlines()[0].startswith("# APPROXIMATE acceptance: lenient (top_k=1000, margin=100.0), not lossless")
    assert "reported, not checked" in md
    # The greedy comparison is a reported fraction, never a numerics verdict, and the shift is measured.
    assert 0.0 <= r["greedy_match"] <= 1.0 and "divergence" not in r
    shift = r["distribution_shift"]
    assert shift["positions"] > 0 and shift["tv"] > 0 and shift["kl"] is None and shift["kl_infinite"] > 0, (
        shift,
        [(p["accept_lengths"], p["tree_sizes"], p["greedy_match"]) for p in r["per_prompt"]],
    )
    assert r["tau"] > 1.0
    assert all(t["hf_generate_answer"] is not None for p in r["per_prompt"] for t in p["turns"])


def test_approximate_plots_and_cli_line_carry_the_label(lenient_report, tmp_path, monkeypatch, capsys):
    from eagle.cli import evaluate as cli
    from eagle.evaluate import plots, runner

    titles = []
    for name in ("plot_accept_length_histogram", "plot_accept_by_depth", "plot_throughput", "plot_speedup_vs_tree"):
        monkeypatch.setattr(plots, name, lambda *a, **k: titles.append(a[-1]) or tmp_path / "x.png")
    report = {**lenient_report, "tree_sweep": [{"tree_total_tokens": 4, "tau": 1.5, "speedup": 1.1}]}
    runner._plots(report, tmp_path)
    assert len(titles) == 4 and all("APPROXIMATE acceptance: lenient" in t for t in titles)

    monkeypatch.setattr(runner, "evaluate", lambda cfg: lenient_report)
    monkeypatch.setattr(cli, "evaluate", lambda cfg: lenient_report, raising=False)
    cli._evaluate(_cfg(Path("."), "unused"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("APPROXIMATE acceptance (decode.acceptance=lenient): NOT lossless")
    assert "speedup baseline: HF transformers generate (PyTorch eager)" in lines[2]


@pytest.mark.slow  # a second target and a full sampled evaluation (~10 s)
def test_sampling_run_other_family(tmp_path):
    """temperature > 0 on a Qwen2-family target: no greedy comparison, report still consistent."""
    from eagle.evaluate import evaluate

    target = save_model("qwen2", tmp_path / "target")
    head, _ = _random_head(target, 1)
    save_head(head, tmp_path / "ckpt" / "checkpoints" / "step-5" / "head")
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "x", "prompt": "Write a poem."}) + "\n")
    r = evaluate(
        compose(
            [
                f"target.path={target}",
                f"draft.path={tmp_path / 'ckpt' / 'checkpoints' / 'step-5'}",
                f"eval.prompts={tmp_path / 'p.jsonl'}",
                "eval.warmup_prompts=0",
                "eval.baselines=[hf_generate]",
                "decode.temperature=0.8",
                "decode.top_p=0.9",
                "decode.max_new_tokens=8",
                f"output_dir={tmp_path / 'out'}",
            ]
        )
    )
    assert r["greedy_match"] is None and r["per_prompt"][0]["greedy_match"] is None
    assert r["speedup_vs_prompt_lookup"] is None and r["speedup"] is not None
    assert r["settings"]["draft_kind"] == "checkpoint" and r["settings"]["temperature"] == 0.8
    p = r["per_prompt"][0]
    assert r["tau"] == pytest.approx(sum(p["accept_lengths"]) / p["target_forwards"])


# --- draft.path ------------------------------------------------------------------------------------


def test_resolve_draft_path_kinds(workspace, tmp_path):
    from eagle.export import export_head

    head, model = _random_head(workspace / "target")
    train = tmp_path / "train"
    save_head(head, train / "best")
    save_head(head, train / "checkpoints" / "step-10" / "head")
    save_head(head, tmp_path / "plain")
    export_head(head, tmp_path / "vllm", "vllm", dtype="float32")

    assert resolve_draft_path(train) == train / "best"
    assert resolve_draft_path(train / "best") == train / "best"
    assert resolve_draft_path(train / "checkpoints" / "step-10") == train / "checkpoints" / "step-10" / "head"
    assert resolve_draft_path(tmp_path / "plain") == tmp_path / "plain"
    exported = resolve_draft(tmp_path / "vllm")
    assert exported.kind == "exported" and exported.folder == tmp_path / "vllm"

    # the exported head computes what the original head computes (float32 export)
    loaded, _ = load_draft(tmp_path / "vllm", model)
    ids = torch.tensor([[5, 6, 7]])
    hidden = torch.randn(1, 3, head.config.hidden_size)
    pos = torch.arange(1, 4)[None]
    with torch.no_grad():
        assert torch.allclose(loaded.logits(loaded(ids, hidden, pos)), head.logits(head(ids, hidden, pos)), atol=1e-5)


def test_resolve_draft_path_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not set"):
        resolve_draft_path(None)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_draft_path(tmp_path / "nope")
    (tmp_path / "f.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file"):
        resolve_draft_path(tmp_path / "f.bin")
    with pytest.raises(CheckpointError, match="holds no draft head"):
        resolve_draft_path(tmp_path)
    (tmp_path / "run" / "checkpoints" / "step-3").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-12").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="step-12"):
        resolve_draft_path(tmp_path / "run")
    (tmp_path / "run" / "best").mkdir()
    with pytest.raises(CheckpointError, match="best"):
        resolve_draft_path(tmp_path / "run")


@pytest.mark.slow  # a console script in a subprocess
def test_cli_reports_bad_draft_path(tmp_path):
    """The console entry point prints one message naming the key and exits 2, before loading any model."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle.cli.evaluate",
            f"draft.path={tmp_path / 'missing'}",
            f"output_dir={tmp_path / 'out'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "draft.path=" in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


# --- the bundled SmolLM2 -----------------------------------------------------------------------------


@pytest.mark.smollm2
def test_smollm2_mt_bench_greedy_match(tmp_path, smollm2):
    """On the real 135M target and MT-bench's first prompt, speculative output equals HF generate's."""
    from eagle.evaluate import evaluate

    model, _, info = smollm2
    cfg = head_config_from_target(model.config, DraftConfig(algorithm="eagle3", draft_vocab_size=None), info)
    torch.manual_seed(0)
    save_head(build_head(cfg, model), tmp_path / "head")
    r = evaluate(
        compose(
            [
                f"draft.path={tmp_path / 'head'}",
                "eval.prompts=mt_bench",
                "eval.max_prompts=1",
                "eval.warmup_prompts=0",
                "eval.baselines=[hf_generate]",
                "decode.max_new_tokens=6",
                "target.dtype=float32",
                f"output_dir={tmp_path / 'out'}",
            ]
        )
    )
    assert r["greedy_match"] == 1.0
    assert r["settings"]["prompt_ids"] == ["81"]


def test_acceptance_by_context_bucket_by_hand():
    lengths, contexts = [1, 3, 2, 4, 1, 2], [10, 1023, 1024, 2047, 5000, 9000]
    rows = metrics.by_context(lengths, contexts)
    assert [(r["context"], r["steps"]) for r in rows] == [("<1K", 2), ("1-2K", 2), ("4-8K", 1), (">=8K", 1)]
    assert rows[0]["tau"] == pytest.approx(2.0) and rows[1]["tau"] == pytest.approx(3.0)
    assert rows[1]["accept_rate_by_depth"] == pytest.approx([1.0, 0.5, 1.0])  # drafts 1 and 3
    with pytest.raises(ValueError, match="context lengths"):
        metrics.by_context([1, 2], [5])


def test_report_splits_acceptance_by_context(greedy_report):
    """Every verify step is in one bucket, and the buckets' steps and tokens add up to the report's."""
    rows = greedy_report["by_context"]
    assert rows and rows[0]["context"] == "<1K"
    steps = sum(len(p["accept_lengths"]) for p in greedy_report["per_prompt"])
    assert sum(r["steps"] for r in rows) == steps
    assert sum(r["tau"] * r["steps"] for r in rows) == pytest.approx(greedy_report["tau"] * steps)
    for p in greedy_report["per_prompt"]:
        contexts = p["context_lengths"]
        assert len(contexts) == len(p["accept_lengths"])
        # within a turn the context grows by what each step emitted
        first = p["turns"][0]
        steps0 = first["target_forwards"]
        grown = [b - a for a, b in zip(contexts[: steps0 - 1], contexts[1:steps0], strict=True)]
        assert grown == p["accept_lengths"][: steps0 - 1]
        assert contexts[0] == first["prompt_tokens"]  # the prompt is cached; the prefill's token is the first root


def test_humaneval_long_puts_each_problem_after_a_long_file_without_its_own_solution():
    from eagle.data.eval_prompts import LONG_FILE_CHARS, humaneval_long, load_eval_prompts

    short = {p.id: p.turns[0] for p in load_eval_prompts("humaneval")}
    long = load_eval_prompts("humaneval_long")
    assert len(long) == len(short) == 164 and len({p.id for p in long}) == 164
    for i, p in enumerate(long[:8]):
        task, _ = p.id.split("@")
        text = p.turns[0]
        assert text.endswith(short[task]) and len(p.turns) == 1
        assert LONG_FILE_CHARS[i % 4] <= len(text) - len(short[task]) < LONG_FILE_CHARS[i % 4] + 5000
        assert text.count(short[task]) == 1  # its own problem (and so its solution) is not in the file
    assert humaneval_long((100,))[0].turns[0].endswith(short["HumanEval/0"])
