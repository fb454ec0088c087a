"""Stage 02's worker: one shard of samples through the verifier, files written from background threads.

``extract_shard(job)`` loads the verifier's text model (``verifier.py``), runs the samples batch by batch (longest
first, right-padded, attention-masked) and overlaps three things: the forward of batch i+1 (compute stream), the
copy of batch i's states into pinned host memory (``DeviceToHost``: a copy stream of the states' GPU, a fixed ring
of pinned buffers), and the writing of earlier batches (``ShardWriter``: threads that save each sample with
``os.write`` straight from the pinned buffer, temporary name, fsync, rename, then a journal line). The forward loop
waits only when every ring slot is still being written. ``extract.py`` plans the shards and finalizes the output.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .progress import Progress, setup_logging
from .records import (
    DataDir,
    HsJournalEntry,
    JsonlAppender,
    RowSelection,
    hs_file_metadata,
    hs_layer_ids,
    load_hs_journal_arrays,
    quantize_hidden_states,
    save_hidden_states,
)
from .verifier import AuxStateCapture, decoder_layers, load_text_config, load_text_model

log = logging.getLogger(__name__)

PAD_TOKEN_ID = 0  # any valid id: padded positions are masked out and dropped before writing


@dataclass
class ShardJob:
    """Everything one worker needs (picklable: workers are spawned processes)."""

    shard: int
    data_dir: str
    verifier: str
    aux_layer_ids: list[int]
    model_dtype: str
    storage_dtype: str
    device: str  # "cpu", "cuda:N"; ignored with device_map
    device_map: str  # "" or "auto"
    batch_tokens: int
    writer_threads: int
    max_pending_batches: int
    progress_every_s: float
    items: RowSelection  # the rows of the shard: positions and lengths; each row's ids read as its batch is formed
    cpu_threads: int = 0  # torch threads for a CPU worker; 0 = torch's default
    trust_remote_code: bool = False  # shared.trust_remote_code, for the verifier's config load
    compile: bool = False  # torch.compile each decoder layer (compile_layers)


# ---------------------------------------------------------------------------------------------------------------
# Batching


def batch_plan(lengths: np.ndarray, positions: np.ndarray, batch_tokens: int) -> list[np.ndarray]:
    """Batches as indices into the samples: longest first (an out-of-memory shows at once; ties in input order),
    each batch at most ``batch_tokens`` padded tokens; a sample longer than that goes alone."""
    order = np.lexsort((np.asarray(positions), -np.asarray(lengths, dtype=np.int64)))  # [n]
    sizes, count, longest = [], 0, 0
    for length in np.asarray(lengths, dtype=np.int64)[order].tolist():
        if count and (count + 1) * longest <= batch_tokens:
            count += 1
        else:
            if count:
                sizes.append(count)
            count, longest = 1, length
    if count:
        sizes.append(count)
    return np.split(order, np.cumsum(sizes)[:-1]) if sizes else []


def make_batches(items: list[tuple[int, str, list[int]]], batch_tokens: int) -> list[list[tuple[int, str, list[int]]]]:
    """``batch_plan`` of a list of (position, row id, input_ids): the batches of items themselves."""
    plan = batch_plan(np.array([len(it[2]) for it in items], dtype=np.int64),
                      np.array([it[0] for it in items], dtype=np.int64), batch_tokens)
    return [[items[k] for k in ks.tolist()] for ks in plan]


def pad_batch(batch: list[tuple[int, str, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, T_max], attention_mask [B, T_max]), right-padded: real tokens keep positions 0..T-1."""
    t_max = max(len(it[2]) for it in batch)
    input_ids = torch.full((len(batch), t_max), PAD_TOKEN_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), t_max), dtype=torch.long)
    for b, (_, _, ids) in enumerate(batch):
        input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[b, : len(ids)] = 1
    return input_ids, attention_mask


# ---------------------------------------------------------------------------------------------------------------
# Device to host


@dataclass
class HostBatch:
    """One batch's outputs on the host, ready to write: views into a pinned ring slot (GPU), or the CPU tensors."""

    states: torch.Tensor  # [B, T, n, H] model dtype, or float8_e4m3fn with scales
    scales: torch.Tensor | None  # [B, T, n, 1] float32 (fp8 storage: one scale per token and state)
    finite: torch.Tensor  # [B] bool: every real token's states are finite
    event: torch.cuda.Event | None = None  # recorded on the copy stream after the copies (GPU only)
    release: object = None  # callable giving the ring slot back once the batch is written


SLOT_ALIGN = 64  # bytes; each tensor of a slot starts on this boundary


