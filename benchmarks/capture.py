"""Capture throughput vs a bare target forward over the same batches, and bytes/token on disk.

    python -m benchmarks capture data.max_conversations=32 [any eagle config override ...]

Runs, in one process and over identical length-sorted batches: (1) the plain CausalLM forward
(`model(input_ids, attention_mask, use_cache=False)`, logits included), (2) the full capture
(`capture_splits`: features, host copy, shard writes, sha256, manifest) into a temporary folder.
Prints tokens/s of both, their ratio, and the capture's bytes/token against layers x hidden x bytes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from eagle.capture.runner import (
    FeatureSource,
    capture_splits,
    estimate_bytes,
    feature_rows,
    length_sorted_batches,
    pad_batch,
)
from eagle.cli.app import compose
from eagle.data.dataset import build_splits, data_fingerprint
from eagle.target.loading import load_target
from eagle.target.structure import default_aux_layer_ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="eagle config overrides, e.g. data.max_conversations=32")
    parser.add_argument("--repeats", type=int, default=1, help="timed passes of each (best is reported)")
    args = parser.parse_args(argv)

    cfg = compose(["data.max_conversations=32", *args.overrides])
    model, tokenizer, info = load_target(cfg.target)
    splits = build_splits(cfg.data, tokenizer, progress=False)
    convs = {"train": splits.train, "heldout": splits.heldout}
    aux = cfg.draft.aux_layer_ids or default_aux_layer_ids(info.num_layers)
    tokens = sum(len(c.input_ids) for part in convs.values() for c in part)

    # The bare forward sees exactly the batches capture forms (per shard, length-sorted).
    batches = []
    for part in convs.values():
        for start in range(0, len(part), cfg.capture.shard_size):
            shard = part[start : start + cfg.capture.shard_size]
            for idx in length_sorted_batches([len(c.input_ids) for c in shard], cfg.capture.batch_tokens):
                batches.append(pad_batch([shard[i].input_ids for i in idx]))

    def bare(limit: int | None = None) -> None:
        with torch.inference_mode():
            for ids, mask in batches[:limit]:
                model(input_ids=ids, attention_mask=mask, use_cache=False)

    def capture() -> int:
        with tempfile.TemporaryDirectory() as tmp:
            m = capture_splits(
                FeatureSource.in_process(model, info),
                convs,
                Path(tmp),
                cfg.capture,
                cfg.draft.algorithm,
                aux,
                {"fingerprint": data_fingerprint(cfg.data, splits), "config": {}},
                progress=False,
                log=lambda s: None,
            )
            return m["totals"]["bytes"]

    bare(limit=1)  # warm-up (allocator, kernels) on the largest batch
    t_bare, t_cap, nbytes = float("inf"), float("inf"), 0
    for _ in range(args.repeats):  # interleaved, so load changes on a shared machine hit both alike
        t0 = time.perf_counter()
        bare()
        t_bare = min(t_bare, time.perf_counter() - t0)
        t0 = time.perf_counter()
        nbytes = capture()
        t_cap = min(t_cap, time.perf_counter() - t0)

    itemsize = torch.empty((), dtype=getattr(torch, cfg.capture.dtype)).element_size()
    rows = feature_rows(cfg.draft.algorithm)
    print(
        f"target {info.source} ({info.model_type}, {info.num_layers} layers, hidden {info.hidden_size}), "
        f"algorithm {cfg.draft.algorithm}, {sum(map(len, convs.values()))} conversations, {tokens} tokens, "
        f"{len(batches)} batches, torch threads {torch.get_num_threads()}"
    )
    print(f"bare forward : {tokens / t_bare:10.1f} tokens/s ({t_bare:.2f} s)")
    print(f"capture      : {tokens / t_cap:10.1f} tokens/s ({t_cap:.2f} s)  ratio capture/bare = {t_bare / t_cap:.3f}")
    print(
        f"bytes/token  : {nbytes / tokens:.1f} on disk vs {rows} layers x {info.hidden_size} hidden x {itemsize} B "
        f"= {rows * info.hidden_size * itemsize} (+5 ids/mask; estimate "
        f"{estimate_bytes(tokens, cfg.draft.algorithm, info.hidden_size, cfg.capture.dtype) / tokens:.1f})"
    )


if __name__ == "__main__":
    sys.exit(main())
