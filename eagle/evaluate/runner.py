"""`evaluate(cfg)`: speculative decoding vs plain decoding baselines on one prompt set, in one run.

For every prompt turn, on identical input ids and with the same torch thread count, it times
  * `speculative`   - the EAGLE tree decoder (`eagle.decode.generator.SpeculativeGenerator`);
  * `autoregressive` - the target alone, one token per forward, with the same KV-cache code;
  * `hf_generate`   - Hugging Face `generate` (the reference a user would otherwise run);
  * `prompt_lookup` - HF prompt-lookup decoding (n-gram drafts from the prompt, no head).
With `eval.turns=all` the next user turn follows the speculative decoder's own previous answer, so
every method sees the same conversation. At temperature 0 the speculative tokens are compared with
HF generate's, which must be identical under `decode.acceptance=exact`; under an approximate rule the
match fraction is reported, not checked, and the report is labelled as not lossless throughout
(`acceptance`, `lossless`, `distribution_shift`). Measurements are appended per prompt to
`eval_progress.jsonl`, so an interrupted run resumes where it stopped (same settings only).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from tqdm.auto import tqdm

from eagle import spec_metrics as metrics
from eagle.algorithms import get_algorithm
from eagle.artifacts import ResolvedDraft, resolve_draft
from eagle.config import ConfigError, DecodeConfig, RootConfig
from eagle.data.eval_prompts import EvalPrompt, load_eval_prompts
from eagle.data.images import attach_record_images
from eagle.data.template import encode_image_prompt
from eagle.decode.approximate import AcceptanceRule, acceptance_label
from eagle.decode.draft import uses_sampled_drafts
from eagle.decode.generator import SpeculativeGenerator, autoregressive_generate
from eagle.evaluate import plots
from eagle.evaluate.assisted import assisted_runner
from eagle.evaluate.baselines import encode_chat, hf_generate, stop_token_ids, timed
from eagle.evaluate.divergence import divergence_at
from eagle.evaluate.divergence import summarize as summarize_divergence
from eagle.evaluate.report import SPEC, aggregate, hardware_info, prompt_record, write_report
from eagle.export.loader import load_draft
from eagle.heads.base import DraftHead
from eagle.target.loading import TargetInfo, load_target
from eagle.target.multimodal import VisionInputs

log = logging.getLogger(__name__)
PROGRESS = "eval_progress.jsonl"

# input_ids [1, T] (and the prompt's images, for a vision-language target) -> the method's record.
TurnRunner = Callable[[torch.Tensor, "VisionInputs | None"], dict[str, Any]]


def resolve_device(cfg: RootConfig) -> torch.device:
    """`cfg.device` if given, else accelerate's choice for this process."""
    if cfg.device:
        return torch.device(cfg.device)
    return PartialState().device


def select_prompts(cfg: RootConfig) -> list[EvalPrompt]:
    """The prompt set, cut to `eval.max_prompts` and to the first turn unless `eval.turns=all`."""
    prompts = load_eval_prompts(cfg.eval.prompts)
    if cfg.eval.max_prompts is not None:
        prompts = prompts[: cfg.eval.max_prompts]
    if cfg.eval.turns == "first":
        prompts = [replace(p, turns=p.turns[:1]) for p in prompts]
    return prompts


def answer_text(tokenizer: Any, tokens: list[int], stop_ids: list[int]) -> str:
    """An assistant answer as text for the next turn's history (stop token and specials dropped)."""
    while tokens and tokens[-1] in stop_ids:
        tokens = tokens[:-1]
    return tokenizer.decode(tokens, skip_special_tokens=True).strip()


def user_message(prompt: EvalPrompt, turn: int) -> dict[str, Any]:
    """User turn `turn` of `prompt` as a message; the first carries the prompt's images (`eagle.data.images`)."""
    message: dict[str, Any] = {"role": "user", "content": prompt.turns[turn]}
    if turn == 0 and prompt.images:
        attach_record_images(prompt.images, [message], f"prompt {prompt.id!r}", None)
    return message


