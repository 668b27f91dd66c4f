"""Capture: run the frozen target over tokenized conversations and store its features in shards.

`capture_splits` is the library core (target and conversations passed in); `run_capture` is the
`eagle-capture` stage (loads the target, builds the data splits, captures into `output_dir`).
Backends (`capture.backend`) differ only in the batch forward: hf runs the target in this process
(`model_forward`), vllm asks vLLM in its own venv (`run_capture_vllm`, `eagle.capture.vllm_engine`);
planning, batches, non-finite checks, shards and manifest are the same code.

Work split: shard k of the global shard order (train shards, then held-out shards) belongs to rank
k % world_size, so ranks of an `accelerate launch` fill disjoint shards; rank 0 merges the per-rank
progress files into `manifest.json` at the end. A re-run (any world size) skips shards that are
already recorded and present, and refuses a folder captured with another target, data, algorithm,
layer set, dtype, shard size or backend (not another `target.shard`: the features are the same).

With `target.shard=fsdp` (eagle/target/shard.py) every forward gathers layers from all ranks, so a rank that
owns fewer batches runs idle forwards until it has run as many as the busiest rank (`forwards_per_rank`).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import PartialState
from torch import nn
from tqdm.auto import tqdm

from eagle.algorithms import get_algorithm
from eagle.capture.features import check_layer_ids, extract_features, idle_forward, vision_batch
from eagle.capture.store import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    RANK_MANIFEST,
    SPLITS,
    STORAGE_DTYPES,
    assemble_manifest,
    check_same_capture,
    completed_shards,
    read_manifest,
    remove_stale_tmp,
    write_shard,
)
from eagle.capture.vllm_engine import VllmEngine, target_without_weights
from eagle.config import CaptureConfig, ConfigError, RootConfig
from eagle.data.dataset import DataSplits, build_splits, data_fingerprint
from eagle.errors import CaptureError
from eagle.fileio import atomic_write_json
from eagle.target.loading import TargetInfo
from eagle.target.multimodal import has_mrope
from eagle.target.precision import DTYPES, resolve_dtype
from eagle.target.shard import is_sharded, load_placed_target
from eagle.target.structure import default_aux_layer_ids


class Conversation(Protocol):
    """What capture reads from `eagle.data.TokenizedConversation`."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]


class ProcessState(Protocol):
    """The part of `accelerate.PartialState` capture uses (a stand-in works in tests)."""

    process_index: int
    num_processes: int
    is_main_process: bool

    def wait_for_everyone(self) -> None: ...


@dataclass(frozen=True)
class ShardJob:
    split: str
    index: int  # shard index within the split
    ordinal: int  # position in the global shard order; decides the owning rank
    conversations: Sequence[Conversation]

    @property
    def tokens(self) -> int:
        return sum(len(c.input_ids) for c in self.conversations)


# --- batching -------------------------------------------------------------------------------------


def length_sorted_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group indices into batches of similar length whose padded size (count x longest) stays
    within `batch_tokens`; a sequence longer than the budget forms a batch of its own.

    Sorting longest first keeps padding small and puts the largest (memory-peak) batch first, so an
    out-of-memory error shows up at once rather than late in a shard.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]  # sorted: the first is the longest
        if current and longest * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists -> (input_ids [B, T] long, attention_mask [B, T] long)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(sequences), width), dtype=torch.long)  # [B, T]
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, : len(seq)] = 1
    return ids, mask


# --- planning -------------------------------------------------------------------------------------


def plan_shards(splits: dict[str, Sequence[Conversation]], shard_size: int) -> list[ShardJob]:
    """Shard k of a split = its conversations [k * shard_size, (k + 1) * shard_size)."""
    jobs: list[ShardJob] = []
    for split in SPLITS:
        convs = splits.get(split) or []
        for index, start in enumerate(range(0, len(convs), shard_size)):
            jobs.append(ShardJob(split, index, len(jobs), convs[start : start + shard_size]))
    return jobs


def forwards_per_rank(jobs: Sequence[ShardJob], world: int, batch_tokens: int) -> list[int]:
    """Target forwards each rank runs for `jobs`: one per length-sorted batch of each shard it owns
    (shard ordinal k on rank k % world), as `_capture_shard` batches them."""
    counts = [0] * world
    for job in jobs:
        lengths = [len(c.input_ids) for c in job.conversations]
        counts[job.ordinal % world] += len(length_sorted_batches(lengths, batch_tokens))
    return counts


