"""Int8 weight linears for drafting on a CPU (`decode.draft_weights=int8 | int8_weight_only`).

Why: at batch 1 a draft level is a handful of [<=16, 576] x [576, N] products whose cost is reading
the weights. The target's forward between two draft steps evicts the head from the CPU caches, so
every level streams the head's layer (~8 MB in bf16) and LM head (~9 MB for 8,192 draft tokens) from
memory again. Int8 weights halve those bytes.

Decoding stays lossless whatever the head computes: the target verifies every drafted token. Only
acceptance can move; per-output-channel symmetric int8 (scale = max |w| / 127 per row) keeps each
logit within ~0.5% of its full-precision value.

Two kernels:
- `DynamicInt8Linear` (`int8`, any float32 or bfloat16 head): fbgemm's dynamically quantised linear.
  Each call quantises its activations to 7-bit integers (one scale per call; 7 bits so that AVX2's
  pairwise int16 sums cannot saturate) and multiplies in int8 (AVX2, or AVX512-VNNI); the output comes
  back in the input's dtype. On the 2-core AVX2 EPYC (no AVX-512), whose float32 products at these
  shapes run far below its memory bandwidth, a [4, 576] x [576, 8192] product took 0.85 ms instead of
  7.8 ms float32. On the 2-core AVX512-BF16 EPYC it also beats the weight-only kernel for a bfloat16
  head: in the decoding loop (cold caches) the LM head costs half (README, Benchmarks).
- `Int8Linear` (`int8_weight_only`, bfloat16 heads): torch's `_weight_int8pack_mm`, the weight-only
  int8 kernel behind gpt-fast's CPU path; activations stay bfloat16 (with float32 activations it is
  slower than a float32 matmul). The fallback where this torch build lacks fbgemm's quantised ops:
  torch marks the quantised-tensor API the dynamic kernel needs as deprecated (moving to torchao);
  `eagle.target.precision.dynamic_int8_available()` says whether it is there.

`quantize_head_int8` fuses q/k/v and gate/up first (`eagle.heads.layers.fuse_for_inference`): with one
scale per output row, and one activation scale per call from the input the parts share, the fused
product equals the three separate ones exactly, at one kernel call instead of three.

A oneDNN-prepacked full-precision linear (`torch.ops.mkldnn._linear_pointwise`) was measured too: 2.3x
faster than either int8 kernel with the weights hot in cache ([4, 576] x [576, 8192] in bf16: 0.13 vs
0.30 ms), but slower in the decoding loop, where the weights come from memory and it reads twice the bytes
(head time per step over 5 MT-bench prompts, two runs each: 8.4 / 7.6 ms packed vs 6.5 / 6.4 ms int8
weight-only; ad-hoc profiles, not a script in this repository); not kept.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
from torch import nn

from eagle.heads.base import DraftHead
from eagle.heads.layers import inference_copy

# The fused-feature projection runs once per decoding step (on the accepted tokens), not once per
# draft level, and the heads read their compute dtype off its weight: it keeps full precision.
KEEP_FULL = frozenset({"fc"})


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (int8 [N, K], float32 scales [N]) with w ~ q * scale per row."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0  # [N]
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
    return q, scales


def int8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain float32 maths of an int8 weight-only linear: x @ (q * scale)^T + bias."""
    y = x.float() @ (qweight.float() * scales.float()[:, None]).t()
    return y if bias is None else y + bias.float()


# torch's CPU kernel reads the input dimension in blocks of 16 and crashes (SIGSEGV, torch 2.13) on
# any other width: narrower layers get zero columns, which add nothing to the product.
K_BLOCK = 16


