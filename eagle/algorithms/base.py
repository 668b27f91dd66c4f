"""What a draft algorithm is to the rest of eagle: one `Algorithm` per `draft.algorithm` name.

An algorithm owns everything that differs between EAGLE-1 and EAGLE-3 outside the head module
itself (`eagle.heads`): which target features it reads (feature spec), how a batch becomes a loss
(`forward_loss`), and how its head is named and described in each export format. Callers ask the
registered algorithm (`eagle.algorithms.get_algorithm(name)`) instead of comparing names, so a new
variant is one module here plus its head class, registered by name.

Alignment of a batch to the head (`eagle.heads.base`): index t reads token x_{t+1} and feature
f_t and predicts x_{t+2}; `aligned_inputs` shifts a collated batch accordingly.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from eagle.algorithms.losses import eagle3_loss_packed, shift_left, step_loss_mask
from eagle.algorithms.ttt import ttt_forward
from eagle.config import ConfigError, DraftConfig, RootConfig, TrainConfig
from eagle.errors import ExportError
from eagle.heads.base import DraftHead, HeadConfig

Number = torch.Tensor | float

# Engines whose draft layer has a SiLU MLP only (read in their code): a head with another activation
# would fail to load there (vLLM, SGLang) or run SiLU in its place (llama.cpp).
_SILU_ONLY = {
    "vllm": "vLLM 0.32's LlamaMLP accepts only silu (vllm/model_executor/models/llama.py line 112)",
    "sglang": "SGLang 0.5.23's LlamaMLP accepts only silu (sglang/srt/models/llama.py line 116)",
    "llamacpp": "llama.cpp b11434's draft-eagle3 layer always runs SiLU (src/models/eagle3.cpp line 274, LLM_FFN_SILU)",
}


@dataclass
class LossParts:
    """One micro-batch's loss and the token-weighted sums the trainer logs. The sums are detached
    0-d tensors (on the loss's device), read back only at a logging step. (Selecting the loss rows,
    `packed_positions`, is a boolean index: on a GPU one host sync per unroll step.)"""

    objective: torch.Tensor  # scalar, already divided by the global token counts `norms`
    step_loss: Sequence[Number]  # per step: sum of token losses
    step_correct: Sequence[Number]
    step_tokens: Sequence[Number]
    extra: dict[str, Number]  # per-token extras x step-0 tokens (Algorithm.extra_metrics)
    finite: torch.Tensor  # bool scalar


@dataclass(frozen=True)
class LossSettings:
    """The loss's knobs, read once from the run's config (`Algorithm.loss_settings`)."""

    steps: int  # unroll steps (training-time test); EAGLE-1 trains with 1
    decay: float  # weight decay^i of unroll step i
    feature_weight: float  # EAGLE-1 smooth-L1 weight
    token_weight: float  # EAGLE-1 soft-CE weight
    noise_std: float  # EAGLE-1 feature noise (training only)
    pad_id: int
    dense_ttt_mask: bool = False  # unroll through the dense mask (the definition; benchmarks/studies/ttt.py)
    loss: str = "ce"  # train.loss (eagle.algorithms.objectives)
    position_weights: str = "decay"  # train.position_weights, `auto` resolved by the algorithm
    position_gamma: float = 7.0
    anchors: int = 0  # block drafters: anchors per sequence
    block_size: int = 1  # block drafters: tokens a pass fills
    cod_ratio: float = 0.7  # P-EAGLE: slot j kept with probability max(cod_ratio^j, cod_floor)
    cod_floor: float = 0.2


def step_masks(loss_mask: torch.Tensor, valid: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """[B, T] masks of the positions that count at each unroll step (as in `eagle.algorithms.losses`)."""
    return [step_loss_mask(loss_mask, valid, i) for i in range(steps)]


def target_positions(batch: dict[str, Any]) -> torch.Tensor | None:
    """[3, B, T] long: the M-RoPE rows of every sequence index as the target numbers them (an M-RoPE
    vision-language target's batch: `eagle.capture.features.extract_features`), or None when they are the
    sequence index itself (every text-only target).

    Heads read positions derived from these the way vLLM derives a draft's: the input at index t (x_{t+1}
    with f_t) sits at f_t's position + 1 (vLLM: at f_t's position; a shift by one in every row, which
    rotary attention does not see), and a draft i steps further at + i in every row. On text all three
    rows are t, so this is exactly the sequence-index rule the heads use without them."""
    pos = batch.get("positions")
    return None if pos is None else pos.long().permute(2, 0, 1)


def take_positions(positions: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """positions [B, T] or [R, B, T], index [B, N] -> the positions at those indices, [B, N] or [R, B, N]."""
    if positions.dim() == 2:
        return positions.gather(1, index)
    return positions.gather(2, index.expand(positions.shape[0], -1, -1))


def aligned_inputs(batch: dict[str, Any], pad_id: int) -> dict[str, torch.Tensor]:
    """Shift a collated batch to the head's alignment (`eagle.heads.base`): index t reads x_{t+1}
    and f_t and predicts x_{t+2}. An M-RoPE target's batch also gets "positions" [3, B, T], the
    step-0 position rows (`target_positions` + 1); without it the heads count t + 1."""
    attn = batch["attention_mask"].to(torch.bool)  # [B, T]
    out = {
        "input_ids": shift_left(batch["input_ids"], 1, pad_id),  # [B, T] x_{t+1}
        "valid": shift_left(attn, 1, False),  # [B, T] x_{t+1} is a real token
        "loss_mask": shift_left(batch["loss_mask"].to(torch.bool), 2, False),  # [B, T] x_{t+2} is a target
    }
    rows = target_positions(batch)
    if rows is not None:
        out["positions"] = rows + 1  # [3, B, T]
    return out


def unroll_aligned(
    head: DraftHead, a: dict[str, torch.Tensor], hidden0: torch.Tensor, settings: LossSettings
) -> list[torch.Tensor]:
    """`ttt_forward` over `aligned_inputs` `a` from step-0 hidden states [B, T, H]: settings.steps outputs
    [B, T, H], at an M-RoPE target's position rows where the batch has them (else t + 1)."""
    return ttt_forward(
        head,
        a["input_ids"],
        hidden0,
        a["valid"],
        settings.steps,
        position_ids=a.get("positions"),
        pad_token_id=settings.pad_id,
        dense_mask=settings.dense_ttt_mask,
    )