def feature_rows(algorithm: str) -> int:
    """Hidden-size rows stored per token: the final state plus the algorithm's aux layers."""
    return get_algorithm(algorithm).feature_rows()


def estimate_bytes(tokens: int, algorithm: str, hidden_size: int, dtype: str) -> int:
    """Disk estimate: tokens x feature layers x hidden x bytes, plus int32 ids and uint8 mask."""
    itemsize = torch.empty((), dtype=STORAGE_DTYPES[dtype]).element_size()
    return tokens * (feature_rows(algorithm) * hidden_size * itemsize + 4 + 1)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def build_header(
    info: TargetInfo,
    data_identity: dict[str, Any],
    algorithm: str,
    aux_layer_ids: list[int] | None,
    capture: CaptureConfig,
    jobs: Sequence[ShardJob],
    engine: dict[str, Any] | None = None,
    mrope: bool = False,
) -> dict[str, Any]:
    """Everything in `manifest.json` except the shard list; `mrope`: the target numbers tokens with M-RoPE rows."""
    features = {"final_hidden": [info.hidden_size]}
    if aux_layer_ids:
        features["aux_hidden"] = [len(aux_layer_ids), info.hidden_size]
    if mrope:  # an M-RoPE target's rotary positions, int32 (`extract_features`)
        features["positions"] = [3]
    splits = {}
    for split in SPLITS:
        mine = [j for j in jobs if j.split == split]
        splits[split] = {
            "num_shards": len(mine),
            "conversations": sum(len(j.conversations) for j in mine),
            "tokens": sum(j.tokens for j in mine),
        }
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "target": {
            "fingerprint": info.fingerprint,
            "source": info.source,
            "model_type": info.model_type,
            "hidden_size": info.hidden_size,
            "num_layers": info.num_layers,
            "vocab_size": info.vocab_size,
            # How the run that wrote this manifest last held the target (target.shard); not part of the
            # capture's identity (the features are the same either way), like the number of processes.
            "shard": info.shard,
        },
        "data": data_identity,
        "algorithm": algorithm,
        "aux_layer_ids": list(aux_layer_ids) if aux_layer_ids else None,
        "features": features,
        "dtype": capture.dtype,
        "shard_size": capture.shard_size,
        # Which backend (capture.backend) and engine computed the features; a resume must use the same.
        "backend": capture.backend,
        "engine": engine,
        "splits": splits,
    }


# --- capture --------------------------------------------------------------------------------------


class _SingleProcess:
    process_index = 0
    num_processes = 1
    is_main_process = True

    def wait_for_everyone(self) -> None:
        return None


def _feature_label(name: str, slot: int | None, aux_layer_ids: list[int] | None) -> str:
    if name == "aux_hidden" and aux_layer_ids is not None and slot is not None:
        return f"aux layer {aux_layer_ids[slot]} (draft.aux_layer_ids[{slot}])"
    return "the final (post-norm) hidden state" if name == "final_hidden" else name


def check_finite_features(
    name: str,
    value: torch.Tensor,  # [b, T, H] or [b, T, 3, H], the target's dtype
    stored: torch.Tensor,  # the same in the storage dtype
    mask: torch.Tensor,  # [b, T], 1 = real token
    aux_layer_ids: list[int] | None,
    storage_dtype: str,
    ids: list[str],
) -> None:
    """Refuse to write a non-finite feature: a capture that overflowed trains into NaN.

    Targets with large residual activations (some reach 3-5e4) overflow float16's 65504 in their
    aux layers; bfloat16 has float32's range. Checked on real (unpadded) positions only.
    """
    real = mask.bool()
    for source, tensor in (("target", value), ("storage", stored)):
        bad = ~torch.isfinite(tensor[real])  # [n, H] or [n, 3, H]
        if not bool(bad.any()):
            continue
        slot = None
        if tensor.dim() == 4:
            slot = int(bad.any(dim=-1).any(dim=0).nonzero()[0])  # [n, 3, H] -> [3]: first bad aux slot
        rows = bad.flatten(1).any(dim=1).nonzero().flatten()  # real positions with a bad value
        conv = ids[int(real.nonzero()[int(rows[0]), 0])]
        finite = value[real].float()
        peak = float(finite[torch.isfinite(finite)].abs().max()) if bool(torch.isfinite(finite).any()) else float("inf")
        where = _feature_label(name, slot, aux_layer_ids)
        if source == "target":
            raise CaptureError(
                f"the target produced non-finite values in {where} (conversation {conv!r}, largest finite "
                f"magnitude {peak:.4g}) in its own dtype {value.dtype}; load it in a wider dtype "
                "(target.dtype=float32 or bfloat16). Nothing was written for this shard."
            )
        raise CaptureError(
            f"{where} overflows capture.dtype={storage_dtype} (conversation {conv!r}: largest magnitude "
            f"{peak:.4g}, {int(bad.sum())} values become inf/nan; float16 holds at most 65504). Capture with "
            "capture.dtype=bfloat16 (float32's range) into a new output_dir; shards already written stay valid."
        )


