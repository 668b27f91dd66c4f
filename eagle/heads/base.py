"""The draft-head interface shared by the trainer, the decoder and the exporter.

Data alignment (the same in training and decoding):
  target tokens x_0 .. x_{T-1}; target features f_t = target state after reading x_0..x_t, from
  which the target predicts x_{t+1}.
  Head input at sequence index t: token x_{t+1} and hidden h_t, where h_t = project_features(f_t)
  for the first draft step, or the head's own previous output for later steps.
  Head position id at index t: the position of x_{t+1}, i.e. t + 1 (+ i at unroll/draft depth i).
  Head output at index t predicts x_{t+2}.

Attention masks are boolean, True = may attend, shape [B, 1, T_query, T_past + T_query]; None means
plain causal attention over (cache + new tokens). Caches are `transformers.Cache` objects (the head
calls `cache.update(k, v, layer_idx)`), so the decoder manages the head's cache with the same code
as the target's.

Embeddings (and, for EAGLE-1, the LM head) are borrowed from the frozen target with
`attach_target`; they are not parameters of the head and are not saved with it.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from torch import nn
from transformers import DynamicCache

from eagle.config import ConfigError, DraftConfig


@dataclass
class HeadConfig:
    """Everything needed to rebuild a head; saved as `head_config.json` next to its weights."""

    algorithm: str  # a name in eagle.algorithms.ALGORITHMS
    hidden_size: int  # head width (= target hidden size)
    target_hidden_size: int
    vocab_size: int  # target vocabulary
    draft_vocab_size: int  # = vocab_size unless EAGLE-3 reduced vocabulary
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    aux_layer_ids: list[int] = field(default_factory=list)  # EAGLE-3 feature layers (vLLM convention)
    target_model_type: str = ""
    target_fingerprint: str = ""  # TargetInfo.fingerprint of the target the head was trained on
    # EAGLE-3.1 normalisations (fused-feature heads): one RMSNorm per aux layer before `fc`, and the
    # final-normed output (not the pre-norm one) fed back as the next step's hidden state.
    fc_norm: bool = False
    norm_output: bool = False
    # Block drafters: tokens a draft pass fills (DFlash: anchor included; P-EAGLE: the K drafts), draft
    # layers (DFlash), the id whose embedding fills the draft positions. EAGLE heads keep the defaults.
    block_size: int = 1
    num_layers: int = 1
    mask_token_id: int | None = None

    def block_mask_id(self) -> int:
        """`mask_token_id` of a block drafter (DFlash, P-EAGLE), which `head_io` always sets when it
        builds one; a config without it cannot fill draft positions and is refused by name."""
        if self.mask_token_id is None:
            raise ConfigError(
                f"this {self.algorithm} head's config has no mask_token_id to fill its draft positions with"
            )
        return self.mask_token_id

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown head config fields {unknown}")
        return cls(**data)

    @classmethod
    def load(cls, path: Path) -> HeadConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


class CausalLM(Protocol):
    """What heads and stages read off a target model (any transformers causal LM)."""

    config: Any

    def get_input_embeddings(self) -> nn.Module: ...

    def get_output_embeddings(self) -> nn.Module: ...


def weight_of(module: nn.Module) -> torch.Tensor:
    """`module.weight` as a tensor: the target's LM head or embedding a head borrows (nn.Linear /
    nn.Embedding, or a transformers module with a `weight` Parameter). nn.Module types attributes as
    Tensor | Module; a module whose `weight` is not a tensor is refused by name."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__} has no weight tensor (got {type(weight).__name__})")
    return weight


