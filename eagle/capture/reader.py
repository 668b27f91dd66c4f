"""Reading a capture for training: a memory-mapped Dataset, a shard-local shuffling sampler, collate.

Shards are opened with `safetensors.safe_open` and sliced per conversation, so only the rows of the
conversations actually read are paged in; nothing loads whole shards into RAM. Each shard is checked
against the manifest (size at construction, sha256 on first use, once per process).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.utils.data import Dataset, Sampler

from eagle.algorithms import get_algorithm
from eagle.capture.store import SHARD_METADATA_KEY, SPLITS, member_path, read_manifest, verify_shard
from eagle.config import ConfigError
from eagle.errors import CaptureError
from eagle.target.loading import TargetInfo
from eagle.target.structure import default_aux_layer_ids

FEATURE_NAMES = ("final_hidden", "aux_hidden", "positions")  # positions: [T, 3] int32, M-RoPE targets only


def check_compatible(
    manifest: dict[str, Any],
    target_info: TargetInfo,
    algorithm: str,
    aux_layer_ids: list[int] | None = None,
    data_dir: str | os.PathLike[str] | None = None,
) -> None:
    """Refuse a capture that cannot train a head of `algorithm` for this target.

    Every capture holds the final state (all EAGLE-1 needs); an algorithm with aux layers (EAGLE-3)
    needs aux states of exactly the requested layers (None = the default layers for this depth).
    """
    where = f"capture {data_dir}" if data_dir is not None else "the capture"
    if not manifest.get("complete", False):
        raise CaptureError(f"{where} is incomplete; re-run eagle-capture with the same settings to finish it")
    target = manifest.get("target", {})
    if target.get("fingerprint") != target_info.fingerprint:
        raise CaptureError(
            f"{where} was captured from target {target.get('source')!r} (fingerprint {target.get('fingerprint')}), "
            f"but this run's target is {target_info.source!r} (fingerprint {target_info.fingerprint}); "
            "capture again with this target or point train.data_dir at a matching capture"
        )
    if target.get("hidden_size") != target_info.hidden_size:
        raise CaptureError(
            f"{where} has hidden size {target.get('hidden_size')}, the target has {target_info.hidden_size}"
        )
    try:
        algo = get_algorithm(algorithm)
    except ConfigError as e:
        raise CaptureError(str(e)) from None
    if algo.num_aux_layers:
        want = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(target_info.num_layers)
        have = manifest.get("aux_layer_ids")
        if "aux_hidden" not in manifest.get("features", {}) or have != want:
            raise CaptureError(
                f"{where} holds aux layers {have} (algorithm={manifest.get('algorithm')}), "
                f"{algo.title} training here needs draft.aux_layer_ids={want}; capture again with "
                f"draft.algorithm={algo.name} draft.aux_layer_ids={want}"
            )


class CaptureDataset(Dataset):
    """Conversations of one split of a capture, as dicts of tensors.

    item: {"input_ids": LongTensor [T], "loss_mask": BoolTensor [T], "final_hidden": [T, H],
           "aux_hidden": [T, 3, H] (EAGLE-3 captures), "id": str}; features keep the storage dtype.
    """

    def __init__(self, data_dir: str | os.PathLike[str], split: str = "train", seed: int = 0, verify: bool = True):
        if split not in SPLITS:
            raise CaptureError(f"split={split!r} is not one of {', '.join(SPLITS)}")
        self.root = Path(data_dir)
        self.manifest = read_manifest(self.root)
        if not self.manifest.get("complete", False):
            raise CaptureError(
                f"capture {self.root} is incomplete ({self.manifest['totals']['shards']} shards recorded); "
                "re-run eagle-capture with the same settings to finish it"
            )
        self.split = split
        self.seed = seed
        self.verify = verify
        self.features = [n for n in FEATURE_NAMES if n in self.manifest.get("features", {})]
        self.entries = [e for e in self.manifest["shards"] if e["split"] == split]
        self._paths: list[Path] = []
        self._offsets: list[list[int]] = []
        self._ids: list[list[str]] = []
        self._index: list[tuple[int, int]] = []  # item -> (shard, conversation in shard)
        self._handles: dict[int, Any] = {}
        self._pid = os.getpid()
        for s, entry in enumerate(self.entries):
            # Size check now (cheap); sha256 on first use of the shard in each process.
            path = verify_shard(self.root, entry, check_sha=False) if verify else member_path(self.root, entry["file"])
            self._paths.append(path)
            offsets, ids = self._read_index(path, entry)
            self._offsets.append(offsets)
            self._ids.append(ids)
            self._index.extend((s, i) for i in range(len(ids)))

    def _read_index(self, path: Path, entry: dict[str, Any]) -> tuple[list[int], list[str]]:
        try:
            with safe_open(str(path), framework="pt") as f:
                offsets = f.get_tensor("offsets").tolist()
                meta = json.loads((f.metadata() or {}).get(SHARD_METADATA_KEY, "{}"))
                ids = [str(i) for i in meta.get("ids", [])]
                names = set(f.keys())
        except Exception as e:  # safetensors raises its own error types for unreadable headers
            raise CaptureError(
                f"{path}: not a readable safetensors shard ({e}); delete it and re-run eagle-capture"
            ) from e
        missing = [n for n in ("input_ids", "loss_mask", *self.features) if n not in names]
        if (
            missing
            or len(ids) != len(offsets) - 1
            or len(ids) != entry["conversations"]
            or offsets[-1] != entry["tokens"]
        ):
            raise CaptureError(
                f"{path}: contents disagree with {self.root / 'manifest.json'} (missing tensors {missing}, "
                f"{len(ids)} ids, {len(offsets) - 1} conversations, {offsets[-1] if offsets else 0} tokens; manifest "
                f"says {entry['conversations']} conversations, {entry['tokens']} tokens); re-capture this folder"
            )
        return offsets, ids

    def __len__(self) -> int:
        return len(self._index)

    def ids(self) -> list[str]:
        """Conversation ids in item order (from the shard indexes; no features are read)."""
        return [i for shard in self._ids for i in shard]

    @property
    def shard_sizes(self) -> list[int]:
        """Conversations per shard, in shard order (items are numbered shard by shard)."""
        return [len(ids) for ids in self._ids]

    def lengths(self) -> list[int]:
        """Token count of every item (for length-aware batching), without reading features."""
        return [self._offsets[s][i + 1] - self._offsets[s][i] for s, i in self._index]

    def _handle(self, s: int) -> Any:
        if os.getpid() != self._pid:  # a DataLoader worker: handles do not survive fork
            self._handles, self._pid = {}, os.getpid()
        if s not in self._handles:
            if self.verify:
                verify_shard(self.root, self.entries[s], check_sha=True)
            handle = safe_open(str(self._paths[s]), framework="pt")
            if self.verify:
                self._check_finite(s, handle)
            self._handles[s] = handle
        return self._handles[s]

    def _check_finite(self, s: int, handle: Any, rows: int = 4096) -> None:
        """Refuse a shard holding inf/nan features (once per shard per process, in row chunks).

        Captures made before `eagle-capture` refused overflow could store float16 infs; a head trained
        on them learns nothing (NaN loss). The shard was just read whole for its sha256, so this pass
        costs memory bandwidth only.
        """
        for name in self.features:
            if name == "positions":  # integers: nothing to overflow
                continue
            view = handle.get_slice(name)
            total = view.get_shape()[0]
            for lo in range(0, total, rows):
                chunk = view[lo : min(total, lo + rows)]  # [rows, H] or [rows, 3, H]
                if bool(torch.isfinite(chunk).all()):
                    continue
                bad = (~torch.isfinite(chunk)).flatten(1).any(dim=1).nonzero().flatten()
                token = lo + int(bad[0])
                conv = next(i for i in range(len(self._ids[s])) if self._offsets[s][i + 1] > token)
                raise CaptureError(
                    f"{self._paths[s]}: {name} holds non-finite values (first in conversation "
                    f"{self._ids[s][conv]!r}, {int((~torch.isfinite(chunk)).sum())} values in rows {lo}-{lo + len(chunk)}); "
                    "the capture overflowed its storage dtype. Re-capture with capture.dtype=bfloat16 into a new "
                    "output_dir."
                )

    def __getitem__(self, idx: int) -> dict[str, Any]:
        s, i = self._index[idx]
        lo, hi = self._offsets[s][i], self._offsets[s][i + 1]
        f = self._handle(s)
        item: dict[str, Any] = {
            "input_ids": f.get_slice("input_ids")[lo:hi].to(torch.long),  # [T]
            "loss_mask": f.get_slice("loss_mask")[lo:hi].to(torch.bool),  # [T]
            "id": self._ids[s][i],
        }
        for name in self.features:
            item[name] = f.get_slice(name)[lo:hi]  # [T, H] or [T, 3, H]
        return item

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_handles"] = {}  # open files are per process
        return state


class ShardShuffleSampler(Sampler[int]):
    """Deterministic order for (seed, epoch): shuffle the shards, then the items within each shard.

    Reading shard by shard keeps page-cache locality on large captures. With `world_size > 1`, rank
    r takes every world_size-th item of the shared order (the tail is padded by wrapping around so
    every rank gets the same count).
    """

    def __init__(
        self,
        shard_sizes: Sequence[int],
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.shard_sizes = list(shard_sizes)
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        """The full order over all ranks for the current epoch."""
        starts = [0]
        for n in self.shard_sizes:
            starts.append(starts[-1] + n)
        if not self.shuffle:
            return list(range(starts[-1]))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        out: list[int] = []
        for s in torch.randperm(len(self.shard_sizes), generator=g).tolist():
            out.extend(starts[s] + j for j in torch.randperm(self.shard_sizes[s], generator=g).tolist())
        return out

    def _mine(self) -> list[int]:
        order = self.order()
        if self.world_size == 1 or not order:
            return order
        per_rank = -(-len(order) // self.world_size)
        padded = (order * (per_rank * self.world_size // len(order) + 1))[: per_rank * self.world_size]
        return padded[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self._mine())

    def __len__(self) -> int:
        total = sum(self.shard_sizes)
        return total if self.world_size == 1 else -(-total // self.world_size)


def collate(items: Sequence[dict[str, Any]], pad_id: int = 0) -> dict[str, Any]:
    """Right-pad items into a batch: input_ids [B, T] long, loss_mask [B, T] bool, attention_mask
    [B, T] bool, final_hidden [B, T, H], aux_hidden [B, T, 3, H] (when present), ids list[str]."""
    if not items:
        raise ValueError("collate needs at least one item")
    width = max(int(it["input_ids"].shape[0]) for it in items)
    b = len(items)
    batch: dict[str, Any] = {
        "input_ids": torch.full((b, width), pad_id, dtype=torch.long),  # [B, T]
        "loss_mask": torch.zeros((b, width), dtype=torch.bool),  # [B, T]
        "attention_mask": torch.zeros((b, width), dtype=torch.bool),  # [B, T]
        "ids": [it["id"] for it in items],
    }
    if any("images" in it for it in items):  # online training on a vision-language target: each row's images
        batch["images"] = [tuple(it.get("images", ())) for it in items]
    for name in FEATURE_NAMES:
        if name in items[0]:
            first = items[0][name]
            batch[name] = torch.zeros((b, width, *first.shape[1:]), dtype=first.dtype)  # [B, T, ...]
    for row, it in enumerate(items):
        n = int(it["input_ids"].shape[0])
        batch["input_ids"][row, :n] = it["input_ids"]
        batch["loss_mask"][row, :n] = it["loss_mask"].to(torch.bool)
        batch["attention_mask"][row, :n] = True
        for name in FEATURE_NAMES:
            if name in batch:
                batch[name][row, :n] = it[name]
    return batch