# One padded batch -> features (`extract_features`' contract): ids [B, T], mask [B, T], aux layer ids ->
# {"final_hidden": [B, T, H], "aux_hidden": [B, T, 3, H]} in the target's dtype. The hf backend runs the
# model in this process; capture.backend=vllm asks vLLM (`eagle.capture.vllm_engine.VllmEngine.forward`).
# A batch with images also passes each row's image references (hf backend only): hence `...`.
BatchForward = Callable[..., dict[str, torch.Tensor]]


def model_forward(model: nn.Module, device: torch.device) -> BatchForward:
    """The hf backend's `BatchForward`: the target in this process on `device`."""

    def forward(
        ids: torch.Tensor, mask: torch.Tensor, aux_layer_ids: list[int] | None, images: Sequence[Sequence[str]] = ()
    ) -> dict[str, torch.Tensor]:
        # images: each row's image references (a vision-language target's batch); none for text.
        vision = vision_batch(model, images, device)
        return extract_features(model, ids.to(device), mask.to(device), aux_layer_ids, vision)

    return forward


def _capture_shard(
    forward: BatchForward,
    job: ShardJob,
    aux_layer_ids: list[int] | None,
    capture: CaptureConfig,
    on_tokens: Callable[[int], None],
) -> dict[str, list[torch.Tensor]]:
    """Forward one shard in length-sorted padded batches; per-conversation features on CPU."""
    convs = job.conversations
    for c in convs:
        if len(c.input_ids) == 0 or len(c.input_ids) != len(c.loss_mask):
            raise CaptureError(
                f"conversation {c.id!r} ({job.split} shard {job.index}) has {len(c.input_ids)} tokens and "
                f"{len(c.loss_mask)} loss-mask entries; the data stage must drop empty or inconsistent records"
            )
    storage = STORAGE_DTYPES[capture.dtype]
    out: dict[str, list[Any]] = {}
    for batch in length_sorted_batches([len(c.input_ids) for c in convs], capture.batch_tokens):
        ids, mask = pad_batch([convs[i].input_ids for i in batch])
        images = [tuple(getattr(convs[i], "images", ())) for i in batch]  # a vision-language target's rows
        # Only batches with images pass them: capture.backend=vllm's forward takes text (refused earlier).
        feats = forward(ids, mask, aux_layer_ids, images) if any(images) else forward(ids, mask, aux_layer_ids)
        for name, value in feats.items():
            if not value.is_floating_point():  # M-RoPE positions: integers, kept exact
                stored = value.to(torch.int32)
            else:  # Cast on the device first: half the bytes cross to the host.
                stored = value.to(storage)  # [b, T, ...]
                check_finite_features(
                    name,
                    value,
                    stored,
                    mask.to(value.device),
                    aux_layer_ids,
                    capture.dtype,
                    [convs[i].id for i in batch],
                )
            value = stored.cpu()  # [b, T, ...]
            slots = out.setdefault(name, [None] * len(convs))
            for row, i in enumerate(batch):
                slots[i] = value[row, : len(convs[i].input_ids)].clone()  # [T_i, ...]
        on_tokens(int(mask.sum()))
    return out


@dataclass
class FeatureSource:
    """What computes the features: the target in this process (`in_process`), or a `forward` run elsewhere
    (capture.backend=vllm), with the manifest's record of the engine."""

    info: TargetInfo
    forward: BatchForward
    engine: dict[str, Any]
    model: nn.Module | None = None  # the in-process target (a sharded one runs idle forwards)
    device: torch.device | None = None

    @classmethod
    def in_process(cls, model: nn.Module, info: TargetInfo, device: torch.device | str | None = None) -> FeatureSource:
        place = torch.device(device) if device is not None else next(model.parameters()).device
        return cls(
            info,
            model_forward(model, place),
            {"name": "transformers", "version": package_version("transformers")},
            model,
            place,
        )