HeadT = TypeVar("HeadT", bound=DraftHead)


def own_head(head: DraftHead, cls: type[HeadT]) -> HeadT:
    """`head` as its algorithm's head class `cls`: every head an algorithm's methods are given was built
    from that algorithm's `head_class` (or a subclass: P-EAGLE's head is an EAGLE-3 head), so this
    narrows the type and refuses, by name, a head of another algorithm."""
    if not isinstance(head, cls):
        raise TypeError(f"a {cls.__name__} is needed here, got {type(head).__name__}")
    return head


def token_norms(counts: list[torch.Tensor], norms: torch.Tensor | None) -> list[torch.Tensor]:
    """Per unroll step, the token count a loss is divided by: the trainer's global one when given
    (so the gradient is the mean over the whole global batch), else this batch's own (at least 1)."""
    if norms is not None:
        return [norms[i].to(counts[i].device, torch.float32) for i in range(len(counts))]
    return [c.float().clamp(min=1.0) for c in counts]


def unrolled_soft_ce(
    step_logits: list[torch.Tensor],  # steps x [N_i, Vd]: the head's logits where step i counts
    target_logits: torch.Tensor,  # [N, V or Vd] the target's, at the label positions
    step_rows: list[torch.Tensor],  # steps x [N_i] label rows (`packed_positions`)
    t2d: torch.Tensor,  # [V] bool: target id is in the draft vocabulary
    d2t: torch.Tensor,  # [Vd] draft id -> target id offset
    decay: float,
    norms: torch.Tensor | None,
    loss: str = "ce",
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], Any]:
    """The unrolled loss (`eagle3_loss_packed`: soft cross-entropy, or `loss` of `eagle.algorithms.objectives`)
    as (objective, step sums, raw result)."""
    steps = len(step_logits)
    r = eagle3_loss_packed(step_logits, target_logits, step_rows, t2d, d2t, decay, loss)
    counts = [torch.as_tensor(c).float() for c in r.step_counts]  # 0-d tensors, as `step_masks` counts them
    n = token_norms(counts, norms)
    terms = [decay**i * r.step_losses[i] * (counts[i] / n[i]) for i in range(steps)]
    objective = sum(terms[1:], terms[0])  # steps >= 1
    step_loss = [x.detach() * c for x, c in zip(r.step_losses, counts, strict=True)]
    step_correct = [(x * c).round() for x, c in zip(r.step_accuracy, counts, strict=True)]
    return objective, step_loss, step_correct, counts, r


