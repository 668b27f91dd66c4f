"""Any eagle head through transformers' own `generate`: the `custom_generate/` folder of a `format=hf` export.

transformers runs a model repository's `custom_generate/generate.py` in place of its `generate` when asked:
`target.generate(custom_generate=FOLDER, trust_remote_code=True, ...)` (`GenerationMixin.load_custom_generate`:
it checks `custom_generate/requirements.txt` against the installed packages, copies the module into its
module cache and calls `generate(model=target, **every generate argument)`). The file eagle writes is a stub
that needs only the `eagle` package (its requirements file says so): it names the head folder and hands the
call to `generate_with_head`, which decodes with eagle's lossless tree decoder
(`eagle.decode.generator.SpeculativeGenerator`), so greedy output is the target's own and sampled output
follows its law, with the same acceptance as `eagle-eval`. The module is copied before it runs, so the stub
cannot find its folder by itself: the export writes the folder's absolute path into it (a folder for the Hub
gets none, and the call then needs `eagle_head=FOLDER`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from eagle.config import DecodeConfig
from eagle.decode.generator import SpeculativeGenerator
from eagle.errors import ExportError

CUSTOM_GENERATE_DIR = "custom_generate"
GENERATE_FILE = f"{CUSTOM_GENERATE_DIR}/generate.py"
REQUIREMENTS_FILE = f"{CUSTOM_GENERATE_DIR}/requirements.txt"

# (folder, id(target)) -> the head attached to that target: a repeated generate call does not reload it.
_HEADS: dict[tuple[str, int], Any] = {}


def custom_generate_files(folder: str | None) -> dict[str, str]:
    """The `custom_generate/` files of a head folder: `folder` is written into the stub (None: the caller
    passes `eagle_head=`)."""
    stub = f'''"""transformers' `generate` with this folder's EAGLE draft head, through eagle's lossless decoder.

Written by eagle-export. Use: target.generate(input_ids, custom_generate=THIS_FOLDER, trust_remote_code=True,
max_new_tokens=..., do_sample=...). Needs the `eagle` package (requirements.txt). eagle_decode={{...}} sets
eagle's decode options (tree_depth, tree_total_tokens, ...); eagle_head=FOLDER points at the head.
"""

from eagle.export.hf_generate import generate_with_head

HEAD = {folder!r}


def generate(model, *args, eagle_head=None, **kwargs):
    return generate_with_head(model, eagle_head or HEAD, *args, **kwargs)
'''
    return {GENERATE_FILE: stub, REQUIREMENTS_FILE: "eagle\n"}


def _head_for(folder: str | None, model: Any) -> Any:
    """The head of `folder` attached to `model` (ExportError naming the folder if it does not fit)."""
    # cycle: the loader reads folders through the format registry, which imports this module
    from eagle.export.loader import load_exported_head

    if not folder:
        raise ExportError(
            "this custom_generate folder names no head folder (it was written for the Hub): pass "
            "eagle_head=FOLDER (the downloaded head) to generate"
        )
    key = (str(Path(folder).resolve()), id(model))
    if key not in _HEADS:
        _HEADS[key] = load_exported_head(folder, model)  # refuses a head of another target, naming the folder
    return _HEADS[key]


def decode_config(model: Any, generation_config: Any, prompt_len: int, kwargs: dict[str, Any]) -> Any:
    """(eagle's DecodeConfig, the effective GenerationConfig) from generate's arguments."""
    gc = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    options = dict(kwargs.pop("eagle_decode", None) or {})
    unused = gc.update(**kwargs)
    ignored = sorted(k for k in unused if k not in ("attention_mask", "input_ids", "pad_token_id", "use_cache"))
    if ignored:
        raise ExportError(f"eagle's custom_generate does not take {', '.join(ignored)} (batch-1 decoding options only)")
    if gc.num_beams not in (None, 1) or (gc.num_return_sequences or 1) != 1:
        raise ExportError("eagle's custom_generate decodes one sequence: num_beams and num_return_sequences must be 1")
    new = gc.max_new_tokens if gc.max_new_tokens is not None else int(gc.max_length) - prompt_len
    sampled = bool(gc.do_sample)
    options = {
        "max_new_tokens": int(new),
        "temperature": float(gc.temperature or 1.0) if sampled else 0.0,
        "top_k": int(gc.top_k or 0) if sampled else 0,
        "top_p": float(gc.top_p or 1.0) if sampled else 1.0,
        **options,
    }
    return DecodeConfig(**options), gc


def generate_with_head(
    model: Any,
    head_folder: str | None,
    inputs: torch.Tensor | None = None,
    generation_config: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """What `custom_generate/generate.py` runs: `model` (the target) decodes `inputs` [1, T] with the head in
    `head_folder`; returns [1, T + new] token ids as `generate` does. Batch size 1, no padding."""
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    if ids is None or ids.dim() != 2 or ids.shape[0] != 1:
        raise ExportError("eagle's custom_generate takes input_ids of shape [1, T] (batch size 1)")
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ExportError("eagle's custom_generate decodes one unpadded sequence: attention_mask must be all ones")
    for name in ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "assistant_model", "streamer"):
        if kwargs.pop(name, None):
            raise ExportError(f"eagle's custom_generate does not take {name}")
    for name in ("synced_gpus", "negative_prompt_ids", "negative_prompt_attention_mask", "use_model_defaults"):
        kwargs.pop(name, None)  # generate's own arguments, passed along by transformers whether set or not
    cfg, gc = decode_config(model, generation_config, int(ids.shape[1]), kwargs)
    head = _head_for(head_folder, model)
    stops = SimpleNamespace(eos_token_id=gc.eos_token_id)  # the decoder reads EOS ids (and model's) from it
    result = SpeculativeGenerator(model, head, stops, cfg).generate(ids[0])
    new = torch.tensor([result.tokens], dtype=ids.dtype, device=ids.device)
    return torch.cat((ids, new), dim=1)
