"""Fuzzing the data path: any file or record either loads or raises EagleError; masks never crash."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle.config import DataConfig
from eagle.data.dataset import load_conversations
from eagle.data.records import Conversation, SkipRecord, normalise_record
from eagle.data.template import tokenize_with_reason
from eagle.errors import EagleError
from tests.tiny_models import FAMILIES, TEMPLATES, make_tokenizer

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
roles = st.sampled_from(["human", "gpt", "user", "assistant", "system", "bing", "tool", "", "GPT"])
turn = st.one_of(
    st.fixed_dictionaries({"from": roles, "value": st.text(max_size=30) | json_values}),
    st.fixed_dictionaries({"role": roles, "content": st.text(max_size=30) | json_values}),
    json_values,
)
records = st.one_of(
    st.fixed_dictionaries({"id": st.text(max_size=5) | st.integers(), "conversations": st.lists(turn, max_size=5)}),
    st.fixed_dictionaries({"messages": st.lists(turn, max_size=5)}, optional={"system": json_values}),
    json_values,
)


@FAST
@given(records)
def test_any_record_normalises_or_fails_cleanly(record):
    try:
        conv = normalise_record(record, index=0, source="fuzz")
    except (EagleError, SkipRecord):
        return
    assert conv.messages and all(m["role"] in ("system", "user", "assistant") for m in conv.messages)
    assert conv.messages[-1]["role"] == "assistant"


@FAST
@given(st.lists(records, max_size=4), st.sampled_from([".json", ".jsonl"]), st.integers(0, 40), st.booleans())
def test_any_file_loads_or_raises_eagle_error(recs, suffix, cut, as_object):
    if suffix == ".jsonl":
        text = "".join(json.dumps(r) + "\n" for r in recs)
    else:
        text = json.dumps({"data": recs} if as_object else recs)
    if cut:  # damage the file: drop a few characters from the end
        text = text[: max(0, len(text) - cut)]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"f{suffix}"
        path.write_text(text)
        try:
            convs, stats = load_conversations(DataConfig(source="local", path=str(path), dedup_against=[]))
        except EagleError:
            return
    assert len(convs) + sum(stats.skipped.values()) == stats.read  # every record is accounted for


specials = [s for f in FAMILIES for s in TEMPLATES[f][1]]
contents = (
    st.text(min_size=1, max_size=25)
    | st.sampled_from(specials).map(lambda s: f" {s} x")
    | st.sampled_from(["\u200b", "🙂🙂", " \n\t ok", "{{ x }}", "{% if %}", "Ġ", "\x00", "ok<|im_end|>"])
)


@FAST
@given(
    st.sampled_from(FAMILIES),
    st.lists(contents, min_size=2, max_size=6),
    st.integers(4, 200),
    st.sampled_from(["truncate", "drop"]),
)
def test_mask_builder_never_crashes(family, texts, max_length, overflow):
    tok = _tokenizers(family)
    messages = [{"role": "user" if k % 2 == 0 else "assistant", "content": t} for k, t in enumerate(texts)]
    try:
        from eagle.data.records import check_messages, trim_trailing

        check_messages(messages)
        messages = trim_trailing(messages)
    except SkipRecord:
        return
    tc, reason = tokenize_with_reason(Conversation("f", messages), tok, max_length, overflow)
    if tc is None:
        assert reason in ("too_long", "empty_loss_mask", "template_error")
        return
    assert len(tc.input_ids) == len(tc.loss_mask) <= max_length
    assert set(tc.loss_mask) <= {0, 1} and any(tc.loss_mask)
    if not tc.truncated and not tc.fallback_turns:
        # Every answer's text is inside the masked tokens, and the first prompt token is not.
        masked = tok.decode([t for t, m in zip(tc.input_ids, tc.loss_mask, strict=True) if m])
        for m in messages:
            if m["role"] == "assistant":
                assert m["content"].strip() in masked
        assert tc.loss_mask[0] == 0


_CACHE: dict = {}


def _tokenizers(family):
    if family not in _CACHE:
        _CACHE[family] = make_tokenizer(family)
    return _CACHE[family]
