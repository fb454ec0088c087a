"""A connector for bench_extract_vllm.py only: vLLM's extract_hidden_states machinery with our connector's
scheduling, but nothing gathered or written (each request is done at once). The plain server, this, and our real
connector side by side split the server's extraction cost into vLLM's method and our copy-out and write."""

from __future__ import annotations

import os
from dataclasses import dataclass

from eagle3pipe.kv_gather import Done
from eagle3pipe.vllm_connector import Eagle3HiddenStatesConnector, Eagle3PendingSave


class NoWriteConnector(Eagle3HiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is not None:
            os.close(lock_fd)
        self._req_copy_events[pending.req_id] = Done()


@dataclass
class SwitchablePendingSave(Eagle3PendingSave):
    skip_write: bool = False  # bench only: gather nothing, write nothing for this request


class SwitchableConnector(Eagle3HiddenStatesConnector):
    """Our connector, except that a request whose ``kv_transfer_params`` hold ``"bench_skip_write": true`` is done at
    once with nothing gathered or written (as NoWriteConnector): one server measures vLLM's method alone and our
    connector's copy-out and write on top, without a second start (bench_slice_gpu.py; a start of a K2.5-sized
    slice costs a minute of device time)."""

    def request_finished(self, request, block_ids):
        delay, params = super().request_finished(request, block_ids)
        pending = self._pending_saves.get(request.request_id)
        if pending is not None and (request.kv_transfer_params or {}).get("bench_skip_write"):
            self._pending_saves[request.request_id] = SwitchablePendingSave(**vars(pending), skip_write=True)
        return delay, params

    def _submit_async_write(self, pending) -> None:
        if not getattr(pending, "skip_write", False):
            return super()._submit_async_write(pending)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is not None:
            os.close(lock_fd)
        self._req_copy_events[pending.req_id] = Done()