class DraftHead(nn.Module, ABC):
    """One draft-head implementation per algorithm; sizes come from `HeadConfig`.

    A subclass declares what it reads and drafts from, so no caller compares algorithm names:
    `num_aux_layers` (how many of the target's low/mid/high aux layers, `HeadConfig.aux_layer_ids`, it
    fuses; 0 = it reads the target's final state alone) and `reduced_vocab` (may draft from a subset
    of the vocabulary).
    """

    algorithm: ClassVar[str]  # the `draft.algorithm` / `HeadConfig.algorithm` name it is registered under
    num_aux_layers: ClassVar[int] = 0
    reduced_vocab: ClassVar[bool] = False
    # Drafts a whole block in one pass (DFlash, P-EAGLE: `draft_block`) instead of one token per
    # forward over its own previous outputs (EAGLE: the decoder expands a tree level by level,
    # `eagle.decode.draft`).
    drafts_block: ClassVar[bool] = False
    # Takes the EAGLE-3.1 options `HeadConfig.fc_norm` / `norm_output` (EAGLE-3's fc and feedback).
    eagle31_options: ClassVar[bool] = False

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config

    # --- target-owned pieces -------------------------------------------------------------------
    @abstractmethod
    def attach_target(self, target: CausalLM) -> None:
        """Borrow the frozen token embeddings (and LM head where used) from the target model."""

    @abstractmethod
    def feature_layer_ids(self) -> list[int]:
        """Indices into the target's `output_hidden_states` the head consumes, in order
        (EAGLE-1: the final post-norm state, index -1; EAGLE-3: the three aux layers)."""

    # --- the four steps ------------------------------------------------------------------------
    @abstractmethod
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, H] embeddings (the target's, frozen)."""

    @abstractmethod
    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """[B, T, k, H_target] target features (k = len(feature_layer_ids())) -> [B, T, H]."""

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        hidden: torch.Tensor,  # [B, T, H]
        position_ids: torch.Tensor,  # [B, T], or [3, B, T] M-RoPE rows (`eagle.heads.layers.RotaryEmbedding`)
        attention_mask: torch.Tensor | None = None,  # bool [B, 1, T, T_past + T] or None (causal)
        past_key_values: Any | None = None,  # transformers.Cache
    ) -> torch.Tensor:
        """Run the backbone; returns the output hidden state [B, T, H]."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, H] output hidden -> [B, T, draft_vocab_size] logits."""

    def init_from_target(
        self, target_model: CausalLM | None, vocab_counts: torch.Tensor | None, special_ids: Sequence[int] | None
    ) -> None:
        """Initialisation that depends on the target or the data (`build_head`); none by default."""

    def start_from_target_layer(self, target_layer: nn.Module) -> list[str]:
        """Start the head's decoder layer (and its input projection) from a target decoder layer
        (`train.init_layer_from_target`, `eagle.heads.target_layer`); returns the target parameter
        names left out."""
        raise NotImplementedError(f"{type(self).__name__} has no decoder layer to start from a target layer")

    def freeze_lm_head(self, target_model: CausalLM | None) -> None:
        """Keep the head's LM head fixed (`train.freeze_lm_head`); with `target_model`, the norm in
        front of it first starts from the target's final norm."""
        raise ConfigError(f"{type(self).__name__} has no LM head of its own to freeze")

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids (identity without a reduced vocabulary)."""
        d2t = getattr(self, "d2t", None)
        if d2t is None:
            return draft_ids
        return draft_ids + d2t[draft_ids]

    @classmethod
    def block_fields(cls, draft: DraftConfig) -> dict[str, int]:
        """The `HeadConfig` fields a block drafter sizes from `draft.*` (its block, its layers); {} for others."""
        return {}

    # --- decoding: the drafting step the decoder drives (`eagle.decode.generator`) ----------------
    def new_draft_cache(self) -> Any:
        """An empty decode-time cache for this head (a `transformers.Cache` of its own K/V by default)."""
        return DynamicCache()

    def commit(
        self, cache: Any, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor | None:
        """Append verified entries to the decode cache: target features [T, k, Ht] at `positions` [T] (or
        an M-RoPE head's [3, T] rows), each with the token after it `tokens` [T]. Returns the output hidden
        [H] of the last entry, the input that drafts the next step (EAGLE), or None for a head that keeps
        only the context."""
        hidden = self.project_features(features[None])  # [1, T, H]
        pos = (positions + 1)[..., None, :]  # [1, T] or [3, 1, T]
        out = self(tokens[None], hidden, pos, attention_mask=None, past_key_values=cache)
        return out[0, -1]  # [H]

    def draft_block(
        self, cache: Any, root_token: int, root_hidden: torch.Tensor | None, root_position: int
    ) -> torch.Tensor:
        """A block drafter's one pass, under inference mode: [D, V] log-probabilities over the target
        vocabulary of the D tokens after the root (the newest accepted token, at `root_position`;
        `root_hidden` is what `commit` returned)."""
        raise NotImplementedError(f"{type(self).__name__} drafts one token per forward (drafts_block is False)")

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The head's own weights (and vocab maps), without anything borrowed from the target."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("target_")}


class BorrowsTargetOutput:
    """Mixin (before `DraftHead` in the bases) for heads that read the target's token embeddings *and* its
    LM head (EAGLE-1, DFlash): `attach_target` borrows both, `borrowed(name)` returns one."""

    _borrowed: BorrowedModules

    def borrowed(self, name: str) -> nn.Module:
        if name not in self._borrowed:
            raise RuntimeError("attach_target(target_model) must be called before using the head")
        return self._borrowed[name]

    def attach_target(self, target: CausalLM) -> None:
        self._borrowed["embed_tokens"] = target.get_input_embeddings()
        self._borrowed["lm_head"] = target.get_output_embeddings()


class BorrowedModules(dict):
    """Frozen target modules a head uses but does not own (embeddings, EAGLE-1's LM head).

    Held in a plain dict attribute instead of as submodules, so they never appear in the head's
    parameters(), state_dict() or DDP wrapper; copying a head (deepcopy, e.g. for an EMA) shares
    them instead of duplicating the target's weights.
    """

    def __deepcopy__(self, memo: dict) -> BorrowedModules:
        return BorrowedModules(self)
