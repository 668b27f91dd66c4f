"""Self-distillation on a tiny target: turn-by-turn answers, output format, resume, torn lines."""

from __future__ import annotations

import json

import pytest

from eagle.config import DataConfig, RegenerateConfig
from eagle.data.dataset import load_conversations
from eagle.data.template import end_of_turn_ids
from eagle.errors import DataError
from eagle.regenerate.local import regenerate_batch
from eagle.regenerate.output import recover_output
from eagle.regenerate.runner import regenerate
from tests.support.data import CONVS

CFG = RegenerateConfig(batch_size=2, max_new_tokens=6)
ENGINES = ("continuous", "generate")


def test_turn_by_turn_replies_feed_the_regenerated_history(tiny_qwen2, monkeypatch):
    model, tok = tiny_qwen2
    from eagle.regenerate import local as mod

    seen = []
    real = mod.generate_replies

    def spy(model, tokenizer, prompts, cfg, stop_ids):
        seen.append([list(p) for p in prompts])
        return real(model, tokenizer, prompts, cfg, stop_ids)

    monkeypatch.setattr(mod, "generate_replies", spy)
    records = regenerate_batch(model, tok, CONVS[:2], CFG, end_of_turn_ids(tok))
    assert [r["id"] for r in records] == ["a", "b"]
    assert len(seen) == 2 and len(seen[0]) == 2 and len(seen[1]) == 1  # round 2: only "a" has a 2nd turn
    a = records[0]["messages"]
    assert [m["role"] for m in a] == ["system", "user", "assistant", "user", "assistant"]
    assert all(m["content"] != "ORIGINAL" for m in a)
    # The second prompt holds the regenerated first answer, not the original.
    assert a[2]["content"] in tok.decode(seen[1][0]) and "ORIGINAL" not in tok.decode(seen[1][0])
    # Greedy replies in a left-padded batch equal those generated one by one.
    solo = regenerate_batch(model, tok, CONVS[1:2], CFG, end_of_turn_ids(tok))
    assert solo[0] == records[1]


# The fast tier keeps the default (continuous) engine; the generate engine runs in make test.
@pytest.mark.parametrize("engine", ["continuous", pytest.param("generate", marks=pytest.mark.slow)])
def test_output_resume_and_torn_line(tiny_qwen2, tmp_path, engine):
    model, tok = tiny_qwen2
    cfg = RegenerateConfig(batch_size=2, max_new_tokens=6, engine=engine)
    out = tmp_path / "regen.jsonl"
    regenerate(model, tok, CONVS, cfg, out, target_fingerprint="t", progress=False)
    full = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in full) == ["a", "b", "c"]

    # A hard kill after the first record, mid-way through writing the second.
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    assert recover_output(out) == {full[0]["id"]}
    assert out.read_text() == lines[0]  # the torn line is cut off
    out.write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    regenerate(model, tok, CONVS, cfg, out, target_fingerprint="t", progress=False)
    resumed = [json.loads(x) for x in out.read_text().splitlines()]
    by_id = lambda records: sorted(records, key=lambda r: r["id"])  # noqa: E731
    assert by_id(resumed) == by_id(full)  # greedy: the resumed run writes what the uninterrupted one did

    # The output reads back through the local reader.
    convs, stats = load_conversations(DataConfig(source="local", path=str(out), dedup_against=[]))
    assert len(convs) + sum(stats.skipped.values()) == 3 and stats.read == 3  # nothing lost silently
    assert len(convs) >= 1
    by_id = {r["id"]: r["messages"] for r in full}
    assert all(c.messages == by_id[c.id] for c in convs)


# The fast tier keeps the default (continuous) engine; the generate engine runs in make test.
@pytest.mark.parametrize("engine", ["continuous", pytest.param("generate", marks=pytest.mark.slow)])
def test_records_keep_the_generated_ids_and_training_reads_those(tiny_qwen2, tmp_path, engine):
    from eagle.data.dataset import build_splits
    from tests.test_template_token_ids import masked_runs

    model, tok = tiny_qwen2
    out = tmp_path / "regen.jsonl"
    regenerate(model, tok, CONVS, RegenerateConfig(batch_size=2, max_new_tokens=6, engine=engine), out, progress=False)
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    stops = set(end_of_turn_ids(tok))
    generated: dict[str, list[list[int]]] = {}
    for cid, record in records.items():
        for m in record["messages"]:
            if m["role"] != "assistant":
                assert "token_ids" not in m
                continue
            ids = m["token_ids"]
            assert 0 < len(ids) <= 6 and not stops & set(ids)  # the answer's ids, stop token excluded
            assert m["content"] == tok.decode(ids, skip_special_tokens=True).strip()
            generated.setdefault(cid, []).append(ids)
    # The point of keeping them: the text alone re-tokenises to other ids for some of these answers.
    assert any(
        tok(tok.decode(ids, skip_special_tokens=True).strip(), add_special_tokens=False)["input_ids"] != ids
        for answers in generated.values()
        for ids in answers
    )
    # data=local reads them back; the tokenised conversation's masked tokens are the generated ids, each
    # followed by the template's end-of-turn token.
    splits = build_splits(
        DataConfig(source="local", path=str(out), dedup_against=[], heldout_fraction=0.0), tok, progress=False
    )
    assert sorted(tc.id for tc in splits.train) == sorted(generated)
    eot = end_of_turn_ids(tok)[0]
    for tc in splits.train:
        assert masked_runs(tc) == [ids + [eot] for ids in generated[tc.id]]
    assert (splits.stats.id_turns, splits.stats.id_fallback_turns) == (sum(map(len, generated.values())), 0)


