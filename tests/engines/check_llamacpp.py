"""The python half of tests/engines/check_llamacpp.sh (opt-in: llama.cpp is built outside .venv), run by .venv.

    prepare  the target's GGUF (llama-server's -m) and HF folder (the converter's --target-model-dir), and
             the held-out prompts (MT-bench first turns, chat template applied) as token ids
    run      llama-server per draft length n (0 = no head, then each n, then 0 again: the two runs without
             the head bracket the others, so their spread shows how steady the machine was): greedy
             decoding of every prompt through the native /completion endpoint, one slot; output token ids,
             llama.cpp's own generation timings, and its speculative counters from /metrics
    verify   llama-bench: the cost of a target pass over n = 1, 2, 4, 8 tokens at context depth D, against
             one token, per thread count: what a verify pass of n drafted tokens costs in one-token steps
    report   per n: acceptance per position (llama.cpp's counters) next to our decoder's prediction on the
             same prompts (eagle-eval, a chain of the same head), mean accepted length, tokens/s with and
             without the head, identical outputs; the verify-cost table; one PASS/FAIL line

PASS = llama-server loads the head, every n's greedy output equals the output without the head, and each
position's acceptance is within noise of our prediction: |llama.cpp - ours| <= 3 standard errors of the two
proportions + ACCEPT_MARGIN (0.05: llama.cpp runs the 4-bit GGUF with 8-bit activations and an f16 head,
we run the same weights dequantised, in float32). Speed is reported, never a PASS condition.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from engine_checks import first_difference
from server_process import Server, free_port

from eagle.config import TargetConfig
from eagle.data.eval_prompts import load_eval_prompts
from eagle.evaluate.baselines import encode_chat
from eagle.export import check_folder
from eagle.export.formats import algorithm_of
from eagle.export.llamacpp import local_target
from eagle.target.loading import load_tokenizer
from eagle.target.resolve import resolve_target_path

ACCEPT_MARGIN = 0.05


# --- prepare ----------------------------------------------------------------------------
def prepare(args: argparse.Namespace) -> int:
    where = local_target(args.target)
    if where.gguf is None or where.hf_dir is None:
        print(
            f"FAIL: llama.cpp check: target.path={args.target} needs a local GGUF file (llama-server's -m) and "
            f"a local HF folder (the converter's --target-model-dir); found gguf={where.gguf}, folder={where.hf_dir}"
            ". Give TARGET=path/to/model.gguf, or convert the HF folder with llama.cpp's convert_hf_to_gguf.py"
        )
        return 1
    cfg = TargetConfig(path=args.target)
    folder, _ = resolve_target_path(cfg)
    tok = load_tokenizer(cfg, folder)
    prompts = [
        {"id": p.id, "prompt_token_ids": encode_chat(tok, [{"role": "user", "content": p.turns[0]}])[0].tolist()}
        for p in load_eval_prompts("mt_bench")[: args.prompts]
    ]
    head = check_folder(args.head)
    algo = algorithm_of(head.config)
    # A block drafter drafts its whole block each pass: that is the one draft length to serve and predict.
    out = {
        "target": args.target,
        "gguf": where.gguf,
        "hf_dir": where.hf_dir,
        "prompts": prompts,
        "algorithm": head.config.algorithm,
        "spec_type": algo.llamacpp_spec_type,
        "block_drafts": algo.block_drafts(head.config),
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    lengths = [len(p["prompt_token_ids"]) for p in prompts]
    print(
        f"prepare: target GGUF {where.gguf}\n  HF folder {where.hf_dir}\n  {len(prompts)} MT-bench first turns, "
        f"{min(lengths)}-{max(lengths)} prompt tokens"
    )
    return 0


# --- run -------------------------------------------------------------------------------
LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the servers are local: never a proxy


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with LOOPBACK.open(req, timeout=timeout) as r:
        return json.loads(r.read())


def _metrics(url: str) -> dict[str, float]:
    """llama-server's Prometheus counters: name (with labels) -> value."""
    with LOOPBACK.open(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.removeprefix("llamacpp:")] = float(value)
    return out


