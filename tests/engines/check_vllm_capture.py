"""The python halves of tests/engines/check_vllm_capture.sh (opt-in; vLLM runs in its own venv, started by
eagle-capture itself through capture.backend=vllm). Both run in our .venv:

    prepare   the first N ShareGPT conversations (bundled data set, file order) that eagle's default split
              holds out of training (data.heldout_fraction / data.split_seed defaults) and that eagle's data
              stage keeps at --max-length with the target's chat template (a loss mask left), as a local .jsonl
    compare   two captures of those conversations, capture.backend=hf and =vllm: identical ids, tokens, loss
              masks and manifests up to backend/engine; per feature (each aux layer, final) the largest
              difference against the storage dtype's tolerance; both throughputs from the runs' logs; one
              PASS/FAIL line (exit 1 on FAIL)

Tolerance per element: eps x (|hf value| + rms of that feature over all tokens), eps = the storage dtype's
machine epsilon (float16 9.8e-4, bfloat16 7.8e-3; at least 1e-4 so that float32 storage still allows the two
engines' kernel differences). The first term is one rounding step of the stored value at its magnitude,
the second a floor for values near zero at the feature's own scale.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

from eagle.capture.reader import CaptureDataset
from eagle.capture.store import read_manifest
from eagle.config import DataConfig, TargetConfig
from eagle.data.dataset import is_heldout
from eagle.data.readers import ReadReport, iter_records
from eagle.data.records import SkipRecord, normalise_record
from eagle.data.template import tokenize_with_reason
from eagle.target.loading import load_tokenizer
from eagle.target.precision import DTYPES


def prepare(args: argparse.Namespace) -> int:
    # The default held-out split: what a default eagle-capture / eagle-train never trains on.
    split = DataConfig(max_length=args.max_length)
    tokenizer = load_tokenizer(TargetConfig(path=args.target))
    report, picked = ReadReport(), []
    for i, record in iter_records(split, report):  # streamed: the bundled file is large
        try:
            conv = normalise_record(record, index=i, source=report.source, fmt=split.format)
        except SkipRecord:
            continue
        if is_heldout(split, conv.id) and tokenize_with_reason(conv, tokenizer, split.max_length, split.overflow)[0]:
            picked.append({"id": conv.id, "conversations": record["conversations"]})
            if len(picked) == args.n:
                break
    with open(args.out, "w") as f:
        for r in picked:
            f.write(json.dumps(r) + "\n")
    print(
        f"prepare: {len(picked)} held-out ShareGPT conversations (data.heldout_fraction={split.heldout_fraction}, "
        f"data.split_seed={split.split_seed}) -> {args.out}"
    )
    return 0 if len(picked) == args.n else 1


def _throughput(log: str) -> tuple[int, float] | None:
    m = re.search(r"this process captured (\d+) tokens in ([\d.]+) s", log)
    return (int(m.group(1)), float(m.group(2))) if m else None


def compare(args: argparse.Namespace) -> int:
    hf_dir, vllm_dir = Path(args.hf), Path(args.vllm)
    mh, mv = read_manifest(hf_dir), read_manifest(vllm_dir)
    problems = []
    for key in (
        "target",
        "data",
        "algorithm",
        "aux_layer_ids",
        "features",
        "dtype",
        "shard_size",
        "splits",
        "complete",
    ):
        if mh.get(key) != mv.get(key):
            problems.append(f"manifest {key} differs: hf {mh.get(key)!r} vs vllm {mv.get(key)!r}")
    if (mh.get("backend"), mv.get("backend")) != ("hf", "vllm"):
        problems.append(f"backends recorded as {mh.get('backend')!r} / {mv.get('backend')!r}")
    storage = DTYPES[mh["dtype"]]
    eps = max(torch.finfo(storage).eps, 1e-4)
    aux_ids = mh.get("aux_layer_ids") or []
    names = [f"aux layer {i}" for i in aux_ids] + ["final (post-norm)"]
    diffs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    refs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    tokens = 0
    for split in ("train", "heldout"):
        if not mh["splits"][split]["conversations"]:
            continue
        a, b = CaptureDataset(hf_dir, split), CaptureDataset(vllm_dir, split)
        if a.ids() != b.ids():
            problems.append(f"{split}: conversation ids differ")
            continue
        for i in range(len(a)):
            x, y = a[i], b[i]
            if x["input_ids"].tolist() != y["input_ids"].tolist() or x["loss_mask"].tolist() != y["loss_mask"].tolist():
                problems.append(f"{split} {x['id']}: tokens or loss mask differ")
                continue
            tokens += len(x["input_ids"])
            pairs = [(x["aux_hidden"][:, j], y["aux_hidden"][:, j]) for j in range(len(aux_ids))]
            pairs.append((x["final_hidden"], y["final_hidden"]))
            for name, (u, v) in zip(names, pairs, strict=True):
                refs[name].append(u.float())
                diffs[name].append((u.float() - v.float()).abs())
    print(
        f"{tokens} tokens compared; storage capture.dtype={mh['dtype']}, tolerance per element "
        f"{eps:.2e} x (|hf| + rms of the feature)"
    )
    print("| feature | max abs diff | max abs hf value | rms | worst diff / tolerance |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        if not refs[name]:
            continue
        ref, diff = torch.cat(refs[name]), torch.cat(diffs[name])
        rms = float(ref.pow(2).mean().sqrt())
        ratio = float((diff / (eps * (ref.abs() + rms))).max())
        print(f"| {name} | {float(diff.max()):.4g} | {float(ref.abs().max()):.4g} | {rms:.4g} | {ratio:.3f} |")
        if not ratio <= 1.0:
            problems.append(f"{name}: a difference of {ratio:.2f}x the tolerance")
    hf_log, vllm_log = Path(args.hf_log).read_text(), Path(args.vllm_log).read_text()
    th, tv = _throughput(hf_log), _throughput(vllm_log)
    start = re.search(r"vLLM (\S+) ready in ([\d.]+) s \(platform (\S+), (\S+),", vllm_log)
    if th:
        print(f"throughput hf (our .venv, transformers): {th[0]} tokens in {th[1]:.1f} s = {th[0] / th[1]:.1f} tok/s")
    if tv and start:
        up = float(start.group(2))
        print(
            f"throughput vllm {start.group(1)} ({start.group(3)}, {start.group(4)}): {tv[0]} tokens in "
            f"{tv[1] - up:.1f} s = {tv[0] / max(1e-9, tv[1] - up):.1f} tok/s after an engine start-up of {up:.1f} s "
            f"({tv[0] / tv[1]:.1f} tok/s with it)"
        )
    if not th or not tv or not start:
        problems.append("could not read both throughputs from the capture logs")
    if problems:
        print("FAIL: vLLM capture check: " + "; ".join(problems))
        return 1
    print(
        f"PASS: vLLM capture check: capture.backend=vllm wrote the hf backend's capture ({tokens} tokens, same ids, "
        f"tokens, loss masks and manifest) with every feature within the {mh['dtype']} tolerance"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("--hf", required=True)
    c.add_argument("--vllm", required=True)
    c.add_argument("--hf-log", required=True)
    c.add_argument("--vllm-log", required=True)
    args = ap.parse_args(argv)
    return {"prepare": prepare, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
