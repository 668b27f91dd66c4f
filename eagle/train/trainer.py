"""The draft-head trainer: `train(cfg) -> TrainResult` (the `eagle-train` stage).

One loop for both algorithms and both data modes, on accelerate:

  setup      target (frozen; offline mode uses only its embeddings and LM head), data splits,
             reduced vocabulary (EAGLE-3, from the training split's loss-mask token counts),
             head, AdamW, warmup + decay schedule, resume from the latest checkpoint
  step       this rank's micro-batches of the global batch -> head loss -> backward (DDP gradient
             sync on the last micro-batch only) -> non-finite check -> clip -> AdamW -> schedule
  log/eval   token-weighted loss / loss_i / acc_i per unroll step, lr, tokens/s; on the held-out
             split also tau_sim (see `eagle.train.metrics`), which picks `output_dir/best/`
  save       `eagle.train.checkpoint` (atomic, resumable bit for bit, pruned)

Loss normalisation: every micro-batch's loss is divided by the GLOBAL number of loss tokens of the
step (per unroll step, all-reduced before the forward), so the gradient is the token mean over the
whole global batch whatever `grad_accum` and the number of processes are: 1 process x batch 8 and
2 processes x 4 give the same update up to float summation order.

Multi-GPU / multi-node: `accelerate launch [--config_file cfg.yaml] -m eagle.cli.train ...` (or
`eagle-train` under `torchrun`); the data-parallel setup (DDP, number of processes and machines,
mixed precision default) comes from the accelerate config file written by `accelerate config`.
`train.batch_size` stays the GLOBAL batch. A draft head is one decoder layer (+ its LM head), so
DDP fits it on any accelerator that fits the target; FSDP and DeepSpeed configs are refused because
evaluation and checkpointing here use the unsharded head.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagle.algorithms import LossParts, LossSettings, get_algorithm
from eagle.algorithms.base import aligned_inputs, step_masks
from eagle.config import ConfigError, RootConfig
from eagle.errors import CheckpointError, TrainingError
from eagle.heads.base import DraftHead
from eagle.train import checkpoint as ckpt
from eagle.train.batches import BatchStream, DataPosition, OfflineSplit, OnlineSplit, eval_batches
from eagle.train.metrics import MetricSums
from eagle.train.resume import check_resume, follow_schedule, run_record
from eagle.train.schedule import build_optimizer, build_scheduler

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------- results
@dataclass
class TrainResult:
    output_dir: Path
    step: int  # optimizer steps done
    stopped: str  # max_steps | signal | nonfinite
    best_dir: Path | None
    best_metric: float | None  # held-out tau_sim of best/
    best_step: int | None
    last_checkpoint: Path | None
    eval_metrics: dict[str, float] = field(default_factory=dict)  # last held-out evaluation
    # Held-out metrics of the freshly initialised head (fresh runs only): the baseline training must beat.
    initial_eval_metrics: dict[str, float] = field(default_factory=dict)
    train_metrics: dict[str, float] = field(default_factory=dict)  # last logged training window
    skipped_steps: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase (rank 0)


@dataclass
class TrainHooks:
    """Optional callbacks (tests, notebooks): called on every rank after each optimizer step."""

    on_step_end: Callable[[int], None] | None = None


# --------------------------------------------------------------------------------------- losses
def head_losses(head: DraftHead, lm_head: nn.Module, batch: dict[str, Any], settings: LossSettings,
                norms: torch.Tensor | None = None, label_rows: torch.Tensor | None = None) -> LossParts:
    """Loss of one collated micro-batch, by the head's algorithm (`Algorithm.forward_loss`)."""
    return get_algorithm(head.config.algorithm).forward_loss(head, lm_head, batch, settings, norms, label_rows)