def host_bytes(batch_size: int, seq_len: int, num_states: int, hidden_size: int, itemsize: int, fp8: bool) -> int:
    """Bytes one batch's outputs take in a ring slot (states, fp8 scales, finite flags; each aligned)."""
    def aligned(n: int) -> int:
        return -(-n // SLOT_ALIGN) * SLOT_ALIGN

    tokens = batch_size * seq_len
    scales = 4 * tokens * num_states if fp8 else 0  # float32, one per token and state
    return aligned(tokens * num_states * hidden_size * itemsize) + aligned(scales) + aligned(batch_size)


class DeviceToHost:
    """Copies each batch's outputs from the GPU into pinned host memory without stalling the forward.

    Pinned buffers come from a fixed ring of ``slots`` (allocated once: page-locking memory mid-run is slow and
    synchronising); ``copy`` blocks only when every slot is still being written (bounded host memory). The copy runs
    on a copy stream *of the states' device*, after that device's compute stream, so it overlaps the next batch's
    forward; the event the writer waits on is recorded on that same stream. (It used to be recorded with
    ``torch.cuda.Event().record()``, i.e. on the *current* device's stream: on cuda:1..N or with a layer split the
    writer could save a buffer before its copy had landed.)"""

    def __init__(self, slots: int, slot_bytes: int):
        self.slot_bytes = slot_bytes
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.wait_s = 0.0  # time the forward loop waited for a free slot (the run is write-bound when large)
        self.alloc_error: BaseException | None = None
        # page-locking GBs takes ~1 s per GB: done in the background (while the verifier loads); each slot is
        # usable as soon as it exists
        self._allocator = threading.Thread(target=self._allocate, args=(slots,), name="pinned-ring", daemon=True)
        self._allocator.start()

    def _allocate(self, slots: int) -> None:
        try:
            for _ in range(slots):
                self._free.put(torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=True))
        except BaseException as e:  # noqa: BLE001  (re-raised in the forward loop)
            self.alloc_error = e
            self._free.put(None)

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def copy(self, states: torch.Tensor, scales: torch.Tensor | None, finite: torch.Tensor) -> HostBatch:
        device = states.device
        t0 = time.monotonic()
        slot = self._free.get()  # waits while every slot is being written
        self.wait_s += time.monotonic() - t0
        if slot is None:
            raise RuntimeError(f"could not allocate pinned host memory ({self.slot_bytes / 1e9:.2f} GB per batch): "
                               f"{self.alloc_error}; lower --batch-tokens or --max-pending-batches")
        stream = self.stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the outputs are complete before the copy reads them
        hosts, offset = [], 0
        with torch.cuda.stream(stream):
            for t in (states, scales, finite):
                if t is None:
                    hosts.append(None)
                    continue
                n = t.numel() * t.element_size()
                if offset + n > self.slot_bytes:
                    raise AssertionError(f"ring slot of {self.slot_bytes} B too small for {n} B at {offset}")
                host = slot[offset:offset + n].view(t.dtype).view(t.shape)
                host.copy_(t, non_blocking=True)
                t.record_stream(stream)  # the allocator must not reuse t's memory before this copy has read it
                hosts.append(host)
                offset += -(-n // SLOT_ALIGN) * SLOT_ALIGN
        event = torch.cuda.Event()
        event.record(stream)
        return HostBatch(hosts[0], hosts[1], hosts[2], event, lambda: self._free.put(slot))


# ---------------------------------------------------------------------------------------------------------------
# Background writer


class ShardWriter:
    """Writes computed batches from a thread pool, one task per sample, so every thread writes whatever is pending
    (a batch of long samples is not left to one thread). The forward loop waits only when ``max_pending`` batches
    are still unwritten (bounded host memory). Each sample: temporary name, fsync, rename, then one journal line.
    The bytes go out with ``os.write`` from the host buffer (records.save_tensors_atomic)."""

    def __init__(self, dd: DataDir, shard: int, storage_dtype: str, threads: int, max_pending: int,
                 progress: Progress, metadata: dict[str, str]):
        self.dd, self.shard, self.storage_dtype = dd, shard, storage_dtype
        self.metadata = metadata  # every file's (records.hs_file_metadata: the captured layer ids)
        self.journal = JsonlAppender(dd.hs_shard_journal(shard))
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"hs-writer-{shard}")
        self.slots = threading.BoundedSemaphore(max_pending)
        self.lock = threading.Lock()
        self.futures: list[Future] = []
        self.progress = progress
        self.tokens = 0
        self.bytes = 0
        self.dropped = 0
        self.copy_wait_s = 0.0  # writer time spent waiting for device-to-host copies (summed over threads)
        self.write_s = 0.0  # writer time spent writing files (summed over threads)

    def submit(self, batch, local_indices: list[int], host: HostBatch) -> None:
        self._raise_failed()
        self.slots.acquire()
        remaining = [len(batch)]

        def sample_done() -> None:  # the batch's last sample gives its buffer and its pending slot back
            with self.lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                if host.release is not None:
                    host.release()
                self.slots.release()

        for b, (item, local_index) in enumerate(zip(batch, local_indices)):
            self.futures.append(self.pool.submit(self._write_sample, host, b, item, local_index, sample_done))

    def _write_sample(self, host: HostBatch, b: int, item, local_index: int, sample_done) -> None:
        position, row_id, ids = item
        t = len(ids)
        try:
            t0 = time.monotonic()
            if host.event is not None:
                host.event.synchronize()  # the device-to-host copy of this batch has landed
            t1 = time.monotonic()
            if not bool(host.finite[b]):
                entry = HsJournalEntry(position, row_id, -1, t, 0, reason="non-finite hidden states (NaN/Inf)")
                log.warning("shard %d: row %s (line %d) has NaN/Inf hidden states: skipped, listed in "
                            "errors.jsonl", self.shard, row_id, position + 1)
            else:
                size = save_hidden_states(
                    self.dd.hs_shard_file(self.shard, local_index), host.states[b, :t],
                    torch.tensor(ids, dtype=torch.long), self.storage_dtype,
                    host.scales[b, :t] if host.scales is not None else None, self.metadata,
                )
                entry = HsJournalEntry(position, row_id, local_index, t, size)
            self._record(entry)
            with self.lock:
                self.copy_wait_s += t1 - t0
                self.write_s += time.monotonic() - t1
        finally:
            sample_done()

    def _record(self, entry: HsJournalEntry) -> None:
        with self.lock:
            self.journal.write(entry.to_json())
            self.tokens += entry.num_tokens
            self.bytes += entry.bytes
            self.dropped += entry.local_index < 0
            elapsed = max(time.monotonic() - self.progress.start, 1e-9)
            self.progress.update(1, errors=int(entry.local_index < 0), **{
                "tokens": f"{self.tokens}", "tok/s": f"{self.tokens / elapsed:.0f}",
                "GB written": f"{self.bytes / 1e9:.2f}"})

    def _raise_failed(self) -> None:
        done = [f for f in self.futures if f.done()]
        for f in done:
            f.result()  # re-raises a writer's exception in the forward loop
        self.futures = [f for f in self.futures if not f.done()]

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        try:
            for f in self.futures:
                f.result()
        finally:
            self.journal.close()


