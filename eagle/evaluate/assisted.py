"""`eval.baselines=[..., hf_assisted]`: the same head through transformers' own assisted generation.

A peer decoder beside eagle's: transformers 5.24 decodes DFlash drafts itself (`generate(...,
assistant_model=drafter, speculation_type="dflash")`), so a DFlash head is exported once into a temporary
`format=transformers` folder (`eagle.export.hf_assistant`), loaded as transformers' drafter and timed like
every other method (`timed`, the same stop tokens and length as `hf_generate_kwargs`). Its verify passes are
counted as the drafter's forwards (transformers drafts once before each), so the report gives its tau beside
ours. transformers has no assisted decoding for EAGLE heads: such a head is refused at start, by name.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from eagle.config import ConfigError, DecodeConfig
from eagle.errors import ExportError
from eagle.evaluate.baselines import hf_generate_kwargs, timed
from eagle.export.exporter import export_head
from eagle.export.hf_assistant import load_dflash_assistant
from eagle.export.registry import check_servable
from eagle.heads.base import DraftHead
from eagle.target.multimodal import VisionInputs

FORMAT = "transformers"  # the export transformers' assisted generation loads


def assistant_for(head: DraftHead, target: Any) -> Any:
    """transformers' drafter holding `head`'s weights, for `target` (ConfigError for a head it cannot run)."""
    try:
        check_servable(head.config, FORMAT)
    except ExportError as e:
        raise ConfigError(
            f"eval.baselines=hf_assisted runs the head in transformers' own assisted generation, which exists "
            f"for DFlash heads only ({e}); drop hf_assisted for a {head.config.algorithm} head"
        ) from e
    with tempfile.TemporaryDirectory(prefix="eagle-hf-assisted-") as folder:
        export_head(head, folder, FORMAT, dtype="float32")
        return load_dflash_assistant(folder, target)


def assisted_runner(head: DraftHead, target: Any, tokenizer: Any, decode: DecodeConfig) -> Any:
    """input_ids [1, T] -> {tokens, seconds, target_forwards, verified_tokens}: `generate` with the head as its
    assistant (verified_tokens: those its verify passes emitted, what tau divides by target_forwards)."""
    drafter = assistant_for(head, target)
    passes = [0]
    drafter.register_forward_hook(lambda *_: passes.__setitem__(0, passes[0] + 1))  # one draft per verify pass
    kw = hf_generate_kwargs(target, tokenizer, decode)
    device = next(target.parameters()).device

    def run(input_ids: torch.Tensor, vision: VisionInputs | None = None) -> dict[str, Any]:
        if vision is not None and vision.num_images:
            raise ConfigError("eval.baselines=hf_assisted: transformers' DFlash drafting takes text prompts only")
        if decode.temperature > 0:
            torch.manual_seed(decode.seed)
        passes[0] = 0
        ids = input_ids.to(device)
        out, seconds = timed(
            lambda: target.generate(
                ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, speculation_type="dflash", **kw
            )
        )
        tokens = out[0, ids.shape[1] :].tolist()
        # The prefill emits the first token undrafted; every later one came out of a verify pass.
        return {"tokens": tokens, "seconds": seconds, "target_forwards": passes[0], "verified_tokens": len(tokens) - 1}

    return run