def run_one(args: argparse.Namespace, prep: dict, n: int, label: str) -> dict:
    """One llama-server (with the head drafting n tokens a step, or without it for n = 0) over every prompt."""
    port = free_port()
    cmd = [
        args.server,
        "-m",
        prep["gguf"],
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(args.threads),
        "-tb",
        str(args.threads),
        "--parallel",
        "1",
        "-c",
        str(args.ctx),
        "--metrics",
        "--no-webui",
    ]
    if n:
        # --spec-draft-p-min 0 (b11434's default, spelt out): draft all n tokens every step, as vLLM's k does.
        cmd += [
            "--spec-draft-model",
            args.head_gguf,
            "--spec-type",
            prep["spec_type"],
            "--spec-draft-n-max",
            str(n),
            "--spec-draft-n-min",
            "0",
            "--spec-draft-p-min",
            "0",
        ]
    server = Server(
        f"llama-server ({label})",
        cmd,
        dict(os.environ, OMP_NUM_THREADS=str(args.threads)),
        Path(args.work) / f"{label}.log",
        port,
    )
    server.log.unlink(missing_ok=True)
    try:
        startup = server.start(args.startup_timeout)
        outputs, predicted_n, predicted_ms = {}, 0, 0.0
        for p in prep["prompts"]:
            r = _post(
                f"{server.url}/completion",
                {
                    "prompt": p["prompt_token_ids"],
                    "n_predict": args.max_new_tokens,
                    "temperature": 0.0,
                    "cache_prompt": False,
                    "return_tokens": True,
                    "stream": False,
                },
                timeout=args.request_timeout,
            )
            outputs[p["id"]] = [int(t) for t in r["tokens"]]
            predicted_n += r["timings"]["predicted_n"]
            predicted_ms += r["timings"]["predicted_ms"]
        m = _metrics(server.url)
    finally:
        server.stop()
    steps = m.get("spec_decode_num_drafts_total", 0.0)
    per_pos = [
        m[f'spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}']
        for i in range(n)
        if f'spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}' in m
    ]
    out = {
        "label": label,
        "n": n,
        "threads": args.threads,
        "startup_s": startup,
        "outputs": outputs,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "tokens_per_s": 1000.0 * predicted_n / predicted_ms if predicted_ms else float("nan"),
        "verify_steps": steps,
        "drafted": m.get("spec_decode_num_draft_tokens_total", 0.0),
        "accepted": m.get("spec_decode_num_accepted_tokens_total", 0.0),
        "accepted_per_pos": per_pos,
    }
    print(
        f"run[{label}]: {predicted_n} tokens, {out['tokens_per_s']:.1f} tok/s"
        + (f", {steps:.0f} verify steps, {out['accepted']:.0f}/{out['drafted']:.0f} drafts accepted" if n else ""),
        flush=True,
    )
    return out


def run(args: argparse.Namespace) -> int:
    prep = json.loads(Path(args.prepared).read_text())
    ns = [int(x) for x in args.ns.split()]
    # 0 first and last: two runs without the head bracket the ones with it.
    plan = [(0, "n0-before")] + [(n, f"n{n}") for n in ns] + [(0, "n0-after")]
    runs = []
    for n, label in plan:
        try:
            runs.append(run_one(args, prep, n, label))
        except (RuntimeError, OSError, KeyError) as e:
            print(f"FAIL: llama.cpp check: llama-server ({label}) failed: {e}\n  (log: {Path(args.work) / label}.log)")
            return 1
    Path(args.out).write_text(
        json.dumps({"threads": args.threads, "max_new_tokens": args.max_new_tokens, "runs": runs}, indent=1)
    )
    return 0


