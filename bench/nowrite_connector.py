"""A connector for bench_extract_vllm.py only: vLLM's extract_hidden_states machinery with our connector's
scheduling, but nothing gathered or written (each request is done at once). The plain server, this, and our real
connector side by side split the server's extraction cost into vLLM's method and our copy-out and write."""

from __future__ import annotations

import os

from eagle3pipe.kv_gather import Done
from eagle3pipe.vllm_connector import Eagle3HiddenStatesConnector


class NoWriteConnector(Eagle3HiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is not None:
            os.close(lock_fd)
        self._req_copy_events[pending.req_id] = Done()