@dataclass
class _CaptureRun:
    """One capture's plan, shared by its phases."""

    root: Path
    source: FeatureSource
    capture: CaptureConfig
    algorithm: str
    aux_layer_ids: list[int] | None
    jobs: list[ShardJob]
    header: dict[str, Any]
    state: ProcessState
    log: Callable[[str], None]

    @property
    def rank(self) -> int:
        return self.state.process_index

    @property
    def world(self) -> int:
        return self.state.num_processes


def capture_splits(
    source: FeatureSource,
    splits: dict[str, Sequence[Conversation]],
    output_dir: str | Path,
    capture: CaptureConfig,
    algorithm: str,
    aux_layer_ids: list[int] | None,
    data_identity: dict[str, Any],
    state: ProcessState | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Capture `splits` ({"train": [...], "heldout": [...]}) into `output_dir`; return the manifest.

    Resumable: shards already recorded (by any earlier run, any world size) are skipped. Under
    several processes every rank must call this with the same arguments. Phases: plan, check (read-only,
    every rank alike), fold earlier progress (rank 0), capture this rank's shards, merge (rank 0).
    """
    run = _plan(
        source,
        splits,
        Path(output_dir),
        capture,
        algorithm,
        aux_layer_ids,
        data_identity,
        state or _SingleProcess(),
        log,
    )
    done, todo = _check_before_writing(run)
    _fold_earlier_progress(run, done)
    _capture_own_shards(run, todo, done, progress)
    return _merge_manifests(run)


def _plan(
    source: FeatureSource,
    splits: dict[str, Sequence[Conversation]],
    root: Path,
    capture: CaptureConfig,
    algorithm: str,
    aux_layer_ids: list[int] | None,
    data_identity: dict[str, Any],
    state: ProcessState,
    log: Callable[[str], None],
) -> _CaptureRun:
    """The algorithm's feature layers, the shards and the manifest header; nothing is read or written."""
    try:
        algo = get_algorithm(algorithm)
    except ConfigError as e:
        raise CaptureError(str(e)) from None
    info = source.info
    if algo.num_aux_layers:
        aux_layer_ids = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(info.num_layers)
        check_layer_ids(aux_layer_ids, info.num_layers)
    else:
        aux_layer_ids = None
    jobs = plan_shards(splits, capture.shard_size)
    if not jobs:
        raise CaptureError("no conversations to capture: the data stage produced empty train and held-out splits")
    mrope = source.model is not None and has_mrope(source.model)
    header = build_header(info, data_identity, algorithm, aux_layer_ids, capture, jobs, source.engine, mrope)
    return _CaptureRun(root, source, capture, algorithm, aux_layer_ids, jobs, header, state, log)


def _check_before_writing(run: _CaptureRun) -> tuple[dict[tuple[str, int], dict[str, Any]], list[ShardJob]]:
    """Identity, progress and disk space, read-only: every rank checks the same files, so all refuse together
    (no rank is left waiting at a barrier) and a refused run writes nothing. Returns (done, to do)."""
    root, capture, hidden = run.root, run.capture, run.source.info.hidden_size
    root.mkdir(parents=True, exist_ok=True)
    if (root / MANIFEST).is_file():
        check_same_capture(read_manifest(root), run.header, root)
    done = completed_shards(root)
    todo = [j for j in run.jobs if (j.split, j.index) not in done]
    need = estimate_bytes(sum(j.tokens for j in todo), run.algorithm, hidden, capture.dtype)
    total_tokens = sum(j.tokens for j in run.jobs)
    if run.state.is_main_process:
        run.log(
            f"eagle-capture: {len(run.jobs)} shards ({len(run.jobs) - len(todo)} done), {total_tokens} tokens; "
            f"estimated size {_human(estimate_bytes(total_tokens, run.algorithm, hidden, capture.dtype))} "
            f"({_human(need)} still to write) in {root}"
        )
    free = shutil.disk_usage(root).free
    if need * capture.free_space_margin > free:
        raise CaptureError(
            f"{root} has {_human(free)} free but the capture still needs about {_human(need)} "
            f"(x capture.free_space_margin={capture.free_space_margin}); free space, choose another output_dir, "
            "or capture fewer conversations (data.max_conversations) / a smaller capture.dtype"
        )
    return done, todo


def _fold_earlier_progress(run: _CaptureRun, done: dict[tuple[str, int], dict[str, Any]]) -> None:
    """Rank 0 clears what a killed run left (temporary files) and folds earlier per-rank progress into
    manifest.json (merged file first, then the parts go: readers always see the union)."""
    if run.state.is_main_process:
        remove_stale_tmp(run.root)
        atomic_write_json(run.root / MANIFEST, assemble_manifest(run.header, done))
        for stale in run.root.glob(RANK_MANIFEST.format(rank="*")):
            stale.unlink(missing_ok=True)
    run.state.wait_for_everyone()


def _shard_writer(
    run: _CaptureRun, done: dict[tuple[str, int], dict[str, Any]]
) -> Callable[[ShardJob, dict[str, list[torch.Tensor]]], None]:
    """Writes one shard and records it: in manifest.json alone, or in this rank's part of it."""
    recorded: dict[tuple[str, int], dict[str, Any]] = dict(done) if run.world == 1 else {}

    def write(job: ShardJob, feats: dict[str, list[torch.Tensor]]) -> None:
        convs = job.conversations
        entry = write_shard(
            run.root,
            job.split,
            job.index,
            [str(c.id) for c in convs],
            [list(c.input_ids) for c in convs],
            [list(c.loss_mask) for c in convs],
            feats,
            run.capture.dtype,
        )
        recorded[(job.split, job.index)] = entry
        if run.world == 1:
            atomic_write_json(run.root / MANIFEST, assemble_manifest(run.header, recorded))
        else:
            own = [recorded[k] for k in sorted(recorded)]
            atomic_write_json(run.root / RANK_MANIFEST.format(rank=run.rank), {"rank": run.rank, "shards": own})

    return write


def _capture_own_shards(
    run: _CaptureRun, todo: list[ShardJob], done: dict[tuple[str, int], dict[str, Any]], progress: bool
) -> None:
    """This rank's shards; a single background writer overlaps disk I/O with the next shard's forwards (at most
    one shard waits in memory). A sharded target's ranks then even out their forward counts."""
    rank, world, source = run.rank, run.world, run.source
    mine = [j for j in todo if j.ordinal % world == rank]
    write = _shard_writer(run, done)
    bar = tqdm(
        total=sum(j.tokens for j in mine),
        unit="tok",
        unit_scale=True,
        desc=f"capture[{rank}/{world}]" if world > 1 else "capture",
        disable=not progress or not run.state.is_main_process,
        file=sys.stderr,
    )
    pending: Future | None = None
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=1) as writer:
        for job in mine:
            feats = _capture_shard(source.forward, job, run.aux_layer_ids, run.capture, bar.update)
            if pending is not None:
                pending.result()  # bound memory to one shard in flight; re-raise write errors
            pending = writer.submit(write, job, feats)
        if world > 1 and source.model is not None and source.device is not None and is_sharded(source.model):
            # Each forward of a sharded target all-gathers from every rank: a rank with fewer forwards than
            # the busiest one (fewer shards, or shorter ones) runs idle ones until it has run as many.
            counts = forwards_per_rank(todo, world, run.capture.batch_tokens)
            for _ in range(max(counts) - counts[rank]):
                idle_forward(source.model, source.device)
        if pending is not None:
            pending.result()
    bar.close()
    if mine and run.state.is_main_process:
        tokens, seconds = sum(j.tokens for j in mine), time.perf_counter() - started
        run.log(
            f"eagle-capture: this process captured {tokens} tokens in {seconds:.1f} s "
            f"({tokens / seconds:.1f} tok/s, forwards and writes)"
        )