def unroll_decay(train: TrainConfig) -> float:
    """Unroll step i's loss weighs decay^i: train.ttt_decay (position_weights=auto), 1 (uniform) or DFlash's
    exp(-1 / position_gamma) (decay). dpace is refused for unrolled heads by config validation."""
    if train.position_weights == "auto":
        return train.ttt_decay
    return 1.0 if train.position_weights == "uniform" else math.exp(-1.0 / train.position_gamma)


class Algorithm(ABC):
    """A draft algorithm: its head class, feature spec, loss and export names."""

    name: ClassVar[str]  # draft.algorithm / HeadConfig.algorithm
    title: ClassVar[str]  # for people: model cards, reports
    head_class: ClassVar[type[DraftHead]]
    # Export: formats that can express the head, the `architectures` entry each one writes, the
    # names that identify the algorithm in a config.json written elsewhere, and the runtimes' names.
    export_formats: ClassVar[tuple[str, ...]]
    # Why each known format outside `export_formats` cannot serve the algorithm (the engine and the code
    # read), so a refusal says more than "no"; docs/serving.md keeps the same table.
    format_refusals: ClassVar[dict[str, str]] = {}
    architectures: ClassVar[dict[str, str]]
    known_architectures: ClassVar[tuple[str, ...]]
    speculators_model_type: ClassVar[str | None] = None  # None: no speculators format
    vllm_method: ClassVar[str]
    vllm_options: ClassVar[dict[str, Any]] = {}  # more of vLLM's speculative_config (P-EAGLE: parallel_drafting)
    llamacpp_spec_type: ClassVar[str] = "draft-eagle3"  # llama-server --spec-type for format=llamacpp
    sglang_algorithm: ClassVar[str]
    extra_metrics: ClassVar[tuple[str, ...]] = ()  # keys of LossParts.extra, weighted per step-0 token
    # Training options it takes: the LK losses (train.loss != ce) need a token law per position to
    # compare with the target's; train.freeze_lm_head needs an LM head of the head's own.
    takes_lk_losses: ClassVar[bool] = True
    owns_lm_head: ClassVar[bool] = False
    takes_dpace: ClassVar[bool] = False  # train.position_weights=dpace: per-token weights within a block

    # --- config --------------------------------------------------------------------------------
    def check_config(self, cfg: RootConfig) -> None:
        """Refuse settings this algorithm cannot honour, naming the key (`eagle.algorithms.check_config`)."""
        t, name = cfg.train, self.name
        if t.position_weights == "dpace" and not self.takes_dpace:
            raise ConfigError(
                f"train.position_weights=dpace weighs the positions of a DFlash block by the head's "
                f"confidence; draft.algorithm={name} weighs its steps by depth: use auto, uniform or "
                "decay"
            )
        if t.loss != "ce" and not self.takes_lk_losses:
            raise ConfigError(
                f"train.loss={t.loss}: {self.title} trains a feature regression beside its token loss; "
                "the LK losses are for algorithms that draft from a token law (or train.loss=ce)"
            )
        if t.freeze_lm_head and not self.owns_lm_head:
            raise ConfigError(
                f"train.freeze_lm_head=true: draft.algorithm={name} has no LM head of its own (it reads "
                "the target's, which is never trained); drop the option"
            )

    def block_drafts(self, cfg: HeadConfig) -> int | None:
        """Draft tokens one pass gives, for a head that drafts a block (what an engine must be told as
        num_speculative_tokens); None for a head that drafts one token a forward."""
        return None

    def recognises(self, config: dict[str, Any]) -> bool:
        """Whether a config.json written elsewhere (no eagle block) holds a head of this algorithm."""
        return any(a in self.known_architectures for a in config.get("architectures") or [])

    # --- feature spec --------------------------------------------------------------------------
    @property
    def num_aux_layers(self) -> int:
        """Aux (low/mid/high) target layers the head fuses, as its head class declares (0 = the final
        state only). The final state is always captured: it gives the labels."""
        return self.head_class.num_aux_layers

    def capture_layer_ids(self, aux_layer_ids: list[int]) -> list[int] | None:
        """The aux layers a capture stores beside the final state (None: the final state only)."""
        return list(aux_layer_ids) if self.num_aux_layers else None

    def feature_rows(self) -> int:
        """Hidden-size rows stored per token: the aux layers plus the final state."""
        return self.num_aux_layers + 1

    # --- training ------------------------------------------------------------------------------
    def loss_settings(self, draft: DraftConfig, train: TrainConfig, pad_id: int, training: bool) -> LossSettings:
        return LossSettings(
            steps=train.ttt_steps,
            decay=unroll_decay(train),
            feature_weight=train.feature_loss_weight,
            token_weight=train.token_loss_weight,
            noise_std=0.0,
            pad_id=pad_id,
            loss=train.loss,
        )

    def summary_weights(self, train: TrainConfig, steps: int) -> tuple[list[float], dict[str, float]]:
        """Weights of each step's loss and of each extra metric in the logged total `loss`."""
        decay = unroll_decay(train)
        return [decay**i for i in range(steps)], {}

    def label_rows(self, head: DraftHead, lm_head: nn.Module) -> torch.Tensor | None:
        """[Vd, H] rows of the target's LM head that the soft labels need, or None for all of them."""
        return None

    def plan_batch(self, batch: dict[str, Any], settings: LossSettings) -> dict[str, Any]:
        """Choices a micro-batch's loss and its token counts share (DFlash's anchors), made once; none by default."""
        return batch

    def step_token_counts(self, batch: dict[str, Any], settings: LossSettings) -> list[float]:
        """Loss tokens of a collated micro-batch per drafted position (unroll step), before the forward."""
        a = aligned_inputs(batch, settings.pad_id)
        return [float(m.sum()) for m in step_masks(a["loss_mask"], a["valid"], settings.steps)]

    @abstractmethod
    def forward_loss(
        self,
        head: DraftHead,
        lm_head: nn.Module,
        batch: dict[str, Any],
        settings: LossSettings,
        norms: torch.Tensor | None,
        label_rows: torch.Tensor | None = None,
    ) -> LossParts:
        """Loss of one collated micro-batch with features (`eagle.train.batches`); `norms` [steps]
        are the global loss-token counts (None = this batch's own)."""

    # --- export --------------------------------------------------------------------------------
    def export_tensor_name(self, name: str, fmt: str) -> str:
        """Our tensor name -> the name format `fmt` stores it under."""
        return name

    def canonical_tensor_name(self, name: str) -> str:
        """A stored tensor name (any format) -> ours."""
        return name

    def format_tensors(self, spec: dict[str, Any], fmt: str) -> dict[str, Any]:
        """Our tensors (name -> spec) a `fmt` folder holds: by default all of them."""
        return spec

    def default_tensors(self, cfg: HeadConfig, fmt: str) -> dict[str, torch.Tensor]:
        """Tensors a `fmt` folder may leave out, with the value their absence means."""
        return {}

    def export_tensors(self, cfg: HeadConfig, tensors: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
        """Our tensors as `fmt` keeps them (before renaming); refuses what `fmt` cannot express."""
        return tensors

    def export_refusals(self, cfg: HeadConfig, fmt: str) -> list[str]:
        """Why format `fmt` (one of `export_formats`) cannot serve a head of `cfg`: one reason per head
        option, each naming the option and the engine; empty when it can."""
        if cfg.hidden_act != "silu" and fmt in _SILU_ONLY:
            return [f"hidden_act={cfg.hidden_act}: {_SILU_ONLY[fmt]}; train the head with draft.hidden_act=silu"]
        return []

    def check_exportable(self, cfg: HeadConfig, fmt: str) -> None:
        """Refuse (ExportError) a head that format `fmt` cannot serve, with every reason and the formats
        that can. Called before anything is written."""
        if fmt not in self.export_formats:
            reason = self.format_refusals.get(fmt)
            article = "an" if self.title[0] in "AEIOU" else "a"
            raise ExportError(
                f"format={fmt} cannot express {article} {self.title} head"
                + (f" ({reason})" if reason else "")
                + "; export it with format="
                + " | ".join(self.export_formats)
            )
        problems = self.export_refusals(cfg, fmt)
        if problems:
            # The engine would build the head without these parts and draft from other values: refuse.
            serving = [f for f in self.export_formats if not self.export_refusals(cfg, f)]
            raise ExportError(
                f"format={fmt} cannot serve this head: "
                + "; ".join(problems)
                + ("; export it with format=" + " | ".join(serving) if serving else "")
            )

    @abstractmethod
    def config_fields(self, cfg: HeadConfig, fmt: str) -> dict[str, Any]:
        """config.json fields of a vllm / sglang / hf folder beyond the Llama layer config."""
