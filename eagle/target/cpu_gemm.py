"""Float32 linears for a few rows at a time on a CPU (`target.cpu_gemm`).

Speculative decoding pays when verifying N drafted tokens costs little more than decoding one: at
batch 1 a decoder step is bound by reading the weights, so 2-32 rows should cost about what one row
does. Some BLAS builds do not deliver that. On a 2-core AVX2 AMD EPYC with torch 2.13's MKL,
`F.linear(x, W)` (x @ W^T) for x of 4-16 rows costs 3-5x one row, while the same product computed as
W @ x^T (then transposed) costs about 1-2x one row:

    SmolLM2-135M LM head [49152, 576], ms:  rows   1     4     8    16
    F.linear  (x @ W^T)                           12    45    62    64
    torch.mm(W, x^T).T                            14    11    14    26

(`python -m benchmarks gemm` prints this table for the machine it runs on.) The values are the same
products in another summation order (differences of ~1e-6 relative, as between any two BLAS kernels),
and the weights are not copied or changed.

`target.cpu_gemm`: `stock` leaves torch's kernel alone; `transposed` computes float32 CPU linears of
2-`MAX_ROWS` rows as W @ x^T; `auto` (default) times both on the model's largest linear (its LM head)
at 8 rows once at load and keeps the faster, so machines whose BLAS is already good stay on it. One row
(every plain decoding step, HF `generate` included) and long inputs (prefill, capture, training) always
take torch's own kernel.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle.errors import EagleError

log = logging.getLogger(__name__)

CPU_GEMM = ("auto", "stock", "transposed")
MAX_ROWS = 32  # covers verify trees; prefill, capture and training (hundreds of rows) keep torch's kernel
PROBE_ROWS = 8
PAYS_BELOW = 0.8  # `auto` switches only when the transposed product takes < 80% of torch's time


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., in], computed as weight @ x^T; returns [..., out] contiguous."""
    rows = x.numel() // x.shape[-1]
    y = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t()  # [out, in] @ [in, rows] -> [rows, out]
    if bias is not None:
        y = y + bias
    return y.contiguous().view(*x.shape[:-1], weight.shape[0])


def _takes_transposed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        2 <= rows <= MAX_ROWS and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
    )


class SmallBatchLinear(nn.Linear):
    """nn.Linear whose float32 CPU products of 2-MAX_ROWS rows run as W @ x^T (same parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _takes_transposed(x, self.weight):
            return transposed_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear) and type(m) in (nn.Linear, SmallBatchLinear)]


def median_ms(fn: Callable[[], object], reps: int = 5) -> float:
    """Median wall time of `fn()` over `reps` calls after one warm-up call, in ms."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


@torch.inference_mode()
def probe_transposed_gemm(weight: torch.Tensor, rows: int = PROBE_ROWS) -> tuple[float, float]:
    """(torch's ms, transposed ms) for `rows` rows through `weight` [out, in] on this machine."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, generator=torch.Generator().manual_seed(0))
    return median_ms(lambda: F.linear(x, weight)), median_ms(lambda: transposed_linear(x, weight, None))


def apply_cpu_gemm(model: nn.Module, choice: str) -> dict[str, Any]:
    """Set the kernel of `model`'s linears for `target.cpu_gemm=choice`; returns what was decided.

    Only plain float32 CPU `nn.Linear`s change (their class, not their parameters); anything else
    (GPU, bf16/fp16, quantised linears) keeps torch's kernel whatever the choice.
    """
    if choice not in CPU_GEMM:
        raise EagleError(f"target.cpu_gemm={choice!r} is not one of {', '.join(CPU_GEMM)}")
    linears = [m for m in _linears(model) if m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    decision: dict[str, Any] = {"choice": choice, "kernel": "stock"}
    if not linears or choice == "stock":
        use = False
    elif choice == "transposed":
        use = True
    else:
        largest = max(linears, key=lambda m: m.weight.numel())
        stock_ms, transposed_ms = probe_transposed_gemm(largest.weight.detach())
        use = transposed_ms < PAYS_BELOW * stock_ms
        decision.update(
            probe_rows=PROBE_ROWS,
            probe_shape=list(largest.weight.shape),
            stock_ms=round(stock_ms, 3),
            transposed_ms=round(transposed_ms, 3),
        )
        log.info(
            "target.cpu_gemm=auto: %d rows x %s float32 linear %.1f ms (torch) vs %.1f ms (W @ x^T): %s",
            PROBE_ROWS,
            tuple(largest.weight.shape),
            stock_ms,
            transposed_ms,
            f"using W @ x^T for 2-{MAX_ROWS} rows" if use else "keeping torch's kernel",
        )
    for m in linears:
        m.__class__ = SmallBatchLinear if use else nn.Linear
    if use:
        decision["kernel"] = "transposed"
    return decision


__all__ = [
    "CPU_GEMM",
    "MAX_ROWS",
    "SmallBatchLinear",
    "apply_cpu_gemm",
    "median_ms",
    "probe_transposed_gemm",
    "transposed_linear",
]