class Int8Linear(nn.Module):
    """A linear layer whose weight is int8 with one scale per output row; activations in `dtype`."""

    qweight: torch.Tensor  # buffers (registered in __init__)
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.pad = -self.in_features % K_BLOCK
        if self.pad:
            qweight = torch.nn.functional.pad(qweight, (0, self.pad))  # [N, K + pad], zero columns
        self.register_buffer("qweight", qweight.contiguous())  # [N, K + pad] int8
        self.register_buffer("scales", scales.to(dtype))  # [N]
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16) -> Int8Linear:
        q, scales = quantize_rows(linear.weight)
        return cls(q, scales, linear.bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).to(self.scales.dtype)  # [M, K]
        if self.pad:
            flat = torch.nn.functional.pad(flat, (0, self.pad))  # [M, K + pad]
        y = torch._weight_int8pack_mm(flat, self.qweight, self.scales)  # [M, N]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def _pack_dynamic(qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> Any:
    """fbgemm's packed form of int8 rows `qweight` [N, K] with per-row `scales` [N] (and a float bias)."""
    zero = torch.zeros(qweight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch's deprecation notice of quantised tensors (see the module doc)
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(qweight, scales.double(), zero, 0)
    return torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.detach().float())


class DynamicInt8Linear(nn.Module):
    """A linear layer with int8 weights (one scale per output row) and activations quantised per call
    to 7-bit integers: fbgemm's dynamic int8 product, output in the input's dtype (see the module doc)."""

    qweight: torch.Tensor  # buffers (registered in __init__)
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())  # [N, K] int8, kept for the reference maths
        self.register_buffer("scales", scales.float())  # [N]
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self._packed = _pack_dynamic(self.qweight, self.scales, self.bias)  # not a tensor: rebuilt on copy

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> DynamicInt8Linear:
        q, scales = quantize_rows(linear.weight)
        return cls(q, scales, linear.bias)

    def __deepcopy__(self, memo: dict) -> DynamicInt8Linear:
        return DynamicInt8Linear(
            self.qweight.clone(), self.scales.clone(), None if self.bias is None else self.bias.clone()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)  # [M, K]
        if flat.dtype != torch.float32:  # (a float32 head skips both casts: fewer ops per draft level)
            flat = flat.float()
        y = torch.ops.quantized.linear_dynamic(flat.contiguous(), self._packed, True)  # [M, N] float32; 7-bit
        y = y.view(*lead, self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights, dynamic int8"


def quantize_head_int8(head: DraftHead, dtype: torch.dtype = torch.bfloat16, weight_only: bool = False) -> DraftHead:
    """A copy of `head` (in `dtype`, bfloat16 or float32) whose linears, except `KEEP_FULL`, hold int8
    weights: `DynamicInt8Linear`, or with `weight_only` (bfloat16 only) `Int8Linear`.

    The caller's head is left as it was (it may still be trained or exported); borrowed target
    modules are shared, not copied (`BorrowedModules`).
    """
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"int8 draft weights need a bfloat16 or float32 head, not {dtype}")
    if weight_only and dtype != torch.bfloat16:
        raise ValueError(f"the weight-only int8 kernel needs a bfloat16 head, not {dtype}")
    quantized = inference_copy(head, dtype)  # fused: int8 rows quantise alike fused or not
    for parent_name, parent in list(quantized.named_modules()):
        for name, child in list(parent.named_children()):
            full_name = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, nn.Linear) and full_name not in KEEP_FULL:
                layer = Int8Linear.from_linear(child, dtype) if weight_only else DynamicInt8Linear.from_linear(child)
                setattr(parent, name, layer)
    return cast(DraftHead, quantized.eval())


def int8_kind(module: nn.Module) -> str | None:
    """The `decode.draft_weights` kind of `module`'s int8 linears (`int8_weight_only` if any is
    `Int8Linear`), or None when it has none."""
    kinds = {type(m) for m in module.modules()} & {Int8Linear, DynamicInt8Linear}
    if not kinds:
        return None
    return "int8_weight_only" if Int8Linear in kinds else "int8"


def has_int8_linears(module: nn.Module) -> bool:
    return int8_kind(module) is not None


__all__ = [
    "KEEP_FULL",
    "DynamicInt8Linear",
    "Int8Linear",
    "has_int8_linears",
    "int8_kind",
    "int8_linear_reference",
    "quantize_head_int8",
    "quantize_rows",
]