# --- verify ----------------------------------------------------------------------------
def verify(args: argparse.Namespace) -> int:
    """llama-bench: tokens/s of an n-token pass at context depth D (pp n) per thread count, n = 1 included."""
    ns = ",".join(args.tokens.split())
    cmd = [
        args.bench,
        "-m",
        args.gguf,
        "-p",
        ns,
        "-n",
        "0",
        "-d",
        str(args.depth),
        "-t",
        ",".join(args.threads.split()),
        "-r",
        str(args.repetitions),
        "-o",
        "json",
    ]
    print("verify: " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=args.timeout)
    if done.returncode != 0:
        print(f"FAIL: llama.cpp check: llama-bench exited {done.returncode}:\n{done.stderr[-2000:]}")
        return 1
    rows = [
        {
            "tokens": r["n_prompt"],
            "threads": r["n_threads"],
            "depth": r.get("n_depth", args.depth),
            "tokens_per_s": r["avg_ts"],
            "stddev_ts": r.get("stddev_ts"),
        }
        for r in json.loads(done.stdout)
    ]
    Path(args.out).write_text(json.dumps({"depth": args.depth, "command": cmd, "rows": rows}, indent=1))
    return 0


# --- report ----------------------------------------------------------------------------
def _within_noise(a: float, n_a: float, b: float, n_b: float) -> tuple[bool, float]:
    """(|a - b| <= 3 standard errors + ACCEPT_MARGIN, that bound) for two proportions over n_a, n_b trials."""
    p = (a * n_a + b * n_b) / max(n_a + n_b, 1)
    se = math.sqrt(max(p * (1 - p), 1e-12) * (1 / max(n_a, 1) + 1 / max(n_b, 1)))
    bound = 3 * se + ACCEPT_MARGIN
    return abs(a - b) <= bound, bound


