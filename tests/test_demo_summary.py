"""`make demo`'s summary (eagle/evaluate/summary.py) on synthetic eagle-eval reports: the float32
exactness line comes first and says lossless; a bf16 run's divergences read as near-ties with their
margins, not as a bare greedy_match=0.25; a real break is called a bug."""

import json

from eagle.evaluate.summary import demo_summary, float32_line, greedy_line


def report(dtype, matches, margins=(), all_numeric=True, limit=0.5):
    """An eagle-eval report.json with one turn per entry of `matches`; a False turn takes the next margin."""
    margins = iter(margins)
    turns = []
    for m in matches:
        div = None if m else {"position": 3, "margin": next(margins), "gap": 0.01}
        turns.append({"greedy_match": m, "divergence": div})
    found = [t["divergence"] for t in turns if t["divergence"]]
    return {
        "tau": 1.62,
        "speedup": 1.41,
        "speedup_vs_prompt_lookup": 1.12,
        "greedy_match": sum(matches) / len(matches),
        "settings": {"dtype": dtype},
        "divergence": {
            "divergent_turns": len(found),
            "turns": len(turns),
            "max_margin": max((d["margin"] for d in found), default=None),
            "margin_limit": limit,
            "all_numeric": all_numeric,
            "dtype": dtype,
        },
        "per_prompt": [{"turns": [t]} for t in turns],
    }


def test_float32_identical_reads_lossless():
    line = float32_line(report("float32", [True] * 4))
    assert line == "float32 (exact arithmetic): identical to HF generate on every turn (4/4): lossless"


def test_float32_divergence_is_a_bug():
    assert "NOT identical to HF generate on 1 of 4 turns: a decoder bug" in float32_line(
        report("float32", [True, True, False, True], margins=[2.0], all_numeric=False)
    )


def test_bf16_divergences_are_near_ties_with_margins():
    line = greedy_line(report("bfloat16", [False, True, False, False], margins=[0.110, 0.012, 0.034]))
    assert line.startswith("bfloat16: identical on 1/4 turns; 3 part at float32 near-ties")
    assert "margin 0.012, 0.034, 0.110; limit 0.5" in line  # each divergence, smallest first
    assert "not a decoder bug" in line
    assert "greedy_match" not in line


def test_bf16_divergence_beyond_the_limit_is_flagged():
    line = greedy_line(report("bfloat16", [False, True], margins=[3.2], all_numeric=False))
    assert "NOT all at near-ties (margins 3.200; limit 0.5): look for a decoder bug" in line


def test_bf16_identical_and_sampled():
    assert greedy_line(report("bfloat16", [True, True])) == "bfloat16: identical to HF generate on every turn (2/2)"
    sampled = {"greedy_match": None, "settings": {"dtype": "bfloat16"}, "per_prompt": [{"turns": [{}]}]}
    assert "not compared with HF generate" in greedy_line(sampled)


def write(path, data):
    path.mkdir(parents=True)
    (path / "report.json").write_text(json.dumps(data))


def test_demo_summary_bf16_run_with_its_float32_check(tmp_path):
    (tmp_path / "capture").mkdir()
    (tmp_path / "capture" / "manifest.json").write_text(json.dumps({"layers": [2], "shards": []}))
    write(tmp_path / "eval", report("bfloat16", [False, True, False, False], margins=[0.11, 0.012, 0.034]))
    write(tmp_path / "eval-float32", report("float32", [True] * 4))
    write(tmp_path / "eval-reference", report("bfloat16", [True] * 4))
    lines = demo_summary(tmp_path)
    assert lines[0] == f"capture: {tmp_path / 'capture'}  (manifest: layers)"
    assert lines[1] == (
        "exactness, the demo head: float32 (exact arithmetic): identical to HF generate on every turn (4/4): lossless"
    )
    assert lines[2] == "eval [bfloat16]: tau=1.62  speedup vs HF generate=1.41x  vs prompt lookup=1.12x"
    assert lines[3].startswith("  greedy: bfloat16: identical on 1/4 turns; 3 part at float32 near-ties")
    assert lines[4].startswith("eval-reference [bfloat16]:")
    assert lines[5] == "  greedy: bfloat16: identical to HF generate on every turn (4/4)"
    assert lines[6] == f"export: {tmp_path / 'export-vllm'}"


def test_demo_summary_float32_run_is_its_own_check(tmp_path):
    write(tmp_path / "eval", report("float32", [True] * 4))
    lines = demo_summary(tmp_path)
    assert lines[0].startswith("exactness, the demo head: float32 (exact arithmetic): identical")
    assert lines[2] == "  greedy: float32 (exact arithmetic): identical to HF generate on every turn (4/4): lossless"