# ---------------------------------------------------------------------------------------------------------------
# One worker


def compile_layers(model) -> None:
    """torch.compile each decoder layer's forward (dynamic shapes: one compile serves every batch shape; layers of
    one class share it). Fuses the elementwise work (norms, rope, routing, masks: ~30 % of the eager forward's GPU
    time on K2.5 layers, BENCHMARKS.md); the capture hooks stay outside the compiled code."""
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward, dynamic=True)


def _input_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def clean_shard_dir(dd: DataDir, shard: int) -> np.ndarray:
    """Journal of a shard after removing what an interrupted run left: temporary files and files no journal line
    vouches for (written but killed before the journal line). Returns the journal (records.HS_JOURNAL_DTYPE: 28
    bytes an entry; the files are listed by name, never opened)."""
    entries, _ = load_hs_journal_arrays(dd.hs_shard_journal(shard), shard)
    written = entries["local_index"][entries["local_index"] >= 0]
    kept = np.zeros(int(written.max()) + 1 if written.size else 0, dtype=bool)  # [max local index + 1]
    kept[written] = True
    folder = dd.hs_shard(shard)
    if folder.exists():
        with os.scandir(folder) as listing:
            for p in listing:
                name = p.name
                # also the lock files an interrupted vLLM backend run leaves (vLLM never deletes them)
                if (name.startswith(".") and ".tmp-" in name or name.endswith(".lock")
                        or (name.endswith(".safetensors") and not _kept(name, kept))):
                    os.unlink(p.path)
    return entries


def _kept(name: str, kept: np.ndarray) -> bool:
    """Whether a shard file's name is hs_{k}.safetensors with k journalled as written."""
    stem = name[len("hs_"):-len(".safetensors")]
    if not name.startswith("hs_") or not stem.isdigit():
        return False
    return int(stem) < len(kept) and bool(kept[int(stem)])


def extract_shard(job: ShardJob) -> dict:
    """Run one worker to the end of its items; returns its counts."""
    threads_before = torch.get_num_threads()
    if job.cpu_threads:
        torch.set_num_threads(job.cpu_threads)
    if job.device.startswith("cuda:") and not job.device_map:
        # this worker's GPU becomes the current device: allocations, streams and events without an explicit
        # device (ours and the libraries') land on it, not on cuda:0
        torch.cuda.set_device(torch.device(job.device))
    try:
        return _extract_shard(job)
    finally:
        torch.set_num_threads(threads_before)  # an in-process worker leaves the caller's setting as it was


