"""Inference servers for the server-backend tests: a real `transformers serve` subprocess and an
in-process fake OpenAI-compatible server whose faults a test switches on."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.support.cli import cli_env


def free_port() -> int:
    """A loopback port nobody listens on (at the time of asking)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_available() -> bool:
    """Whether `transformers serve` can run here (the `transformers[serving]` extra is installed)."""
    from transformers.utils.import_utils import is_serve_available

    return is_serve_available()


class ServedModel:
    """`transformers serve FOLDER` on a loopback port, in a process group of its own (killed whole)."""

    def __init__(self, folder: Path, log: Path, port: int | None = None) -> None:
        self.folder, self.log, self.port = folder, log, port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServedModel:
        """Start the server (returns at once; `wait_ready` waits for it)."""
        cmd = [
            sys.executable,
            "-m",
            "transformers.cli.transformers",
            "serve",
            str(self.folder),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--log-level",
            "warning",
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=cli_env(), start_new_session=True
            )
        return self

    def wait_ready(self, timeout: float = 180.0) -> ServedModel:
        """Wait until /v1/models answers; raise (with the server's log) if it exits or takes longer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(
                    f"transformers serve exited ({self.proc and self.proc.returncode}):\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"transformers serve did not answer /v1/models within {timeout:.0f} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL the server's process group (what a crash or an OOM kill does) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def start_all(servers: list[ServedModel], timeout: float = 180.0) -> None:
    """Start several servers at once (their start-up overlaps), then wait for each."""
    for s in servers:
        s.start()
    for s in servers:
        s.wait_ready(timeout)


class JsonHandler(BaseHTTPRequestHandler):
    """The fake servers' request handler: quiet, answers JSON, and can drop a connection the way the kernel
    drops a killed process's (`reset`)."""

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:  # the connection was reset on purpose
            pass

    def _send(self, code: int, payload: str | dict[str, Any]) -> None:
        data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def reset(self) -> None:
        """Break the connection: SO_LINGER 0 makes close() send a RST, as for a killed process's sockets."""
        self.request.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.request.close()
        self.close_connection = True


def serve_in_thread(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """A server on a free port of 127.0.0.1 answering with `handler`, in a daemon thread (started)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return httpd, thread


class FakeServer:
    """An OpenAI-compatible server in a thread on 127.0.0.1. `reply(body) -> (text, ids)` answers a
    completion; `fault` (None | "reset" | an HTTP status | "hang") takes over after `fail_after`
    completions: "reset" breaks every connection (a crashed process), "hang" never answers."""

    def __init__(
        self,
        reply: Callable[[dict[str, Any]], tuple[str, list[int]]],
        owned_by: str = "vllm",
        models: tuple[str, ...] = ("tiny",),
        status: bool = False,
    ) -> None:
        self.reply, self.owned_by, self.models, self.status = reply, owned_by, models, status
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.fault: str | int | None = None
        self.fail_after = 0
        self.fault_body = '{"error": "fake failure"}'
        self.answered = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(JsonHandler):
            def do_GET(self) -> None:
                if self.path != "/v1/models":
                    return self._send(404, '{"error": "not found"}')
                entries = []
                for m in fake.models:
                    entry = {"id": m, "object": "model", "owned_by": fake.owned_by}
                    if fake.status:
                        entry["status"] = {"value": "loaded"}
                    entries.append(entry)
                self._send(200, json.dumps({"object": "list", "data": entries}))

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append((self.path, body))
                    failing = fake.fault is not None and fake.answered >= fake.fail_after
                    if not failing:
                        fake.answered += 1
                if failing and fake.fault == "reset":
                    return self.reset()
                if failing and fake.fault == "hang":
                    time.sleep(30)
                    return
                if failing:
                    return self._send(int(fake.fault), fake.fault_body)
                text, ids = fake.reply(body)
                if self.path == "/completion":  # llama.cpp's native endpoint
                    return self._send(200, json.dumps({"content": text, "tokens": ids, "stop": True}))
                choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": "stop"}
                if body.get("return_token_ids"):
                    choice["token_ids"] = ids
                self._send(200, json.dumps({"id": "x", "object": "text_completion", "choices": [choice]}))

        self.httpd, self.thread = serve_in_thread(Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def completions(self) -> list[dict[str, Any]]:
        return [b for p, b in self.requests if p in ("/v1/completions", "/completion")]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
