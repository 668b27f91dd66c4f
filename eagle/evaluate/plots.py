"""PNG figures of an evaluation report (matplotlib, Agg backend: no display needed).

Each function takes plain numbers from the report, writes one PNG atomically and returns its path,
so the publish stage can reuse the figures in a model card.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path


def new_figure():
    """pyplot on the headless Agg backend, imported on first use."""
    import matplotlib  # heavy: matplotlib (~0.8 s), only when a plot is drawn

    matplotlib.use("Agg", force=True)  # headless: never try to open a window
    import matplotlib.pyplot as plt  # heavy: as above (after use(), so pyplot starts on Agg)

    return plt


def save_figure(fig, path: Path) -> Path:
    """Write `fig` to `path` (PNG) through a temporary file, so a reader never sees half a plot."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    return path


def plot_accept_length_histogram(counts: Mapping[int, int], path: Path, title: str = "") -> Path:
    """Bar chart of how many verify steps emitted 1, 2, ... tokens (bonus token included)."""
    plt = new_figure()
    fig, ax = plt.subplots(figsize=(6, 4))
    total = sum(counts.values()) or 1
    xs = sorted(counts)
    ax.bar(xs, [counts[x] / total for x in xs], color="#4C72B0")
    ax.set_xlabel("tokens emitted per target forward (acceptance length)")
    ax.set_ylabel("share of verify steps")
    ax.set_xticks(xs)
    ax.set_title(title or "Acceptance length distribution")
    try:
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def plot_accept_by_depth(rates: Sequence[float], fractions: Sequence[float], path: Path, title: str = "") -> Path:
    """Per-depth conditional acceptance rate and unconditional share of steps reaching the depth."""
    plt = new_figure()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(rates) + 1), rates, "o-", label="P(accept d | accepted d-1)")
    ax.plot(range(1, len(fractions) + 1), fractions, "s--", label="share of steps accepting >= d")
    ax.set_xlabel("draft depth d")
    ax.set_ylabel("rate")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(range(1, max(len(rates), len(fractions), 1) + 1))
    ax.legend()
    ax.set_title(title or "Acceptance by draft depth")
    try:
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def plot_speedup_vs_tree(
    sizes: Sequence[int], speedups: Sequence[float], taus: Sequence[float], path: Path, title: str = ""
) -> Path:
    """Speedup over HF generate (left axis) and tau (right axis) against verified tree size."""
    plt = new_figure()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, speedups, "o-", color="#C44E52", label="speedup vs HF generate")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("tree size (draft tokens verified per step)")
    ax.set_xticks(list(sizes))
    ax.set_ylabel("speedup", color="#C44E52")
    ax2 = ax.twinx()
    ax2.plot(sizes, taus, "s--", color="#4C72B0", label="tau")
    ax2.set_ylabel("tau (tokens per target forward)", color="#4C72B0")
    ax.set_title(title or "Speedup vs tree size")
    try:
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def plot_throughput(methods: Mapping[str, float], path: Path, title: str = "") -> Path:
    """Tokens per second of each decoding method."""
    plt = new_figure()
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(methods)
    ax.barh(names, [methods[n] for n in names], color="#55A868")
    ax.set_xlabel("tokens / s")
    ax.set_title(title or "Decoding throughput")
    try:
        return save_figure(fig, path)
    finally:
        plt.close(fig)
