"""Real acceptance while training (`train.eval_decode_every=N`): the current head in eagle's own decoder.

Every N optimizer steps (and once at the end of a run that stops at max_steps or max_minutes) the first
`train.eval_decode_prompts` held-out conversations are decoded, each from its prompt (the tokens before
the conversation's first loss token: the first user turn through the chat template, generation prompt
included, as the data stage rendered it), for at most `train.eval_decode_max_new_tokens` tokens, by
`SpeculativeGenerator` with the target the trainer already holds and a copy of the current head. It
logs `tau_real` (tokens per verify pass, as eagle-eval's `tau`) and the acceptance rate by draft depth
beside the held-out `tau_sim` of the same head, keeps `output_dir/best/` by it under
`train.select_by=tau_real`, and puts the distance between the two in the run summary.

It needs only the target, its tokenizer, the head and the held-out split (`SplitData.item`), so it works
the same in every `train.mode`: offline mode loads the whole target too (eagle.train.trainer).

Decoding settings: `decode.*` as eagle-eval reads them, except `max_new_tokens` (the bound above) and
`tree=auto`, which decodes as `dynamic` with the same bounds: auto picks trees from timings of this
machine, so the same head would give another tau_real under another load, and steps would not compare.

Randomness: the decoder samples with its own generator (`decode.seed`), and the process's RNG states
(torch, CUDA, numpy, python) are saved before and restored after, so a run with and without these
evaluations draws the same random numbers and trains the same head.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import broadcast_object_list

from eagle import spec_metrics
from eagle.algorithms import get_algorithm
from eagle.config import ConfigError, DecodeConfig, TrainConfig
from eagle.decode.generator import SpeculativeGenerator
from eagle.heads.base import DraftHead
from eagle.train import checkpoint as ckpt

if TYPE_CHECKING:  # the recipe calls in; a run-time import would be a cycle
    from eagle.train.trainer import TrainRecipe

PREFIX = "eval_decode"  # metrics.jsonl split and the tracker's prefix: eval_decode/tau_real beside eval_decode/tau_sim


def heldout_prompts(split: Any, count: int) -> list[torch.Tensor]:
    """[T] prompt ids of the first `count` held-out conversations that have one: each item's tokens before
    its first loss-mask token (the chat template's user turn and generation prompt, rendered by the data
    stage). The same prompts every evaluation, so tau_real compares across steps."""
    prompts: list[torch.Tensor] = []
    for index in range(len(split)):
        if len(prompts) == count:
            break
        item = split.item(index)
        mask = item["loss_mask"].bool()
        first = int(mask.nonzero()[0]) if bool(mask.any()) else 0
        if first > 0:  # a conversation that opens with a trained token has no prompt to decode from
            prompts.append(item["input_ids"][:first].long().clone())
    return prompts


def decode_settings(decode: DecodeConfig, max_new_tokens: int) -> DecodeConfig:
    """`decode.*` bounded to `max_new_tokens`, tree=auto decoded as dynamic (see the module docstring)."""
    return replace(decode, max_new_tokens=max_new_tokens, tree="dynamic" if decode.tree == "auto" else decode.tree)


def max_depth(decode: DecodeConfig, head: DraftHead) -> int:
    """The deepest draft a verify pass can accept: eagle-eval's depth for `accept_rate_by_depth`."""
    block = get_algorithm(head.config.algorithm).block_drafts(head.config)
    if block is not None:  # a block drafter drafts every block position, whatever decode.tree_depth says
        depth = block
    elif decode.tree == "static" and decode.static_paths:
        depth = max(len(p) for p in decode.static_paths)
    else:
        depth = decode.tree_depth
    return max(depth, decode.lookup_tokens)  # grafted lookup chains reach deeper than the head drafts


