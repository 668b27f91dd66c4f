"""The python halves of tests/engines/check_vllm_stream.sh (opt-in; the vLLM servers run in their own venv,
started by `python -m eagle.cli.serve_target`). Both run in our .venv:

    wait-step  block until a training run's metrics.jsonl has logged step --step (or the run's process exited)
    compare    the stream run against offline training on a capture.backend=vllm capture of the same
               conversations: the loss of every step within --rtol, the held-out acc@k, the stream's report
               (a server dropped, samples asked again, none unservable, no states file left behind), the
               trained tokens per second of each path; one PASS/FAIL line (exit 1 on FAIL)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from eagle.train.batches import BatchStream, OfflineSplit


def _records(out: Path, split: str) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("split") == split]


def wait_step(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if any(r["step"] >= args.step for r in _records(Path(args.out), "train")):
            print(f"wait-step: step {args.step} logged")
            return 0
        if args.pid and not os.path.exists(f"/proc/{args.pid}"):
            print(f"wait-step: the training process {args.pid} exited before step {args.step}")
            return 1
        time.sleep(0.5)
    print(f"wait-step: no step {args.step} within {args.timeout} s")
    return 1


def trained_tokens(capture: Path, steps: int, batch_size: int, max_length: int, seed: int) -> int:
    """Tokens the runs trained on: the same batches in both (the capture's train split in the trainer's order)."""
    split = OfflineSplit(capture, "train", seed=seed)
    stream = BatchStream(split, seed, batch_size, 1, max_length, pad_id=0)
    lengths = split.lengths()
    return sum(min(lengths[i], max_length) for _ in range(steps) for i in stream.next_indices())


def compare(args: argparse.Namespace) -> int:
    stream, offline = Path(args.stream), Path(args.offline)
    a, b = _records(stream, "train"), _records(offline, "train")
    problems: list[str] = []
    if [r["step"] for r in a] != [r["step"] for r in b] or not a:
        problems.append(f"logged steps differ: stream {[r['step'] for r in a]}, offline {[r['step'] for r in b]}")
    worst = 0.0
    print("step  loss (stream)  loss (offline)  rel. difference")
    for x, y in zip(a, b, strict=False):
        rel = abs(x["loss"] - y["loss"]) / max(abs(y["loss"]), 1e-9)
        worst = max(worst, rel)
        print(f"{x['step']:4d}  {x['loss']:13.6f}  {y['loss']:14.6f}  {rel:.2e}")
    if worst > args.rtol:
        problems.append(f"step losses differ by up to {worst:.2e} (tolerance {args.rtol:g})")
    ea, eb = _records(stream, "eval"), _records(offline, "eval")
    if ea and eb:
        accs = sorted(k for k in eb[-1] if k.startswith("acc_"))
        diffs = {k: abs(ea[-1][k] - eb[-1][k]) for k in accs}
        print("held-out at the end: " + ", ".join(f"{k} {ea[-1][k]:.4f} vs {eb[-1][k]:.4f}" for k in accs))
        if max(diffs.values(), default=0.0) > args.acc_tol:
            problems.append(f"held-out accuracy differs by up to {max(diffs.values()):.4f} (tolerance {args.acc_tol})")
    summary = json.loads((stream / "train_summary.json").read_text())
    report = summary.get("stream") or {}
    print(
        f"stream: served {report.get('served')}, asked again elsewhere {report.get('requeued')}, dropped "
        f"{list(report.get('dropped_servers') or {})}, unservable {len(report.get('unservable') or {})}"
    )
    if args.killed and args.killed not in (report.get("dropped_servers") or {}):
        problems.append(f"the killed server {args.killed} is not reported as dropped")
    if report.get("unservable"):
        problems.append(f"unservable samples: {report['unservable']}")
    left = sorted(Path(args.states).glob("**/*.safetensors")) if args.states else []
    if left:
        problems.append(f"{len(left)} states files left in {args.states}")
    tokens = trained_tokens(Path(args.capture), args.steps, args.batch_size, args.max_length, args.seed)
    t = json.loads(args.times)
    stream_tps = tokens / t["stream"]
    offline_s = t["capture"] + t["offline"]
    print(
        f"throughput: {tokens} trained tokens in {args.steps} steps; stream (2 servers, one killed at step "
        f"{args.kill_step}) {t['stream']:.1f} s = {stream_tps:.1f} tok/s; capture.backend=vllm {t['capture']:.1f} s "
        f"(engine start included) + offline training {t['offline']:.1f} s = {tokens / offline_s:.1f} tok/s; "
        + (
            f"stream from 1 server {t['stream1']:.1f} s = {tokens / t['stream1']:.1f} tok/s; "
            if t.get("stream1")
            else ""
        )
        + f"disk: stream {args.stream_disk} (peak states files {args.peak_files}), capture {args.capture_disk}"
    )
    if problems:
        print("FAIL: " + "; ".join(problems))
        return 1
    print(
        f"PASS: stream == offline step by step (worst relative loss difference {worst:.1e}), the killed server's "
        f"samples went to the other ({report.get('requeued')} asked again), no states file left"
    )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait-step")
    w.add_argument("--out", required=True)
    w.add_argument("--step", type=int, required=True)
    w.add_argument("--pid", type=int, default=0)
    w.add_argument("--timeout", type=float, default=1800)
    c = sub.add_parser("compare")
    for name in ("--stream", "--offline", "--capture", "--times"):
        c.add_argument(name, required=True)
    c.add_argument("--states", default="")
    c.add_argument("--killed", default="")
    c.add_argument("--kill-step", type=int, default=0)
    c.add_argument("--steps", type=int, required=True)
    c.add_argument("--batch-size", type=int, required=True)
    c.add_argument("--max-length", type=int, required=True)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--rtol", type=float, default=2e-3)
    c.add_argument("--acc-tol", type=float, default=0.01)
    c.add_argument("--stream-disk", default="?")
    c.add_argument("--capture-disk", default="?")
    c.add_argument("--peak-files", default="?")
    args = p.parse_args()
    return wait_step(args) if args.cmd == "wait-step" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
