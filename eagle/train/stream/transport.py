"""How a served sample's hidden states travel from a vLLM server to the trainer: `StatesTransport`.

A server answers a completion with a handle (`kv_transfer_params["hidden_states_path"]` for vLLM's
hidden-states connectors); the transport turns the handle into tensors (`fetch`) and frees what the
server wrote once the trainer holds them (`release`). `SharedFileTransport` is the first backend: the
servers write one safetensors file per request into a folder the trainer can read (the same machine,
or a shared file system); `release` deletes the file, so the folder never holds more than the samples
in flight. A Mooncake or NIXL backend would implement the same two calls (docs/scaling.md).
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file


@dataclass(frozen=True)
class EngineStates:
    """One request's states as the engine stored them (vLLM's layer order, not yet eagle's features)."""

    hidden_states: torch.Tensor  # [N, K, H]: K = the engine's layer ids, ascending
    token_ids: torch.Tensor  # [N]: the prompt tokens the states belong to


class TransportGone(Exception):
    """The states a server named cannot be read (the server died mid-write, or the handle is not where
    this machine can see it). The message says which."""


class StatesTransport(Protocol):
    """Get a sample's tensors by the handle a server answered with; release them afterwards."""

    def fetch(self, handle: str) -> EngineStates: ...

    def release(self, handle: str) -> None: ...


class SharedFileTransport:
    """The connector's files in a folder both the servers and this process see (`train.stream.storage_dir`).

    Files are read only from inside `root` (a handle elsewhere is refused, never read or deleted), after
    the connector's `<file>.lock` is free (it holds it exclusively while writing), and deleted by `release`.
    """

    def __init__(self, root: str | Path, wait_s: float = 120.0) -> None:
        self.root = Path(root).resolve()
        self.wait_s = wait_s

    def path_of(self, handle: str) -> Path:
        """The file a handle names, or TransportGone when it lies outside `root` or is not a safetensors file."""
        path = Path(handle).resolve()
        if not path.is_relative_to(self.root) or path.suffix != ".safetensors":
            raise TransportGone(
                f"the server wrote its states to {handle}, outside train.stream.storage_dir={self.root}: start "
                "the servers with the storage folder this trainer reads (python -m eagle.cli.serve_target)"
            )
        return path

    def _wait_unlocked(self, path: Path) -> None:
        lock = Path(f"{path}.lock")
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            return
        deadline = time.monotonic() + self.wait_s
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    return
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TransportGone(f"{path} was still being written after {self.wait_s:g} s") from None
                    time.sleep(0.005)
        finally:
            os.close(fd)

    def fetch(self, handle: str) -> EngineStates:
        path = self.path_of(handle)
        self._wait_unlocked(path)
        try:
            data = load_file(str(path))
        except FileNotFoundError:
            raise TransportGone(
                f"the server named {path} but no file is there (the server stopped, or it writes to a folder "
                "this machine does not see: train.stream.storage_dir must be shared by both)"
            ) from None
        except (SafetensorError, OSError) as e:
            raise TransportGone(f"{path} cannot be read ({e})") from e
        if "hidden_states" not in data or "token_ids" not in data:
            raise TransportGone(f"{path} holds {sorted(data)}, not hidden_states and token_ids")
        return EngineStates(hidden_states=data["hidden_states"], token_ids=data["token_ids"])

    def release(self, handle: str) -> None:
        path = self.path_of(handle)
        path.unlink(missing_ok=True)
        Path(f"{path}.lock").unlink(missing_ok=True)

    def sweep(self, older_than_s: float) -> int:
        """Delete states files (and their locks) last written more than `older_than_s` ago: what a trainer killed
        mid-run left behind (no live request waits that long). Returns how many files went."""
        if not self.root.is_dir():
            return 0
        cutoff, gone = time.time() - older_than_s, 0
        for path in self.root.glob("**/*.safetensors"):
            try:
                if path.stat().st_mtime < cutoff:
                    self.release(str(path))
                    gone += 1
            except (FileNotFoundError, TransportGone):
                continue
        return gone

    def held(self) -> int:
        """States files in the folder now (tests: the folder never holds more than the samples in flight)."""
        return sum(1 for _ in self.root.glob("**/*.safetensors")) if self.root.is_dir() else 0
