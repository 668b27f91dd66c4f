"""Training on tiny targets: a workspace (target, conversations, capture), small-run overrides, and
comparisons of the heads and optimizer states two runs wrote."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle.cli.app import compose
from eagle.decode import SpeculativeGenerator
from eagle.evaluate import evaluate
from eagle.export import load_draft
from tests.support.data import write_conversations
from tests.support.decode import decode_cfg, hf_greedy, prompt_ids
from tests.tiny_models import make_model, save_model


def base_overrides(target_dir: Path, conversations: Path, algorithm: str) -> list[str]:
    return [
        f"target.path={target_dir}",
        "data=local",
        f"data.path={conversations}",
        "data.heldout_fraction=0.2",
        "data.dedup_against=[]",
        "data.max_length=64",
        "capture.dtype=float32",
        "capture.shard_size=4",
        f"draft.algorithm={algorithm}",
        "draft.draft_vocab_size=128",
        "device=cpu",
    ]


def train_overrides(out: Path, capture: Path | None, steps: int = 6, **extra: object) -> list[str]:
    """Small-run training overrides; `extra` as key__sub=value replaces or adds keys."""
    ov: dict[str, object] = {
        "output_dir": out,
        "train.max_steps": steps,
        "train.batch_size": 4,
        "train.lr": 3e-3,
        "train.warmup_steps": 2,
        "train.ttt_steps": 3,
        "train.eval_every": 3,
        "train.save_every": 2,
        "train.log_every": 1,
        "train.eval_batches": 1,
        "train.keep_checkpoints": 10,
    }
    if capture is not None:
        ov.update({"train.mode": "offline", "train.data_dir": capture})
    else:
        ov["train.mode"] = "online"
    ov.update({k.replace("__", "."): v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in ov.items()]


class Workspace:
    """A tiny target folder, a conversation file and a capture of it for one algorithm."""

    def __init__(self, root: Path, family: str = "llama", algorithm: str = "eagle3") -> None:
        from eagle.capture.runner import run_capture

        self.root = root
        self.family = family
        self.algorithm = algorithm
        self.target = save_model(family, root / "target")
        self.conversations = write_conversations(root / "convs.jsonl")
        self.base = base_overrides(self.target, self.conversations, algorithm)
        self.capture = root / "capture"
        run_capture(compose(self.base + [f"output_dir={self.capture}"]))

    def cfg(self, out: Path, online: bool = False, steps: int = 6, **extra: object):
        return compose(self.base + train_overrides(out, None if online else self.capture, steps, **extra))

    def check_trained_head(self, out: Path, algorithm: str, block_size: int, report_dir: Path | None) -> None:
        """The head trained into `out` loads onto the workspace's target (rebuilt from its seed), is the
        `algorithm` with `block_size`, and decodes greedily as HF `generate` does; with `report_dir`,
        eagle-eval on it also gives greedy output identical to HF generate and a report naming both."""
        model, tok = make_model(self.family)
        head, _ = load_draft(str(out), model.eval())
        assert head.config.algorithm == algorithm and head.config.block_size == block_size
        ids = prompt_ids(tok, "The quick brown fox")
        res = SpeculativeGenerator(model, head, tok, decode_cfg(draft_dtype="float32")).generate(ids)
        assert res.tokens == hf_greedy(model, ids, 24)
        if report_dir is None:
            return
        prompts = report_dir / "prompts.jsonl"
        report_dir.mkdir(parents=True, exist_ok=True)
        prompts.write_text(json.dumps({"id": "p", "prompt": "Write a short poem about the sea."}) + "\n")
        report = evaluate(
            compose(
                [
                    f"target.path={self.target}",
                    f"draft.path={out}",
                    f"eval.prompts={prompts}",
                    "eval.warmup_prompts=0",
                    "decode.max_new_tokens=16",
                    "decode.temperature=0",
                    "target.dtype=float32",
                    f"output_dir={report_dir / 'eval'}",
                ]
            )
        )
        assert report["greedy_match"] == 1.0
        assert report["settings"]["algorithm"] == algorithm and report["settings"]["block_size"] == block_size


def head_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def final_head(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:07d}" / "head"


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = head_weights(a), head_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs between {a} and {b}"


def assert_same_optimizer_state(a: Path, b: Path, step: int) -> None:
    """The optimizer state (Adam moments) of two training output dirs at `step` is bit-identical."""
    from eagle.train.checkpoint import load_torch

    name = Path("checkpoints") / f"step-{step:07d}" / "optimizer.pt"
    oa, ob = load_torch(a / name), load_torch(b / name)
    for k, st in oa["state"].items():
        for key, v in st.items():
            assert torch.equal(v, ob["state"][k][key]), (k, key)


# One plain-SGD update (-lr x gradient, no clipping, constant lr): weights after it compare the
# gradients themselves. After AdamW a near-zero gradient moves a weight by ~lr x sign(g), so float
# summation order (another CPU, BLAS kernel or reduction tree) becomes an lr-sized difference.
SGD_STEP = dict(
    train__optimizer="sgd",
    train__lr=1.0,
    train__warmup_steps=0,
    train__schedule="constant",
    train__grad_clip=0,
    train__eval_every=100,
    train__save_every=100,
)


def assert_same_update(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Weights after the same SGD steps computed two ways agree within float32 summation error.

    Each gradient entry is a sum over a few hundred token terms; reordering such a sum changes it by
    a few ulps of the largest partial sum, so 64 float32 ulps of the tensor's largest weight bound the
    difference with room to spare. A normalisation bug (a micro-batch divided by its own instead of
    the global token count) moves weights by a sizeable fraction of the update (~0.1-0.5 here).
    """
    assert a.keys() == b.keys()
    for k in a:
        if not a[k].is_floating_point():
            assert torch.equal(a[k], b[k]), k
            continue
        tol = 64 * torch.finfo(torch.float32).eps * float(a[k].abs().max())
        torch.testing.assert_close(a[k], b[k], atol=tol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