def prompt_vision(tokenizer: Any, prompt: EvalPrompt) -> VisionInputs | None:
    """The pixel inputs of a prompt's images (None for a text prompt): the same for every turn."""
    if not prompt.images:
        return None
    return encode_image_prompt(tokenizer, [user_message(prompt, 0)], f"prompt {prompt.id!r}")[1]


def turn_inputs(tokenizer: Any, prompt: EvalPrompt, answers: list[str]) -> list[torch.Tensor]:
    """Input ids of each turn: earlier turns carry the given assistant answers ([1, T] each); a prompt's images
    are in its first turn, each as its image tokens."""
    messages: list[dict[str, Any]] = []
    inputs = []
    for i in range(len(prompt.turns)):
        messages.append(user_message(prompt, i))
        if prompt.images:
            ids = encode_image_prompt(tokenizer, messages, f"prompt {prompt.id!r}")[0]
            inputs.append(torch.tensor([ids], dtype=torch.long))  # [1, T]
        else:
            inputs.append(encode_chat(tokenizer, messages))
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return inputs


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def speculative_runner(generator: Any, decode: DecodeConfig) -> TurnRunner:
    def run(input_ids: torch.Tensor, vision: VisionInputs | None = None) -> dict[str, Any]:
        res, seconds = timed(lambda: generator.generate(input_ids, vision))
        timings = {k: float(v) for k, v in asdict(res.timings).items()}
        timings["overhead_s"] = float(res.timings.overhead_s)
        return {
            "tokens": [int(t) for t in res.tokens],
            "seconds": seconds,
            "target_forwards": int(res.target_forwards),
            "accept_lengths": [int(n) for n in res.accept_lengths],
            "context_lengths": [int(n) for n in res.context_lengths],
            "tree_sizes": [int(n) for n in res.tree_sizes],
            "lookup_nodes": [int(n) for n in res.lookup_nodes],
            "lookup_accepted": [int(n) for n in res.lookup_accepted],
            "timings": timings,
            "stop_reason": res.stop_reason,
            "shift": asdict(res.shift),  # distance of the emitted law from the target's (0 under exact)
        }

    return run


def baseline_runners(cfg: RootConfig, target: Any, tokenizer: Any, decode: DecodeConfig) -> dict[str, TurnRunner]:
    """The baselines named in `eval.baselines`, each as input_ids -> {tokens, seconds}."""

    def autoregressive(input_ids: torch.Tensor, vision: VisionInputs | None = None) -> dict[str, Any]:
        res, seconds = timed(lambda: autoregressive_generate(target, tokenizer, input_ids, decode, vision=vision))
        return {"tokens": [int(t) for t in res.tokens], "seconds": seconds}

    def hf(input_ids: torch.Tensor, vision: VisionInputs | None = None) -> dict[str, Any]:
        return asdict(hf_generate(target, tokenizer, input_ids, decode, vision=vision))

    def lookup(input_ids: torch.Tensor, vision: VisionInputs | None = None) -> dict[str, Any]:
        return asdict(
            hf_generate(target, tokenizer, input_ids, decode, cfg.eval.prompt_lookup_num_tokens, vision=vision)
        )

    known = {"autoregressive": autoregressive, "hf_generate": hf, "prompt_lookup": lookup}
    return {name: known[name] for name in cfg.eval.baselines if name in known}  # hf_assisted needs the head: _start


DivergenceFn = Callable[[torch.Tensor, list[int], list[int], int], dict[str, Any]]


