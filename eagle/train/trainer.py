"""The draft-head trainer: `train(cfg) -> TrainResult` (the `eagle-train` stage).

One loop for both algorithms and both data modes, on accelerate:

  setup      target (frozen; offline mode uses only its embeddings and LM head), data splits,
             reduced vocabulary (EAGLE-3, from the training split's loss-mask token counts),
             head, AdamW, warmup + decay schedule, resume from the latest checkpoint
  step       this rank's micro-batches of the global batch -> head loss -> backward (DDP gradient
             sync on the last micro-batch only) -> non-finite check -> clip -> AdamW -> schedule
  log/eval   token-weighted loss / loss_i / acc_i per unroll step, lr, tokens/s; on the held-out
             split also tau_sim (see `eagle.train.metrics`), which picks `output_dir/best/`; with
             train.eval_decode_every also tau_real from decoding (`eagle.train.decode_eval`), which
             picks it instead under train.select_by=tau_real
  save       `eagle.train.checkpoint` (atomic, resumable bit for bit, pruned)

Loss normalisation, in one place (`TrainRecipe.global_token_counts`): every micro-batch's sum of
token losses is divided by the GLOBAL number of loss tokens of the step (per unroll step, counted
from the batch masks and all-reduced before the forward; over the world size, as DDP averages the
ranks' gradients), so the gradient is the token mean over the whole global batch whatever
`grad_accum` and the number of processes are: 1 process x batch 8 and 2 processes x 4 give the
same update up to float summation order. Accumulation is the trainer's own (micro-batches under
`no_sync`), so accelerate is told 1 and rescales nothing.

Multi-GPU / multi-node: `accelerate launch [--config_file cfg.yaml] -m eagle.cli.train ...` (or
`eagle-train` under `torchrun`); the data-parallel setup (DDP, number of processes and machines,
mixed precision default) comes from the accelerate config file written by `accelerate config`.
`train.batch_size` stays the GLOBAL batch. A draft head is one decoder layer (+ its LM head), so
the head is always replicated (DDP); accelerate's FSDP and DeepSpeed configs are refused because
evaluation and checkpointing here use the unsharded head. A target too large for one device is
sharded instead with `target.shard=fsdp` (eagle/target/shard.py): every training step gives each rank the
same number of micro-batches, so the sharded forwards stay in step; held-out evaluation adds idle
forwards (`eagle.train.heldout`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from torch import nn

from eagle.algorithms import LossParts, LossSettings, get_algorithm
from eagle.algorithms.head_io import build_head, head_config_from_target, load_head
from eagle.artifacts import resolve_draft
from eagle.capture.reader import check_compatible, read_manifest
from eagle.config import ConfigError, RootConfig
from eagle.data.dataset import build_splits
from eagle.errors import CheckpointError, TrainingError
from eagle.heads.base import DraftHead, HeadConfig
from eagle.heads.target_layer import pick_target_layer
from eagle.target.loading import TargetInfo
from eagle.target.shard import gathered, load_placed_target
from eagle.tracking import Tracker
from eagle.train import checkpoint as ckpt
from eagle.train import heldout
from eagle.train.batches import BatchStream, DataPosition, OfflineSplit, OnlineSplit
from eagle.train.decode_eval import DecodeEval, format_decode_eval
from eagle.train.heldout import evaluate_heldout
from eagle.train.metrics import MetricSums
from eagle.train.resume import follow_schedule, run_record
from eagle.train.runtime import PhaseTimer, StopFlag, checkpoint_to_resume, grad_norm, make_accelerator
from eagle.train.schedule import build_optimizer, build_scheduler
from eagle.train.stream import StreamStopped, build_stream_splits


# --------------------------------------------------------------------------------------- results
@dataclass
class TrainResult:
    output_dir: Path
    step: int  # optimizer steps done
    stopped: str  # max_steps | max_minutes | signal | nonfinite
    best_dir: Path | None
    best_metric: float | None  # best/'s train.select_by figure: held-out tau_sim, or tau_real
    best_step: int | None
    last_checkpoint: Path | None
    eval_metrics: dict[str, float] = field(default_factory=dict)  # last held-out evaluation
    # Held-out metrics of the freshly initialised head (fresh runs only): the baseline training must beat.
    initial_eval_metrics: dict[str, float] = field(default_factory=dict)
    train_metrics: dict[str, float] = field(default_factory=dict)  # last logged training window
    skipped_steps: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase (rank 0)
    # train.mode=stream: samples per server, requeued samples, dropped servers, unservable conversations
    stream: dict[str, Any] = field(default_factory=dict)
    # train.eval_decode_every: last tau_real beside tau_sim, their gap (last, mean), history (DecodeEval.summary)
    decode_eval: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainHooks:
    """Optional callbacks (tests, notebooks, the CLI).

    on_step_end: called on every rank after each optimizer step.
    load_init:   reads `train.init_from` as (path, target) -> head. The trainer sits below the export
                 layer, so by itself it reads only saved heads; `eagle-train` passes the loader that
                 also reads exported folders (`eagle.export.loader.load_draft`).
    """

    on_step_end: Callable[[int], None] | None = None
    load_init: Callable[[str, nn.Module], DraftHead] | None = None


# --------------------------------------------------------------------------------------- the step module
class TrainStep(nn.Module):
    """The head plus its loss as one module, so DDP sees every head call inside `forward`."""

    def __init__(self, head: DraftHead, lm_head: nn.Module, settings: LossSettings) -> None:
        super().__init__()
        self.head = head
        self.algorithm = get_algorithm(head.config.algorithm)
        self._borrowed: dict[Any, Any] = {"lm_head": lm_head}  # frozen target module: not a parameter here
        self.settings = settings

    def forward(self, batch: dict[str, Any], norms: torch.Tensor) -> LossParts:
        return self.algorithm.forward_loss(
            self.head, self._borrowed["lm_head"], batch, self.settings, norms, self._label_rows()
        )

    def _label_rows(self) -> torch.Tensor | None:
        """`Algorithm.label_rows`, gathered once per device (the head's vocab maps are fixed)."""
        key = ("label_rows", str(self.head.d2t.device) if hasattr(self.head, "d2t") else "")
        if key not in self._borrowed:
            self._borrowed[key] = self.algorithm.label_rows(self.head, self._borrowed["lm_head"])
        return self._borrowed[key]


def _build_data(cfg: RootConfig, target: nn.Module, tokenizer: Any, info: Any, aux: list[int], accelerator: Any):
    """(train split, held-out split or None) for train.mode."""
    t = cfg.train
    if t.mode == "offline":
        if not t.data_dir:
            raise ConfigError("train.mode=offline needs train.data_dir=CAPTURE_DIR (the output_dir of eagle-capture)")
        manifest = read_manifest(t.data_dir)
        check_compatible(manifest, info, cfg.draft.algorithm, aux or None, data_dir=t.data_dir)
        offline, held = OfflineSplit(t.data_dir, "train", seed=t.seed), OfflineSplit(t.data_dir, "heldout", seed=t.seed)
        return offline, (held if len(held) else None)
    if t.mode == "stream":  # online mode's splits, features from vLLM servers (eagle/train/stream/)
        stream, stream_held, _recipe = build_stream_splits(cfg, target, tokenizer, info, accelerator)
        return stream, stream_held
    with accelerator.main_process_first():
        splits = build_splits(cfg.data, tokenizer, progress=accelerator.is_main_process)
    layer_ids = get_algorithm(cfg.draft.algorithm).capture_layer_ids(aux)
    online = OnlineSplit(splits.train, cfg.capture.shard_size, target, layer_ids)
    online_held = OnlineSplit(splits.heldout, cfg.capture.shard_size, target, layer_ids) if splits.heldout else None
    return online, online_held


@dataclass
class StepOutcome:
    grad_norm: torch.Tensor
    stop_requested: bool  # SIGINT/SIGTERM on any rank
    nonfinite_stop: bool = False  # train.nonfinite=stop hit a bad step: checkpoint of the state before it saved


log = logging.getLogger(__name__)

# Phases that are not training: left out of tokens/s.
_NOT_TRAINING = ("eval", "checkpoint", "logging")


# --------------------------------------------------------------------------------------- the recipe
class TrainRecipe:
    """One training run: `setup`, then `train` (the loop) calling `train_step`, `log_window`,
    `evaluate_heldout` and `save_checkpoint`. Use `train(cfg)`; the class is for reading and tests."""

    def __init__(self, cfg: RootConfig, hooks: TrainHooks | None = None) -> None:
        self.cfg, self.hooks = cfg, hooks or TrainHooks()
        self.out = Path(cfg.output_dir)
        self.timer = PhaseTimer()
        self.started: float | None = None  # this session's start (perf_counter), set by train()
        self.wall_before = 0.0  # wall seconds of the sessions before this one (from the checkpoint)

    # --- setup ---------------------------------------------------------------------------------
    def setup(self) -> None:
        """The run's phases, in order (the RNG draws of each depend on the ones before)."""
        self._setup_runtime()
        target, info, head_cfg = self._setup_target_and_data()
        head = self._setup_head(target, head_cfg)
        optimizer = self._setup_optimizer()
        self._restore_or_start(head, optimizer, head_cfg, info)
        self._setup_step(head, optimizer)
        self._setup_tracking(info)
        self.decode_eval = DecodeEval.for_recipe(self)  # None unless train.eval_decode_every

    def _setup_runtime(self) -> None:
        """Accelerator and processes; which checkpoint (if any) this run resumes, and the record a later
        resume is compared with."""
        cfg = self.cfg
        self.accelerator = acc = make_accelerator(cfg)
        self.rank, self.world, self.device = acc.process_index, acc.num_processes, acc.device
        self.resume_from = checkpoint_to_resume(cfg, log=print if acc.is_main_process else None)
        self.resume_record = run_record(cfg)  # stored in every checkpoint

    def _setup_target_and_data(self) -> tuple[Any, TargetInfo, HeadConfig]:
        """The frozen target, the head's config sized from it, and the training and held-out splits.

        target.shard=fsdp: decoder layers sharded; the embeddings, final norm and LM head the head reads
        (build_head, freeze_lm_head, self.lm_head) stay whole in every process (eagle/target/shard.py)."""
        cfg = self.cfg
        target, tokenizer, info = load_placed_target(cfg.target, device=self.device)
        head_cfg = head_config_from_target(target.config, cfg.draft, info)
        self.train_split, self.held_split = _build_data(
            cfg, target, tokenizer, info, list(head_cfg.aux_layer_ids), self.accelerator
        )
        self.pad_id = int(tokenizer.pad_token_id or 0)
        self.target, self.tokenizer = target, tokenizer  # train.eval_decode_every decodes with them
        return target, info, head_cfg

    def _setup_head(self, target: Any, head_cfg: HeadConfig) -> DraftHead:
        """The head: fresh (a reduced vocabulary chosen from the training split's tokens), warm-started or
        from a target layer where asked, its LM head frozen where asked; the parameters that train."""
        t = self.cfg.train
        counts = None
        if head_cfg.draft_vocab_size < head_cfg.vocab_size:
            counts = self.train_split.token_counts(head_cfg.vocab_size)  # [V] loss-mask tokens of the training split
        torch.manual_seed(t.seed)  # the same initial head on every rank and every run
        head = build_head(head_cfg, target_model=target, vocab_counts=counts).to(self.device)
        if t.init_from and self.resume_from is None:
            self._warm_start(head, target)
        if t.init_layer_from_target is not None and self.resume_from is None:
            self._start_from_target_layer(head, target, t.init_layer_from_target)
        if t.freeze_lm_head:  # before the optimizer is built: it only holds what trains
            fresh = self.resume_from is None and not t.init_from
            head.freeze_lm_head(target if fresh else None)  # a warm start's or checkpoint's norm is its own
        head.train()
        self.lm_head = target.get_output_embeddings()
        self.params = [p for p in head.parameters() if p.requires_grad]
        return head

    def _setup_optimizer(self) -> torch.optim.Optimizer:
        optimizer = build_optimizer(self.params, self.cfg.train)
        self.scheduler = build_scheduler(optimizer, self.cfg.train, clock=self.budget_spent)
        return optimizer

    def _restore_or_start(
        self, head: DraftHead, optimizer: torch.optim.Optimizer, head_cfg: HeadConfig, info: TargetInfo
    ) -> None:
        """A fresh TrainState, or the checkpoint's: head, optimizer, schedule, data position and random
        streams as they were (the per-rank streams, e.g. EAGLE-1's feature noise, restored exactly)."""
        aux = list(head_cfg.aux_layer_ids)
        self.state = ckpt.TrainState(
            algorithm=head_cfg.algorithm, target_fingerprint=info.fingerprint, aux_layer_ids=aux, world_size=self.world
        )
        rng = None
        if self.resume_from is not None:
            saved = ckpt.read_state(self.resume_from)
            ckpt.check_resumable(saved, self.resume_from, head_cfg.algorithm, info.fingerprint, aux)
            head.load_state_dict(load_head(self.resume_from / "head", algorithm=head_cfg.algorithm).state_dict())
            optimizer.load_state_dict(ckpt.load_torch(self.resume_from / "optimizer.pt"))
            self.scheduler.load_state_dict(ckpt.load_torch(self.resume_from / "scheduler.pt"))
            follow_schedule(optimizer, self.scheduler)  # a raised max_steps re-shapes the decay still to come
            rng = ckpt.load_rng(self.resume_from, self.rank)
            self.state = saved
            self.state.world_size = self.world
            self.wall_before = saved.wall_seconds
        torch.manual_seed(self.cfg.train.seed * 1000 + self.rank + 1)
        if rng is not None:
            ckpt.set_rng_state(rng)

    def _setup_step(self, head: DraftHead, optimizer: torch.optim.Optimizer) -> None:
        """The batch stream from the saved data position, the algorithm's loss settings, the prepared step."""
        t = self.cfg.train
        self.stream = BatchStream(
            self.train_split,
            t.seed,
            t.batch_size,
            t.grad_accum,
            t.max_length,
            self.pad_id,
            self.rank,
            self.world,
            DataPosition(self.state.epoch, self.state.index),
            group_lengths=t.group_by_length,
        )
        follow = getattr(self.train_split, "follow", None)
        if callable(follow):  # train.mode=stream requests features ahead along the batch order, up to max_steps
            per_step = sum(sl.stop - sl.start for sl in self.stream.slices)  # this rank's items a step
            follow(lambda n: self.stream.upcoming(max(0, min(n, per_step * (t.max_steps - self.state.step - 1)))))
        algo = self.algorithm = get_algorithm(self.cfg.draft.algorithm)
        self.settings = algo.loss_settings(self.cfg.draft, t, self.pad_id, training=True)
        self.loss_weights, self.extra_weights = algo.summary_weights(t, self.settings.steps)
        self.wrapper, self.optimizer = self.accelerator.prepare(TrainStep(head, self.lm_head, self.settings), optimizer)

    def _setup_tracking(self, info: TargetInfo) -> None:
        """The result record, the tracker and the counters of logging, evaluation and saving."""
        cfg, acc = self.cfg, self.accelerator
        self.result = TrainResult(
            output_dir=self.out,
            step=self.state.step,
            stopped="max_steps",
            best_dir=None,
            best_metric=self.state.best_metric,
            best_step=self.state.best_step,
            last_checkpoint=self.resume_from,
            skipped_steps=list(self.state.skipped_steps),
        )
        self.head_extra = {"target": info.source, "target_fingerprint": info.fingerprint}
        self.tracker = Tracker(
            cfg.logger,
            self.out,
            json.loads(json.dumps(asdict(cfg), default=str)),
            total=cfg.train.max_steps,
            initial=self.state.step,
            enabled=acc.is_main_process,
        )
        self.window = MetricSums()  # training sums since the last log line
        self.window_t0, self.window_busy0 = time.perf_counter(), self.timer.total(_NOT_TRAINING)
        self.last_saved_step = self.state.step if self.resume_from is not None else -1
        self.last_eval_step = -1
        if acc.is_main_process and self.resume_from is not None:
            self.tracker.write(
                f"eagle-train: resumed from {self.resume_from} (step {self.state.step}, epoch "
                f"{self.state.epoch}, item {self.state.index})"
            )

    def _start_from_target_layer(self, head: DraftHead, target: nn.Module, index: int) -> None:
        """`train.init_layer_from_target`: the fresh head's decoder layer from a target layer."""
        layer_id, layer = pick_target_layer(target, index)
        with gathered(layer):  # target.shard=fsdp: the whole layer on every rank for the copy
            left = head.start_from_target_layer(layer)
        if self.accelerator.is_main_process:
            print(
                f"eagle-train: decoder layer initialised from the target's layer {layer_id}"
                + (f" (left out: {', '.join(left)})" if left else "")
            )

    def _warm_start(self, head: DraftHead, target: nn.Module) -> None:
        """Copy the weights (and vocab maps) of `train.init_from` into the freshly built `head`."""
        source = str(self.cfg.train.init_from)
        if self.hooks.load_init is not None:
            init = self.hooks.load_init(source, target)
        else:
            resolved = resolve_draft(source)
            if resolved.kind != "head":
                raise ConfigError(
                    f"train.init_from={source!r} is an exported folder; this trainer was built "
                    "without the exported-head loader: run eagle-train, or give a saved head"
                )
            init = load_head(resolved.folder, target_model=target)
        differ = [
            f"{f.name}: {getattr(init.config, f.name)!r} there, {getattr(head.config, f.name)!r} here"
            for f in fields(head.config)
            if f.name != "target_fingerprint" and getattr(init.config, f.name) != getattr(head.config, f.name)
        ]
        if differ:
            raise ConfigError(
                f"train.init_from={source!r} holds a head of another shape than this run builds ("
                + "; ".join(differ)
                + "): set the draft.* options to match it, or drop train.init_from"
            )
        if init.config.target_fingerprint != head.config.target_fingerprint:
            log.warning(
                "train.init_from=%s was trained against target %s, this run's target is %s",
                source,
                init.config.target_fingerprint or "?",
                head.config.target_fingerprint or "?",
            )
        own, theirs = head.trainable_state_dict(), init.trainable_state_dict()
        if set(own) != set(theirs):
            raise CheckpointError(
                f"train.init_from={source!r}: tensors {sorted(set(own) ^ set(theirs))} differ from this run's head"
            )
        with torch.no_grad():
            for name, value in own.items():
                value.copy_(theirs[name].to(value.dtype))
        if self.accelerator.is_main_process:
            print(f"eagle-train: head initialised from {source} (optimizer and schedule start fresh)")

    @property
    def head(self) -> DraftHead:
        return self.accelerator.unwrap_model(self.wrapper).head

    # --- one optimizer step --------------------------------------------------------------------
    def global_token_counts(self, micro: list[dict[str, Any]]) -> torch.Tensor:
        """[steps] the denominators of every micro-batch's loss: loss tokens per unroll step over the
        whole global batch (all micro-batches, all ranks), divided by the world size because DDP
        averages the ranks' gradients. The update is then the token mean of the global batch, the
        same for any grad_accum and number of processes. Counted before the forward because every
        unroll step has its own denominator (one gradient rescale afterwards cannot apply five); the
        masks are cheap host tensors here, before `featurize` moves the batch to the device."""
        local = torch.zeros(self.settings.steps, dtype=torch.float64)
        for mb in micro:
            local += torch.tensor(self.algorithm.step_token_counts(mb, self.settings), dtype=torch.float64)
        total = self.accelerator.reduce(local.to(self.device), reduction="sum") if self.world > 1 else local
        return total.clamp(min=1.0) / self.world

    def _featurize(self, mb: dict[str, Any]) -> tuple[dict[str, Any], StreamStopped | None]:
        """The micro-batch with its target features, or the StreamStopped that stops the run. With several
        processes streaming, every process learns whether any one lost every server (one flag all-reduced
        per micro-batch), so they all save and stop together instead of some waiting in the gradient
        all-reduce for a process that has stopped."""
        lost: StreamStopped | None = None
        try:
            mb = self.train_split.featurize(mb, self.device)
        except StreamStopped as e:
            lost = e
        if self.cfg.train.mode == "stream" and self.accelerator.num_processes > 1:
            flag = torch.tensor([0.0 if lost is None else 1.0], device=self.device)
            if float(self.accelerator.reduce(flag, reduction="sum").item()) > 0 and lost is None:
                lost = StreamStopped("another process of this run lost every server of train.stream.urls")
        return mb, lost

    def train_step(self, stop: StopFlag) -> StepOutcome:
        """Forward/backward over this rank's micro-batches, then clip and step (or skip a non-finite step)."""
        t, acc, state = self.cfg.train, self.accelerator, self.state
        pre_position = DataPosition(self.stream.position.epoch, self.stream.position.index)
        pre_rng = ckpt.rng_state() if t.nonfinite == "stop" or t.mode == "stream" else None
        with self.timer("data"):
            micro, ids = self.stream.next_step()
        norms = self.global_token_counts(micro)
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        for i, mb in enumerate(micro):
            with self.timer("data"):
                mb, lost = self._featurize(mb)
                if lost is not None:  # every server gone: save the state before this step, then stop
                    self.optimizer.zero_grad(set_to_none=True)
                    self.stream.position = pre_position
                    path = self.result.last_checkpoint = self.save_checkpoint(pre_rng)
                    raise StreamStopped(
                        f"{lost}. The state before step {state.step + 1} is saved in {path}; start a server and "
                        "run the same command to resume"
                    ) from lost
            sync = contextlib.nullcontext() if i == len(micro) - 1 else acc.no_sync(self.wrapper)
            with self.timer("forward_backward"), sync:
                parts = self.wrapper(mb, norms)
                acc.backward(parts.objective)
            finite = finite & parts.finite.to(self.device)
            self.window.add(
                parts.step_loss,
                parts.step_correct,
                parts.step_tokens,
                parts.extra,
                mb["attention_mask"].sum(),
                float(mb["attention_mask"].numel()),
            )
        with self.timer("optimizer"):
            norm = acc.clip_grad_norm_(self.params, t.grad_clip) if t.grad_clip > 0 else grad_norm(self.params)
            bad_local = ~finite
            if t.mixed_precision != "fp16":  # fp16: inf gradients are the loss scaler's business (it skips the step)
                bad_local = bad_local | ~torch.isfinite(torch.as_tensor(norm, device=self.device)).all()
            flags = torch.stack([bad_local.float(), torch.tensor(float(stop.signum is not None), device=self.device)])
            if self.world > 1:
                flags = acc.reduce(flags, reduction="sum")
            bad, stop_requested = (x > 0 for x in flags.tolist())  # the step's one host sync: skip or step
            if bad:
                self.optimizer.zero_grad(set_to_none=True)
                all_ids = gather_object(ids) if self.world > 1 else ids
                self.tracker.write(
                    f"eagle-train: non-finite loss or gradient at step {state.step + 1} "
                    f"(conversations {all_ids}); train.nonfinite={t.nonfinite}"
                )
                if t.nonfinite == "stop":
                    self.stream.position = pre_position
                    self.result.last_checkpoint = self.save_checkpoint(pre_rng)
                    return StepOutcome(norm, stop_requested, nonfinite_stop=True)
                state.skipped_steps.append(state.step + 1)
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            with warnings.catch_warnings():  # a skipped step still moves the schedule on, on purpose
                warnings.filterwarnings(
                    "ignore", message=r"Detected call of `lr_scheduler.step\(\)` before", category=UserWarning
                )
                self.scheduler.step()
        return StepOutcome(norm, stop_requested)

    # --- logging, evaluation, checkpoints --------------------------------------------------------
    def log_window(self, outcome: StepOutcome) -> None:
        """Reduce the training sums since the last log line over ranks and log them with tokens/s."""
        with self.timer("logging"):
            total = self.window.reduce(self.accelerator)
            elapsed = time.perf_counter() - self.window_t0 - (self.timer.total(_NOT_TRAINING) - self.window_busy0)
            metrics = total.summary(self.loss_weights, self.extra_weights)
            metrics.update(
                lr=float(self.scheduler.get_last_lr()[0]),
                grad_norm=float(outcome.grad_norm),
                tokens_per_s=float(total.tokens) / max(elapsed, 1e-9),
                padding_share=total.padding_share,
                epoch=float(self.stream.position.epoch),
            )
            self.result.train_metrics = metrics
            self.state.metrics.update({f"train/{k}": v for k, v in metrics.items()})
            self.tracker.log(metrics, self.state.step, prefix="train")
            self.window = MetricSums()
            self.window_t0, self.window_busy0 = time.perf_counter(), self.timer.total(_NOT_TRAINING)

    def evaluate_heldout(self, untrained: bool = False) -> None:
        """Held-out metrics now; the best tau_sim so far is kept in `best/`. `untrained`: the fresh
        head's figures, logged as the baseline (evaluation draws no random numbers, so the run and
        its bit-for-bit resume are unchanged)."""
        if self.held_split is None:
            return
        try:
            with self.timer("eval"):
                metrics = evaluate_heldout(
                    self.head, self.lm_head, self.held_split, self.cfg, self.accelerator, self.pad_id
                )
        except StreamStopped as e:  # every server gone during an evaluation: the state after the last step is saved
            path = self.result.last_checkpoint = self.save_checkpoint()
            raise StreamStopped(
                f"{e}. The state after step {self.state.step} is saved in {path}; start a server and run the "
                "same command to resume"
            ) from e
        if untrained:
            self.result.initial_eval_metrics = metrics
            self.tracker.log(metrics, 0, prefix="eval_untrained")
            heldout.check_heldout_finite(metrics, self.head, "the untrained head")
            return
        state = self.state
        self.result.eval_metrics = metrics
        self.last_eval_step = state.step
        state.metrics.update({f"eval/{k}": v for k, v in metrics.items()})
        self.tracker.log(metrics, state.step, prefix="eval")
        heldout.check_heldout_finite(metrics, self.head, f"step {state.step}")
        if self.cfg.train.select_by == "tau_sim" and (
            state.best_metric is None or metrics["tau_sim"] > state.best_metric
        ):
            state.best_metric, state.best_step = metrics["tau_sim"], state.step
            if self.accelerator.is_main_process:
                with self.timer("checkpoint"):
                    ckpt.save_best(
                        self.out,
                        self.head,
                        {**self.head_extra, "step": state.step, **{f"eval_{k}": v for k, v in metrics.items()}},
                    )
            self.accelerator.wait_for_everyone()

    def wall_seconds(self) -> float:
        """The run's wall time so far: earlier sessions (from the checkpoint) plus this one."""
        return self.wall_before + (time.perf_counter() - self.started if self.started is not None else 0.0)

    def budget_spent(self) -> float:
        """train.schedule_over=minutes' clock: the share of train.max_minutes the run has spent."""
        return self.wall_seconds() / (60.0 * (self.cfg.train.max_minutes or float("inf")))

    def save_checkpoint(self, rng_override: dict[str, Any] | None = None) -> Path:
        with self.timer("checkpoint"):
            self.state.epoch, self.state.index = self.stream.position.epoch, self.stream.position.index
            self.state.wall_seconds = self.wall_seconds()
            path = ckpt.save_checkpoint(
                self.out,
                self.state,
                self.head,
                self.optimizer,
                self.scheduler,
                self.cfg.train.keep_checkpoints,
                self.rank,
                self.accelerator.wait_for_everyone,
                rng_override,
                self.head_extra,
                run_config=self.resume_record,
            )
        self.last_saved_step = self.state.step
        return path

    # --- the loop ------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        self.started = started = time.perf_counter()
        self.setup()
        t, state, result = self.cfg.train, self.state, self.result
        deadline = None
        if t.max_minutes:  # per session; with schedule_over=minutes the whole run's budget
            deadline = started + 60.0 * t.max_minutes - (self.wall_before if t.schedule_over == "minutes" else 0.0)
        if self.resume_from is None and state.step == 0:
            self.evaluate_heldout(untrained=True)
        with StopFlag() as stop:
            while state.step < t.max_steps:
                outcome = self.train_step(stop)
                if outcome.nonfinite_stop:
                    result.stopped = "nonfinite"
                    break
                state.step += 1
                if state.step % t.log_every == 0 or state.step == t.max_steps:
                    self.log_window(outcome)
                shown = (
                    {"loss": result.train_metrics["loss"]} if "loss" in result.train_metrics else {}
                )  # none before the first log
                self.tracker.advance(1, lr=self.scheduler.get_last_lr()[0], **shown)
                if state.step % t.eval_every == 0:
                    self.evaluate_heldout()
                if self.decode_eval is not None and self.decode_eval.due(state.step):
                    self.decode_eval.run(self)
                if state.step % t.save_every == 0 or outcome.stop_requested:
                    result.last_checkpoint = self.save_checkpoint()
                if self.hooks.on_step_end is not None:
                    self.hooks.on_step_end(state.step)
                if outcome.stop_requested:
                    result.stopped = "signal"
                    self.tracker.write(
                        f"eagle-train: stopped by signal after step {state.step}; checkpoint "
                        f"{result.last_checkpoint}. Run the same command again to resume."
                    )
                    break
                if deadline is not None and self.past(deadline) and state.step < t.max_steps:
                    result.stopped = "max_minutes"
                    self.tracker.write(
                        f"eagle-train: train.max_minutes={t.max_minutes} reached after step "
                        f"{state.step}; run the same command again to continue."
                    )
                    break
            if result.stopped in ("max_steps", "max_minutes"):
                if self.last_eval_step != state.step:
                    self.evaluate_heldout()
                if self.decode_eval is not None and self.decode_eval.due(state.step, final=True):
                    self.decode_eval.run(self)
                if self.last_saved_step != state.step:
                    result.last_checkpoint = self.save_checkpoint()
                if not (self.out / ckpt.BEST).is_dir() and self.accelerator.is_main_process:
                    # No held-out split: the final weights are the best we can tell.
                    ckpt.save_best(self.out, self.head, {**self.head_extra, "step": state.step})
                    state.best_step = state.step
                self.accelerator.wait_for_everyone()
        return self.close()

    def past(self, deadline: float) -> bool:
        """Whether this rank's clock passed `deadline`, agreed by all ranks (they stop together)."""
        late = torch.tensor([float(time.perf_counter() > deadline)], device=self.device)
        if self.world > 1:
            late = self.accelerator.reduce(late, reduction="sum")
        return bool(late.item() > 0)

    def close(self) -> TrainResult:
        """Final summary: tracker closed, `train_summary.json`, and an error if nothing was learnt."""
        state, result, out = self.state, self.result, self.out
        if self.decode_eval is not None:
            result.decode_eval = self.decode_eval.summary(self)
        self.tracker.summary({f"best/{k}": v for k, v in (result.eval_metrics or {}).items()})
        self.tracker.close()
        if state.step > 0 and len(state.skipped_steps) >= state.step:
            raise TrainingError(
                f"every one of the {state.step} optimizer steps had a non-finite loss or gradient and was skipped "
                f"(train.nonfinite=skip): the head in {out} learnt nothing. Check the data (a capture with inf/nan "
                "features: re-capture with capture.dtype=bfloat16) or lower train.lr"
            )
        result.step = state.step
        result.best_metric, result.best_step = state.best_metric, state.best_step
        result.best_dir = out / ckpt.BEST if (out / ckpt.BEST).is_dir() else None
        result.skipped_steps = list(state.skipped_steps)
        result.timings = dict(self.timer.seconds)
        stream_report = getattr(self.train_split, "report", None)
        if callable(stream_report):  # train.mode=stream
            result.stream = stream_report()
            self.train_split.close()
        if self.accelerator.is_main_process:
            summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(result).items()}
            ckpt.atomic_write_text(
                out / "train_summary.json", json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n"
            )
        self.accelerator.wait_for_everyone()
        return result