def test_resume_refuses_other_settings_and_corrupt_files(tiny_qwen2, tmp_path):
    model, tok = tiny_qwen2
    out = tmp_path / "regen.jsonl"
    regenerate(model, tok, CONVS[:1], CFG, out, target_fingerprint="t", progress=False)
    with pytest.raises(DataError, match="different settings"):
        regenerate(
            model,
            tok,
            CONVS,
            RegenerateConfig(batch_size=2, max_new_tokens=7),
            out,
            target_fingerprint="t",
            progress=False,
        )
    with pytest.raises(DataError, match="target"):
        regenerate(model, tok, CONVS, CFG, out, target_fingerprint="other", progress=False)
    out.write_text("garbage\n" + out.read_text())
    with pytest.raises(DataError, match="line 1 is not a regenerated record"):
        regenerate(model, tok, CONVS, CFG, out, target_fingerprint="t", progress=False)


@pytest.mark.slow  # ~16 s; seeds per conversation are also checked in test_continuous.py
@pytest.mark.parametrize("engine", ENGINES)
def test_sampling_is_seeded(tiny_qwen2, tmp_path, engine):
    model, tok = tiny_qwen2
    cfg = RegenerateConfig(batch_size=3, max_new_tokens=6, temperature=1.0, top_k=50, seed=3, engine=engine)
    outs = []
    for k in range(2):
        path = tmp_path / f"s{k}.jsonl"
        regenerate(model, tok, CONVS, cfg, path, progress=False)
        outs.append(path.read_text())
    assert outs[0] == outs[1]


@pytest.mark.parametrize("engine", ENGINES)
def test_empty_reply_ends_the_conversation_and_is_counted_on_read(tiny_qwen2, tmp_path, monkeypatch, engine):
    model, tok = tiny_qwen2
    from eagle.decode.continuous import ContinuousGenerator
    from eagle.regenerate import local as mod

    stop = end_of_turn_ids(tok)[0]
    monkeypatch.setattr(mod, "generate_replies", lambda m, t, prompts, c, s: [[] for _ in prompts])
    monkeypatch.setattr(ContinuousGenerator, "_choose", lambda self, logits, slots: [stop] * len(slots))
    out = tmp_path / "e.jsonl"
    regenerate(
        model, tok, CONVS[1:2], RegenerateConfig(batch_size=2, max_new_tokens=6, engine=engine), out, progress=False
    )
    assert recover_output(out) == {"b"}  # marked done: a restart does not retry it forever
    with pytest.raises(DataError, match="no_assistant_turn=1"):
        from eagle.data.dataset import build_splits

        build_splits(DataConfig(source="local", path=str(out), dedup_against=[]), tok)


def test_cli_stage_on_a_checkpoint_folder(tiny_target_dir, tmp_path):
    from eagle.cli.app import compose
    from eagle.cli.regenerate import regenerate_stage

    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in CONVS))
    cfg = compose(
        [
            f"target.path={tiny_target_dir}",
            "target.dtype=float32",
            "data=local",
            f"data.path={data}",
            "data.dedup_against=[]",
            f"output_dir={tmp_path / 'run'}",
            "regenerate.max_new_tokens=4",
        ]
    )
    regenerate_stage(cfg)
    out = tmp_path / "run" / "regenerated.jsonl"
    assert sorted(json.loads(x)["id"] for x in out.read_text().splitlines()) == ["a", "b", "c"]
    assert json.loads((tmp_path / "run" / "regenerated.jsonl.meta.json").read_text())["dtype"] == "float32"
    assert (tmp_path / "run" / "regenerated.jsonl.meta.json").is_file()
