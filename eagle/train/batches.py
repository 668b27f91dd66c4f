"""Training batches from a capture (offline) or from the frozen target in the loop (online).

Both modes go through the same code: a split is a list of conversations laid out in shards
(offline: the capture's shards; online: the same layout the capture would write, shard k = items
[k * capture.shard_size, (k + 1) * shard_size) of the data stage's split), ordered per epoch by the
capture reader's `ShardShuffleSampler`, cut into global batches, collated by the reader's `collate`.
Online mode then adds the features by running `extract_features`, the function the capture uses;
offline mode reads them. So the same data and seed give the same batches in both modes (up to the
capture's storage dtype).

Data position: (epoch, index) = the next global batch starts at item `index` of epoch `epoch`'s
order. A global batch of `train.batch_size` conversations is split into `grad_accum` micro-steps,
each into `world_size` equal rank slices; the position only depends on optimizer steps taken, so
training resumes (on any world size) exactly where it stopped. The tail of an epoch shorter than a
global batch is skipped (every step has the same number of conversations).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch import nn

from eagle.capture.features import extract_features, idle_forward, vision_batch
from eagle.capture.reader import CaptureDataset, ShardShuffleSampler, collate
from eagle.capture.store import member_path
from eagle.config import ConfigError
from eagle.errors import CaptureError
from eagle.heads.vocab import count_tokens
from eagle.target.shard import is_sharded


class SplitData(Protocol):
    """A split as items in shard layout, plus how its batches get their target features."""

    def __len__(self) -> int: ...

    @property
    def shard_sizes(self) -> list[int]: ...

    def item(self, index: int) -> dict[str, Any]: ...

    def lengths(self) -> list[int]: ...

    def featurize(self, batch: dict[str, Any], device: torch.device) -> dict[str, Any]: ...

    def idle_forward(self, device: torch.device) -> None: ...


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


class OfflineSplit:
    """One split of a capture (`CaptureDataset`); features come from the shards."""

    def __init__(self, data_dir: str | Path, split: str, seed: int = 0) -> None:
        self.dataset = CaptureDataset(data_dir, split=split, seed=seed)
        self.data_dir = Path(data_dir)
        self.split = split

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def shard_sizes(self) -> list[int]:
        return self.dataset.shard_sizes

    def item(self, index: int) -> dict[str, Any]:
        return self.dataset[index]

    def lengths(self) -> list[int]:
        return self.dataset.lengths()

    def featurize(self, batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
        batch = _to_device(batch, device)
        # Half-precision storage is for disk; compute reads float32 features (a few MB per batch).
        # CPU autocast cannot mix float16 inputs into bf16 regions (`at::autocast::prioritize`
        # rejects them), and float32 keeps the soft labels' LM-head input exact.
        return {
            k: (v.float() if isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16) else v)
            for k, v in batch.items()
        }

    def idle_forward(self, device: torch.device) -> None:
        """Nothing: features come from disk, no target forward to keep in step."""

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """Loss-mask token counts [V] of this split, read from the shards' ids (no features)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for entry in self.dataset.entries:
            path = member_path(self.data_dir, entry["file"])
            with safe_open(str(path), framework="pt") as f:
                ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")  # [N], [N]
            try:
                counts += count_tokens(ids, mask, vocab_size)
            except ValueError as e:
                raise CaptureError(f"{path}: {e}; the capture is from a target with another vocabulary") from e
        return counts


class ConversationSplit:
    """Tokenised conversations in the capture's shard layout, no features yet: what online and stream
    mode share (each adds its own `featurize`)."""

    def __init__(self, conversations: Sequence[Any], shard_size: int) -> None:
        self.conversations = list(conversations)  # TokenizedConversation: id, input_ids, loss_mask
        self.shard_size = shard_size

    def __len__(self) -> int:
        return len(self.conversations)

    @property
    def shard_sizes(self) -> list[int]:
        n, s = len(self.conversations), self.shard_size
        return [min(s, n - start) for start in range(0, n, s)]

    def lengths(self) -> list[int]:
        return [len(c.input_ids) for c in self.conversations]

    def item(self, index: int) -> dict[str, Any]:
        c = self.conversations[index]
        return {
            "input_ids": torch.tensor(c.input_ids, dtype=torch.long),  # [T]
            "loss_mask": torch.tensor(c.loss_mask, dtype=torch.bool),  # [T]
            "id": str(c.id),
            **({"images": tuple(c.images)} if getattr(c, "images", ()) else {}),  # a vision-language target's
        }

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for c in self.conversations:
            counts += count_tokens(torch.tensor(c.input_ids), torch.tensor(c.loss_mask), vocab_size)
        return counts


