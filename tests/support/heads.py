"""Head helpers shared by the export tests."""

from __future__ import annotations

import torch


def randomise(head: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn from N(0, 0.2^2). Fresh heads have ones in every norm and zeros in biases;
    random values make a round trip sensitive to any tensor (an fc_norm included) being dropped, renamed
    wrongly, transposed or not applied."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
