"""Is `target.cpu_gemm=transposed` worth it on this machine? Float32 linears of a few rows, and whole
target forwards of 1-32 new tokens after a 256-token context, with torch's kernel and with W @ x^T.

    python -m benchmarks gemm [--target smollm2-135m-instruct] [--rows 1 2 4 8 16 32] [--threads N]

Prints, per row count: ms for each distinct linear shape of the target (each kernel), and ms for a
target forward (KV cache of 256 tokens, the decoder's own `target_forward`, causal chain), with the
ratio transposed / stock. Both kernels are timed in the same process, alternating, median of 7.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

from eagle.cli.app import compose
from eagle.decode.cache import crop_cache
from eagle.decode.target import new_cache, target_forward, verify_plan
from eagle.evaluate.report import hardware_info
from eagle.target.cpu_gemm import apply_cpu_gemm, median_ms, transposed_linear
from eagle.target.loading import load_target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct", help="target.path (default: the bundled SmolLM2)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = compose([f"target.path={args.target}", "target.dtype=float32", "target.cpu_gemm=stock"])
    model, _, _ = load_target(cfg.target, "cpu", stage="decode")
    hw = hardware_info("cpu")
    print(f"{hw['cpu']} | {torch.get_num_threads()} threads | torch {torch.__version__}")

    shapes = sorted(
        {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)}, key=lambda s: -s[0] * s[1]
    )
    gen = torch.Generator().manual_seed(0)
    print(f"\nlinears (ms, torch / W @ x^T):\n{'[out, in]':<16}" + "".join(f"{r:>16}" for r in args.rows))
    with torch.inference_mode():
        for out_f, in_f in shapes:
            w = torch.randn(out_f, in_f, generator=gen)
            cells = []
            for rows in args.rows:
                x = torch.randn(rows, in_f, generator=gen)
                stock = median_ms(lambda x=x, w=w: F.linear(x, w), args.reps)
                mine = median_ms(lambda x=x, w=w: transposed_linear(x, w, None), args.reps)
                cells.append(f"{stock:.2f} / {mine:.2f}")
            print(f"{str([out_f, in_f]):<16}" + "".join(f"{c:>16}" for c in cells))

    ids = torch.randint(0, model.config.vocab_size, (args.context + max(args.rows),), generator=gen)
    plan = verify_plan(model.config)
    cache = new_cache(model.config, plan)
    target_forward(model, ids[: args.context], torch.arange(args.context), cache, plan=plan, last_logits_only=True)

    def forward(rows: int) -> None:
        target_forward(
            model,
            ids[args.context : args.context + rows],
            torch.arange(args.context, args.context + rows),
            cache,
            plan=plan,
        )
        crop_cache(cache, args.context)

    print(f"\ntarget forward of N new tokens after {args.context} cached (ms):")
    print(f"{'N':>4}{'torch':>10}{'W @ x^T':>10}{'ratio':>8}{'torch vs N=1':>14}{'W@x^T vs N=1':>14}")
    base: dict[str, float] = {}
    for rows in args.rows:
        apply_cpu_gemm(model, "stock")
        stock = median_ms(lambda rows=rows: forward(rows), args.reps)
        apply_cpu_gemm(model, "transposed")
        mine = median_ms(lambda rows=rows: forward(rows), args.reps)
        base.setdefault("stock", stock)
        base.setdefault("mine", mine)
        print(
            f"{rows:>4}{stock:>10.1f}{mine:>10.1f}{mine / stock:>8.2f}{stock / base['stock']:>14.2f}"
            f"{mine / base['mine']:>14.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