def run_prompt(
    prompt: EvalPrompt,
    tokenizer: Any,
    runners: dict[str, TurnRunner],
    temperature: float,
    stop_ids: list[int],
    divergence: DivergenceFn | None = None,
) -> dict[str, Any]:
    """All methods on every turn of one prompt; the history follows the speculative answers."""
    turns: list[dict[str, Any]] = []
    answers: list[str] = []
    vision = prompt_vision(tokenizer, prompt)  # a vision-language target's prompt images, every turn
    for i in range(len(prompt.turns)):
        input_ids = turn_inputs(tokenizer, replace(prompt, turns=prompt.turns[: i + 1]), answers)[i]  # [1, T]
        methods = {name: fn(input_ids, vision) for name, fn in runners.items()}
        spec = methods[SPEC]["tokens"]
        record: dict[str, Any] = {
            "turn": i,
            "prompt_tokens": int(input_ids.shape[1]),
            "methods": methods,
            "greedy_match": None,
            "first_mismatch": None,
        }
        if temperature == 0 and "hf_generate" in methods:
            record["first_mismatch"] = first_mismatch(spec, methods["hf_generate"]["tokens"])
            record["greedy_match"] = record["first_mismatch"] is None
            # The float32 recheck runs the target on ids alone: not for a prompt with images.
            if record["first_mismatch"] is not None and divergence is not None and vision is None:
                record["divergence"] = divergence(
                    input_ids, spec, methods["hf_generate"]["tokens"], record["first_mismatch"]
                )
        answers.append(answer_text(tokenizer, spec, stop_ids))
        record["answer"] = answers[-1]
        if "hf_generate" in methods:  # the target alone on the same input (HumanEval scores both)
            record["hf_generate_answer"] = answer_text(tokenizer, methods["hf_generate"]["tokens"], stop_ids)
        turns.append(record)
    return prompt_record(prompt.id, prompt.category, turns)


def _divergence_fn(cfg: RootConfig, target: Any, device: torch.device, dtype: str) -> DivergenceFn:
    """Float32 logits at a greedy divergence; a float32 copy of the target is loaded on first need."""
    holder: dict[str, Any] = {"model": target if dtype == "float32" else None}

    def fn(input_ids: torch.Tensor, ours: list[int], theirs: list[int], position: int) -> dict[str, Any]:
        if holder["model"] is None:
            log.info(
                "greedy output left HF generate's in %s: loading a float32 copy of the target to check the divergence",
                dtype,
            )
            holder["model"] = load_target(replace(cfg.target, dtype="float32"), device=device)[0]
        return divergence_at(holder["model"], input_ids, ours, theirs, position)

    return fn