def measure(
    target: Any, head: DraftHead, tokenizer: Any, prompts: list[torch.Tensor], decode: DecodeConfig, device: Any
) -> dict[str, Any]:
    """Decode every prompt with the lossless decoder and `head` (eval mode, then its mode before); the
    process's RNG states are restored afterwards. Returns tau_real, accept_rate_by_depth and counts."""
    rng, was_training = ckpt.rng_state(), head.training
    started = time.perf_counter()
    lengths: list[int] = []
    forwards = tokens = 0
    try:
        head.eval()
        with torch.no_grad():
            generator = SpeculativeGenerator(target, head, tokenizer, decode, device=device)  # decodes a copy
            for ids in prompts:
                res = generator.generate(ids)
                lengths += [int(n) for n in res.accept_lengths]
                forwards += int(res.target_forwards)
                tokens += len(res.tokens)
    finally:
        head.train(was_training)
        ckpt.set_rng_state(rng)
    return {
        "tau_real": spec_metrics.tau(lengths, forwards),
        "accept_rate_by_depth": spec_metrics.accept_rate_by_depth(lengths, max_depth(decode, head)),
        "verify_passes": forwards,
        "new_tokens": tokens,
        "seconds": time.perf_counter() - started,
    }


@dataclass
class DecodeEval:
    """The run's decoding evaluations: when they are due, running one, best/ by tau_real, the summary."""

    train_cfg: TrainConfig
    decode: DecodeConfig
    target: Any
    tokenizer: Any
    split: Any
    prompts: list[torch.Tensor] | None = None  # built on first use (offline items also read features)
    last_step: int = -1
    history: list[dict[str, Any]] = field(default_factory=list)  # this session's evaluations

    @classmethod
    def for_recipe(cls, recipe: TrainRecipe) -> DecodeEval | None:
        """None where train.eval_decode_every is 0 / null; a clear refusal where there is nothing to decode."""
        t = recipe.cfg.train
        if not t.eval_decode_every:
            return None
        if recipe.held_split is None:
            raise ConfigError(
                f"train.eval_decode_every={t.eval_decode_every} decodes held-out prompts, but this run has no "
                "held-out split (data.heldout_fraction=0, or a capture without one): capture with "
                "data.heldout_fraction > 0, or set train.eval_decode_every=0"
            )
        decode = decode_settings(recipe.cfg.decode, t.eval_decode_max_new_tokens)
        return cls(t, decode, recipe.target, recipe.tokenizer, recipe.held_split)

    def due(self, step: int, final: bool = False) -> bool:
        every = self.train_cfg.eval_decode_every or 0
        return self.last_step != step and (final or step % every == 0)

    def run(self, recipe: TrainRecipe) -> dict[str, Any]:
        """One evaluation at the recipe's step. Rank 0 decodes while the other ranks wait at the broadcast
        (a barrier): the decoder runs batch 1 on one whole target, and a share per rank would gain little
        on a few prompts; every rank then holds the same figures, so best/ is chosen alike everywhere."""
        state, acc = recipe.state, recipe.accelerator
        if recipe.last_eval_step != state.step:  # every tau_real beside a tau_sim of the same head
            recipe.evaluate_heldout()
        with recipe.timer("eval"):
            box: list[Any] = [None]
            if acc.is_main_process:
                if self.prompts is None:
                    self.prompts = self._prompts()
                box[0] = measure(self.target, recipe.head, self.tokenizer, self.prompts, self.decode, recipe.device)
            if acc.num_processes > 1:
                broadcast_object_list(box, from_process=0)
        metrics = self._record(recipe, box[0])
        if self.train_cfg.select_by == "tau_real":
            self._keep_best(recipe, metrics)
        return metrics

    def _prompts(self) -> list[torch.Tensor]:
        prompts = heldout_prompts(self.split, self.train_cfg.eval_decode_prompts)
        if not prompts:
            raise ConfigError(
                "train.eval_decode_every: no held-out conversation has a prompt before its first trained token, "
                "so there is nothing to decode from; set train.eval_decode_every=0"
            )
        return prompts

    def _record(self, recipe: TrainRecipe, measured: dict[str, Any]) -> dict[str, Any]:
        """Log one evaluation (console, metrics.jsonl, wandb) and keep it for the summary and a resume."""
        state, step = recipe.state, recipe.state.step
        tau_sim = recipe.result.eval_metrics.get("tau_sim")
        metrics: dict[str, Any] = {"tau_real": measured["tau_real"]}
        if tau_sim is not None:
            metrics.update(tau_sim=float(tau_sim), tau_gap=float(tau_sim) - measured["tau_real"])
        metrics.update({f"accept_d{d}": r for d, r in enumerate(measured["accept_rate_by_depth"], start=1)})
        metrics.update({k: measured[k] for k in ("verify_passes", "new_tokens", "seconds")})
        recipe.tracker.log(metrics, step, prefix=PREFIX)
        self.last_step = step
        self.history.append({"step": step, **metrics})
        # The last evaluation and running sums in the checkpoint's state, so that a resumed run's summary
        # (last figures, mean gap) covers the whole run; the previous evaluation's keys go first, as its
        # acceptance may have reached deeper.
        saved = state.metrics
        sums = {k: saved.pop(f"{PREFIX}/{k}", 0.0) for k in ("gap_sum", "gap_count")}
        for key in [k for k in saved if k.startswith(f"{PREFIX}/")]:
            del saved[key]
        if "tau_gap" in metrics:
            sums = {"gap_sum": sums["gap_sum"] + metrics["tau_gap"], "gap_count": sums["gap_count"] + 1.0}
        saved.update({f"{PREFIX}/{k}": float(v) for k, v in {**metrics, **sums, "step": step}.items()})
        return metrics

    def _keep_best(self, recipe: TrainRecipe, metrics: dict[str, Any]) -> None:
        """train.select_by=tau_real: this head goes to best/ when its tau_real beats every earlier one."""
        state = recipe.state
        if state.best_metric is not None and metrics["tau_real"] <= state.best_metric:
            return
        state.best_metric, state.best_step = metrics["tau_real"], state.step
        if recipe.accelerator.is_main_process:
            extra = {**recipe.head_extra, "step": state.step, "select_by": "tau_real"}
            extra.update({f"eval_{k}": v for k, v in recipe.result.eval_metrics.items()})
            extra.update({f"eval_decode_{k}": v for k, v in metrics.items()})
            with recipe.timer("checkpoint"):
                ckpt.save_best(recipe.out, recipe.head, extra)
        recipe.accelerator.wait_for_everyone()

    def summary(self, recipe: TrainRecipe) -> dict[str, Any]:
        """For train_summary.json and the wandb summary: the last tau_real beside its tau_sim, how far apart
        they were (tau_sim - tau_real: > 0 where tau_sim promised more), at the last evaluation and on mean."""
        saved, t = recipe.state.metrics, self.train_cfg
        out: dict[str, Any] = {
            "select_by": t.select_by,
            "every": t.eval_decode_every,
            "prompts": len(self.prompts) if self.prompts is not None else None,
            "max_new_tokens": t.eval_decode_max_new_tokens,
            "history": self.history,
        }
        if f"{PREFIX}/tau_real" in saved:
            out.update(step=int(saved[f"{PREFIX}/step"]), tau_real=saved[f"{PREFIX}/tau_real"])
            out.update(tau_sim=saved.get(f"{PREFIX}/tau_sim"), gap_last=saved.get(f"{PREFIX}/tau_gap"))
            depths = sorted(int(k.rsplit("accept_d", 1)[1]) for k in saved if k.startswith(f"{PREFIX}/accept_d"))
            out["accept_rate_by_depth"] = [saved[f"{PREFIX}/accept_d{d}"] for d in depths]
            count = saved.get(f"{PREFIX}/gap_count", 0.0)
            out.update(gap_mean=saved[f"{PREFIX}/gap_sum"] / count if count else None, evaluations=int(count))
        recipe.tracker.summary({f"{PREFIX}/{k}": v for k, v in out.items() if isinstance(v, (int, float))})
        return out


def format_decode_eval(summary: dict[str, Any]) -> str:
    """One line of eagle-train's closing summary: the last tau_real beside its tau_sim, and the gap."""
    rates = " ".join(f"d{d}={r:.2f}" for d, r in enumerate(summary.get("accept_rate_by_depth", []), start=1))
    line = f"real acceptance ({summary.get('prompts')} held-out prompts): tau_real={summary['tau_real']:.3f}"
    if summary.get("tau_sim") is not None:
        line += f" beside tau_sim={summary['tau_sim']:.3f} at step {summary['step']}"
    if summary.get("gap_mean") is not None:
        line += (
            f"; tau_sim - tau_real: last {summary['gap_last']:+.3f}, mean {summary['gap_mean']:+.3f} "
            f"over {summary['evaluations']} evaluations"
        )
    return line + (f"; acceptance by depth {rates}" if rates else "")


__all__ = [
    "DecodeEval",
    "format_decode_eval",
    "decode_settings",
    "heldout_prompts",
    "max_depth",
    "measure",
]
