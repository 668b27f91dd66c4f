"""The EAGLE-3 reduced draft vocabulary, chosen from token frequencies of the training data.

Counted are the tokens the head must learn to predict: target tokens at positions whose loss mask
is 1. The `draft_vocab_size` most frequent ids are kept (special tokens such as eos always), and
the kept ids are SORTED by target id. Sorting makes the two maps consistent with boolean-mask
selection: `target_logits[..., t2d]` returns columns in increasing target id, i.e. in draft-id
order, and draft id d maps back to target id d + d2t[d] (the vLLM / SGLang convention).

Tokens outside the draft vocabulary cannot be drafted. In training their probability mass is
dropped: the soft target is the target distribution renormalised over the draft vocabulary (see
`eagle.algorithms.losses`), and `coverage` reports which share of the counted tokens the draft
vocabulary covers, so a too-small vocabulary is visible.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from eagle.target.structure import config_token_ids


def count_tokens(token_ids: torch.Tensor, loss_mask: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Occurrences [V] (int64) of each id in `token_ids` [...] where `loss_mask` [...] is nonzero."""
    ids = token_ids.reshape(-1).long()
    if loss_mask is not None:
        ids = ids[loss_mask.reshape(-1).to(torch.bool)]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size}) while counting the draft vocabulary")
    return torch.bincount(ids, minlength=vocab_size)


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int, special_ids: Iterable[int] = ()) -> torch.Tensor:
    """Target ids [draft_vocab_size] of the draft vocabulary, sorted ascending.

    Special ids come first in priority, then ids by decreasing count (ties: lower id first); if the
    data has fewer distinct tokens than `draft_vocab_size`, the rest is filled with never-seen ids
    from the low end of the vocabulary (ids are unique either way).
    """
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in [1, {vocab_size}]")
    specials = sorted({int(i) for i in special_ids if 0 <= int(i) < vocab_size})
    if len(specials) > draft_vocab_size:
        raise ValueError(f"{len(specials)} special tokens do not fit a draft vocabulary of {draft_vocab_size}")
    # Sort key: specials first, then count descending, then id ascending (stable sort on -count).
    score = counts.double().clone()
    score[specials] = float("inf")
    order = torch.sort(-score, stable=True).indices  # zero-count ids end up last, in id order
    return torch.sort(order[:draft_vocab_size]).values


def build_vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Vd], t2d bool [V]) for sorted draft ids: target = d + d2t[d]."""
    draft_ids = draft_ids.long()
    if draft_ids.numel() > 1 and not bool((draft_ids[1:] > draft_ids[:-1]).all()):
        raise ValueError("draft ids must be strictly increasing (sorted, unique)")
    d2t = draft_ids - torch.arange(draft_ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def draft_vocab_from_counts(
    counts: torch.Tensor, draft_vocab_size: int, special_ids: Sequence[int] = ()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(draft ids [Vd], d2t [Vd], t2d [V]) for the `draft_vocab_size` most useful ids."""
    ids = select_draft_vocab(counts, draft_vocab_size, special_ids)
    d2t, t2d = build_vocab_maps(ids, counts.numel())
    return ids, d2t, t2d


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of the counted tokens whose id is in the draft vocabulary (1.0 when nothing counted)."""
    total = int(counts.sum())
    return 1.0 if total == 0 else float(counts[t2d.to(counts.device)].sum()) / total


def special_token_ids(target_model: object) -> list[int]:
    """eos / bos / pad ids from a target's config and generation config (any may be a list)."""
    return sorted(
        config_token_ids(
            ("eos_token_id", "bos_token_id", "pad_token_id"),
            getattr(target_model, "config", None),
            getattr(target_model, "generation_config", None),
        )
    )