def _fingerprint(cfg: RootConfig, decode: DecodeConfig, draft_folder: Path, target_fingerprint: str) -> str:
    """Identity of everything a stored measurement depends on (a retrained head changes it)."""
    weights = sorted(
        (f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in Path(draft_folder).iterdir() if f.is_file()
    )
    keys = {
        "target": asdict(cfg.target),
        "target_fingerprint": target_fingerprint,
        "draft": str(draft_folder),
        "draft_files": weights,
        "decode": asdict(decode),
        "eval": {k: v for k, v in asdict(cfg.eval).items() if k not in ("tree_sweep", "warmup_prompts")},
    }
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _load_progress(path: Path, fingerprint: str) -> dict[str, dict[str, Any]]:
    """Finished prompt records of an earlier run with identical settings ({} otherwise)."""
    if not path.is_file():
        return {}
    done: dict[str, dict[str, Any]] = {}
    with open(path) as f:
        lines = f.read().splitlines()
    if not lines or json.loads(lines[0]).get("fingerprint") != fingerprint:
        log.warning("%s is from a run with other settings; starting over", path)
        return {}
    for line in lines[1:]:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash: that prompt runs again
            continue
        done[rec["id"]] = rec
    return done


def _append_progress(path: Path, fingerprint: str, record: dict[str, Any]) -> None:
    new = not path.is_file() or path.stat().st_size == 0
    with open(path, "a") as f:
        if new:
            f.write(json.dumps({"fingerprint": fingerprint}) + "\n")
        f.write(json.dumps(record) + "\n")
        f.flush()


def tree_settings(decode: DecodeConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"tree": decode.tree}
    if decode.tree == "static":
        out["static_paths"] = decode.static_paths
    else:
        # tree=auto: tree_total_tokens is the fallback; each step picks from auto_candidates.
        out.update(
            tree_top_k=decode.tree_top_k, tree_depth=decode.tree_depth, tree_total_tokens=decode.tree_total_tokens
        )
    if decode.tree == "auto":
        out["auto_candidates"] = list(decode.auto_candidates)
    if decode.lookup_tokens:
        out.update(lookup_tokens=decode.lookup_tokens, lookup_ngram=[decode.lookup_min_ngram, decode.lookup_max_ngram])
    if decode.temperature > 0:  # what the head's drafts are (at T=0 always its top-k)
        out["draft_choice"] = "sample (chain)" if uses_sampled_drafts(decode) else "topk"
    return out


def _max_depth(decode: DecodeConfig, block_drafts: int | None = None) -> int | None:
    depth: int | None
    if block_drafts is not None:  # a block drafter drafts every block position, whatever decode.tree_depth says
        depth = block_drafts
    elif decode.tree == "static" and decode.static_paths:
        depth = max(len(p) for p in decode.static_paths)
    else:
        depth = decode.tree_depth if decode.tree != "static" else None
    if depth is not None and decode.lookup_tokens:  # grafted lookup chains reach deeper than the head drafts
        depth = max(depth, decode.lookup_tokens)
    return depth


def run_tree_sweep(
    cfg: RootConfig,
    target: Any,
    head: Any,
    tokenizer: Any,
    device: torch.device,
    decode: DecodeConfig,
    prompts: list[EvalPrompt],
    per_prompt: list[dict[str, Any]],
) -> list[dict]:
    """Speculative decoding at each `eval.tree_sweep` size on the main run's exact turn inputs."""
    by_id = {p.id: p for p in prompts}
    hf_tokens = sum(p["tokens_by_method"].get("hf_generate", 0) for p in per_prompt)
    hf_seconds = sum(p["seconds"].get("hf_generate", 0.0) for p in per_prompt)
    hf_tps = metrics.throughput(hf_tokens, hf_seconds)
    rows = []
    for size in tqdm(cfg.eval.tree_sweep, desc="tree sweep", unit="size"):
        sweep_decode = replace(decode, tree="dynamic", tree_total_tokens=int(size))
        run = speculative_runner(
            SpeculativeGenerator(target, head, tokenizer, sweep_decode, device=device), sweep_decode
        )
        tokens = forwards = 0
        seconds = 0.0
        lengths: list[int] = []
        for rec in per_prompt:
            answers = [t["answer"] for t in rec["turns"]]
            vision = prompt_vision(tokenizer, by_id[rec["id"]])
            for input_ids in turn_inputs(tokenizer, by_id[rec["id"]], answers):
                out = run(input_ids, vision)
                tokens += len(out["tokens"])
                seconds += out["seconds"]
                forwards += out["target_forwards"]
                lengths += out["accept_lengths"]
        tps = metrics.throughput(tokens, seconds)
        rows.append(
            {
                "tree_total_tokens": int(size),
                "tau": metrics.tau(lengths, forwards),
                "tokens_per_s": tps,
                "speedup": tps / hf_tps if hf_tps > 0 and tps > 0 else None,
            }
        )
    return rows


def _plots(report: dict[str, Any], out: Path) -> dict[str, str]:
    files = {}
    label = acceptance_label(report.get("acceptance_settings"))

    def title(default: str) -> str:  # '' keeps the plot's own title; an approximate rule is named on every plot
        return f"{default}\n{label}" if label else ""

    hist = {int(k): v for k, v in report["accept_length_histogram"].items()}
    if hist:
        files["accept_length_histogram"] = plots.plot_accept_length_histogram(
            hist, out / "accept_length_hist.png", title("Acceptance length distribution")
        )
    if report["accept_rate_by_depth"]:
        files["accept_by_depth"] = plots.plot_accept_by_depth(
            report["accept_rate_by_depth"],
            report["accept_fraction_by_depth"],
            out / "accept_by_depth.png",
            title("Acceptance by draft depth"),
        )
    files["throughput"] = plots.plot_throughput(
        {m: v["tokens_per_s"] for m, v in report["methods"].items()},
        out / "throughput.png",
        title("Decoding throughput"),
    )
    sweep = [r for r in report.get("tree_sweep", []) if r["speedup"] is not None]
    if sweep:
        files["speedup_vs_tree"] = plots.plot_speedup_vs_tree(
            [r["tree_total_tokens"] for r in sweep],
            [r["speedup"] for r in sweep],
            [r["tau"] for r in sweep],
            out / "speedup_vs_tree.png",
            title("Speedup vs tree size"),
        )
    return {k: str(v) for k, v in files.items()}


@dataclass
class _Session:
    """What one evaluation runs with: the loaded target and head, the decoder and the methods it times."""

    target: Any
    tokenizer: Any
    info: TargetInfo
    head: DraftHead
    draft: ResolvedDraft
    device: torch.device
    decode: DecodeConfig
    generator: SpeculativeGenerator
    runners: dict[str, TurnRunner]
    stop_ids: list[int]
    rule: AcceptanceRule
    check: bool  # greedy divergences rechecked in float32 (exact rule only)
    divergence: Any


def evaluate(cfg: RootConfig) -> dict[str, Any]:
    """Run the evaluation described by `cfg`; write report.json, report.md and plots to `cfg.output_dir`."""
    if not cfg.draft.path:
        raise ConfigError("eagle-eval needs draft.path=DIR (a training output dir, checkpoint dir or exported head)")
    resolve_draft(cfg.draft.path)  # fail on a wrong draft.path before minutes of model loading
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = select_prompts(cfg)
    previous_threads = torch.get_num_threads()
    if cfg.eval.num_threads:
        torch.set_num_threads(cfg.eval.num_threads)  # one setting for every method, restored on exit
    try:
        session = _start(cfg)
        # Warm-up: first calls pay for allocator growth and kernel selection; not measured.
        for prompt in tqdm(prompts[: cfg.eval.warmup_prompts], desc="warm-up", unit="prompt"):
            run_prompt(
                replace(prompt, turns=prompt.turns[:1]),
                session.tokenizer,
                session.runners,
                session.decode.temperature,
                session.stop_ids,
            )
        per_prompt, reused = _run_prompts(cfg, session, prompts, out)
        report = _report(cfg, session, prompts, per_prompt, reused)
        report["plots"] = _plots(report, out)
        write_report(report, out)
        return report
    finally:
        torch.set_num_threads(previous_threads)


def _start(cfg: RootConfig) -> _Session:
    """Target, head, the speculative decoder (its verify passes timed now, not on the first prompt) and the
    baselines, each as a runner of one turn."""
    device = resolve_device(cfg)
    target, tokenizer, info = load_target(cfg.target, device=device, stage="decode")
    head, draft = load_draft(cfg.draft.path, target, device=device)
    decode = copy.deepcopy(cfg.decode)
    generator = SpeculativeGenerator(target, head, tokenizer, decode, device=device)
    if decode.tree == "auto":
        generator.calibrate()
    runners = {SPEC: speculative_runner(generator, decode), **baseline_runners(cfg, target, tokenizer, decode)}
    if "hf_assisted" in cfg.eval.baselines:  # the same head in transformers' own assisted generation
        runners["hf_assisted"] = assisted_runner(head, target, tokenizer, decode)
    rule = AcceptanceRule.from_config(decode)
    # The float32 recheck of greedy divergences claims losslessness: only for the exact rule (config
    # validation refuses eval.divergence_check=true with an approximate one, which reports the match only).
    check = rule.lossless if cfg.eval.divergence_check is None else cfg.eval.divergence_check
    divergence = _divergence_fn(cfg, target, device, info.dtype) if check else None
    return _Session(
        target,
        tokenizer,
        info,
        head,
        draft,
        device,
        decode,
        generator,
        runners,
        stop_token_ids(target, tokenizer),
        rule,
        check,
        divergence,
    )


def _run_prompts(
    cfg: RootConfig, s: _Session, prompts: list[EvalPrompt], out: Path
) -> tuple[list[dict[str, Any]], list[str]]:
    """Every prompt's record, reusing those a run with the same settings finished (progress file), each new
    one appended as it finishes. Returns (records, ids reused)."""
    progress = out / PROGRESS
    fingerprint = _fingerprint(cfg, s.decode, s.draft.folder, s.info.fingerprint)
    done = _load_progress(progress, fingerprint)
    if not done and progress.exists():
        progress.unlink()
    reused = [p.id for p in prompts if p.id in done]
    if reused:
        log.warning(
            "reusing %d finished prompts from %s (same settings); delete it to measure them again",
            len(reused),
            progress,
        )
    per_prompt = []
    for prompt in tqdm(prompts, desc="eval", unit="prompt"):
        if prompt.id in done:
            per_prompt.append(done[prompt.id])
            continue
        rec = run_prompt(prompt, s.tokenizer, s.runners, s.decode.temperature, s.stop_ids, s.divergence)
        _append_progress(progress, fingerprint, rec)
        per_prompt.append(rec)
    return per_prompt, reused


def _report(
    cfg: RootConfig, s: _Session, prompts: list[EvalPrompt], per_prompt: list[dict[str, Any]], reused: list[str]
) -> dict[str, Any]:
    """The report: aggregates, greedy divergences, the tree sweep, the settings it ran with, the records."""
    decode, head = s.decode, s.head
    drafts = get_algorithm(head.config.algorithm).block_drafts(head.config)
    report = aggregate(per_prompt, decode.temperature, _max_depth(decode, drafts), acceptance=s.rule.settings())
    if decode.temperature == 0 and "hf_generate" in cfg.eval.baselines and s.check:
        turns = [t.get("divergence") for p in per_prompt for t in p["turns"]]
        report["divergence"] = summarize_divergence(turns, cfg.eval.divergence_margin_limit)
        report["divergence"]["dtype"] = s.info.dtype
    if cfg.eval.tree_sweep:
        report["tree_sweep"] = run_tree_sweep(cfg, s.target, head, s.tokenizer, s.device, decode, prompts, per_prompt)
    report["settings"] = _settings(cfg, s, prompts, reused)
    report["per_prompt"] = per_prompt
    return report


def _settings(cfg: RootConfig, s: _Session, prompts: list[EvalPrompt], reused: list[str]) -> dict[str, Any]:
    decode, info, generator = s.decode, s.info, s.generator
    return {
        "target": cfg.target.path,
        "target_fingerprint": info.fingerprint,
        "dtype": info.dtype,  # the target's, every method alike (target.dtype resolved)
        "cpu_gemm": info.gemm,  # the target's kernel for float32 CPU products of 2-32 rows, every method alike
        "draft_dtype": generator.draft_dtype,  # the head's compute dtype (decode.draft_dtype resolved)
        "draft_weights": generator.draft_weights,  # full | int8 | int8_weight_only (resolved)
        "draft_path": cfg.draft.path,
        "draft_folder": str(s.draft.folder),
        "draft_kind": s.draft.via,
        "algorithm": s.head.config.algorithm,
        # tokens a draft pass fills (block drafters; null for EAGLE heads)
        "block_size": s.head.config.block_size if s.head.drafts_block else None,
        "prompts": cfg.eval.prompts,
        "prompt_ids": [p.id for p in prompts],
        "turns": cfg.eval.turns,
        "temperature": decode.temperature,
        "top_p": decode.top_p,
        "top_k": decode.top_k,
        "max_new_tokens": decode.max_new_tokens,
        "seed": decode.seed,
        "tree": tree_settings(decode),
        "auto_verify_seconds": (
            {str(k): v for k, v in generator.verify_times.items()} if generator.verify_times else None
        ),
        "warmup_prompts": cfg.eval.warmup_prompts,
        "resumed_prompt_ids": reused,
        "prompt_lookup_num_tokens": cfg.eval.prompt_lookup_num_tokens,
        "hardware": hardware_info(s.device),
    }
