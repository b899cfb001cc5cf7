"""vLLM's hidden-states connector for a server without an accelerator, loaded by vLLM itself (eval/engines/vllm.py puts
this folder, and only it, on the server's path: `kv_connector_module_path`).

vLLM's `ExampleHiddenStatesConnector` (with the `extract_hidden_states` speculative method) copies each finished
request's hidden states out of its KV cache through a CUDA stream into pinned memory, which a CPU build refuses
(`pin_memory=True requires a CUDA or other accelerator backend`). This one copies them straight from the KV cache and
writes the same file (`hidden_states` [T, layers, d], `token_ids` [T]) before the request is reported finished, under
the same lock its clients wait on. It imports vLLM, torch and safetensors only: it runs in vLLM's environment.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, extract_from_kv_cache)


class _Copied:
    """Stands for the CUDA event the parent polls: the copy is done when the write returns."""

    @staticmethod
    def query() -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous copy from the KV cache (see the module docstring)."""

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size)[None] + blocks[:, None] * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the lock the client waits on
        self._req_copy_events[pending.req_id] = _Copied()
