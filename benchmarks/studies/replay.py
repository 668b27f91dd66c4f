"""What replaying accepted tokens costs on targets whose layers keep a state (issue #51).

A target with recurrent, convolution or compressed state layers (Qwen3.5, Nemotron-H, Falcon-H1, LFM2,
LFM3) verifies chains; after a partial acceptance the decoder puts the states back as they were before
the verify pass and runs the accepted tokens again (`Timings.replay_s`). A per-position state (the
state after every drafted token kept by the verify pass itself) would save that forward at the cost
of one state copy per drafted token. This study decodes with an oracle head that misses every
`--miss-every`-th token (partial acceptances at a known rate) and reports, per family, the share of
target time spent replaying and the tokens per verify pass.

    python -m benchmarks replay [--families qwen3_5,nemotron_h,falcon_h1,lfm2,lfm3] [--hidden 256]
        [--layers 8] [--new-tokens 128] [--miss-every 3] [--depth 4]

Models are random (tests/tiny_models.py configs at --hidden / --layers); timings depend on shapes,
not on the weights. One torch thread.
"""

from __future__ import annotations

import argparse
import sys

import torch

from eagle.config import DecodeConfig
from eagle.decode import SpeculativeGenerator
from tests.support.decode import OracleHead, hf_greedy, prompt_ids
from tests.tiny_models import make_model

PROMPT = "Write a short poem about the sea. The sea is wide and blue and deep."


def _missing_oracle(sequence: list[int], vocab: int, miss_every: int) -> OracleHead:
    """An oracle head that drafts the target's own continuation except at every `miss_every`-th position."""
    wrong = [t if (i % miss_every) else (t + 1) % vocab for i, t in enumerate(sequence)]
    return OracleHead(wrong, vocab)


def measure(family: str, hidden: int, layers: int, new_tokens: int, miss_every: int, depth: int) -> dict:
    model, tok = make_model(family, hidden=hidden, num_layers=layers)
    ids = prompt_ids(tok, PROMPT)
    ref = hf_greedy(model, ids, new_tokens)
    cfg = DecodeConfig(tree="dynamic", tree_top_k=1, tree_depth=depth, max_new_tokens=new_tokens, temperature=0.0)
    gen = SpeculativeGenerator(model, _missing_oracle(ids + ref, len(tok), miss_every), tok, cfg)
    gen.generate(ids)  # warm-up
    res = gen.generate(ids)
    assert res.tokens == ref, f"{family}: output differs from the target's own"
    t = res.timings
    return {
        "family": family,
        "passes": len(res.accept_lengths),
        "replays": res.replays,
        "tokens_per_pass": sum(res.accept_lengths) / max(1, len(res.accept_lengths)),
        "target_s": t.target_s,
        "replay_s": t.replay_s,
        "replay_share": t.replay_s / t.target_s if t.target_s else 0.0,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="qwen3_5,nemotron_h,falcon_h1,lfm2,lfm3")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--miss-every", type=int, default=3)
    ap.add_argument("--depth", type=int, default=4)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print("| family | verify passes | replays | tokens/pass | target s | replay s | replay share |")
    print("|---|---|---|---|---|---|---|")
    for family in args.families.split(","):
        r = measure(family, args.hidden, args.layers, args.new_tokens, args.miss_every, args.depth)
        print(
            f"| {r['family']} | {r['passes']} | {r['replays']} | {r['tokens_per_pass']:.2f} | "
            f"{r['target_s']:.3f} | {r['replay_s']:.3f} | {r['replay_share']:.0%} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
