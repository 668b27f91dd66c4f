"""`target.shard=fsdp`: the frozen target held as FSDP2 shards across the processes of a launch.

Capture and online training run the target's decoder once per batch and never train it. With
`target.shard=none` every process holds all of it; with `fsdp` each of N processes holds 1/N of every
decoder layer and all-gathers a layer for its forward (`reshard_after_forward=True`: one layer is whole
at a time), so N devices that together hold the target can capture or train without one holding it all.
The draft head stays replicated (DDP) either way; the features are the same either way.

What is sharded and what is not:
  decoder layers    `fully_shard` each (the one ModuleList of `num_hidden_layers` modules), then the
                    decoder itself as the root (the module `extract_features` calls).
  embeddings, final norm, LM head
                    whole in every process: the root's `ignored_params` (the LM head is outside the
                    decoder). The draft head reads them outside the target's forward at every step (its
                    token embeddings, EAGLE-3's soft labels through the LM head rows of the draft
                    vocabulary, EAGLE-1's logits through the LM head), and at set-up (the head's LM head
                    rows, `train.freeze_lm_head`'s final norm). Whole copies are what those reads need;
                    a tied embedding stays tied. Cost per process: V x H twice (once when tied), e.g.
                    2 x 2 GiB in bf16 for Llama-3-70B's 128256 x 8192, next to ~128 GiB / N of layers.
  a layer read outside a forward (`train.init_layer_from_target`): `gathered(layer)` all-gathers it for
                    the copy, on every process.

Loading (`load_sharded_target`): every process builds the model on the `meta` device (no memory),
shards it and allocates only its shards; process 0 alone reads the checkpoint, into CPU memory, and
`set_model_state_dict(..., broadcast_from_rank0=True)` sends one tensor at a time to the others, each
keeping its slice. Peak: the whole target once in process 0's CPU memory; on each device its shards, the
whole embeddings / LM head, and one tensor in flight.

Lockstep: each forward all-gathers from all processes, so all must run the target's forward equally
often. Callers that split uneven work add `eagle.capture.features.idle_forward` calls (capture: shards
per process; training: held-out micro-batches); training steps give every process the same number of
micro-batches already.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from eagle.config import ConfigError, TargetConfig
from eagle.errors import EagleError, TargetError
from eagle.target.loading import (
    TargetInfo,
    attention_implementation,
    check_shard_stage,
    load_target,
    load_tokenizer,
    load_weights,
    target_info,
)
from eagle.target.precision import resolve_dtype
from eagle.target.resolve import resolve_target_path
from eagle.target.structure import decoder_layer_stacks, decoder_of


def world_size() -> int:
    """Processes in the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` was sharded by `shard_target` (its decoder is an FSDP module)."""
    return isinstance(decoder_of(model), FSDPModule)


def shard_target(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard `model`'s decoder layers over `mesh` in place (FSDP2), the rest kept whole (module docstring).

    Works on a model on the `meta` device (then `to_empty` allocates the shards) or a loaded one.
    """
    decoder = decoder_of(model)
    stacks = decoder_layer_stacks(model)
    if len(stacks) != 1:
        raise TargetError(
            f"target.shard=fsdp: found {len(stacks)} module lists of decoder layers in "
            f"{type(model).__name__}, expected exactly one; use target.shard=none for this target"
        )
    in_layers = {id(p) for layer in stacks[0] for p in layer.parameters()}
    whole = {p for p in decoder.parameters() if id(p) not in in_layers}  # embeddings, final norm
    for layer in stacks[0]:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(decoder, mesh=mesh, reshard_after_forward=True, ignored_params=whole)
    _keep_output_capture(decoder)


def _keep_output_capture(decoder: nn.Module) -> None:
    """transformers records `output_hidden_states` through hooks it chooses by the model's class, looked up
    in a registry keyed by the class name; `fully_shard` swaps the decoder's class for an FSDP subclass,
    whose name is not there (the decoder then returns no hidden states). Register the subclass the way
    `PreTrainedModel.__init__` registers every model."""
    try:
        # optional: a private registry of recent transformers versions
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # versions without the registry read the class attribute, which the subclass inherits
        return
    # The registry keys on the model's class alone (str(model.__class__)), which any module has.
    _CAN_RECORD_REGISTRY[cast(PreTrainedModel, decoder)] = getattr(decoder, "_can_record_outputs", None)


@contextlib.contextmanager
def gathered(module: nn.Module) -> Iterator[nn.Module]:
    """`module` with its whole weights inside the block, for reads outside a forward.

    An FSDP-sharded module is all-gathered on entry and resharded on exit: a collective, so every
    process must enter the block, in the same order. Any other module is yielded as it is.
    """
    if not isinstance(module, FSDPModule):
        yield module
        return
    module.unshard()
    try:
        yield module
    finally:
        module.reshard()


def _skeleton(cfg: TargetConfig, resolved: str, dtype: torch.dtype) -> PreTrainedModel:
    """The target's model with parameters on the `meta` device (no memory) and real buffers (rotary
    frequencies and other values computed at construction, which no checkpoint holds)."""
    try:
        config = AutoConfig.from_pretrained(resolved, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(
                config,
                dtype=dtype,
                trust_remote_code=cfg.trust_remote_code,
                attn_implementation=attention_implementation(cfg.attn_implementation, config),
            )
    except Exception as e:  # transformers raises many types for configs it cannot build
        raise TargetError(f"cannot build target.path={cfg.path!r} ({resolved}) for target.shard=fsdp: {e}") from e
    return model.eval().requires_grad_(False)


def _full_state_on_rank0(cfg: TargetConfig, resolved: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Process 0: the whole target's state dict (CPU); the others: {}. A load error on process 0 is raised
    on every process (the others would otherwise wait for its broadcast forever)."""
    state: dict[str, torch.Tensor] = {}
    problem: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            state = load_weights(cfg, resolved, dtype).state_dict()
        except EagleError as e:
            problem = [str(e)]
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise TargetError(problem[0] if dist.get_rank() == 0 else f"process 0 could not load the target: {problem[0]}")
    return state


def load_sharded_target(
    cfg: TargetConfig, device: torch.device | str, stage: str = "capture"
) -> tuple[Any, Any, TargetInfo]:
    """The frozen target as FSDP2 shards over the default process group, its tokenizer and `TargetInfo`.

    Every process of the group must call this (it is a collective). Refused (ConfigError) in a single
    process and for decoding stages.
    """
    check_shard_stage(cfg, stage)
    world = world_size()
    if world < 2:
        raise ConfigError(
            f"target.shard={cfg.shard} splits the target over the processes of a multi-process launch, but this "
            "is a single process: start N > 1 processes (torchrun --nproc_per_node N -m eagle.cli.capture|train "
            "..., or accelerate launch --num_processes N on GPUs), or set target.shard=none"
        )
    device = torch.device(device)
    dtype = resolve_dtype(cfg.dtype, device, stage)
    resolved, fingerprint = resolve_target_path(cfg)
    tokenizer = load_tokenizer(cfg, resolved)
    model = _skeleton(cfg, resolved, dtype)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    shard_target(model, init_device_mesh(device.type, (world,)))
    model.to_empty(device=device)  # this process's shards and the whole embeddings / LM head, uninitialised
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])  # not in a state dict when non-persistent; to_empty left them uninitialised
    full: dict[str, Any] = _full_state_on_rank0(cfg, resolved, dtype)  # set_model_state_dict takes dict[str, ValueType]
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    model.tie_weights()  # to_empty gave tied weights a copy each; tie them again where the config ties them
    model.eval().requires_grad_(False)
    return model, tokenizer, target_info(cfg, resolved, fingerprint, model.config, dtype, shard=cfg.shard)


def load_placed_target(
    cfg: TargetConfig, device: torch.device | str | None = None, stage: str = "capture"
) -> tuple[Any, Any, TargetInfo]:
    """The frozen target as `target.shard` places it in this process: whole (`eagle.target.loading.load_target`)
    or sharded (`load_sharded_target`)."""
    if cfg.shard == "fsdp":
        if device is None:
            raise ValueError("load_placed_target: target.shard=fsdp needs the process's device")
        return load_sharded_target(cfg, device, stage)
    return load_target(cfg, device=device, stage=stage)


__all__ = ["gathered", "is_sharded", "load_placed_target", "load_sharded_target", "shard_target", "world_size"]