class TrainStep(nn.Module):
    """The head plus its loss as one module, so DDP/FSDP see every head call inside `forward`."""

    def __init__(self, head: DraftHead, lm_head: nn.Module, settings: LossSettings) -> None:
        super().__init__()
        self.head = head
        self.algorithm = get_algorithm(head.config.algorithm)
        self._borrowed: dict[str, Any] = {"lm_head": lm_head}  # frozen target module: not a parameter here
        self.settings = settings

    def forward(self, batch: dict[str, Any], norms: torch.Tensor) -> LossParts:  # type: ignore[override]
        return self.algorithm.forward_loss(self.head, self._borrowed["lm_head"], batch, self.settings, norms,
                                           self._label_rows())

    def _label_rows(self) -> torch.Tensor | None:
        """`Algorithm.label_rows`, gathered once per device (the head's vocab maps are fixed)."""
        key = ("label_rows", str(self.head.d2t.device) if hasattr(self.head, "d2t") else "")
        if key not in self._borrowed:
            self._borrowed[key] = self.algorithm.label_rows(self.head, self._borrowed["lm_head"])
        return self._borrowed[key]


# --------------------------------------------------------------------------------------- helpers
class _StopFlag:
    """SIGINT/SIGTERM set a flag; the loop finishes the step, saves and returns."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handlers, the run just cannot be interrupted cleanly
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C aborts at once
        self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class _Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def _grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    grads = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    return torch.stack(grads).norm() if grads else torch.zeros(())


def _loss_settings(cfg: RootConfig, pad_id: int, training: bool) -> LossSettings:
    return get_algorithm(cfg.draft.algorithm).loss_settings(cfg.draft, cfg.train, pad_id, training)


def _summary_weights(cfg: RootConfig, steps: int) -> tuple[list[float], dict[str, float]]:
    return get_algorithm(cfg.draft.algorithm).summary_weights(cfg.train, steps)


# --------------------------------------------------------------------------------------- setup
def _build_data(cfg: RootConfig, target: nn.Module, tokenizer: Any, info: Any, aux: list[int], accelerator: Any):
    """(train split, held-out split or None) for train.mode."""
    t = cfg.train
    if t.mode == "offline":
        from eagle.capture.reader import check_compatible, read_manifest

        if not t.data_dir:
            raise ConfigError("train.mode=offline needs train.data_dir=CAPTURE_DIR (the output_dir of eagle-capture)")
        manifest = read_manifest(t.data_dir)
        check_compatible(manifest, info, cfg.draft.algorithm, aux or None, data_dir=t.data_dir)
        train = OfflineSplit(t.data_dir, "train", seed=t.seed)
        held = OfflineSplit(t.data_dir, "heldout", seed=t.seed)
        return train, (held if len(held) else None)
    from eagle.data.dataset import build_splits

    with accelerator.main_process_first():
        splits = build_splits(cfg.data, tokenizer, progress=accelerator.is_main_process)
    layer_ids = get_algorithm(cfg.draft.algorithm).capture_layer_ids(aux)
    train = OnlineSplit(splits.train, cfg.capture.shard_size, target, layer_ids)
    held = OnlineSplit(splits.heldout, cfg.capture.shard_size, target, layer_ids) if splits.heldout else None
    return train, held


def _prepare_output(cfg: RootConfig, log: Callable[[str], None] | None = print) -> Path | None:
    """The checkpoint to resume from per train.resume (auto | true | false), or None.

    A checkpoint written under settings that change the training trajectory is refused; allowed
    changes (max_steps, cadences, logger) are logged (`eagle.train.resume.check_resume`)."""
    out = Path(cfg.output_dir)
    mode = str(cfg.train.resume).lower()
    latest = ckpt.find_latest_checkpoint(out)
    if mode == "false" and latest is not None:
        raise CheckpointError(
            f"{out} already holds training checkpoints ({latest.name}) and train.resume=false; use another "
            "output_dir, delete its checkpoints/, or set train.resume=auto to continue"
        )
    if mode == "true" and latest is None:
        raise CheckpointError(f"train.resume=true but {out} has no complete checkpoint under {ckpt.CHECKPOINTS}/")
    if mode == "false" or latest is None:
        return None
    check_resume(cfg, latest, log)
    return latest


def _make_accelerator(cfg: RootConfig):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedDataParallelKwargs, DistributedType

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1 or (
        torch.distributed.is_available() and torch.distributed.is_initialized()
    )
    if not launched:
        # accelerate keeps process-wide state; a second train() in the same process (a notebook,
        # tests) with another mixed precision or accumulation would be refused or silently keep
        # the first run's settings. Single-process state is safe to rebuild.
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    from eagle.precision import resolve_mixed_precision

    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    mixed = resolve_mixed_precision(cfg.train.mixed_precision, device)
    if cfg.train.mixed_precision == "auto":
        log.info("train.mixed_precision=auto -> %s on %s", mixed, device)
    accelerator = Accelerator(
        mixed_precision=mixed,
        gradient_accumulation_steps=cfg.train.grad_accum,
        # Without an accelerator say so explicitly: a multi-process launch on CPU then uses gloo.
        cpu=cfg.device == "cpu" or (cfg.device is None and not torch.cuda.is_available()),
        # Unused parameters never occur (every head weight is in every step's graph); saying so
        # spares DDP a graph walk per step.
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=False)],
    )
    # Checked after creating the Accelerator: a bare PartialState() first would settle the process
    # group without the cpu flag and turn a multi-process CPU launch into N single processes.
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ConfigError(
            f"eagle-train runs data-parallel (DDP) only; the accelerate config asks for "
            f"{accelerator.distributed_type.value}. Re-run `accelerate config` choosing multi-GPU without "
            "FSDP/DeepSpeed (the head is one layer: it needs no sharding)"
        )
    return accelerator


# --------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(
    head: DraftHead,
    lm_head: nn.Module,
    split: Any,
    cfg: RootConfig,
    accelerator: Any,
    pad_id: int,
) -> dict[str, float]:
    """Held-out metrics over the first `eval_batches x batch_size` conversations (fixed, all ranks)."""
    t = cfg.train
    micro = max(1, t.batch_size // (t.grad_accum * accelerator.num_processes))
    settings = _loss_settings(cfg, pad_id, training=False)
    sums = MetricSums()
    was_training = head.training
    head.eval()
    try:
        for batch in eval_batches(split, t.eval_batches * t.batch_size, micro, t.max_length, pad_id,
                                  accelerator.process_index, accelerator.num_processes):
            batch = split.featurize(batch, accelerator.device)
            with accelerator.autocast():
                parts = head_losses(head, lm_head, batch, settings)
            sums.add(parts.step_loss, parts.step_correct, parts.step_tokens, parts.extra,
                     float(batch["attention_mask"].sum()))
    finally:
        head.train(was_training)
    if not sums.step_tokens:  # this rank had no held-out items: contribute zeros to the reduce
        zeros = [0.0] * settings.steps
        sums.add(zeros, zeros, zeros, dict.fromkeys(get_algorithm(cfg.draft.algorithm).extra_metrics, 0.0))
    total = sums.reduce(accelerator)
    return total.summary(*_summary_weights(cfg, settings.steps))


def _check_heldout_finite(metrics: dict[str, float], head: nn.Module, when: str) -> None:
    """A non-finite held-out metric means the run cannot be trusted: stop and say why."""
    bad = sorted(k for k, v in metrics.items() if not math.isfinite(v))
    if not bad:
        return
    weights_ok = all(bool(torch.isfinite(p).all()) for p in head.parameters())
    cause = ("the held-out data give non-finite losses (inf/nan features, or target logits that overflow)"
             if weights_ok else "the head's weights are no longer finite (training diverged: lower train.lr, "
             "keep train.grad_clip > 0)")
    raise TrainingError(f"held-out metrics of {when} are not finite ({', '.join(bad)}): {cause}; "
                        "checkpoints written so far are kept")


# --------------------------------------------------------------------------------------- train
def train(cfg: RootConfig, hooks: TrainHooks | None = None) -> TrainResult:
    """Train a draft head per `cfg` into `cfg.output_dir`; see the module docstring."""
    from accelerate.utils import gather_object

    from eagle.heads.io import build_head, head_config_from_target, load_head
    from eagle.targets import load_target
    from eagle.tracking import Tracker

    hooks = hooks or TrainHooks()
    t = cfg.train
    out = Path(cfg.output_dir)
    accelerator = _make_accelerator(cfg)
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    timer = _Timer()
    resume_from = _prepare_output(cfg, log=print if accelerator.is_main_process else None)
    resume_record = run_record(cfg)  # stored in every checkpoint: what a later resume is compared with

    # --- target, data, head --------------------------------------------------------------------
    target, tokenizer, info = load_target(cfg.target, device=device)
    head_cfg = head_config_from_target(target.config, cfg.draft, info)
    aux = list(head_cfg.aux_layer_ids)
    train_split, held_split = _build_data(cfg, target, tokenizer, info, aux, accelerator)
    pad_id = int(tokenizer.pad_token_id or 0)
    counts = None
    if head_cfg.draft_vocab_size < head_cfg.vocab_size:  # a reduced vocabulary is chosen from the data
        counts = train_split.token_counts(head_cfg.vocab_size)  # [V] loss-mask tokens of the training split
    torch.manual_seed(t.seed)  # the same initial head on every rank and every run
    head = build_head(head_cfg, target_model=target, vocab_counts=counts).to(device)
    head.train()
    lm_head = target.get_output_embeddings()
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, t)
    scheduler = build_scheduler(optimizer, t)

    state = ckpt.TrainState(algorithm=head_cfg.algorithm, target_fingerprint=info.fingerprint,
                            aux_layer_ids=aux, world_size=world)
    rng = None
    if resume_from is not None:
        saved = ckpt.read_state(resume_from)
        ckpt.check_resumable(saved, resume_from, head_cfg.algorithm, info.fingerprint, aux)
        loaded = load_head(resume_from / "head", algorithm=head_cfg.algorithm)
        head.load_state_dict(loaded.state_dict())
        optimizer.load_state_dict(ckpt.load_torch(resume_from / "optimizer.pt"))
        scheduler.load_state_dict(ckpt.load_torch(resume_from / "scheduler.pt"))
        follow_schedule(optimizer, scheduler)  # a raised max_steps re-shapes the decay still to come
        rng = ckpt.load_rng(resume_from, rank)
        state = saved
        state.world_size = world
    # Per-rank random streams (EAGLE-1 feature noise); restored exactly on resume.
    torch.manual_seed(t.seed * 1000 + rank + 1)
    if rng is not None:
        ckpt.set_rng_state(rng)

    stream = BatchStream(train_split, t.seed, t.batch_size, t.grad_accum, t.max_length, pad_id, rank, world,
                         DataPosition(state.epoch, state.index), group_lengths=t.group_by_length)
    settings = _loss_settings(cfg, pad_id, training=True)
    wrapper = TrainStep(head, lm_head, settings)
    wrapper, optimizer = accelerator.prepare(wrapper, optimizer)
    steps = settings.steps
    loss_weights, extra_weights = _summary_weights(cfg, steps)
    # The objective is already the global token mean: undo accelerator.backward's division by its
    # accumulation steps and DDP's averaging over ranks.
    backward_scale = float(world) * float(accelerator.gradient_accumulation_steps)

    result = TrainResult(output_dir=out, step=state.step, stopped="max_steps", best_dir=None,
                         best_metric=state.best_metric, best_step=state.best_step, last_checkpoint=resume_from,
                         skipped_steps=list(state.skipped_steps))
    head_extra = {"target": info.source, "target_fingerprint": info.fingerprint}

    def save(rng_override: dict[str, Any] | None = None) -> Path:
        with timer("checkpoint"):
            state.epoch, state.index = stream.position.epoch, stream.position.index
            return ckpt.save_checkpoint(out, state, accelerator.unwrap_model(wrapper).head, optimizer, scheduler,
                                        t.keep_checkpoints, rank, accelerator.wait_for_everyone, rng_override,
                                        head_extra, run_config=resume_record)

    def run_eval() -> None:
        if held_split is None:
            return
        with timer("eval"):
            metrics = evaluate(accelerator.unwrap_model(wrapper).head, lm_head, held_split, cfg, accelerator, pad_id)
        result.eval_metrics = metrics
        state.metrics.update({f"eval/{k}": v for k, v in metrics.items()})
        tracker.log(metrics, state.step, prefix="eval")
        _check_heldout_finite(metrics, accelerator.unwrap_model(wrapper).head, f"step {state.step}")
        if state.best_metric is None or metrics["tau_sim"] > state.best_metric:
            state.best_metric, state.best_step = metrics["tau_sim"], state.step
            if accelerator.is_main_process:
                with timer("checkpoint"):
                    ckpt.save_best(out, accelerator.unwrap_model(wrapper).head,
                                   {**head_extra, "step": state.step, **{f"eval_{k}": v for k, v in metrics.items()}})
            accelerator.wait_for_everyone()

    run_config = json.loads(json.dumps(asdict(cfg), default=str))
    tracker = Tracker(cfg.logger, out, run_config, total=t.max_steps, initial=state.step,
                      enabled=accelerator.is_main_process)
    window = MetricSums()
    window_t0 = time.perf_counter()
    busy = ("eval", "checkpoint", "logging")  # time not spent training, left out of tokens/s
    window_busy0 = sum(timer.seconds.get(k, 0.0) for k in busy)
    last_saved_step = state.step if resume_from is not None else -1
    last_eval_step = -1
    if accelerator.is_main_process and resume_from is not None:
        tracker.write(f"eagle-train: resumed from {resume_from} (step {state.step}, epoch {state.epoch}, "
                      f"item {state.index})")

    if resume_from is None and state.step == 0 and held_split is not None:
        # The untrained head's held-out figures, so every run states what training bought. Evaluation
        # draws no random numbers, so this leaves the run itself (and bit-for-bit resume) unchanged.
        with timer("eval"):
            result.initial_eval_metrics = evaluate(accelerator.unwrap_model(wrapper).head, lm_head, held_split,
                                                   cfg, accelerator, pad_id)
        tracker.log(result.initial_eval_metrics, 0, prefix="eval_untrained")
        _check_heldout_finite(result.initial_eval_metrics, accelerator.unwrap_model(wrapper).head, "the untrained head")

    with _StopFlag() as stop:
        while state.step < t.max_steps:
            pre_position = DataPosition(stream.position.epoch, stream.position.index)
            pre_rng = ckpt.rng_state() if t.nonfinite == "stop" else None
            with timer("data"):
                micro, ids = stream.next_step()
            # Global loss-token counts per unroll step: the denominator of every micro-batch's loss.
            local = torch.zeros(steps, dtype=torch.float64)
            for mb in micro:
                a = aligned_inputs(mb, pad_id)
                local += torch.tensor([float(m.sum()) for m in step_masks(a["loss_mask"], a["valid"], steps)],
                                      dtype=torch.float64)
            norms = accelerator.reduce(local.to(device), reduction="sum") if world > 1 else local
            finite = True
            for i, mb in enumerate(micro):
                with timer("data"):
                    mb = train_split.featurize(mb, device)
                sync = contextlib.nullcontext() if i == len(micro) - 1 else accelerator.no_sync(wrapper)
                with timer("forward_backward"), sync:
                    parts = wrapper(mb, norms)
                    accelerator.backward(parts.objective * backward_scale)
                finite &= parts.finite
                window.add(parts.step_loss, parts.step_correct, parts.step_tokens, parts.extra,
                           float(mb["attention_mask"].sum()), float(mb["attention_mask"].numel()))
            with timer("optimizer"):
                if t.grad_clip > 0:
                    grad_norm = accelerator.clip_grad_norm_(params, t.grad_clip)
                else:
                    grad_norm = _grad_norm(params)
                grad_ok = bool(torch.isfinite(torch.as_tensor(grad_norm)).all())
                # fp16: inf gradients are the loss scaler's business (it skips the step and lowers the scale).
                bad_local = (not finite) or (not grad_ok and t.mixed_precision != "fp16")
                flags = torch.tensor([float(bad_local), float(stop.signum is not None)], device=device)
                if world > 1:
                    flags = accelerator.reduce(flags, reduction="sum")
                bad, stop_requested = bool(flags[0] > 0), bool(flags[1] > 0)
                if bad:
                    optimizer.zero_grad(set_to_none=True)
                    all_ids = gather_object(ids) if world > 1 else ids
                    tracker.write(f"eagle-train: non-finite loss or gradient at step {state.step + 1} "
                                  f"(conversations {all_ids}); train.nonfinite={t.nonfinite}")
                    if t.nonfinite == "stop":
                        stream.position = pre_position
                        result.last_checkpoint = save(pre_rng)
                        result.stopped = "nonfinite"
                        break
                    state.skipped_steps.append(state.step + 1)
                else:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            state.step += 1
            lr = scheduler.get_last_lr()[0]
            tracker.advance(1, loss=window.summary(loss_weights, extra_weights)["loss"] if window.step_tokens else 0.0,
                            lr=lr)

            if state.step % t.log_every == 0 or state.step == t.max_steps:
                with timer("logging"):
                    total = window.reduce(accelerator)
                    elapsed = time.perf_counter() - window_t0
                    elapsed -= sum(timer.seconds.get(k, 0.0) for k in busy) - window_busy0
                    metrics = total.summary(loss_weights, extra_weights)
                    metrics.update(lr=lr, grad_norm=float(grad_norm), tokens_per_s=total.tokens / max(elapsed, 1e-9),
                                   padding_share=total.padding_share,
                                   epoch=float(stream.position.epoch))
                    result.train_metrics = metrics
                    state.metrics.update({f"train/{k}": v for k, v in metrics.items()})
                    tracker.log(metrics, state.step, prefix="train")
                    window, window_t0 = MetricSums(), time.perf_counter()
                    window_busy0 = sum(timer.seconds.get(k, 0.0) for k in busy)
            if state.step % t.eval_every == 0:
                run_eval()
                last_eval_step = state.step
            if state.step % t.save_every == 0 or stop_requested:
                result.last_checkpoint = save()
                last_saved_step = state.step
            if hooks.on_step_end is not None:
                hooks.on_step_end(state.step)
            if stop_requested:
                result.stopped = "signal"
                tracker.write(f"eagle-train: stopped by signal after step {state.step}; checkpoint "
                              f"{result.last_checkpoint}. Run the same command again to resume.")
                break

        if result.stopped == "max_steps":
            if last_eval_step != state.step:
                run_eval()
            if last_saved_step != state.step:
                result.last_checkpoint = save()
            if not (out / ckpt.BEST).is_dir() and accelerator.is_main_process:
                # No held-out split: the final weights are the best we can tell.
                ckpt.save_best(out, accelerator.unwrap_model(wrapper).head, {**head_extra, "step": state.step})
                state.best_step = state.step
            accelerator.wait_for_everyone()

    tracker.summary({f"best/{k}": v for k, v in (result.eval_metrics or {}).items()})
    tracker.close()
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
    result.timings = dict(timer.seconds)
    if accelerator.is_main_process:
        summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(result).items()}
        ckpt.atomic_write_text(out / "train_summary.json", json.dumps(summary, indent=2, sort_keys=True,
                                                                      default=str) + "\n")
    accelerator.wait_for_everyone()
    return result


def format_result(result: TrainResult) -> str:
    """Human summary: held-out acc@k and tau_sim of the last evaluation, where the best head is."""
    lines = [f"eagle-train: {result.stopped} at step {result.step}; output in {result.output_dir}"]
    m = result.eval_metrics
    if m:
        for label, metrics in (("untrained head", result.initial_eval_metrics), ("held-out", m)):
            if metrics:
                accs = [f"acc@{i}={metrics[f'acc_{i}']:.3f}" for i in range(len(metrics)) if f"acc_{i}" in metrics]
                lines.append(f"{label}: loss={metrics['loss']:.4f} " + " ".join(accs)
                             + f" tau_sim={metrics['tau_sim']:.3f}")
    else:
        lines.append("held-out: no held-out split (data.heldout_fraction=0 or none captured); best/ = final weights")
    if result.best_dir is not None:
        best = f" (tau_sim={result.best_metric:.3f} at step {result.best_step})" if result.best_metric else ""
        lines.append(f"best head: {result.best_dir}{best}")
    if result.skipped_steps:
        lines.append(f"skipped non-finite steps: {result.skipped_steps}")
    return "\n".join(lines)


__all__ = ["TrainHooks", "TrainResult", "TrainStep", "evaluate", "format_result", "head_losses", "train"]
