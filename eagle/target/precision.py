"""Which floating-point dtype a stage runs the target (and head) in, chosen for the machine.

`target.dtype=auto` resolves per stage:
  * decoding / evaluation: bfloat16 where the device computes it natively (CUDA with bf16, CPUs with
    AVX512-BF16 or AMX-BF16), float32 elsewhere. On such CPUs a bf16 forward of one token costs ~0.6x
    the float32 one and a verify pass of 8 tokens ~0.45x (weights are read at half the bytes), and that
    is where speculation pays. The output stays the target's own greedy output *in that dtype* up to
    argmax near-ties (see `eagle.evaluate.divergence`).
  * regeneration (self-distillation): as decoding. Answers are generated in the dtype the target
    will be served in, and a batch of 32 decodes ~1.7x faster in bf16.
  * capture / training: float32 on a CPU (features keep full precision), bfloat16 on an
    accelerator with bf16. The head's compute in training is `train.mixed_precision`
    (`resolve_mixed_precision`: `auto` = bf16 autocast where native).

The draft head has its own setting (`decode.draft_dtype`, `resolve_draft_dtype`): the CPU preset runs it
in bfloat16 wherever that is native, also beside a float32 target, and with int8 weights through
fbgemm's dynamic int8 product (`decode.draft_weights`, `resolve_draft_weights`; on CPUs without bf16
a float32 head); the verify pass in the target's dtype decides every token.

An explicit dtype the device cannot run natively is refused with the missing CPU flag named: torch
would emulate it, several times slower than float32.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from eagle.errors import TargetError

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = ("auto", *DTYPES)
# CPU flags (/proc/cpuinfo) under which oneDNN runs each half-precision dtype natively.
_CPU_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of this machine (empty where /proc/cpuinfo is not readable)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_dtype_support(dtype: str, device: torch.device | str | None = None) -> tuple[bool, str]:
    """(whether `device` computes `dtype` natively, the reason in words)."""
    if dtype == "float32":
        return True, "float32 is always native"
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        ok = dtype == "float16" or torch.cuda.is_bf16_supported()
        return ok, f"CUDA device {'supports' if ok else 'lacks'} {dtype}"
    if dev.type != "cpu":  # mps, xpu, ...: trust the backend
        return True, f"{dev.type} device"
    flags = _CPU_FLAGS[dtype]
    have = [f for f in flags if f in cpu_flags()]
    if have:
        return True, f"CPU flag {have[0]}"
    return False, f"this CPU has none of the flags {' / '.join(flags)}"


def resolve_dtype(name: str, device: torch.device | str | None = None, stage: str = "decode") -> torch.dtype:
    """The torch dtype for `target.dtype=name` on `device` in `stage` (decode | regenerate | capture | train)."""
    if name == "auto":
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if stage not in ("decode", "regenerate") and dev.type == "cpu":
            return torch.float32
        ok, _ = native_dtype_support("bfloat16", dev)
        return torch.bfloat16 if ok else torch.float32
    if name not in DTYPES:
        raise TargetError(f"target.dtype={name!r} is not one of {', '.join(DTYPE_NAMES)}")
    ok, why = native_dtype_support(name, device)
    if not ok:
        raise TargetError(
            f"target.dtype={name} on {device or 'cpu'}: {why}, so torch would emulate {name} (slower than "
            "float32); use target.dtype=float32 or target.dtype=auto"
        )
    return DTYPES[name]


MIXED_PRECISION = ("auto", "no", "bf16", "fp16")


def resolve_mixed_precision(name: str, device: torch.device | str | None = None) -> str:
    """accelerate's `mixed_precision` for `train.mixed_precision=name` on `device`: no | bf16 | fp16.

    `auto` is bf16 autocast where the device computes bf16 natively (a CPU with AVX512-BF16 / AMX,
    a CUDA device with bf16), else no (float32). On such a CPU one EAGLE-3 step runs ~1.7x faster
    under bf16 autocast (benchmarks/train.py). An explicit half precision the device would only
    emulate is refused, naming the device and the missing support.
    """
    if name not in MIXED_PRECISION:
        raise TargetError(f"train.mixed_precision={name!r} is not one of {', '.join(MIXED_PRECISION)}")
    if name == "no":
        return name
    dtype = {"auto": "bfloat16", "bf16": "bfloat16", "fp16": "float16"}[name]
    ok, why = native_dtype_support(dtype, device)
    if name == "auto":
        return "bf16" if ok else "no"
    if not ok:
        raise TargetError(
            f"train.mixed_precision={name} on {device or 'cpu'}: {why}, so autocast would emulate {dtype} "
            "(slower than float32); use train.mixed_precision=no or train.mixed_precision=auto"
        )
    return name


DRAFT_DTYPES = ("auto", "target", *DTYPES)
DRAFT_WEIGHTS = ("auto", "full", "int8", "int8_weight_only")


def resolve_draft_dtype(name: str, target_dtype: torch.dtype, device: torch.device | str | None = None) -> torch.dtype:
    """The draft head's compute dtype for `decode.draft_dtype=name` beside a target in `target_dtype`.

    `target`: the target's dtype. `auto`: bfloat16 where the device computes it natively, else the
    target's dtype. Drafting is weight-bound at batch 1, so a bf16 head beside a float32 target drafts
    in about half the time (the float32 verify pass still decides every token, so greedy output stays
    the float32 target's own).
    """
    if name not in DRAFT_DTYPES:
        raise TargetError(f"decode.draft_dtype={name!r} is not one of {', '.join(DRAFT_DTYPES)}")
    if name == "target":
        return target_dtype
    if name == "auto":
        return torch.bfloat16 if native_dtype_support("bfloat16", device)[0] else target_dtype
    ok, why = native_dtype_support(name, device)
    if not ok:
        raise TargetError(
            f"decode.draft_dtype={name} on {device or 'cpu'}: {why}, so torch would emulate {name}; "
            "use decode.draft_dtype=auto or decode.draft_dtype=target"
        )
    return DTYPES[name]


@functools.cache
def dynamic_int8_available() -> bool:
    """Whether this torch build has fbgemm's dynamic int8 linear (`eagle.heads.quantize.DynamicInt8Linear`)."""
    engines = set(torch.backends.quantized.supported_engines)
    ops = all(hasattr(torch.ops.quantized, op) for op in ("linear_prepack", "linear_dynamic"))
    return bool(engines & {"fbgemm", "x86"}) and ops and hasattr(torch, "_make_per_channel_quantized_tensor")


def resolve_draft_weights(name: str, draft_dtype: torch.dtype, device: torch.device | str | None = None) -> str:
    """`full`, `int8` or `int8_weight_only` for `decode.draft_weights=name` (see `eagle.heads.quantize`).

    Both int8 kinds run on a CPU. `int8`: fbgemm's dynamic int8 product (int8 weights, activations
    quantised per call) for a float32 or bfloat16 head; where this torch build lacks it a bfloat16 head
    falls back to `int8_weight_only` (torch's weight-only kernel, bfloat16 activations; bfloat16 heads
    only). `auto` is `int8` on a CPU wherever one of them runs, else `full`.
    """
    if name not in DRAFT_WEIGHTS:
        raise TargetError(f"decode.draft_weights={name!r} is not one of {', '.join(DRAFT_WEIGHTS)}")
    if name == "full":
        return name
    dev = torch.device(device) if device is not None else torch.device("cpu")
    why, kind = "", "int8_weight_only" if name == "int8_weight_only" else "int8"
    if dev.type != "cpu":
        why = f"int8 draft weights run on a CPU (here: {dev.type})"
    elif kind == "int8_weight_only" and draft_dtype != torch.bfloat16:
        why = f"the weight-only int8 kernel needs a bfloat16 head (here: {dtype_name(draft_dtype)})"
    elif draft_dtype not in (torch.float32, torch.bfloat16):
        why = f"int8 draft weights need a bfloat16 or float32 head (here: {dtype_name(draft_dtype)})"
    elif kind == "int8" and not dynamic_int8_available():
        if draft_dtype == torch.bfloat16:
            kind = "int8_weight_only"
        else:
            why = "this torch build has no fbgemm dynamic int8 linear for a float32 head"
    if name == "auto":
        return "full" if why else kind
    if why:
        raise TargetError(f"decode.draft_weights={name}: {why}; set decode.draft_weights=full")
    return kind


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = [
    "DRAFT_DTYPES",
    "DRAFT_WEIGHTS",
    "DTYPES",
    "DTYPE_NAMES",
    "MIXED_PRECISION",
    "cpu_flags",
    "dtype_name",
    "dynamic_int8_available",
    "native_dtype_support",
    "resolve_draft_dtype",
    "resolve_draft_weights",
    "resolve_dtype",
    "resolve_mixed_precision",
]