def _merge_manifests(run: _CaptureRun) -> dict[str, Any]:
    """Rank 0 collects every rank's entries into the final manifest; every rank returns it."""
    run.state.wait_for_everyone()
    if run.state.is_main_process:
        manifest = assemble_manifest(run.header, completed_shards(run.root))
        atomic_write_json(run.root / MANIFEST, manifest)
        for part in run.root.glob(RANK_MANIFEST.format(rank="*")):
            part.unlink(missing_ok=True)
        t = manifest["totals"]
        per_token = t["bytes"] / max(1, t["tokens"])
        run.log(
            f"eagle-capture: {t['conversations']} conversations, {t['tokens']} tokens, {t['shards']} shards, "
            f"{_human(t['bytes'])} ({t['bytes']} bytes, {per_token:.1f} bytes/token) in {run.root}"
            + ("" if manifest["complete"] else " -- INCOMPLETE: re-run to finish")
        )
    run.state.wait_for_everyone()
    return read_manifest(run.root)


def run_capture(cfg: RootConfig) -> dict[str, Any]:
    """The `eagle-capture` stage: target + data splits from `cfg`, features into `cfg.output_dir`."""
    if cfg.capture.backend == "vllm":
        return run_capture_vllm(cfg)

    # Without an accelerator, or with device=cpu, processes started by torchrun / accelerate must
    # join a gloo group (accelerate only does so when asked for CPU).
    cpu = cfg.device == "cpu" or not torch.accelerator.is_available()
    state = PartialState(cpu=cpu)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != state.num_processes:
        raise CaptureError(
            f"WORLD_SIZE={launched} processes were launched but accelerate formed a group of "
            f"{state.num_processes}; each would capture every shard. Launch with torchrun or accelerate launch "
            "(GPU) / torchrun (CPU), or run a single process"
        )
    device = torch.device(cfg.device) if cfg.device else state.device
    model, tokenizer, info = load_placed_target(cfg.target, device=device)
    # Rank 0 first: whatever the data stage caches is built once, then read by the others.
    with state.main_process_first():
        splits = build_splits(cfg.data, tokenizer, progress=state.is_main_process)
    return _capture_data_splits(cfg, FeatureSource.in_process(model, info, device), splits, state=state)