def report(args: argparse.Namespace) -> int:
    prep = json.loads(Path(args.prepared).read_text())
    res = json.loads(Path(args.runs).read_text())
    ours = json.loads(Path(args.ours).read_text())
    max_n = max(r["n"] for r in res["runs"])
    ours_pos = ours["accept_fraction_by_depth"][:max_n]  # eagle-eval pads the list to its tree_depth
    ours_steps = sum(ours["accept_length_histogram"].values())  # one accept length per verify pass
    runs = {r["label"]: r for r in res["runs"]}
    before, after = runs["n0-before"], runs["n0-after"]
    base_tps = (before["tokens_per_s"] + after["tokens_per_s"]) / 2
    problems = []
    print(
        f"llama.cpp ({args.version}) llama-server, {res['threads']} thread(s): target {prep['gguf']}\n  head "
        f"{args.head_gguf}\n  {len(prep['prompts'])} MT-bench first turns x up to {res['max_new_tokens']} new tokens, "
        f"greedy; without the head {before['tokens_per_s']:.1f} tok/s before, {after['tokens_per_s']:.1f} after"
    )
    print(
        f"  our prediction: eagle-eval, a chain of {len(ours_pos)} drafts of the same head on the same prompts "
        f"({ours_steps} verify steps): acceptance per position {' / '.join(f'{x:.2f}' for x in ours_pos)}"
    )
    print(
        "| draft n | tok/s | vs no head | acceptance per position (llama.cpp) | ours | mean accepted length | "
        "greedy outputs identical |"
    )
    print("|---:|---:|---:|---|---|---:|---|")
    print(f"| 0 | {base_tps:.1f} | 1.00 | - | - | 1.00 | - |")
    for r in runs.values():
        n = r["n"]
        if not n:
            continue
        steps = r["verify_steps"]
        per_pos = [a / steps for a in r["accepted_per_pos"]] if steps else []
        mal = 1 + r["accepted"] / steps if steps else float("nan")
        same = sum(before["outputs"][pid] == r["outputs"][pid] for pid in before["outputs"])
        total = len(before["outputs"])
        print(
            f"| {n} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base_tps:.2f} | "
            f"{' / '.join(f'{x:.2f}' for x in per_pos) or 'n/a'} | {' / '.join(f'{x:.2f}' for x in ours_pos[:n])} | "
            f"{mal:.2f} | {same}/{total} |"
        )
        if not steps:
            problems.append(f"n={n}: llama-server made no verify steps (the head is not drafting)")
        if same != total:
            pid, at = first_difference(before["outputs"], r["outputs"])
            problems.append(
                f"n={n}: greedy output differs from no head on {total - same}/{total} prompts (first: "
                f"prompt {pid} at new token {at})"
            )
        for i, (a, b) in enumerate(zip(per_pos, ours_pos, strict=False)):
            ok, bound = _within_noise(a, steps, b, ours_steps)
            if not ok:
                problems.append(
                    f"n={n} position {i + 1}: llama.cpp accepts {a:.3f}, our decoder {b:.3f} (more than "
                    f"the noise bound {bound:.3f} apart: is the head converted with the right layers?)"
                )
    if args.verify and Path(args.verify).is_file():
        v = json.loads(Path(args.verify).read_text())
        threads = sorted({r["threads"] for r in v["rows"]})
        print(
            f"\nllama.cpp's verify cost (llama-bench, pass over n tokens at context depth {v['depth']}, as a "
            "multiple of a one-token pass; tok/s in brackets):"
        )
        print("| n tokens | " + " | ".join(f"{t} thread(s)" for t in threads) + " |")
        print("|---:|" + "---:|" * len(threads))
        by = {(r["tokens"], r["threads"]): r["tokens_per_s"] for r in v["rows"]}
        for n in sorted({r["tokens"] for r in v["rows"]}):
            cells = []
            for t in threads:
                one, tps = by.get((1, t)), by.get((n, t))
                cells.append(f"{(n / tps) / (1 / one):.2f} ({tps:.0f})" if one and tps else "n/a")
            print(f"| {n} | " + " | ".join(cells) + " |")
        print(
            "A chain of n drafts pays when its mean accepted length exceeds the cost of an (n+1)-token pass plus "
            "n head steps, in one-token steps."
        )
    if problems:
        print("FAIL: llama.cpp check: " + "; ".join(problems))
        return 1
    print(
        f"PASS: llama.cpp check: llama-server serves the head (--spec-type {prep['spec_type']}), greedy outputs "
        "identical to "
        "no head at every n, acceptance per position within noise of our decoder's"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--head", required=True, help="the format=llamacpp export (its algorithm picks --spec-type)")
    p.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--prepared", required=True)
    r.add_argument("--server", required=True)
    r.add_argument("--head-gguf", required=True)
    r.add_argument("--ns", default="1 2 3 4", help="draft lengths (--spec-draft-n-max), space-separated")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--ctx", type=int, default=2048)
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--startup-timeout", type=float, default=300.0)
    r.add_argument("--request-timeout", type=float, default=600.0)
    r.add_argument("--work", required=True)
    r.add_argument("--out", required=True)
    v = sub.add_parser("verify")
    v.add_argument("--bench", required=True)
    v.add_argument("--gguf", required=True)
    v.add_argument("--tokens", default="1 2 4 8")
    v.add_argument("--threads", default="1 2")
    v.add_argument("--depth", type=int, default=256)
    v.add_argument("--repetitions", type=int, default=10)
    v.add_argument("--timeout", type=float, default=1200.0)
    v.add_argument("--out", required=True)
    q = sub.add_parser("report")
    q.add_argument("--prepared", required=True)
    q.add_argument("--runs", required=True)
    q.add_argument("--ours", required=True, help="eagle-eval's report.json of the same head as a chain")
    q.add_argument("--verify", default=None)
    q.add_argument("--head-gguf", default="")
    q.add_argument("--version", default="b11434")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    rc = {"prepare": prepare, "run": run, "verify": verify, "report": report}[args.cmd](args)
    if args.cmd in ("run", "verify"):
        print(f"{args.cmd}: {time.perf_counter() - started:.0f}s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
