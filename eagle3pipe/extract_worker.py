"""Stage 02's worker: one shard of samples through the verifier, files written from background threads.

``extract_shard(job)`` loads the verifier's text model (``verifier.py``), runs the samples batch by batch (longest
first, right-padded, attention-masked), and hands each batch's states to ``ShardWriter``: pinned host copies are
made asynchronously, and writer threads save each sample (temporary name, fsync, rename) and journal it, so the
forward loop never waits on the disk. ``extract.py`` plans the shards and finalizes the output.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from .progress import Progress, setup_logging
from .records import (
    DataDir,
    HsJournalEntry,
    JsonlAppender,
    load_hs_journal,
    quantize_hidden_states,
    save_hidden_states,
)
from .verifier import AuxStateCapture, load_text_model

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
    items: list[tuple[int, str, list[int]]]  # (position in input, row id, input_ids)
    cpu_threads: int = 0  # torch threads for a CPU worker; 0 = torch's default
    trust_remote_code: bool = False  # shared.trust_remote_code, for the verifier's config load


# ---------------------------------------------------------------------------------------------------------------
# Batching


def make_batches(items: list[tuple[int, str, list[int]]], batch_tokens: int) -> list[list[tuple[int, str, list[int]]]]:
    """Longest first (an out-of-memory shows at once), each batch at most ``batch_tokens`` padded tokens; a sample
    longer than that goes alone."""
    ordered = sorted(items, key=lambda it: (-len(it[2]), it[0]))
    batches: list[list] = []
    for it in ordered:
        if batches and (len(batches[-1]) + 1) * len(batches[-1][0][2]) <= batch_tokens:
            batches[-1].append(it)
        else:
            batches.append([it])
    return batches


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
# Background writer


class ShardWriter:
    """Writes computed batches from a thread pool; the forward loop only waits when ``max_pending`` batches are
    still unwritten (bounded host memory). Each sample: temporary name, fsync, rename, then one journal line."""

    def __init__(self, dd: DataDir, shard: int, storage_dtype: str, threads: int, max_pending: int,
                 progress: Progress):
        self.dd, self.shard, self.storage_dtype = dd, shard, storage_dtype
        self.journal = JsonlAppender(dd.hs_shard_journal(shard))
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"hs-writer-{shard}")
        self.slots = threading.BoundedSemaphore(max_pending)
        self.lock = threading.Lock()
        self.futures: list[Future] = []
        self.progress = progress
        self.tokens = 0
        self.bytes = 0
        self.dropped = 0

    def submit(self, batch, local_indices: list[int], states, scales, finite, event) -> None:
        self._raise_failed()
        self.slots.acquire()
        fut = self.pool.submit(self._write_batch, batch, local_indices, states, scales, finite, event)
        fut.add_done_callback(lambda _: self.slots.release())
        self.futures.append(fut)

    def _write_batch(self, batch, local_indices, states, scales, finite, event) -> None:
        if event is not None:
            event.synchronize()  # the device-to-host copy of this batch has landed
        finite = finite.tolist()
        for b, ((position, row_id, ids), local_index) in enumerate(zip(batch, local_indices)):
            t = len(ids)
            if not finite[b]:
                entry = HsJournalEntry(position, row_id, -1, t, 0, reason="non-finite hidden states (NaN/Inf)")
                log.warning("shard %d: row %s (line %d) has NaN/Inf hidden states: skipped, listed in errors.jsonl",
                            self.shard, row_id, position + 1)
            else:
                size = save_hidden_states(
                    self.dd.hs_shard_file(self.shard, local_index), states[b, :t],
                    torch.tensor(ids, dtype=torch.long), self.storage_dtype,
                    scales[b, :t] if scales is not None else None,
                )
                entry = HsJournalEntry(position, row_id, local_index, t, size)
            with self.lock:
                self.journal.write(entry.to_json())
                self.tokens += t
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


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _input_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def clean_shard_dir(dd: DataDir, shard: int) -> list[HsJournalEntry]:
    """Journal of a shard after removing what an interrupted run left: temporary files and files no journal line
    vouches for (written but killed before the journal line). Returns the journal."""
    entries = load_hs_journal(dd.hs_shard_journal(shard))
    kept = {dd.hs_shard_file(shard, e.local_index).name for e in entries if e.local_index >= 0}
    folder = dd.hs_shard(shard)
    if folder.exists():
        for p in folder.iterdir():
            # also the lock files an interrupted vLLM backend run leaves (vLLM never deletes them)
            if (p.name.startswith(".") and ".tmp-" in p.name or (p.suffix == ".safetensors" and p.name not in kept)
                    or p.suffix == ".lock"):
                p.unlink()
    return entries


def extract_shard(job: ShardJob) -> dict:
    """Run one worker to the end of its items; returns its counts."""
    threads_before = torch.get_num_threads()
    if job.cpu_threads:
        torch.set_num_threads(job.cpu_threads)
    try:
        return _extract_shard(job)
    finally:
        torch.set_num_threads(threads_before)  # an in-process worker leaves the caller's setting as it was


def _extract_shard(job: ShardJob) -> dict:
    dd = DataDir(job.data_dir)
    dd.hs_shard(job.shard).mkdir(parents=True, exist_ok=True)
    entries = clean_shard_dir(dd, job.shard)
    next_local = max((e.local_index for e in entries), default=-1) + 1
    if job.device_map:
        device_map, device = job.device_map, None
    elif job.device.startswith("cuda"):
        device_map, device = {"": job.device}, None  # load straight onto the GPU, not through host memory
    else:
        device_map, device = None, job.device
    model = load_text_model(job.verifier, getattr(torch, job.model_dtype), device=device, device_map=device_map,
                            trust_remote_code=job.trust_remote_code)
    capture = AuxStateCapture(model, job.aux_layer_ids)
    device = _input_device(model)
    batches = make_batches(job.items, job.batch_tokens)
    total_tokens = sum(len(it[2]) for it in job.items)
    progress = Progress(len(job.items), unit="samples", every_s=job.progress_every_s, desc=f"shard {job.shard}")
    writer = ShardWriter(dd, job.shard, job.storage_dtype, job.writer_threads, job.max_pending_batches, progress)
    log.info("shard %d: %d samples, %d tokens, %d batches on %s", job.shard, len(job.items), total_tokens,
             len(batches), job.device_map or device)
    try:
        for batch in batches:
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
                states, scales = states.view(b, t, n, h), scales.view(b, t, n, 1)
            event = None
            if states.device.type == "cuda":
                # async copies into pinned host memory (torch's caching host allocator reuses it); the writer
                # waits on the event, this loop does not
                states, finite = _to_pinned(states), _to_pinned(finite)
                scales = _to_pinned(scales) if scales is not None else None
                event = torch.cuda.Event()
                event.record()
            local = list(range(next_local, next_local + len(batch)))
            next_local += len(batch)
            writer.submit(batch, local, states, scales, finite, event)
    finally:
        writer.close()
        capture.remove()
        progress.close()
    return {"samples": len(job.items), "tokens": writer.tokens, "bytes": writer.bytes, "dropped": writer.dropped}


def worker_main(job: ShardJob, log_file: str) -> None:
    setup_logging(Path(log_file))
    extract_shard(job)
