"""The EAGLE-3 draft vocabulary: selection, sorting, d2t / t2d consistency, coverage."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle.heads.vocab import (
    build_vocab_maps,
    count_tokens,
    coverage,
    draft_vocab_from_counts,
    select_draft_vocab,
)


def test_most_frequent_kept_sorted_with_specials():
    counts = torch.zeros(50, dtype=torch.long)
    counts[[40, 3, 17, 8]] = torch.tensor([100, 50, 20, 10])
    ids = select_draft_vocab(counts, 4, special_ids=[49])
    assert ids.tolist() == [3, 17, 40, 49]  # top-3 by count + the special, sorted by target id


def test_fewer_distinct_tokens_than_draft_vocab_pads_with_low_ids():
    counts = torch.zeros(30, dtype=torch.long)
    counts[[20, 25]] = 5
    ids = select_draft_vocab(counts, 5, special_ids=[29])
    assert ids.tolist() == [0, 1, 20, 25, 29]


def test_count_tokens_respects_loss_mask_and_range():
    ids = torch.tensor([[1, 2, 2, 3]])
    counts = count_tokens(ids, torch.tensor([[0, 1, 1, 1]]), 5)
    assert counts.tolist() == [0, 0, 2, 1, 0]
    with pytest.raises(ValueError, match="outside"):
        count_tokens(torch.tensor([7]), None, 5)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=40, max_size=40), st.integers(1, 40), st.integers(0, 39))
def test_maps_line_up_with_mask_selection(raw_counts, vd, special):
    counts = torch.tensor(raw_counts)
    ids, d2t, t2d = draft_vocab_from_counts(counts, vd, special_ids=[special])
    assert ids.numel() == vd == int(t2d.sum()) and special in ids.tolist()
    d = torch.arange(vd)
    assert torch.equal(d + d2t[d], ids)  # draft id -> target id
    logits = torch.randn(3, 40)
    # Bool-mask selection returns the draft-vocab columns in draft-id order.
    assert torch.equal(logits[..., t2d], logits[..., d + d2t[d]])
    # No kept id has a smaller count than a dropped non-special id.
    dropped = counts[~t2d]
    kept = counts[t2d & (torch.arange(40) != special)]
    if dropped.numel() and kept.numel():
        assert int(kept.min()) >= int(dropped.max())


def test_coverage_and_unsorted_ids_rejected():
    counts = torch.tensor([6, 0, 3, 1])
    _, t2d = build_vocab_maps(torch.tensor([0, 2]), 4)
    assert coverage(counts, t2d) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="increasing"):
        build_vocab_maps(torch.tensor([2, 0]), 4)