class OnlineSplit(ConversationSplit):
    """Tokenised conversations; features come from running the frozen target on each batch."""

    def __init__(
        self,
        conversations: Sequence[Any],  # TokenizedConversation: id, input_ids, loss_mask
        shard_size: int,
        target: nn.Module,
        aux_layer_ids: list[int] | None,
    ) -> None:
        super().__init__(conversations, shard_size)
        self.target = target
        self.aux_layer_ids = aux_layer_ids

    def featurize(self, batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
        batch = _to_device(batch, device)
        vision = vision_batch(self.target, batch.get("images", ()), device)  # the rows' images, if any
        feats = extract_features(
            self.target, batch["input_ids"], batch["attention_mask"].long(), self.aux_layer_ids, vision
        )
        # Inference tensors cannot be saved for backward; a clone outside inference mode can.
        batch.update({k: v.clone() for k, v in feats.items()})
        return batch

    def idle_forward(self, device: torch.device) -> None:
        """A dropped target forward where the target is sharded (target.shard=fsdp), for a rank that has
        fewer batches than another: every rank must run as many target forwards."""
        if is_sharded(self.target):
            idle_forward(self.target, device)


def truncate_item(item: dict[str, Any], max_length: int) -> dict[str, Any]:
    """Cut an item's per-token tensors to `max_length` tokens (train.max_length)."""
    if int(item["input_ids"].shape[0]) <= max_length:
        return item
    return {k: (v[:max_length] if isinstance(v, torch.Tensor) else v) for k, v in item.items()}


# Conversations sorted together by `group_by_length`: windows of this many global batches. Wide
# enough that neighbours in length are close (padding a few %), narrow enough that a window still
# mixes conversations from across the shuffled order.
GROUP_WINDOW_BATCHES = 32


def group_by_length(
    order: list[int], lengths: Sequence[int], batch_size: int, max_length: int, generator: torch.Generator
) -> list[int]:
    """`order` regrouped so that each run of `batch_size` items has similar (truncated) lengths.

    Windows of GROUP_WINDOW_BATCHES x batch_size consecutive items are sorted by length and cut
    into batches; the batches of a window are then shuffled (with `generator`), so long and short
    batches alternate. Every item stays in its window: the epoch holds the same items, and the
    shuffle's randomness over windows is kept. The tail shorter than a window is grouped likewise.
    """
    window = GROUP_WINDOW_BATCHES * batch_size
    out: list[int] = []
    for lo in range(0, len(order), window):
        chunk = sorted(order[lo : lo + window], key=lambda i: (min(lengths[i], max_length), i))
        batches = [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size)]
        full = [b for b in batches if len(b) == batch_size]
        # A short last batch stays last: the epoch's tail that BatchStream drops is never a full batch.
        for k in torch.randperm(len(full), generator=generator).tolist():
            out.extend(full[k])
        out.extend(i for b in batches if len(b) < batch_size for i in b)
    return out


@dataclass
class DataPosition:
    epoch: int = 0
    index: int = 0


def micro_slices(batch_size: int, grad_accum: int, world_size: int, rank: int) -> list[slice]:
    """Slices of a global batch that `rank` trains on, one per micro-step.

    Micro-step a covers items [a * B/A, (a + 1) * B/A); rank r takes the r-th of its W equal parts.
    """
    if batch_size % (grad_accum * world_size):
        raise ConfigError(
            f"train.batch_size={batch_size} must be divisible by train.grad_accum={grad_accum} x "
            f"{world_size} processes (each process trains on equal micro-batches)"
        )
    micro = batch_size // grad_accum
    per_rank = micro // world_size
    return [slice(a * micro + rank * per_rank, a * micro + (rank + 1) * per_rank) for a in range(grad_accum)]


