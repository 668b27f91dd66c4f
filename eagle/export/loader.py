"""Load any exported or third-party EAGLE-3 / EAGLE-1 folder as one of our `DraftHead`s.

So `eagle-eval draft.path=EXPORTED_DIR` measures exactly the weights a runtime would serve, and
published heads made elsewhere (vLLM/SGLang-style or speculators folders) run in our decoder
when their target matches.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from eagle.algorithms import get_algorithm
from eagle.algorithms.head_io import check_head_fits_target, load_head
from eagle.artifacts import ResolvedDraft, resolve_draft
from eagle.errors import CheckpointError, ExportError
from eagle.export.formats import algorithm_of
from eagle.export.validate import check_folder
from eagle.heads.base import DraftHead
from eagle.target.structure import text_config

log = logging.getLogger(__name__)


def load_exported_head(
    folder: str | Path,
    target_model: Any,
    map_location: str | torch.device = "cpu",
    dtype: torch.dtype | None = torch.float32,
) -> DraftHead:
    """Validate `folder`, rebuild the head, check it fits `target_model`, attach it.

    `dtype`: floating weights are cast to it (float32 by default, for CPU decoding); None keeps
    the stored dtype. A folder without aux layer ids gets the runtimes' default for the target's
    depth. Stored target-owned tensors (embed_tokens, EAGLE-1's lm_head) are not used: the head
    borrows the target's, and a warning says so if the stored ones differ.
    """
    text = text_config(target_model.config)
    head_data = check_folder(folder, num_target_layers=int(text.num_hidden_layers))
    cfg = head_data.config
    if not cfg.target_model_type:
        cfg.target_model_type = str(getattr(text, "model_type", "") or "")
    try:
        check_head_fits_target(cfg, target_model)
    except CheckpointError as e:
        raise ExportError(f"{folder}: {e}") from e
    head = get_algorithm(cfg.algorithm).head_class(cfg)
    state = dict(head_data.tensors)
    own = head.trainable_state_dict()
    # What the folder's format may leave out (vLLM's EAGLE-1 fc bias, a full vocabulary's maps).
    for name, value in algorithm_of(cfg).default_tensors(cfg, head_data.format).items():
        state.setdefault(name, value)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ExportError(
            f"{folder}: tensors do not match an {cfg.algorithm} head: missing {missing}, unexpected {unexpected}"
        )
    state = {k: v.to(own[k].dtype) for k, v in state.items()}  # stored fp16/bf16 -> the module's dtype
    head.load_state_dict(state, strict=False)  # exact key match checked above
    if dtype is not None:
        head.to(dtype)
    head.to(map_location)
    head.eval()
    _warn_on_borrowed_mismatch(head_data.borrowed, target_model, folder)
    head.attach_target(target_model)
    return head


def _warn_on_borrowed_mismatch(borrowed: dict[str, torch.Tensor], target_model: Any, folder: str | Path) -> None:
    targets = {
        "embed_tokens.weight": target_model.get_input_embeddings(),
        "lm_head.weight": target_model.get_output_embeddings(),
    }
    for name, stored in borrowed.items():
        module = targets.get(name)
        if module is None or module.weight.shape != stored.shape:
            continue
        if not torch.allclose(stored.float(), module.weight.detach().float().cpu(), atol=1e-2, rtol=1e-2):
            log.warning("%s stores its own %s that differs from the target's; eagle uses the target's", folder, name)


def load_draft(path: str | Path | None, target: Any, device: Any = "cpu") -> tuple[DraftHead, ResolvedDraft]:
    """Load the head named by `draft.path` (see `eagle.artifacts.resolve_draft`) onto `device`,
    attached to `target`, in eval mode: a head folder through `load_head`, an exported folder
    through `load_exported_head`. The one head loader of the decode / eval path."""
    resolved = resolve_draft(path)
    if resolved.kind == "head":
        head = load_head(resolved.folder, target_model=target, map_location=device)
    else:
        head = load_exported_head(resolved.folder, target, map_location=device)
    head.eval().requires_grad_(False)
    return head, resolved