def run_capture_vllm(cfg: RootConfig) -> dict[str, Any]:
    """`eagle-capture capture.backend=vllm`: the same splits, shards and manifest, the target in vLLM (one
    engine, which parallelises itself: capture.tensor_parallel_size) and no weights in this process."""
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise CaptureError(
            f"capture.backend=vllm runs one vLLM engine from one process, but WORLD_SIZE="
            f"{os.environ['WORLD_SIZE']} processes were launched; run a single process (vLLM spreads "
            "the target over GPUs with capture.tensor_parallel_size)"
        )
    if cfg.target.shard != "none":
        raise CaptureError(
            f"target.shard={cfg.target.shard} places the target in eagle's processes; with "
            "capture.backend=vllm vLLM holds it (capture.tensor_parallel_size): set target.shard=none"
        )
    engine = VllmEngine(cfg.capture, cfg.output_dir)  # refuses a missing engine before anything is written
    # target.dtype=auto resolves as for the hf backend on this machine; an explicit dtype is vLLM's to check.
    here = torch.device(cfg.device) if cfg.device else (torch.accelerator.current_accelerator() or torch.device("cpu"))
    dtype = resolve_dtype("auto", here, "capture") if cfg.target.dtype == "auto" else DTYPES[cfg.target.dtype]
    tokenizer, info = target_without_weights(cfg.target, dtype)
    splits = build_splits(cfg.data, tokenizer)
    if any(c.images for c in (*splits.train, *splits.heldout)):
        raise CaptureError(
            "capture.backend=vllm captures text conversations; this data holds images (a vision-language "
            "target): capture it with capture.backend=hf"
        )
    with engine:
        engine.bind(cfg.target, info, max(len(c.input_ids) for c in (*splits.train, *splits.heldout)))
        return _capture_data_splits(cfg, FeatureSource(info, engine.forward, engine.describe()), splits)


def _capture_data_splits(
    cfg: RootConfig, source: FeatureSource, splits: DataSplits, state: ProcessState | None = None
) -> dict[str, Any]:
    """`capture_splits` of the data stage's train and held-out splits, identified by the data's fingerprint and
    config (what a resumed capture must match)."""
    identity = {"fingerprint": data_fingerprint(cfg.data, splits), "config": asdict(cfg.data)}
    return capture_splits(
        source,
        {"train": splits.train, "heldout": splits.heldout},
        cfg.output_dir,
        cfg.capture,
        cfg.draft.algorithm,
        cfg.draft.aux_layer_ids,
        identity,
        state=state,
    )