def _extract_shard(job: ShardJob) -> dict:
    dd = DataDir(job.data_dir)
    dd.hs_shard(job.shard).mkdir(parents=True, exist_ok=True)
    entries = clean_shard_dir(dd, job.shard)
    next_local = int(entries["local_index"].max()) + 1 if len(entries) else 0
    lengths = job.items.lengths
    batches = batch_plan(lengths, job.items.positions, job.batch_tokens)  # indices into job.items
    d2h = None
    if job.device_map or job.device.startswith("cuda"):  # the pinned ring fills while the verifier loads
        fp8 = job.storage_dtype == "fp8"
        itemsize = 1 if fp8 else torch.empty(0, dtype=getattr(torch, job.model_dtype)).element_size()
        hidden = load_text_config(job.verifier, job.trust_remote_code)[0].hidden_size
        num_states = len(job.aux_layer_ids) + 1
        slot_bytes = max(host_bytes(len(b), int(lengths[b[0]]), num_states, hidden, itemsize, fp8) for b in batches)
        d2h = DeviceToHost(job.max_pending_batches, slot_bytes)
    if job.device_map:
        device_map, device = job.device_map, None
    elif job.device.startswith("cuda"):
        device_map, device = {"": job.device}, None  # load straight onto the GPU, not through host memory
    else:
        device_map, device = None, job.device
    model = load_text_model(job.verifier, getattr(torch, job.model_dtype), device=device, device_map=device_map,
                            trust_remote_code=job.trust_remote_code)
    if job.compile:
        compile_layers(model)
    capture = AuxStateCapture(model, job.aux_layer_ids)
    device = _input_device(model)
    total_tokens = job.items.tokens
    progress = Progress(len(job.items), unit="samples", every_s=job.progress_every_s, desc=f"shard {job.shard}")
    num_layers = len(decoder_layers(model))
    writer = ShardWriter(dd, job.shard, job.storage_dtype, job.writer_threads, job.max_pending_batches, progress,
                         hs_file_metadata(hs_layer_ids(job.aux_layer_ids, num_layers), num_layers))
    log.info("shard %d: %d samples, %d tokens, %d batches on %s%s%s", job.shard, len(job.items), total_tokens,
             len(batches), job.device_map or device,
             f"; pinned ring {job.max_pending_batches} x {d2h.slot_bytes / 1e9:.2f} GB" if d2h else "",
             "; decoder layers compiled (the first batches compile)" if job.compile else "")
    started = time.monotonic()
    try:
        for ks in batches:
            batch = [job.items[k] for k in ks.tolist()]  # the rows' ids, read now
            input_ids, attention_mask = pad_batch(batch)
            input_ids = input_ids.to(device, non_blocking=True)
            attention_mask = attention_mask.to(device, non_blocking=True)
            states = capture(input_ids, attention_mask)  # [B, T, n, H]
            real = attention_mask.to(states.device).bool()  # [B, T]
            finite = (torch.isfinite(states).all(-1).all(-1) | ~real).all(-1)  # [B]
            scales = None
            if job.storage_dtype == "fp8":  # quantise on the device: half the bytes to copy out
                b, t, n, h = states.shape
                states, scales = quantize_hidden_states(states.view(b * t, n, h))
                states, scales = states.view(b, t, n, h), scales.view(b, t, n, 1)  # one scale per token and state
            host = d2h.copy(states, scales, finite) if d2h is not None else HostBatch(states, scales, finite)
            local = list(range(next_local, next_local + len(batch)))
            next_local += len(batch)
            writer.submit(batch, local, host)
        loop_s = time.monotonic() - started
    finally:
        writer.close()
        capture.remove()
        progress.close()
    total_s = time.monotonic() - started
    # where the time went: a forward loop that waited long for free buffers is bound by the writes (disk)
    log.info("shard %d: forward loop %.1f s (waited %.1f s for a free pinned buffer), all written after %.1f s; "
             "writer threads %.1f s writing, %.1f s waiting for copies", job.shard, loop_s,
             d2h.wait_s if d2h else 0.0, total_s, writer.write_s, writer.copy_wait_s)
    return {"samples": len(job.items), "tokens": writer.tokens, "bytes": writer.bytes, "dropped": writer.dropped,
            "loop_s": loop_s, "total_s": total_s, "slot_wait_s": d2h.wait_s if d2h else 0.0,
            "write_s": writer.write_s, "copy_wait_s": writer.copy_wait_s}


def worker_main(job: ShardJob, log_file: str) -> None:
    setup_logging(Path(log_file))
    extract_shard(job)
