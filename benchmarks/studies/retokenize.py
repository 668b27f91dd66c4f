"""Do regenerated answers reach training as the ids the target generated?

Training reads a regenerated conversation through the chat template. If only an answer's text were
kept, its tokens would be the re-tokenisation of that text, which can differ from the generated ids:
the record's content is stripped (a newline at the token limit goes), BPE merges the decoded text
canonically (`B|rend|on` where the target sampled `Bre|ndon`), a token that ends inside a UTF-8
character decodes to U+FFFD. Records therefore keep the ids (`"token_ids"` on assistant messages) and
tokenisation splices them in (eagle/data/template.py). This prints both:
  * text only: answers whose re-tokenised ids differ from the generated ones (what training would read
    without the ids), their share and a few examples;
  * after the splice: answers whose masked tokens, in the conversation as `data=local` tokenises it,
    are not the generated ids with the template's own tokens around them (should be 0), and among
    them the turns whose ids were refused and their text tokenised instead (should be 0 too).

    OMP_NUM_THREADS=1 python -m benchmarks retokenize --conversations 200 regenerate.max_new_tokens=256 \\
        [regenerate.max_turns=1] [target.path=...] [data=...] [--output ids.jsonl]
        regenerates the first N conversations of `data` first, as eagle-regenerate does (the local
        continuous engine unless overridden; greedy unless regenerate.temperature is set), into a
        temporary file or --output (an existing --output is resumed), then checks it.
        OMP_NUM_THREADS=1 is recommended on a shared CPU machine: torch otherwise starts a spinning
        thread per core for every process.
    python -m benchmarks retokenize --input regenerated.jsonl [target.path=...]
        checks a file written by eagle-regenerate: the local engine, or a server engine that returns
        token ids (vLLM, SGLang, llama.cpp).

Eagle overrides (target.path=..., data=..., regenerate.*=...) work as for eagle-regenerate; target.path
must name the model that generated the file (its tokenizer and chat template).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from eagle.cli.app import compose
from eagle.cli.regenerate import regenerate_stage
from eagle.config import DataConfig
from eagle.data.dataset import load_conversations
from eagle.data.records import Conversation
from eagle.data.template import render, tokenize_with_reason
from eagle.target.loading import load_tokenizer

NO_LIMIT = 10**9  # max_length: nothing is cut


def retokenized(tokenizer: Any, messages: list[dict[str, Any]], k: int) -> list[int] | None:
    """The ids training would read for assistant message `k` if only its text were kept: the tokens of
    the rendered conversation that start inside the answer's text (template glue and end-of-turn tokens
    left out); None when the template does not render the answer where its prompt ends."""
    full = render(tokenizer, messages, add_generation_prompt=False)
    prompt = render(tokenizer, messages[:k], add_generation_prompt=True)
    upto = render(tokenizer, messages[: k + 1], add_generation_prompt=False)
    content = messages[k]["content"].strip()
    start = upto.find(content, len(prompt)) if upto.startswith(prompt) and full.startswith(upto) else -1
    if start < 0:
        return None
    end = start + len(content)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    return [t for t, (a, _) in zip(enc["input_ids"], enc["offset_mapping"], strict=True) if start <= a < end]


def masked_runs(input_ids: list[int], loss_mask: list[int]) -> list[list[int]]:
    """The runs of masked tokens: one per located assistant answer (the turns between are unmasked)."""
    runs: list[list[int]] = [[]]
    for t, m in zip(input_ids, loss_mask, strict=True):
        if m:
            runs[-1].append(t)
        elif runs[-1]:
            runs.append([])
    return [r for r in runs if r]


def spliced(run: list[int], text_run: list[int], ids: list[int]) -> bool:
    """Whether `run` (an answer's masked tokens with its ids) is `ids` with, around them, tokens that the
    text-only rendering has there too (the template's glue before, its end-of-turn token after)."""
    for i in range(len(run) - len(ids) + 1):
        if run[i : i + len(ids)] == ids:
            before, after = run[:i], run[i + len(ids) :]
            if text_run[: len(before)] == before and (not after or text_run[-len(after) :] == after):
                return True
    return False


def compare(conversations: list[Conversation], tokenizer: Any) -> dict[str, Any]:
    """Counts over the assistant answers that hold token ids (see the module docstring)."""
    stats: dict[str, Any] = {
        "checked": 0,
        "text_differs": 0,
        "unlocated": 0,
        "splice_differs": 0,
        "refused": 0,
        "skipped": 0,
        "examples": [],
        "splice_examples": [],
    }
    for conv in conversations:
        text_only = Conversation(conv.id, [{"role": m["role"], "content": m["content"]} for m in conv.messages])
        with_ids, _ = tokenize_with_reason(conv, tokenizer, NO_LIMIT, "truncate")
        plain, _ = tokenize_with_reason(text_only, tokenizer, NO_LIMIT, "truncate")
        answers = [(k, m) for k, m in enumerate(conv.messages) if m["role"] == "assistant"]
        if with_ids is None or plain is None:
            stats["skipped"] += sum("token_ids" in m for _, m in answers)  # the template rejected it
            continue
        stats["refused"] += with_ids.id_fallback_turns
        runs = masked_runs(with_ids.input_ids, with_ids.loss_mask)
        text_runs = masked_runs(plain.input_ids, plain.loss_mask)
        aligned = len(runs) == len(text_runs) == len(answers)  # every answer located: run j is answer j
        for j, (k, m) in enumerate(answers):
            ids = m.get("token_ids")
            if not ids:
                continue
            stats["checked"] += 1
            again = retokenized(tokenizer, text_only.messages, k)
            if again is None:
                stats["unlocated"] += 1
            elif again != ids:
                stats["text_differs"] += 1
                stats["examples"].append((conv.id, k, ids, again))
            if not (aligned and spliced(runs[j], text_runs[j], ids)):
                stats["splice_differs"] += 1
                stats["splice_examples"].append((conv.id, k))
    return stats


def _show(tokenizer: Any, generated: list[int], again: list[int]) -> str:
    at = next(
        (i for i, (x, y) in enumerate(zip(generated, again, strict=False)) if x != y), min(len(generated), len(again))
    )
    window = slice(max(0, at - 2), at + 4)
    return (
        f"    first difference at token {at} (generated {len(generated)} ids, re-tokenised {len(again)})\n"
        f"    generated:    {generated[window]} {tokenizer.convert_ids_to_tokens(generated[window])}\n"
        f"    re-tokenised: {again[window]} {tokenizer.convert_ids_to_tokens(again[window])}"
    )


def generate(overrides: list[str], n: int, output: Path) -> None:
    """Regenerate the first `n` conversations of `data` into `output`, as eagle-regenerate would."""
    regenerate_stage(
        compose(
            [*overrides, f"data.max_conversations={n}", f"regenerate.output={output}", f"output_dir={output.parent}"]
        )
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="eagle config overrides, e.g. target.path=... data=...")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", type=Path, help="a regenerated JSONL whose assistant messages hold token_ids")
    source.add_argument(
        "--conversations",
        "--generate",
        type=int,
        metavar="N",
        help="regenerate the first N conversations of data here first",
    )
    parser.add_argument("--output", type=Path, help="with --conversations: write (or resume) the records here")
    parser.add_argument("--examples", type=int, default=3, help="differences to show")
    args = parser.parse_args(argv)

    cfg = compose(args.overrides)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.input
        if args.conversations:
            path = (args.output or Path(tmp) / "regenerated.jsonl").resolve()
            generate(args.overrides, args.conversations, path)
        tokenizer = load_tokenizer(cfg.target)
        if not getattr(tokenizer, "is_fast", False):
            sys.exit("benchmarks retokenize: needs a fast tokenizer (offsets locate the answer in the rendered text)")
        # Read as training reads it (data=local): the reader keeps the ids, tokenisation splices them.
        conversations, _ = load_conversations(
            DataConfig(source="local", path=str(path), dedup_against=[], system_prompt=cfg.data.system_prompt)
        )
    stats = compare(conversations, tokenizer)
    n = stats["checked"]
    if n == 0:
        sys.exit("benchmarks retokenize: no assistant message holds token_ids (the engine returned none?)")
    print(f"answers with token ids: {n} (in {len(conversations)} conversations)")
    print(f"text only: re-tokenise to other ids: {stats['text_differs']} ({stats['text_differs'] / n:.1%})")
    if stats["unlocated"]:
        print(f"text only: not located in the rendering (template rewrites history): {stats['unlocated']}")
    print(
        f"after the splice: masked tokens other than the generated ids: {stats['splice_differs']} "
        f"({stats['splice_differs'] / n:.1%}); ids refused (text tokenised): {stats['refused']}"
    )
    if stats["skipped"]:
        print(f"answers in conversations the template rejects (not checked after the splice): {stats['skipped']}")
    for cid, k, generated, again in stats["examples"][: args.examples]:
        print(f"  text only, conversation {cid!r}, message {k}:")
        print(_show(tokenizer, generated, again))
    for cid, k in stats["splice_examples"][: args.examples]:
        print(f"  after the splice, conversation {cid!r}, message {k}: masked tokens differ from the ids")


if __name__ == "__main__":
    main()
