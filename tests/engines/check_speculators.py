"""The python halves of tests/engines/check_speculators.sh (opt-in: the speculators library lives in its own venv).

    reference  (our .venv)         the target's EAGLE-3 features for a few MT-bench first turns, and our
                                   head's logits on them at unroll steps 0 and 1 (eagle's own loader, on
                                   the exported folder; step 1 = training-time test, teacher-forced tokens)
    compare    (speculators venv)  `SpeculatorModel.from_pretrained(EXPORT)`, the same inputs through the
                                   library's own forward (ttt_steps=2), and its logits against ours

Only `reference` imports eagle; `compare` needs nothing but speculators, torch and safetensors.
Inputs per prompt i (a whole prompt, chat template applied): `i.features` [1, T-1, 3 x Ht] = target
layers aux_layer_ids at positions 0..T-2, `i.input_ids` [1, T-1] = tokens 1..T-1 (EAGLE-3 pairs the
features of position t with the token at t+1), `i.position_ids` [1, T-1] = 1..T-1 (as eagle trains),
`i.logits` [1, T-1, V_draft] = ours at step 0, `i.logits1` the same at step 1. Step 1 reads step 0's
output as its hidden state, so it is where `norm_output` (EAGLE-3.1: that output is normed) shows: a
loader that dropped the option agrees at step 0 and not at step 1. Both sides feed step 1 the same
teacher-forced tokens (the inputs shifted left by one, 0 past the end) at positions + 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def reference(args: argparse.Namespace) -> int:
    # engine venv: `compare` runs in the speculators venv, which has no eagle
    from eagle.algorithms.ttt import ttt_forward
    from eagle.config import TargetConfig
    from eagle.data.eval_prompts import load_eval_prompts
    from eagle.export import load_exported_head
    from eagle.target.loading import load_target

    torch.set_num_threads(max(1, args.threads))
    model, tok, _ = load_target(TargetConfig(path=args.target))
    head = load_exported_head(args.export, model)  # float32, the target's own embedding
    aux = head.feature_layer_ids()
    prompts = load_eval_prompts("mt_bench")[: args.prompts]
    out: dict[str, torch.Tensor] = {}
    positions = 0
    for i, p in enumerate(prompts):
        text = tok.apply_chat_template(
            [{"role": "user", "content": p.turns[0]}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[:, : args.max_tokens]  # [1, T]
        with torch.no_grad():
            states = model.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
            feats = torch.stack([states[k] for k in aux], dim=2)[:, :-1]  # [1, T-1, 3, Ht]
            step_ids = ids[:, 1:]  # [1, T-1]
            pos = torch.arange(1, ids.shape[1]).unsqueeze(0)  # [1, T-1]
            outs = ttt_forward(
                head, step_ids, head.project_features(feats), torch.ones_like(step_ids), steps=2, position_ids=pos
            )  # two [1, T-1, H]: steps 0 and 1
            logits, logits1 = (head.logits(h) for h in outs)  # [1, T-1, V_draft] each
        out[f"{i}.features"] = feats.flatten(2).float().contiguous()
        out[f"{i}.input_ids"] = step_ids.contiguous()
        out[f"{i}.position_ids"] = pos.contiguous()
        out[f"{i}.logits"] = logits.float().contiguous()
        out[f"{i}.logits1"] = logits1.float().contiguous()
        positions += step_ids.shape[1]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file(out, args.out, metadata={"prompts": json.dumps([p.id for p in prompts]), "export": str(args.export)})
    print(f"reference: {len(prompts)} MT-bench prompts, {positions} positions, aux layers {aux} -> {args.out}")
    return 0


def compare(args: argparse.Namespace) -> int:
    # engine venv: only the speculators venv has speculators
    from speculators import SpeculatorModel, SpeculatorModelConfig

    torch.set_num_threads(max(1, args.threads))
    t0 = time.time()
    config = SpeculatorModelConfig.from_pretrained(args.export)
    # Eager attention: the library's default (flex attention) builds its block mask for 128-token blocks and
    # refuses an unrolled step over a shorter prompt on CPU ("block_mask was created for ... q_len=52").
    # The attention maths is the same; only the kernel differs.
    config.transformer_layer_config._attn_implementation = "eager"
    model = SpeculatorModel.from_pretrained(args.export, config=config, dtype=torch.float32).eval()
    print(
        f"speculators {version('speculators')}: {type(model).__name__} loaded from {args.export} in "
        f"{time.time() - t0:.1f}s (verifier {model.config.speculators_config.verifier.name_or_path})"
    )
    embed = model.embed_tokens.weight
    problems = []
    if bool(embed.isnan().any()) or not bool(embed.abs().amax() > 0):
        problems.append("embed_tokens.weight is NaN or all zeros after from_pretrained")
    ref = load_file(args.ref)
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda mod, inp, out: captured.append(out.detach()))
    steps = 2 if "0.logits1" in ref else 1  # a reference from before step 1 was added: step 0 only
    agree, total, max_diff = [0] * steps, 0, [0.0] * steps
    n = len({k.split(".")[0] for k in ref})
    with torch.no_grad():
        for i in range(n):
            captured.clear()
            ids = ref[f"{i}.input_ids"]
            drafts = model(
                hidden_states=ref[f"{i}.features"],
                input_ids=ids,
                document_ids=torch.zeros_like(ids),
                position_ids=ref[f"{i}.position_ids"],
                ttt_steps=steps,
            )
            for step in range(steps):
                theirs = captured[step].float()  # [1, T-1, V_draft]
                ours = ref[f"{i}.logits" if step == 0 else f"{i}.logits{step}"]
                if not torch.equal(drafts[step], theirs.argmax(-1)):
                    problems.append(
                        f"prompt {i} step {step}: the returned draft tokens are not the argmax of lm_head's output"
                    )
                agree[step] += int((theirs.argmax(-1) == ours.argmax(-1)).sum())
                max_diff[step] = max(max_diff[step], float((theirs - ours).abs().max()))
            total += ids.numel()
    hook.remove()
    fracs = [a / max(total, 1) for a in agree]
    for step in range(steps):
        print(
            f"speculators vs eagle step-{step} logits: top-1 agreement {agree[step]}/{total} = {fracs[step]:.4f}, "
            f"max |logit diff| {max_diff[step]:.4f} ({n} prompts)"
        )
        if fracs[step] < args.min_agreement:
            problems.append(f"step-{step} top-1 agreement {fracs[step]:.4f} < {args.min_agreement}")
    frac, max_diff = min(fracs), max(max_diff)
    if problems:
        print("FAIL: speculators check: " + "; ".join(problems))
        return 1
    print(
        f"PASS: speculators check: SpeculatorModel.from_pretrained loads the export and agrees with eagle on "
        f"{frac:.2%} of top-1 tokens at unroll step{'s 0 and 1' if steps == 2 else ' 0'} ({total} positions, "
        f"max |logit diff| {max_diff:.4f})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reference", help="(our .venv) features + our logits -> a safetensors file")
    r.add_argument("--export", required=True, help="the speculators-format export folder")
    r.add_argument("--target", default="smollm2-135m-instruct", help="target.path of the head")
    r.add_argument("--prompts", type=int, default=4)
    r.add_argument("--max-tokens", type=int, default=256, help="tokens kept per prompt")
    r.add_argument("--out", required=True)
    r.add_argument("--threads", type=int, default=2)
    c = sub.add_parser("compare", help="(speculators venv) the library's logits vs the reference file")
    c.add_argument("--export", required=True)
    c.add_argument("--ref", required=True)
    c.add_argument("--min-agreement", type=float, default=0.99)
    c.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    return reference(args) if args.cmd == "reference" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
