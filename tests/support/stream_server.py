"""A FAKE vLLM server for `train.mode=stream` tests: vLLM's OpenAI server with `extract_hidden_states` and a
hidden-states connector, as far as the trainer can see it.

`/v1/models` lists the served name; `/v1/completions` (prompt = token ids, max_tokens = 1) computes the
prompt's states with a tiny transformers model in vLLM's layer convention (`vllm_convention_states`, the
stand-in worker's), writes `{"hidden_states": [N, K, H], "token_ids": [N]}` into the storage folder under
an exclusive `<file>.lock` as the connector does, and answers with `kv_transfer_params.hidden_states_path`.
A prompt longer than max_model_len - 1 gets vLLM's HTTP 400. Faults, for the trainer's fault handling:
`kill()` (every later connection refused, as for a dead process), `fault="reset"` after `fail_after`
answers, `fault="wrong_tokens"`, `fault="no_states"`, `prefix_caching=True` (a repeated prompt returns
only its uncached rows), `wrong_layers=True` (other layers than the name says).
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagle.train.stream.client import StreamRecipe
from tests.support.servers import JsonHandler, serve_in_thread
from tests.support.standin_vllm_worker import vllm_convention_states


class FakeStatesServer:
    # One forward at a time across every fake server: they share the model, and the states are read
    # through forward hooks registered on it for the duration of one forward.
    FORWARD = threading.Lock()

    def __init__(self, model: Any, recipe: StreamRecipe, storage: Path, served_name: str | None = None) -> None:
        self.model, self.recipe, self.storage = model.eval(), recipe, Path(storage)
        self.served_name = served_name or recipe.served_name
        self.fault: str | None = None
        self.fail_after = 0
        self.answered = 0
        self.prefix_caching = False
        self.wrong_layers = False
        self.delay = 0.0  # seconds each completion takes on top of its forward
        self.reset_prompts: set[tuple[int, ...]] = set()  # these prompts: the connection breaks, the server lives
        self.fatal_prompts: set[tuple[int, ...]] = set()  # these prompts: the server dies (kill) mid-request
        self.refuse_prompts: set[tuple[int, ...]] = set()  # these prompts: HTTP 400, as for a too long prompt
        self.seen: set[tuple[int, ...]] = set()
        self.most_files = 0  # the most states files the storage folder held at once, after a write
        self.lock = threading.Lock()
        fake = self

        class Handler(JsonHandler):
            def do_GET(self) -> None:
                if self.path != "/v1/models":
                    return self._send(404, {"error": "not found"})
                entry = {"id": fake.served_name, "object": "model", "owned_by": "vllm", "root": fake.recipe.model}
                entry["max_model_len"] = fake.recipe.max_model_len
                self._send(200, {"object": "list", "data": [entry]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    return self._send(404, {"error": "not found"})
                if body.get("model") != fake.served_name:
                    return self._send(404, {"error": f"The model `{body.get('model')}` does not exist."})
                with fake.lock:
                    failing = fake.fault == "reset" and fake.answered >= fake.fail_after
                    failing = failing or tuple(int(t) for t in body["prompt"]) in fake.reset_prompts
                    if tuple(int(t) for t in body["prompt"]) in fake.fatal_prompts:
                        failing = True
                        threading.Thread(target=fake.kill, daemon=True).start()
                    if not failing:
                        fake.answered += 1
                if failing:
                    return self.reset()
                ids = [int(t) for t in body["prompt"]]
                if len(ids) + int(body.get("max_tokens", 16)) > fake.recipe.max_model_len or (
                    tuple(ids) in fake.refuse_prompts
                ):
                    return self._send(
                        400,
                        {
                            "error": {
                                "message": f"This model's maximum context length is {fake.recipe.max_model_len} "
                                f"tokens. However, you requested {len(ids) + 1} tokens.",
                                "code": 400,
                            }
                        },
                    )
                choice = {"index": 0, "text": "x", "finish_reason": "length"}
                if fake.fault == "no_states":
                    return self._send(200, {"id": "cmpl-x", "choices": [choice]})
                time.sleep(fake.delay)
                path = fake.write_states(ids)
                self._send(
                    200, {"id": "cmpl-x", "choices": [choice], "kv_transfer_params": {"hidden_states_path": path}}
                )

        self.httpd, self.thread = serve_in_thread(Handler)
        self.port = self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_states(self, ids: list[int]) -> str:
        layers = list(self.recipe.layer_ids)
        if self.wrong_layers:
            layers = [max(i - 1, 0) for i in layers[:-1]] + layers[-1:]
        with FakeStatesServer.FORWARD, self.lock:
            states = vllm_convention_states(self.model, ids, layers)  # [N, K, H]
            cached = 0
            if self.prefix_caching and tuple(ids) in self.seen:
                cached = (len(ids) - 1) // 16 * 16  # whole blocks of 16 served from the cache
            self.seen.add(tuple(ids))
        tokens = torch.tensor(ids[cached:], dtype=torch.long)
        if self.fault == "wrong_tokens":
            tokens = tokens.flip(0).contiguous()
        states = states[cached:].contiguous()
        self.storage.mkdir(parents=True, exist_ok=True)
        path = str(self.storage / f"{uuid.uuid4().hex}.safetensors")
        fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            save_file({"hidden_states": states, "token_ids": tokens}, path)
        finally:
            os.close(fd)
        with self.lock:
            self.most_files = max(self.most_files, sum(1 for _ in self.storage.glob("*.safetensors")))
        return path

    def kill(self) -> None:
        """Gone: the listening socket closed, later connections refused."""
        self.httpd.shutdown()
        self.httpd.server_close()

    def close(self) -> None:
        try:
            self.httpd.shutdown()
            self.httpd.server_close()
        except OSError:
            pass