def warn_cut_sequences(lengths: list[int], max_length: int, rank: int = 0) -> None:
    """Say when training sequences are longer than train.max_length: only their first max_length tokens are
    trained, which silently undoes a long-context capture (data.pack=true data.max_length=4096)."""
    longer = [n for n in lengths if n > max_length]
    if longer and rank == 0:
        print(
            f"train: note: {len(longer)} of {len(lengths)} training sequences are longer than "
            f"train.max_length={max_length} (longest {max(longer)}); only their first {max_length} tokens are "
            "trained: raise train.max_length to train on all of them",
            file=sys.stderr,
            flush=True,
        )


class BatchStream:
    """Deterministic, resumable stream of this rank's micro-batches for each optimizer step."""

    def __init__(
        self,
        data: SplitData,
        seed: int,
        batch_size: int,
        grad_accum: int,
        max_length: int,
        pad_id: int,
        rank: int = 0,
        world_size: int = 1,
        position: DataPosition | None = None,
        group_lengths: bool = False,
    ) -> None:
        if len(data) < batch_size:
            raise ConfigError(
                f"the training split has {len(data)} conversations, fewer than train.batch_size={batch_size}; "
                "lower train.batch_size or use more data"
            )
        self.data = data
        self.sampler = ShardShuffleSampler(data.shard_sizes, seed=seed, shuffle=True)
        self.batch_size = batch_size
        self.slices = micro_slices(batch_size, grad_accum, world_size, rank)
        self.max_length = max_length
        self.pad_id = pad_id
        self.position = position or DataPosition()
        self.seed = seed
        lengths = data.lengths()
        self.lengths = lengths if group_lengths else None
        warn_cut_sequences(lengths, max_length, rank)
        self._order_epoch: int | None = None
        self._order: list[int] = []

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            self.sampler.set_epoch(epoch)
            order = self.sampler.order()
            if self.lengths is not None:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch + 7_919)  # not the sampler's stream
                order = group_by_length(order, self.lengths, self.batch_size, self.max_length, g)
            self._order, self._order_epoch = order, epoch
        return self._order

    def next_indices(self) -> list[int]:
        """Item indices of the next global batch; advances the position."""
        pos = self.position
        if pos.index + self.batch_size > len(self.data):  # drop the short tail of an epoch
            pos = DataPosition(pos.epoch + 1, 0)
        order = self._epoch_order(pos.epoch)
        indices = order[pos.index : pos.index + self.batch_size]
        self.position = DataPosition(pos.epoch, pos.index + self.batch_size)
        return indices

    def upcoming(self, count: int) -> list[int]:
        """This rank's next `count` item indices in the order its micro-batches will take them, from the
        current position on (across epochs), without moving it: what stream mode requests ahead."""
        out: list[int] = []
        pos = self.position
        while len(out) < count:
            if pos.index + self.batch_size > len(self.data):
                pos = DataPosition(pos.epoch + 1, 0)
            indices = self._epoch_order(pos.epoch)[pos.index : pos.index + self.batch_size]
            out.extend(i for sl in self.slices for i in indices[sl])
            pos = DataPosition(pos.epoch, pos.index + self.batch_size)
        return out[:count]

    def next_step(self) -> tuple[list[dict[str, Any]], list[str]]:
        """(this rank's collated micro-batches on CPU, features not yet added; ids of this rank's items)."""
        indices = self.next_indices()
        micro = []
        ids: list[str] = []
        for sl in self.slices:
            items = [truncate_item(self.data.item(i), self.max_length) for i in indices[sl]]
            batch = collate(items, pad_id=self.pad_id)
            ids.extend(batch["ids"])
            micro.append(batch)
        return micro, ids


def eval_batch_count(num_items: int, split_size: int, micro_size: int, world_size: int) -> int:
    """The most micro-batches `eval_batches` gives any rank: rank 0's (it takes items 0, W, 2W, ...)."""
    per_rank = -(-min(num_items, split_size) // world_size)
    return -(-per_rank // micro_size)


def eval_batches(
    data: SplitData,
    num_items: int,
    micro_size: int,
    max_length: int,
    pad_id: int,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[dict[str, Any]]:
    """This rank's share of the first `num_items` held-out conversations (fixed order), collated
    lazily (one micro-batch in memory at a time)."""
    mine = list(range(min(num_items, len(data))))[rank::world_size]
    for start in range(0, len(mine), micro_size):
        items = [truncate_item(data.item(i), max_length) for i in mine[start : start + micro_size]]
        yield collate(items, pad_id=pad_id)
