"""Time the recipe's training step (loss forward + backward + AdamW) on real captured batches.

    python -m benchmarks train_step --capture outputs/study/capture [--batches 8] [--ttt 5]
        [--recipe smollm2-135m-instruct] [override ...]

Batches are pairs of conversations of neighbouring lengths (as `train.group_by_length` makes them),
drawn at random from the capture's train shards 1-3, with their real loss masks (prompts excluded),
so the step computes what a training run computes. One warm-up step, then the batches once; prints
one JSON line with seconds, tokens and tokens/s.

It calls only interfaces that older commits have too (`compose`, `load_target`, `build_head`,
`Algorithm.forward_loss`), so two checkouts can be compared in one session, alternating:

    git worktree add /tmp/prev <commit>
    for tree in /tmp/prev $PWD /tmp/prev $PWD; do
        PYTHONPATH=$tree python -m benchmarks train_step --capture outputs/study/capture; done
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

import eagle
from eagle.algorithms import get_algorithm
from eagle.algorithms.head_io import build_head, head_config_from_target
from eagle.cli.app import compose
from eagle.target.loading import load_target


def _conversations(capture: Path, shards: slice) -> list[dict[str, torch.Tensor]]:
    out = []
    for f in sorted((capture / "train").glob("shard-*.safetensors"))[shards]:
        data = load_file(str(f))
        offsets = data["offsets"].tolist()
        for a, b in zip(offsets[:-1], offsets[1:], strict=True):
            out.append({k: data[k][a:b] for k in ("input_ids", "aux_hidden", "final_hidden", "loss_mask")})
    return sorted(out, key=lambda c: c["input_ids"].numel())


def _collate(convs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-padded batch in the trainer's layout ([B, T] ids / masks, [B, T, k, H] aux, [B, T, H] final)."""
    b, t = len(convs), max(c["input_ids"].numel() for c in convs)
    aux, final = convs[0]["aux_hidden"], convs[0]["final_hidden"]
    out = {
        "input_ids": torch.zeros(b, t, dtype=torch.long),
        "attention_mask": torch.zeros(b, t, dtype=torch.long),
        "loss_mask": torch.zeros(b, t, dtype=torch.uint8),
        "aux_hidden": torch.zeros(b, t, *aux.shape[1:], dtype=aux.dtype),
        "final_hidden": torch.zeros(b, t, *final.shape[1:], dtype=final.dtype),
    }
    for i, c in enumerate(convs):
        n = c["input_ids"].numel()
        out["input_ids"][i, :n] = c["input_ids"]
        out["attention_mask"][i, :n] = 1
        for k in ("loss_mask", "aux_hidden", "final_hidden"):
            out[k][i, :n] = c[k]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--capture", type=Path, required=True, help="an eagle-capture output_dir of the recipe")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--ttt", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipe", default="smollm2-135m-instruct")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    cfg = compose([f"recipe={args.recipe}", f"train.ttt_steps={args.ttt}", *args.overrides])
    target, _, _ = load_target(cfg.target, stage="train")
    head_cfg = head_config_from_target(target.config, cfg.draft)
    torch.manual_seed(args.seed)
    head = build_head(
        head_cfg, target, torch.ones(head_cfg.vocab_size)
    )  # the vocabulary choice does not change timings
    algorithm = get_algorithm(head_cfg.algorithm)
    lm_head = target.get_output_embeddings()
    label_rows = algorithm.label_rows(head, lm_head)
    settings = algorithm.loss_settings(cfg.draft, cfg.train, 0, training=True)
    convs = _conversations(args.capture, slice(1, 4))
    g = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, len(convs) - 1, (args.batches,), generator=g).tolist()
    batches = [_collate(convs[s : s + 2]) for s in starts]
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-5)

    def step(batch: dict[str, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        parts = algorithm.forward_loss(head, lm_head, batch, settings, None, label_rows)
        parts.objective.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step(batches[0])  # warm-up
    seconds = sum(step(b) for b in batches)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    loss_tokens = sum(int(b["loss_mask"].sum()) for b in batches)
    print(
        json.dumps(
            {
                "eagle": str(Path(eagle.__file__).parent.parent),
                "ttt_steps": args.ttt,
                "batches": args.batches,
                "seconds": seconds,
                "tokens": tokens,
                "tokens_per_s": tokens / seconds,
                "loss_token_share": loss_tokens / tokens,
                "threads": torch.get_num_threads(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
