"""Where a head's acceptance goes: the training metric on the training data, its held-out split,
fresh text of the same source, and the evaluation prompts.

`eagle-train` picks `best/` by held-out tau_sim, measured on the capture's held-out split: conversations
from the same source (and the same self-distillation) as the training data. The speed a user sees comes
from other prompts (MT-bench, HumanEval). This probe runs the same teacher-forced measurement (the
algorithm's unrolled loss: acc@k per unroll step and tau_sim, as `eagle.train.heldout` computes them)
over each kind of text, so the gap between "held-out" and "evaluation" is a number instead of a guess:

    train      items of the capture's train split (stored features): memorisation shows as train >> heldout
    heldout    items of the capture's held-out split (stored features): what `best/` was chosen on
    fresh      source conversations the capture does not contain, first turn answered greedily by the target
    mt_bench   MT-bench first turns, answered greedily by the target
    humaneval  HumanEval prompts, answered greedily by the target

For the generated sets the loss mask is the answer, the features come from one forward of the target
over prompt + answer (as a capture computes them), and `coverage` is the share of answer tokens the
draft vocabulary contains (a token outside it can never be drafted). The accuracies count a step as
right when the head's top-1 is the target's top-1 over the full vocabulary (no draft-vocabulary
renormalisation), i.e. what greedy decoding accepts.

    python -m benchmarks probe_acceptance --draft DIR --capture DIR [--n 20] [--new-tokens 128]
        [--sets train,heldout,fresh,mt_bench,humaneval] [--json OUT.json] [override ...]

Overrides are Hydra overrides for the target and data (default: recipe=smollm2-135m-instruct
target.dtype=bfloat16); `fresh` reads `data.*` (the recipe's source), skipping every id in the capture.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from eagle.algorithms import get_algorithm
from eagle.capture.features import extract_features
from eagle.capture.reader import CaptureDataset, collate
from eagle.cli.app import compose
from eagle.data.dataset import load_conversations
from eagle.data.eval_prompts import load_eval_prompts
from eagle.data.template import end_of_turn_ids
from eagle.evaluate.baselines import encode_chat
from eagle.export.loader import load_draft
from eagle.regenerate.job import first_turn_prompt
from eagle.target.loading import load_target
from eagle.train.metrics import MetricSums


def _metrics(algo: Any, head: Any, lm_head: Any, settings: Any, batches: list[dict[str, Any]]) -> dict[str, float]:
    sums = MetricSums()
    for batch in batches:
        parts = algo.forward_loss(head, lm_head, batch, settings, norms=None)  # full-vocabulary labels
        sums.add(parts.step_loss, parts.step_correct, parts.step_tokens, parts.extra)
    host = sums.host()  # one read-back for the summary and the token count
    summary = host.summary([1.0] * settings.steps, {})
    return {k: v for k, v in summary.items() if k.startswith(("acc_", "tau_sim"))} | {
        "tokens": float(host.step_tokens[0]) if host.step_tokens else 0.0
    }


def _stored(split: Any, n: int, dtype: torch.dtype) -> list[dict[str, Any]]:
    out = []
    step = max(len(split) // max(n, 1), 1)  # evenly spaced items: the split's order groups by shard
    for i in range(0, min(n * step, len(split)), step):
        batch = collate([split[i]])
        out.append(
            {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in batch.items()}
        )
    return out


@torch.no_grad()
def _generated(
    model: Any, head: Any, prompts: list[list[int]], new_tokens: int, eos: list[int]
) -> tuple[list[dict[str, Any]], float]:
    """Greedy answers to `prompts` (token ids), featurised as one capture forward each; and coverage."""
    batches, covered, total = [], 0, 0
    t2d = getattr(head, "t2d", None)  # [V] bool; a full-vocabulary head has none
    in_vocab = t2d.bool() if t2d is not None else torch.ones(head.config.vocab_size, dtype=torch.bool)
    for ids in prompts:
        x = torch.tensor([ids])
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else 0,
        )
        seq = out[:, : x.shape[1] + new_tokens]  # [1, T]
        mask = torch.zeros_like(seq, dtype=torch.bool)
        mask[:, x.shape[1] :] = True
        feats = extract_features(model, seq, torch.ones_like(seq), list(head.config.aux_layer_ids) or None)
        answer = seq[0, x.shape[1] :]
        covered += int(in_vocab[answer].sum())
        total += int(answer.numel())
        batches.append(
            {
                "input_ids": seq,
                "loss_mask": mask,
                "attention_mask": torch.ones_like(mask),
                **{k: v.clone() for k, v in feats.items()},
            }
        )
    return batches, covered / max(total, 1)


def _fresh_prompts(cfg: Any, tokenizer: Any, exclude: set[str], n: int, max_prompt_tokens: int) -> list[list[int]]:
    """First turns of the source's conversations that are not in `exclude`, from the end of what the
    capture could have read (the next ones in source order)."""
    limit = len(exclude) + 4 * n + 64
    convs, _ = load_conversations(dataclasses.replace(cfg.data, max_conversations=limit))
    prompts = []
    for conv in convs:
        if conv.id in exclude:
            continue
        ids = first_turn_prompt(tokenizer, conv)  # what eagle-regenerate sends
        if 0 < len(ids) <= max_prompt_tokens:
            prompts.append(ids)
    if len(prompts) < n:
        raise SystemExit(f"only {len(prompts)} fresh conversations in the first {limit} of the source")
    return prompts[:n]


def _eval_prompts(name: str, tokenizer: Any, n: int) -> list[list[int]]:
    # encode_chat: the prompt ids eagle-eval decodes from
    return [
        encode_chat(tokenizer, [{"role": "user", "content": p.turns[0]}])[0].tolist()
        for p in load_eval_prompts(name)[:n]
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", required=True, help="head: training dir, saved head or exported folder")
    p.add_argument("--capture", required=True, help="the capture the head was trained on")
    p.add_argument("--n", type=int, default=20, help="items / prompts per set")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--sets", default="train,heldout,fresh,mt_bench,humaneval")
    p.add_argument("--steps", type=int, default=None, help="unroll steps (default: the run's train.ttt_steps)")
    p.add_argument(
        "--max-prompt-tokens", type=int, default=512, help="fresh: longest prompt kept (the reference regeneration's)"
    )
    p.add_argument("--json", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    overrides = args.overrides or ["recipe=smollm2-135m-instruct", "target.dtype=bfloat16"]
    cfg = compose(overrides)
    torch.manual_seed(0)
    model, tokenizer, _ = load_target(cfg.target, "cpu", stage="decode")
    head, _ = load_draft(args.draft, model)
    dtype = next(model.parameters()).dtype
    head.to(dtype)
    algo = get_algorithm(head.config.algorithm)
    settings = algo.loss_settings(cfg.draft, cfg.train, tokenizer.pad_token_id or 0, training=False)
    if args.steps is not None:
        settings = dataclasses.replace(settings, steps=args.steps)
    lm_head = model.get_output_embeddings()
    eos = end_of_turn_ids(tokenizer)
    splits = {name: CaptureDataset(args.capture, split=name) for name in ("train", "heldout")}
    results: dict[str, dict[str, float]] = {}
    for name in args.sets.split(","):
        t0 = time.perf_counter()
        coverage = None
        if name in splits:
            batches = _stored(splits[name], args.n, dtype)
        else:
            if name == "fresh":
                captured = {i for s in splits.values() for i in s.ids()}
                prompts = _fresh_prompts(cfg, tokenizer, captured, args.n, args.max_prompt_tokens)
            else:
                prompts = _eval_prompts(name, tokenizer, args.n)
            batches, coverage = _generated(model, head, prompts, args.new_tokens, eos)
        row = _metrics(algo, head, lm_head, settings, batches)
        if coverage is not None:
            row["coverage"] = coverage
        results[name] = row
        accs = " / ".join(f"{row[f'acc_{i}']:.3f}" for i in range(settings.steps))
        cov = f", draft-vocab coverage {coverage:.3f}" if coverage is not None else ""
        print(
            f"{name:10s} {len(batches):3d} items, {int(row['tokens'])} tokens: tau_sim {row['tau_sim']:.2f}, "
            f"acc@0.. {accs}{cov} ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "draft": args.draft,
                    "capture": args.capture,
                    "n": args.n,
                    "new_tokens": args.new_tokens,
                    "results": results,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