def train(cfg: RootConfig, hooks: TrainHooks | None = None) -> TrainResult:
    """Train a draft head per `cfg` into `cfg.output_dir`; see the module docstring."""
    return TrainRecipe(cfg, hooks).train()


def format_result(result: TrainResult) -> str:
    """Human summary: held-out acc@k and tau_sim of the last evaluation, where the best head is."""
    lines = [f"eagle-train: {result.stopped} at step {result.step}; output in {result.output_dir}"]
    m = result.eval_metrics
    if m:
        for label, metrics in (("untrained head", result.initial_eval_metrics), ("held-out", m)):
            if metrics:
                accs = [f"acc@{i}={metrics[f'acc_{i}']:.3f}" for i in range(len(metrics)) if f"acc_{i}" in metrics]
                lines.append(
                    f"{label}: loss={metrics['loss']:.4f} " + " ".join(accs) + f" tau_sim={metrics['tau_sim']:.3f}"
                )
    elif result.stopped == "signal":  # the final evaluation is skipped so that a stop is quick
        lines.append(
            "held-out: not evaluated (stopped by a signal); the same command resumes, and evaluates at its end"
        )
    else:
        lines.append("held-out: no held-out split (data.heldout_fraction=0 or none captured); best/ = final weights")
    if result.best_dir is not None:
        by = result.decode_eval.get("select_by", "tau_sim")
        best = f" ({by}={result.best_metric:.3f} at step {result.best_step})" if result.best_metric else ""
        lines.append(f"best head: {result.best_dir}{best}")
    if result.decode_eval.get("tau_real") is not None:
        lines.append(format_decode_eval(result.decode_eval))
    if result.skipped_steps:
        lines.append(f"skipped non-finite steps: {result.skipped_steps}")
    if result.stream:
        s = result.stream
        served = ", ".join(f"{url}: {n}" for url, n in s["served"].items())
        lines.append(f"stream: samples served by {served or 'no server'}; {s['requeued']} asked again elsewhere")
        if s["unservable"]:
            named = "; ".join(f"{cid} ({why})" for cid, why in list(s["unservable"].items())[:10])
            lines.append(
                f"stream: {len(s['unservable'])} conversation(s) could not be served and trained nothing: {named}"
            )
    return "\n".join(lines)


__all__ = ["TrainHooks", "TrainRecipe", "TrainResult", "TrainStep", "format_result", "train"]
