"""`decode.tree=auto`: pick the verified tree size that maximises expected tokens per second.

Model. A verify pass over a tree of s drafted nodes takes t(s) seconds, measured once on this machine
(`time_verify_passes`; the draft work is the same for every s and enters as `fixed_s`). The expected
number of tokens a step emits is 1 (the bonus token) plus the sum, over the tree's nodes, of the
probability that the node is accepted; we take that probability to be the head's own cumulative draft
probability of the node (the product of its draft probabilities along the path), i.e. we trust the
head to be calibrated. The dynamic tree of size s keeps the s candidates with the highest cumulative
probability, so E[tokens](s) = 1 + sum of the s largest exp(score). Each step picks
argmax_s E[tokens](s) / (t(s) + fixed_s) over `decode.auto_candidates` from the scores of the pool it
just drafted, so confident stretches (code, repetitions) get big trees and uncertain ones small trees.
Heads are usually over-confident, so the probabilities are scaled by a running calibration factor
(accepted drafts / predicted accepted drafts over recent steps, `AutoTreeState`). The depth follows
the machine too: a further draft level costs one head forward (measured) and adds, in expectation,
the share of the frontier's probability mass its children draw (`draft_pool`), scaled by the same
calibration ratio (here allowed above 1: on code the head under-predicts); drafting stops once that is
worth less than the level's time at the tokens per second the decoder is achieving.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from eagle.decode.cache import crop_cache
from eagle.decode.lookup import LookupStats
from eagle.decode.target import VerifyPlan, new_cache, target_forward

# Bound on how much the depth decision may trust the head beyond its own probabilities (the depth is
# bounded by decode.tree_depth anyway; this keeps one lucky stretch from pinning it there).
MAX_DEPTH_CALIBRATION = 4.0


@dataclass
class AutoTreeState:
    """Running measurements behind `decode.tree=auto` (exponential moving averages over steps)."""

    calibration: float = 1.0  # accepted drafts / the head's predicted accepted drafts, at most 1
    depth_calibration: float = 1.0  # the same ratio up to MAX_DEPTH_CALIBRATION (the depth decision)
    predicted: float = 0.0  # predicted accepted drafts of the tree being verified
    levels: int = 0  # draft levels of the tree being verified
    level_s: float = 0.0  # seconds per draft level (head forward + top-k)
    step_s: float = 0.0  # seconds per decoding step (draft + verify)
    tokens: float = 1.0  # tokens emitted per step
    _sums: tuple[float, float] = (0.0, 0.0)  # decayed (accepted, predicted)
    decay: float = 0.9

    def observe(self, accepted: int, draft_s: float, step_s: float) -> None:
        a, p = self._sums
        a, p = self.decay * a + accepted, self.decay * p + self.predicted
        self._sums = (a, p)
        # Bounded: one lucky or unlucky stretch must not switch drafting off or make it unbounded.
        ratio = (a + 0.5) / (p + 0.5)
        self.calibration = min(1.0, max(0.05, ratio))
        self.depth_calibration = min(MAX_DEPTH_CALIBRATION, max(0.05, ratio))
        w = 1.0 - self.decay
        per_level = draft_s / max(1, self.levels)
        self.level_s = per_level if self.step_s == 0 else (1 - w) * self.level_s + w * per_level
        self.tokens = accepted + 1.0 if self.step_s == 0 else (1 - w) * self.tokens + w * (accepted + 1.0)
        self.step_s = step_s if self.step_s == 0 else (1 - w) * self.step_s + w * step_s

    def min_level_gain(self) -> float:
        """Uncalibrated expected gain (`draft_pool`) below which another draft level costs more than it
        brings.

        Calibrated with `depth_calibration`, which may exceed 1: where the head under-predicts its
        acceptance (code, repetitions), deeper levels pay more than its own probabilities say. The tree
        size keeps `calibration` (at most 1): scaled node probabilities above 1 would mean nothing there."""
        if self.step_s <= 0:
            return 0.0  # nothing measured yet: draft the configured depth
        tokens_per_s = self.tokens / self.step_s
        return self.level_s * tokens_per_s / self.depth_calibration


def expected_chain_tokens(rates: LookupStats, max_depth: int) -> list[float]:
    """Expected accepted nodes of a chain of length 0..max_depth from its measured acceptance by
    position (`LookupStats`, here for the head's sampled draft chains: their nodes are accepted with
    sum min(p, q), which the head's own probabilities do not give)."""
    return [0.0, *rates.expected(torch.arange(max_depth))]


def choose_chain_length(
    rates: LookupStats, verify_times: dict[int, float], level_s: float, fixed_s: float, max_depth: int
) -> int:
    """The chain length k maximising (1 + E[accepted](k)) / (t_verify(k) + k * level_s + fixed_s);
    `max_depth` until verify passes are timed."""
    if not verify_times:
        return max_depth
    gains = expected_chain_tokens(rates, max_depth)

    def rate(k: int) -> float:
        return (1.0 + gains[k]) / (verify_time(verify_times, k) + k * level_s + fixed_s)

    return max(range(max_depth + 1), key=rate)


def expected_tokens(scores: torch.Tensor, sizes: list[int]) -> list[float]:
    """Expected tokens per step for each tree size, from the pool's cumulative log-probs [M]."""
    probs = torch.sort(scores.float().exp(), descending=True).values  # [M]
    csum = torch.cat([torch.zeros(1), probs.cumsum(0)])  # csum[s] = mass of the s best nodes
    return [1.0 + float(csum[min(s, probs.numel())]) for s in sizes]


def choose_tree_size(verify_times: dict[int, float], scores: torch.Tensor, default: int, fixed_s: float = 0.0) -> int:
    """The size maximising expected tokens / (verify time + fixed time); `default` if nothing is timed."""
    if not verify_times:
        return default
    sizes = sorted(verify_times)
    gains = expected_tokens(scores, sizes)
    rates = [g / (verify_times[s] + fixed_s) for s, g in zip(sizes, gains, strict=True)]
    return sizes[max(range(len(sizes)), key=rates.__getitem__)]


def verify_time(verify_times: dict[int, float], size: int) -> float:
    """Seconds of a verify pass over `size` drafted nodes, interpolated linearly between timed sizes
    (extrapolated along the last two beyond the largest; the smallest's time below it)."""
    sizes = sorted(verify_times)
    if size <= sizes[0]:
        return verify_times[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:], strict=False):
        if size <= hi:
            return verify_times[lo] + (verify_times[hi] - verify_times[lo]) * (size - lo) / (hi - lo)
    if len(sizes) == 1:
        return verify_times[sizes[0]]
    lo, hi = sizes[-2], sizes[-1]
    return verify_times[hi] + (verify_times[hi] - verify_times[lo]) * (size - hi) / (hi - lo)


