"""A server subprocess for the scripts that start engines (benchmarks/regenerate_servers.py, check_llamacpp.py):
its own process group, killed with this process (also by SIGKILL, through the parent-death signal on
Linux), ready when a URL answers, stopped with TERM then KILL."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def free_port() -> int:
    """A loopback port nobody listens on (at the time of asking)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when this script dies, even by SIGKILL (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class Server:
    """An OpenAI-compatible server subprocess in a process group of its own."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path, port: int) -> None:
        self.name, self.cmd, self.env, self.log, self.port = name, cmd, env, log, port
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> float:
        """Start it and wait until /v1/models answers; the seconds that took. RuntimeError (with the log's
        tail) if it exits or does not answer within `timeout`."""
        t0 = time.perf_counter()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) while starting:\n{self.tail()}")
            try:
                with opener.open(f"{self.url}/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not answer /v1/models within {timeout:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        """TERM its process group, KILL it after 10 s, reap it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""
