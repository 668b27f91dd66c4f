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
Heads are usually over-confident, which biases toward larger trees; the measured acceptance figures
of eagle-eval show whether that matters for a given head.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from eagle.decode.cache import crop_cache
from eagle.decode.target import new_cache, target_forward


def expected_tokens(scores: torch.Tensor, sizes: list[int]) -> list[float]:
    """Expected tokens per step for each tree size, from the pool's cumulative log-probs [M]."""
    probs = torch.sort(scores.float().exp(), descending=True).values  # [M]
    csum = torch.cat([torch.zeros(1), probs.cumsum(0)])  # csum[s] = mass of the s best nodes
    return [1.0 + float(csum[min(s, probs.numel())]) for s in sizes]


def choose_tree_size(
    verify_times: dict[int, float], scores: torch.Tensor, default: int, fixed_s: float = 0.0
) -> int:
    """The size maximising expected tokens / (verify time + fixed time); `default` if nothing is timed."""
    if not verify_times:
        return default
    sizes = sorted(verify_times)
    gains = expected_tokens(scores, sizes)
    rates = [g / (verify_times[s] + fixed_s) for s, g in zip(sizes, gains, strict=True)]
    return sizes[max(range(len(sizes)), key=rates.__getitem__)]


@torch.inference_mode()
def time_verify_passes(
    target: Any,
    sizes: list[int],
    context_len: int,
    windows: dict[str, int | None] | None,
    device: torch.device,
    reps: int = 3,
) -> dict[int, float]:
    """Median seconds of one verify pass (root + s nodes after `context_len` cached tokens) per size."""
    vocab = int(target.get_output_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    cache = new_cache()
    ctx = torch.randint(0, vocab, (context_len,), generator=gen).to(device)
    target_forward(target, ctx, torch.arange(context_len, device=device), cache, windows=windows)
    times: dict[int, float] = {}
    for s in sorted(set(sizes)):
        toks = torch.randint(0, vocab, (s + 1,), generator=gen).to(device)
        pos = context_len + torch.tensor([0] + [1] * s, device=device)  # root + s children: a flat tree
        mask = torch.eye(s + 1, dtype=torch.bool, device=device)
        mask[:, 0] = True
        runs = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            target_forward(target, toks, pos, cache, mask, windows=windows)
            if i:  # the first run warms up allocators and kernels
                runs.append(time.perf_counter() - t0)
            crop_cache(cache, context_len)
        times[s] = statistics.median(runs)
    return times