def monotone_envelope(times: dict[int, float]) -> dict[int, float]:
    """t(s) := min over s' >= s of t(s'): a pass over more tokens never costs less than one over fewer.

    On a shared CPU a timing is the true cost plus interference; a smaller size that came out slower
    than a larger one was disturbed, and left so it would steer every step to the larger size.
    """
    out: dict[int, float] = {}
    best = float("inf")
    for s in sorted(times, reverse=True):
        best = min(best, times[s])
        out[s] = best
    return dict(sorted(out.items()))


@torch.inference_mode()
def time_verify_passes(
    target: Any,
    sizes: list[int],
    context_len: int,
    plan: VerifyPlan,
    device: torch.device,
    reps: int = 5,
) -> dict[int, float]:
    """Seconds of one verify pass (root + s nodes after `context_len` cached tokens) per size.

    Sizes are timed in interleaved rounds (a burst of interference hits every size alike instead of
    a few neighbours), each keeps its fastest run (the least disturbed), and the result is made
    non-decreasing in s (`monotone_envelope`). A target that verifies chains (`plan.trees` false) times
    chains of s nodes instead of flat trees (its state layers are not rolled back here: the cache is thrown
    away)."""
    vocab = int(target.get_output_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    cache = new_cache(target.config, plan)
    ctx = torch.randint(0, vocab, (context_len,), generator=gen).to(device)
    target_forward(target, ctx, torch.arange(context_len, device=device), cache, plan=plan, last_logits_only=True)
    passes = {}
    for s in sorted(set(sizes)):
        toks = torch.randint(0, vocab, (s + 1,), generator=gen).to(device)
        if not plan.trees:
            pos = context_len + torch.arange(s + 1, device=device)
            mask = torch.ones(s + 1, s + 1, dtype=torch.bool, device=device).tril()
        else:
            pos = context_len + torch.tensor([0] + [1] * s, device=device)  # root + s children: a flat tree
            mask = torch.eye(s + 1, dtype=torch.bool, device=device)
            mask[:, 0] = True
        passes[s] = (toks, pos, mask)
    runs: dict[int, list[float]] = {s: [] for s in passes}
    for i in range(reps + 1):
        for s, (toks, pos, mask) in passes.items():
            t0 = time.perf_counter()
            target_forward(target, toks, pos, cache, mask, plan=plan)
            if i:  # the first round warms up allocators and kernels
                runs[s].append(time.perf_counter() - t0)
            crop_cache(cache, context_len)
    return monotone_envelope({s: min(r) for s, r in runs.items()})
