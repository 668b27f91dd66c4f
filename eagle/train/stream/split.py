"""`train.mode=stream`: a training split whose features come from vLLM servers (`StreamSplit`).

The split is online mode's (the data stage's tokenised conversations in the capture's shard layout,
`ConversationSplit`), so the same data and seed give the same batches as offline and online training;
only `featurize` differs: each row's tokens (already cut at train.max_length) go to a server, and the
states come back as the features offline training reads from a `capture.backend=vllm` capture. Loss
masks never leave the trainer. The trainer's batch stream tells the split what comes next (`follow`),
so `train.stream.prefetch` samples are requested ahead of the step that needs them.

A row whose sample cannot be served keeps zero features and a loss mask of zeros, so it trains
nothing; the sample is counted and named in the run summary (`report`). Its tokens were already
counted in that step's loss denominators (counted before features are fetched), so that step's update
is smaller by their share: the summary says how many there were.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from eagle.train.batches import ConversationSplit
from eagle.train.stream.pool import Sample, StatesPool


def sample_key(conversation_id: str, token_ids: list[int]) -> str:
    """The same conversation and tokens, the same key (a row of a batch and the prefetch agree on it)."""
    digest = hashlib.sha1(json.dumps([conversation_id, token_ids]).encode(), usedforsecurity=False)
    return digest.hexdigest()


class StreamSplit(ConversationSplit):
    """Conversations whose target features a `StatesPool` of servers supplies (see the module docstring)."""

    def __init__(
        self,
        conversations: Sequence[Any],  # TokenizedConversation: id, input_ids, loss_mask
        shard_size: int,
        pool: StatesPool,
        max_length: int,
        hidden_size: int,
        aux_layers: int,
        ledger: Path | None = None,
    ) -> None:
        super().__init__(conversations, shard_size)
        self.pool = pool
        self.max_length = max_length
        self.hidden_size = hidden_size
        self.aux_layers = aux_layers  # aux_hidden's layer count (0: the algorithm reads final_hidden only)
        self.ledger = ledger  # unservable samples, one JSON line each: the summary counts them across resumes
        self._upcoming: Callable[[int], list[int]] | None = None
        self._logged: set[str] = set()

    def follow(self, upcoming: Callable[[int], list[int]]) -> None:
        """Request ahead along `upcoming(n)`: this rank's next n item indices (`BatchStream.upcoming`)."""
        self._upcoming = upcoming

    def sample(self, index: int) -> Sample:
        c = self.conversations[index]
        tokens = [int(t) for t in c.input_ids[: self.max_length]]
        return Sample(sample_key(str(c.id), tokens), tokens, str(c.id))

    def featurize(self, batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
        """batch (input_ids [B, T], attention_mask [B, T], loss_mask [B, T], ids) -> the same plus
        final_hidden [B, T, H] and aux_hidden [B, T, 3, H] (float32) from the servers."""
        lengths = [int(n) for n in batch["attention_mask"].sum(dim=1).tolist()]
        rows = [
            Sample(sample_key(str(cid), tokens), tokens, str(cid))
            for cid, tokens in (
                (cid, [int(t) for t in batch["input_ids"][r, :n].tolist()])
                for r, (cid, n) in enumerate(zip(batch["ids"], lengths, strict=True))
            )
        ]
        self.pool.want(rows)
        if self._upcoming is not None and self.pool.prefetch > 0:
            self.pool.want(self.sample(i) for i in self._upcoming(self.pool.prefetch))
        got = [self.pool.take(s) for s in rows]
        b, t = batch["input_ids"].shape
        final = torch.zeros((b, t, self.hidden_size), dtype=torch.float32)  # [B, T, H]
        aux = None
        if self.aux_layers:
            aux = torch.zeros((b, t, self.aux_layers, self.hidden_size), dtype=torch.float32)  # [B, T, 3, H]
        for r, (sample, features) in enumerate(zip(rows, got, strict=True)):
            n = len(sample.token_ids)
            if features is None:
                batch["loss_mask"][r] = False  # unservable: trains nothing, reported in the summary
                self._record(sample)
                continue
            final[r, :n] = features["final_hidden"]
            if aux is not None:
                aux[r, :n] = features["aux_hidden"]
        batch["final_hidden"] = final
        if aux is not None:
            batch["aux_hidden"] = aux
        return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    def idle_forward(self, device: torch.device) -> None:
        """Nothing: the servers run the target, no forward here to keep in step."""

    def _record(self, sample: Sample) -> None:
        if self.ledger is None or sample.label in self._logged:
            return
        self._logged.add(sample.label)
        line = json.dumps({"id": sample.label, "reason": self.pool.report.unservable.get(sample.label, "")})
        self.ledger.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    def report(self) -> dict[str, Any]:
        """What the run summary says: samples per server, requeued samples, dropped servers, and every
        unservable conversation of the run (this session's and earlier sessions', from the ledger)."""
        r = self.pool.report
        unservable = dict(r.unservable)
        if self.ledger is not None and self.ledger.is_file():
            for line in self.ledger.read_text().splitlines():
                if line.strip():
                    entry = json.loads(line)
                    unservable.setdefault(str(entry["id"]), str(entry["reason"]))
        return {
            "served": dict(r.served),
            "requeued": r.requeued,
            "dropped_servers": dict(r.dropped),
            "unservable": unservable,
        }

    def close(self) -> None:
        self.pool.close()
