"""Tree maths: fast functions equal their loop references; static/dynamic tree construction."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle.decode.tree import (
    TreeError,
    compile_static_tree,
    depths_of,
    reindex_parents,
    retrieval_paths,
    retrieval_paths_reference,
    select_dynamic,
    select_dynamic_reference,
    tree_mask,
    tree_mask_reference,
)


@st.composite
def parent_lists(draw, max_nodes: int = 40) -> list[int]:
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


@settings(max_examples=60, deadline=None)
@given(parent_lists())
def test_tree_mask_matches_reference(parents):
    p = torch.tensor(parents)
    assert torch.equal(tree_mask(p), tree_mask_reference(parents))


@settings(max_examples=60, deadline=None)
@given(parent_lists())
def test_retrieval_paths_match_reference(parents):
    p = torch.tensor(parents)
    fast = retrieval_paths(p)
    ref = retrieval_paths_reference(parents)
    # Same set of rows (leaf order is by leaf index in both).
    assert fast.tolist() == ref.tolist()
    d = depths_of(p)
    assert d[0] == 0 and all(int(d[i]) == int(d[parents[i]]) + 1 for i in range(1, len(parents)))


def test_tree_mask_small_example():
    #      0
    #     / \
    #    1   2
    #    |
    #    3
    m = tree_mask(torch.tensor([-1, 0, 0, 1]))
    assert m.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, True, False],
        [True, True, False, True],
    ]
    assert retrieval_paths(torch.tensor([-1, 0, 0, 1])).tolist() == [[0, 2, -1], [0, 1, 3]]


def test_compile_static_tree_orders_breadth_first():
    t = compile_static_tree([[0, 0], [1], [0], [0, 1], [0, 0, 0]])
    assert t.parents == [-1, 0, 0, 1, 1, 3]
    assert t.ranks == [-1, 0, 1, 0, 1, 0]
    assert t.depths == [0, 1, 1, 2, 2, 3]


@pytest.mark.parametrize("paths", [[[0, 1]], [[0], [0]], [[]], [[0], [-1]]])
def test_compile_static_tree_rejects_bad_paths(paths):
    with pytest.raises(TreeError):
        compile_static_tree(paths)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_select_dynamic_matches_reference_and_keeps_ancestors(data):
    # A pool like the drafter's: children's cumulative scores are parent score + log q (<= 0), with
    # deliberate ties (log q = 0 and repeated values).
    m = data.draw(st.integers(1, 30))
    parents, scores = [], []
    for i in range(m):
        par = data.draw(st.integers(-1, i - 1))
        step = data.draw(st.sampled_from([0.0, -0.5, -1.0, -1.0, -2.0]))
        parents.append(par)
        scores.append((scores[par] if par >= 0 else 0.0) + step)
    total = data.draw(st.integers(1, m + 2))
    kept = select_dynamic(torch.tensor(scores), torch.tensor(parents), total)
    assert kept.tolist() == select_dynamic_reference(scores, parents, total)
    kept_set = set(kept.tolist())
    for k in kept_set:
        assert parents[k] == -1 or parents[k] in kept_set
    new_parents = reindex_parents(kept, torch.tensor(parents))
    assert all(0 <= int(q) <= i for i, q in enumerate(new_parents.tolist()))  # parents before children
