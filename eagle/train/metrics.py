"""Training metrics: token-weighted loss / top-1 accuracy per unroll step and the simulated tau.

Simulated acceptance length (chain drafts, greedy verification):

    tau_sim = 1 + sum_{k=0}^{N-1} prod_{j=0}^{k} acc_j

where acc_j is the held-out top-1 accuracy of the head at unroll step j (draft token j + 1 equals
the target's argmax). A chain of N drafted tokens is accepted up to the first miss, so the expected
number of accepted drafts is sum_k P(drafts 0..k all match); the leading 1 is the bonus token the
target emits itself in every verify pass. Taking P(all match) = prod acc_j treats acc_j as the
accuracy *given* the earlier drafts matched. That is how the unroll measures it (each step is fed
the true tokens), but errors of neighbouring steps are correlated, so tau_sim is an estimate of a
chain decoder's tau, not of a tree decoder's (which is higher); use it to rank checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def simulated_tau(acc: Sequence[float]) -> float:
    """tau_sim = 1 + sum_k prod_{j<=k} acc_j (see the module docstring)."""
    total, running = 1.0, 1.0
    for a in acc:
        running *= float(a)
        total += running
    return total


Number = torch.Tensor | float


def _value(x: Number) -> Number:
    """A tensor stays on its device (detached, float64: sums of many tokens); a number stays a number."""
    return x.detach().to(torch.float64) if isinstance(x, torch.Tensor) else float(x)


@dataclass
class MetricSums:
    """Sums that add up across micro-batches, steps and ranks; `summary()` turns them into means.

    Everything is token-weighted: a step's loss and accuracy are means over its valid (loss-mask)
    tokens, so long sequences count by their length, the same on any batch split or world size.
    `extra` holds other per-token quantities (EAGLE-1 feature loss, EAGLE-3 vocab coverage) as sums
    weighted by the step-0 token count. Values may be 0-d tensors on the training device: they are
    summed there and read back (one host sync) only by `reduce` / `summary`, at a logging step.
    """

    step_loss: list[Number] = field(default_factory=list)  # per unroll step: sum of token losses
    step_correct: list[Number] = field(default_factory=list)  # per unroll step: top-1 matches
    step_tokens: list[Number] = field(default_factory=list)  # per unroll step: valid tokens
    extra: dict[str, Number] = field(default_factory=dict)  # name -> sum of value x step-0 tokens
    tokens: Number = 0.0  # real (attention) tokens seen, for throughput
    computed: Number = 0.0  # positions computed (batch x padded width): tokens + padding

    def add(
        self,
        step_loss: Sequence[Number],
        step_correct: Sequence[Number],
        step_tokens: Sequence[Number],
        extra: dict[str, Number] | None = None,
        tokens: Number = 0.0,
        computed: Number = 0.0,
    ) -> None:
        """Add one micro-batch's sums (per-step lists have one entry per unroll step)."""
        n = len(step_correct)
        if not self.step_correct:
            self.step_loss, self.step_correct, self.step_tokens = [0.0] * n, [0.0] * n, [0.0] * n
        if n != len(self.step_correct):
            raise ValueError(f"unroll length changed from {len(self.step_correct)} to {n}")
        for i in range(n):
            self.step_loss[i] = self.step_loss[i] + _value(step_loss[i])
            self.step_correct[i] = self.step_correct[i] + _value(step_correct[i])
            self.step_tokens[i] = self.step_tokens[i] + _value(step_tokens[i])
        for k, v in (extra or {}).items():
            self.extra[k] = self.extra.get(k, 0.0) + _value(v)
        self.tokens = self.tokens + _value(tokens)
        self.computed = self.computed + _value(computed)

    def _flat(self) -> tuple[list[float], list[str]]:
        """Every sum as one list of floats (a single device-to-host copy), and the extra keys in order."""
        keys = sorted(self.extra)
        values = [
            self.tokens,
            self.computed,
            *self.step_loss,
            *self.step_correct,
            *self.step_tokens,
            *(self.extra[k] for k in keys),
        ]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if tensors:
            device = tensors[0].device
            flat = torch.stack(
                [
                    v.to(device) if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64, device=device)
                    for v in values
                ]
            )
            return [float(x) for x in flat.cpu().tolist()], keys
        return [float(v) for v in values], keys

    def _from_flat(self, values: list[float], keys: list[str]) -> MetricSums:
        tokens, computed, *rest = values
        v: list[Number] = list(rest)
        n = len(self.step_correct)
        return MetricSums(
            v[:n], v[n : 2 * n], v[2 * n : 3 * n], dict(zip(keys, v[3 * n :], strict=True)), tokens, computed
        )

    def host(self) -> MetricSums:
        """The same sums as plain floats (one host sync)."""
        return self._from_flat(*self._flat())

    @property
    def padding_share(self) -> float:
        """Share of the computed positions that were padding (0 when nothing was recorded)."""
        tokens, computed = float(self.tokens), float(self.computed)
        return 1.0 - tokens / computed if computed else 0.0

    def reduce(self, accelerator: object | None) -> MetricSums:
        """Sum over all processes (with one process or without an accelerator: the sums as floats).

        Every rank must call it with the same number of steps and the same `extra` keys.
        """
        values, keys = self._flat()
        if accelerator is None or getattr(accelerator, "num_processes", 1) == 1:
            return self._from_flat(values, keys)
        flat = torch.tensor(values, dtype=torch.float64)
        flat = accelerator.reduce(flat.to(accelerator.device), reduction="sum").cpu()  # type: ignore[attr-defined]
        return self._from_flat([float(x) for x in flat.tolist()], keys)

    def summary(self, loss_weights: Sequence[float], extra_weights: dict[str, float] | None = None) -> dict[str, float]:
        """{loss, loss_i, acc_i, tau_sim, extras}: token-weighted means.

        `loss` = sum_i loss_weights[i] * loss_i + sum_k extra_weights[k] * extra_k, i.e. the training
        objective (EAGLE-3: decay^i per step; EAGLE-1: token weight on step 0 plus feature weight).
        """
        h = self.host()  # every value a float from here on
        out: dict[str, float] = {}
        accs: list[float] = []
        total = 0.0
        for i, (ls, c, n) in enumerate(zip(h.step_loss, h.step_correct, h.step_tokens, strict=True)):
            out[f"loss_{i}"] = float(ls) / max(float(n), 1.0)
            accs.append(float(c) / max(float(n), 1.0))
            out[f"acc_{i}"] = accs[-1]
            if i < len(loss_weights):
                total += loss_weights[i] * out[f"loss_{i}"]
        n0 = max(float(h.step_tokens[0]), 1.0) if h.step_tokens else 1.0
        for k, v in h.extra.items():
            out[k] = float(v) / n0
            total += (extra_weights or {}).get(k, 0.0) * out[k]
        out["loss"] = total
        out["tau_sim"] = simulated_tau(accs)
        return out
