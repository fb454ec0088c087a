"""Stage 04 online (``train.data_source: online``): the draft trains from states stage 02's vLLM servers extract as
training goes, on a bounded spool instead of a finished hidden_states/.

The rows are stage 02's (``extract.read_rows``: synthetic/ or prepared/, a partial 01b output refused); they are
written once as the rows dataset hidden_states/ would hold (``DataDir.train_spool_rows``, row i = input line i; kept
for a --resume or a later run over the same rows: ``records.ensure_hs_rows``), so
speculators' reader, its packing and our collate are the offline ones: online and offline train the same packed
rows in the same order. The states come from the servers stage 02 starts (``extract.server_args``) or runs
(``--extract-url``) through stage 02's own client: ``extract_vllm.Extractor.one`` (the request naming the file, the
lock wait, ``check_file``, retries, ``ServerPool`` routing around a server that stops answering), and the capture
check (``extract_vllm.check_capture``) runs on every server before the first step.

A background thread runs an asyncio loop that walks this rank's packed rows of the whole run in the order the loop
reads them (``plan_order``: each epoch's rows, then its held-out rows when it is evaluated, so the spool keeps filling
across epoch boundaries; the plan is the epoch plans' arrays, a row's ``Slot`` is made when it is reached and dropped
with its files) and extracts each row's samples into its own folder of the spool
(``DataDir.train_spool_slot``) while the rank's share of ``train.spool_gb`` allows (a row is admitted when the upper
bound of its files' bytes fits beside the rows already admitted); the training loop waits for a row's files, packs
it, trains, and deletes the files of a step once that optimizer step is done (a held-out row's once it is packed).
Each epoch re-extracts, except the samples ``train.cache_gb`` keeps. The cache is one folder for every rank
(``DataDir.train_spool_cache``), planned from every rank's rows (``cache_owners``, the same on every rank): the first
row of the job to read a sample extracts it into the cache while the cache's bytes allow, that row's rank owns the
file, and every later row that reads it, on any rank, hard-links it into its folder after checking it again (stage
02's ``check_file`` and the size the owner wrote; another rank waits for the owner's word, a small JSON beside the
file). Each epoch re-deals the samples to the ranks (one packing for every world size), so a cache per rank would
hold the wrong samples for the next epoch; shared, a full cache extracts each sample once whatever the world size.

What a failure becomes: a sample whose file keeps failing its content check, or whose states are not finite, is
trained without and listed (``DataDir.train_online_errors``), as stage 02 drops it. A sample a transient failure
leaves open after every retry (no server answers) is never trained without, whatever ``--max-error-share`` says:
04 saves a checkpoint at the last finished step, before the step that needs the sample, and stops naming
``--resume``, which trains that step whole (under torchrun every rank asks ``stop_reason`` before a step, so all stop
there and the save, a collective, runs). A resume starts from the checkpoint's step with an empty spool and cache
(nothing from before is trusted; the folders of ranks the job no longer has are deleted too) and drops the listed
failures of the steps it trains again. The weight-0 placeholder row a rank re-reads where an epoch's last step has
too few rows (``train.rank_rows``) is another rank's row: never counted, listed, or a reason to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from .cli import StageError
from .config import PipelineConfig
from .progress import Progress
from .records import (
    DataDir,
    DroppedRow,
    HiddenStatesManifest,
    JsonlAppender,
    RowSelection,
    ensure_hs_rows,
    hs_bytes_estimate,
    hs_rows_identity,
    read_jsonl,
    repair_jsonl,
    tmp_path_for,
    write_jsonl_atomic,
)
from .train_batches import (
    BatchSource,
    SourceStopped,
    check_lengths_fit,
    datasets_without_video,
    PackedRows,
    make_collate,
    packed_batches,
    split_files,
    states_reader,
    train_dtype,
)

log = logging.getLogger(__name__)

WAIT_POLL_S = 0.01  # the prefetcher's look at the spool budget between two admissions


def online_manifest(cfg: PipelineConfig, src: Path, rows: list, num_layers: int) -> HiddenStatesManifest:
    """What hidden_states/manifest.json would say of these rows' states (the same identity hash stage 02 gives
    them, so --resume's check and the provenance read the same), with no bytes stored."""
    from .extract import output_identity
    from .verifier import state_names

    identity = output_identity(cfg, src)
    s = cfg.shared
    return HiddenStatesManifest(
        verifier=identity["verifier"], num_layers=num_layers, aux_layer_ids=list(s.aux_layer_ids),
        hidden_size=s.hidden_size, model_dtype=cfg.extract.model_dtype, storage_dtype=cfg.extract.storage_dtype,
        num_samples=len(rows), num_tokens=int(rows.lengths.sum(dtype=np.int64)), num_dropped=0, bytes=0,
        input=str(src), config_hash=hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16],
        states=state_names(list(s.aux_layer_ids), num_layers))


def build_online_data(cfg: PipelineConfig, device: torch.device):
    """(train_dataset, held-out dataset or None, manifest) as ``train.build_data`` returns them, over the rows
    dataset of every input row split as offline (``train_batches.split_files``: a share of eval_fraction drawn with
    shared.seed is held out, train.max_samples cuts the rest); each dataset's files are read from the spool folder
    of the row being packed (``OnlineBatches``)."""
    from .extract import read_rows
    from .verifier import load_text_config

    datasets_without_video()
    dd = DataDir(cfg.data_dir)
    src, rows = read_rows(cfg)
    text, _ = load_text_config(cfg.shared.verifier, cfg.shared.trust_remote_code)
    if text.hidden_size != cfg.shared.hidden_size:
        raise StageError(f"{cfg.shared.verifier}: hidden size {text.hidden_size}, shared.hidden_size is "
                         f"{cfg.shared.hidden_size}: fix --hidden-size")
    manifest = online_manifest(cfg, src, rows, text.num_hidden_layers)
    check_lengths_fit(rows.lengths, cfg)
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:  # one copy for every rank, written once for these rows
        written = ensure_hs_rows(dd.train_spool_rows, hs_rows_identity(src, rows),
                                 lambda: ((r.input_ids, r.loss_mask) for r in rows))  # streamed from the index
        log.info("online: rows dataset %s %s", dd.train_spool_rows,
                 "written" if written else "kept: written before from these rows")
    if distributed:
        dist.barrier()
    train_files, held_files = split_files(len(rows), cfg.train.eval_fraction, cfg.shared.seed, cfg.train.max_samples)

    def dataset(files):
        transfer, dataset_class, stored = states_reader(manifest, dd.train_spool_rank(0), train_dtype(device))
        out = dataset_class(max_len=cfg.train.total_seq_len, datapath=str(dd.train_spool_rows), transfer=transfer,
                            on_missing="warn", file_indices=files, hidden_states_dtype=stored)
        out.online_rows = rows  # the input row of each file index (dataset.file_index(i)), for the requests
        return out

    return dataset(train_files), (dataset(held_files) if held_files is not None else None), manifest


def job_reads(every_rank: list[list], eval_rows: list[list[list[int]]],
              accum: int = 1) -> Iterator[tuple[int, bool, bool, list[int]]]:
    """(rank, held out, real, samples) of every packed row the job reads, in the order it reads them: epoch by epoch
    (``every_rank[r]``: rank r's ``train.run_plan``), each step's rows micro-step by micro-step (``accum`` a step)
    and rank by rank (the packing's order), and after each step an evaluation follows (``EpochPlan.eval_steps``),
    every rank's held-out rows (``eval_rows[r]``, the same at every evaluation). ``real`` False: the weight-0
    placeholder a rank re-reads (another rank's row)."""
    for plans in zip(*every_rank):  # one EpochPlan of every rank, per epoch
        first = plans[0]
        evaluate_after = {(s - first.first_step) * accum for s in first.eval_steps}  # micro-steps read before each
        for m in range(len(first.plan) + 1):
            if m in evaluate_after:
                for j in range(max(map(len, eval_rows), default=0)):
                    for rank, rows in enumerate(eval_rows):
                        if j < len(rows):
                            yield rank, True, True, rows[j]
            if m < len(first.plan):
                for rank, p in enumerate(plans):
                    yield rank, False, bool(p.plan.real[m]), p.rows[m]


def cache_owners(reads, file_bytes: Callable[[bool, int], tuple[int, int]], budget: int,
                 num_files: int) -> tuple[np.ndarray, int]:
    """The cache of the whole job (train.cache_gb, one folder for every rank), from ``job_reads``: the first real row
    to read a sample keeps it (extracts it into the cache) while the upper bounds of the files kept fit in
    ``budget``, and its rank owns it; every later row that reads it, on any rank (a placeholder row too), reuses it
    (``cache_roles``). ``file_bytes(held_out, sample)``: (file index, upper-bound bytes). Returns (owner rank of
    each file, -1 for a file not kept: int32 [num_files], bytes reserved). Every rank computes the same plan from
    the same packing, so no rank has to ask another which files the cache will hold."""
    owners = np.full(num_files, -1, dtype=np.int32)
    reserved = 0
    for rank, held_out, real, samples in reads:
        for i in samples:
            f, need = file_bytes(held_out, i)
            if owners[f] < 0 and real and reserved + need <= budget:
                owners[f] = rank
                reserved += need
    return owners, reserved


def cache_roles(files, rank: int, owners: np.ndarray, seen: np.ndarray) -> tuple[set[int], set[int]]:
    """One read's part in the cache plan (``cache_owners``), from the owners alone: (files it keeps, files it
    reuses). The first read of a kept file in the job is its owner's (a placeholder row re-reads its step's first
    row, read before it in the same step, and a file that did not fit the budget then never fits later), so a
    rank's first read of a file it owns keeps it and every other read of a kept file reuses it. ``seen``: bool per
    file, the kept files this rank has read so far, in its order of reads (updated)."""
    keeps, reuses = set(), set()
    for f in files:
        owner = owners[f]
        if owner < 0:
            continue
        if owner == rank and not seen[f]:
            seen[f] = True
            keeps.add(f)
        else:
            reuses.add(f)
    return keeps, reuses


def plan_cache(reads, file_bytes: Callable[[bool, int], tuple[int, int]],
               budget: int) -> tuple[dict[int, int], list[tuple[int, set[int], set[int]]], int]:
    """``cache_owners`` and ``cache_roles`` over a whole job at once, for a look at the plan (the online source asks
    a row's roles when it makes the row's slot): (owner rank of each file kept, each read's (rank, files it keeps,
    files it reuses) in ``reads``' order, bytes reserved)."""
    reads = list(reads)
    files = [[file_bytes(held_out, i)[0] for i in samples] for _, held_out, _, samples in reads]
    num_files = 1 + max((f for fs in files for f in fs), default=-1)
    owners, reserved = cache_owners(reads, file_bytes, budget, num_files)
    seen = [np.zeros(num_files, dtype=bool) for _ in range(1 + max((r[0] for r in reads), default=0))]
    roles = [(rank, *cache_roles(fs, rank, owners, seen[rank])) for (rank, *_), fs in zip(reads, files)]
    return {int(f): int(owners[f]) for f in np.flatnonzero(owners >= 0)}, roles, reserved


def _say(path: Path, obj: dict) -> None:
    """A small JSON file other ranks poll for, whole or absent (temporary name, then rename). No fsync: the cache
    and its words live as long as the run and are deleted at the next start."""
    tmp = tmp_path_for(path)
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


@dataclass
class Slot:
    """One packed row of the rank's plan: its samples' files in their own spool folder. Made when the prefetcher
    reaches the row or the training loop asks for it (``OnlineBatches.slot``), dropped when its files are deleted:
    the plan itself is the epoch plans' arrays."""

    epoch: int
    index: int  # micro-step of the rank's epoch plan (held out: position in the rank's held-out rows)
    samples: list[int]  # indices into ``dataset``
    dataset: object  # the split the row packs (its file index of sample i: dataset.file_index(i))
    folder: Path
    reserved: int  # upper bound of its files' bytes
    held_out: bool = False  # a row of an evaluation, not trained
    step: int | None = None  # the run's optimizer step that trains it (1-based; held out: the step it follows)
    ready: threading.Event = field(default_factory=threading.Event)
    # the step's first row again, weight 0, where the epoch's last step has fewer rows than ranks x grad_accum
    # (train.rank_rows' real False): another rank's row, so never counted, listed or a reason to stop
    repeat: bool = False
    failed: dict[int, tuple[str, bool]] = field(default_factory=dict)  # file index: (reason, open: transient)
    written: int = 0  # bytes of the files written
    admitted_step: int = -1  # optimizer steps the run had finished when the prefetcher admitted the row
    listed: bool = False  # its failures are counted and in online_errors.jsonl
    keeps: set[int] = field(default_factory=set)  # file indices it extracts into the cache (train.cache_gb)
    reuses: set[int] = field(default_factory=set)  # file indices it takes from the cache, kept by an earlier row

    @property
    def key(self) -> tuple[int, bool, int, int]:
        """(epoch, held out, step, index): the row's place in the rank's plan (``OnlineBatches.plan_order``)."""
        return self.epoch, self.held_out, self.step, self.index

    @property
    def files(self) -> list[int]:
        return [self.dataset.file_index(i) for i in self.samples]

    @property
    def open_failures(self) -> list[int]:
        """File indices no server gave after every retry: the row cannot train (a placeholder row can, at weight 0)."""
        return [] if self.repeat else sorted(i for i, (_, is_open) in self.failed.items() if is_open)


class OnlineBatches(BatchSource):
    """The data-source seam, online (``train_batches.BatchSource``): a prefetcher thread fills the spool with
    the states of this rank's next packed rows, walking the whole run's plan in order (``plan_order``: each epoch's
    rows, then its held-out rows), so it keeps filling across epoch boundaries; ``epoch`` and ``evaluation`` hand out
    each row packed by the offline collate once its files are there; ``step_done`` deletes the files of the step
    just trained, an evaluation row's files go once it is packed. A row's ``Slot`` exists from when the prefetcher
    reaches it (or the loop asks for it first) until its files are deleted: the spool's window, not the run."""

    def __init__(self, cfg: PipelineConfig, dataset, manifest: HiddenStatesManifest, ranks, device: torch.device,
                 val_dataset=None, eval_rows: list[list[int]] = ()):
        self.cfg, self.dataset, self.manifest, self.ranks = cfg, dataset, manifest, ranks
        self.val_dataset, self.eval_rows = val_dataset, list(eval_rows)
        self.dd = DataDir(cfg.data_dir)
        self.collate = make_collate(dataset, cfg)
        self.plans: dict = {}  # epoch: this rank's EpochPlan (its rows and their flags as arrays: the plan itself)
        self.first_step: dict[int, int] = {}  # epoch: optimizer steps done when it begins
        self.steps_done = 0  # the run's optimizer steps (from the resumed step on)
        # the rows' slots, made in the plan's order (``slot``, ``next_planned``): those the prefetcher has reached or
        # the loop asked for, until their files are deleted; the training loop's ones the prefetcher has not reached
        self.plan_lock = threading.Lock()
        self.order: Iterator[tuple[int, bool, int, int]] = iter(())  # the keys of the plan not yet made a slot
        self.live: dict[tuple[int, bool, int, int], Slot] = {}
        self.made_early: deque[Slot] = deque()
        self.current_epoch: int | None = None  # the epoch whose rows are being handed out, its rows, and how many were
        self.current_rows = self.handed = 0
        # train.cache_gb, one cache for every rank (plan_cache): the rank owning a file extracts it into the cache,
        # every later row reading it (of any rank) links the cached file (checked again) into its folder
        self.cache_budget = int(cfg.train.cache_gb * 1e9)
        self.cache_dir = self.dd.train_spool_cache
        self.cache_reserved = self.cache_on_disk = self.cache_high_water = 0
        self.cache_owner = np.zeros(0, dtype=np.int32)  # file index: the rank that extracts it into the cache, -1
        self.cache_seen = np.zeros(0, dtype=bool)  # file index: a kept file this rank has read (``cache_roles``)
        self.cache_tried: dict[int, asyncio.Event] = {}  # file index: its first extraction has ended (loop thread)
        self.cache_sizes: dict[int, int] = {}  # file index: the bytes of the file as written and checked (its owner)
        self.cache_locks: dict[int, asyncio.Lock] = {}  # file index: one check or re-extraction at a time
        self.budget = int(cfg.train.spool_gb * 1e9 / ranks.world)  # this rank's share of the spool
        # a step's rows must fit at once, and on CUDA the next row too (device_batches copies it during the step)
        self.rows_at_once = cfg.train.grad_accum + (device.type == "cuda")
        self.pin = device.type == "cuda"  # pinned, as the offline DataLoader's: device_batches' copy is then async
        self.num_states = len(cfg.shared.aux_layer_ids) + 1
        # before any server starts (K2.5 loads for tens of minutes): full rows; ``epoch`` checks the real ones
        self.check_budget(hs_bytes_estimate(cfg.train.total_seq_len, 1, self.num_states, cfg.shared.hidden_size,
                                            cfg.extract.storage_dtype))
        if ranks.main and cfg.extract.max_error_share:
            log.warning("extract.max_error_share %g does not apply online: a sample no server answers for stops 04 "
                        "before the step that needs it (a checkpoint; --resume trains that step whole), and a "
                        "sample whose file fails its check is trained without and listed",
                        cfg.extract.max_error_share)
        self.lock = threading.Lock()
        self.list_lock = threading.Lock()
        self.reserved = self.on_disk = self.high_water = 0
        self.consumed: list[Slot] = []  # handed out, files not yet deleted
        self.epochs: dict[int, dict] = {}  # epoch: counts for its metrics record
        self.server = None
        self.stopping = False
        self.error: BaseException | None = None
        self.errors_log: JsonlAppender | None = None  # opened by ``plan`` (a resume first drops what it redoes)
        # the samples of the rows queued (trained and held out), each counted once its files are in the spool
        self.progress = Progress(0, unit="samples", every_s=cfg.shared.progress_every_s, desc="online states")
        shutil.rmtree(self.dd.train_spool_rank(ranks.rank), ignore_errors=True)  # never trusted: refilled
        self.dd.train_spool_rank(ranks.rank).mkdir(parents=True, exist_ok=True)
        self.loop: asyncio.AbstractEventLoop | None = None  # the prefetcher's, set by the thread
        self.queue: asyncio.Queue | None = None
        started = threading.Event()
        self.thread = threading.Thread(target=self._thread, args=(started,), name="online-states", daemon=True)
        self.thread.start()
        started.wait()
        if self.error is not None:
            self.close()
            raise self.error

    # ---- the training loop's side

    def row_bytes(self, samples, dataset=None) -> int:
        lengths = (dataset or self.dataset).approx_lengths
        return hs_bytes_estimate(sum(lengths[i] for i in samples), len(samples), self.num_states,
                                 self.cfg.shared.hidden_size, self.cfg.extract.storage_dtype)

    def check_budget(self, row_bytes: int) -> None:
        """Refuses a spool share that cannot hold a step's rows of ``row_bytes`` (upper bound) at once."""
        need = row_bytes * self.rows_at_once
        if need > self.budget:
            raise StageError(
                f"train.spool_gb {self.cfg.train.spool_gb:g}: this rank's share is {self.budget / 1e9:.3f} GB "
                f"({self.ranks.world} rank(s)), but {self.rows_at_once} packed row(s) must fit at once (grad_accum "
                f"{self.cfg.train.grad_accum}{', and the next row on CUDA' if self.rows_at_once > self.cfg.train.grad_accum else ''}) "
                f"and the largest takes up to {need / self.rows_at_once / 1e9:.3f} GB of states: raise --spool-gb to "
                f"at least {need * self.ranks.world / 1e9:.3f} or lower --total-seq-len")

    @property
    def plans_every_rank(self) -> bool:
        """train.cache_gb: the cache is planned from every rank's reads (``cache_owners``), so ``plan`` needs every
        rank's plan; without it only this rank's is built."""
        return self.cache_budget > 0

    def plan_order(self, epochs) -> Iterator[tuple[int, bool, int, int]]:
        """The keys (epoch, held out, step, index) of every row the run reads, in the order the loop reads them:
        each epoch's packed rows (index: micro-step of the epoch plan, step: the run's optimizer step that trains
        it, 1-based), with the held-out rows of each evaluation (index: position in the rank's held-out rows, step:
        the step it follows) after the rows of the step it follows (``EpochPlan.eval_steps``). Lazy: made from the
        epoch plans' arrays as it is walked."""
        accum = self.cfg.train.grad_accum
        for p in epochs:
            done = 0
            steps = sorted(p.eval_steps) if self.val_dataset is not None else []
            for step in [*steps, None]:
                # the rows of the steps up to this evaluation
                upto = len(p.rows) if step is None else min(len(p.rows), (step - p.first_step) * accum)
                for k in range(done, upto):
                    yield p.epoch, False, p.first_step + k // accum + 1, k
                if step is not None:
                    for k in range(len(self.eval_rows)):
                        yield p.epoch, True, step, k
                done = max(done, upto)

    def _row_parts(self, key: tuple[int, bool, int, int], seen: np.ndarray | None) -> tuple:
        """(samples, dataset, repeat, keeps, reuses, reserved) of the row at ``key``; ``seen``: the cache's roles
        (``cache_roles``), asked in the plan's order (None: a row the cache plan does not know, an evaluation
        queued after the plan)."""
        epoch, held_out, step, k = key
        if held_out:
            samples, dataset, repeat = list(self.eval_rows[k]), self.val_dataset, False
        else:
            p = self.plans[epoch]
            samples, dataset, repeat = list(p.rows[k]), self.dataset, not p.plan.real[k]
        keeps, reuses = set(), set()
        if seen is not None and len(self.cache_owner):
            files = [dataset.file_index(i) for i in samples]
            keeps, reuses = cache_roles(files, self.ranks.rank, self.cache_owner, seen)
            # a row's spool reservation covers only what the cache does not hold
            reserved = self.row_bytes([i for i, f in zip(samples, files) if f not in keeps and f not in reuses],
                                      dataset)
        else:
            reserved = self.row_bytes(samples, dataset)
        return samples, dataset, repeat, keeps, reuses, reserved

    def _row(self, key: tuple[int, bool, int, int], seen: np.ndarray | None) -> Slot:
        """The slot of the row at ``key`` (``_row_parts``)."""
        epoch, held_out, step, k = key
        samples, dataset, repeat, keeps, reuses, reserved = self._row_parts(key, seen)
        folder = (self.dd.train_spool_eval_slot(self.ranks.rank, step, k) if held_out else
                  self.dd.train_spool_slot(self.ranks.rank, epoch, k))
        return Slot(epoch, k, samples, dataset, folder, reserved, held_out=held_out, step=step, repeat=repeat,
                    keeps=keeps, reuses=reuses)

    def _make(self, key: tuple[int, bool, int, int]) -> Slot:
        """The next row of the plan's order made a slot and kept until its files are deleted (plan_lock held)."""
        slot = self.live[key] = self._row(key, self.cache_seen)
        return slot

    def next_planned(self) -> Slot | None:
        """The prefetcher's next row of the plan (None: none left): one the loop asked for first, or the next key."""
        with self.plan_lock:
            if self.made_early:
                return self.made_early.popleft()
            key = next(self.order, None)
            return None if key is None else self._make(key)

    def slot(self, key: tuple[int, bool, int, int]) -> Slot:
        """The slot of the row at ``key``, the one the prefetcher fills: made now, with the plan's rows before it,
        when the loop asks before the prefetcher reached it (the loop asks only for its next step's rows, so
        this runs ahead of the spool's window by a step at most)."""
        with self.plan_lock:
            slot = self.live.get(key)
            while slot is None:
                nxt = next(self.order, None)
                assert nxt is not None, f"row {key} is not in the plan, or its files were deleted"
                made = self._make(nxt)
                self.made_early.append(made)
                slot = made if nxt == key else None
            return slot

    def _counts(self, epoch: int) -> dict:
        """The epoch's counts for its metrics record (and the progress line's share of them)."""
        return self.epochs.setdefault(epoch, {"samples": 0, "extracted": 0, "dropped": 0, "open": 0, "wait_s": 0.0,
                                              "total": 0, "held_out_extracted": 0, "cached": 0,
                                              # its trained rows, those admitted once its first step had begun,
                                              # and the step count at its first row's admission
                                              "rows": 0, "admitted_late": 0, "first_admitted": -1})

    def _queue(self, slots: list[Slot]) -> None:
        """Hands ``slots`` (an evaluation the plan does not hold) to the prefetcher, after the plan's rows."""
        self.check_budget(max((s.reserved for s in slots), default=0))
        for slot in slots:
            self._counts(slot.epoch)["total"] += 0 if slot.repeat else len(slot.samples)
        self.progress.add_total(sum(0 if s.repeat else len(s.samples) for s in slots))
        self._hand(slots)

    def _hand(self, rows) -> None:
        """Queues ``rows`` (slots, or a call giving the next slot, None at the end) for the prefetcher."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, rows)
        except RuntimeError:  # the loop has ended (closed): the prefetcher stopped on an error
            raise self.error or StageError("online: the prefetcher thread has ended") from None

    def plan(self, epochs, every_rank: list[list] | None = None) -> None:
        """Hands the prefetcher every row the run will read (``train.run_plan``), in the order the loop reads them
        (``plan_order``): each epoch's packed rows, with the held-out rows of each evaluation after the rows of the
        step it follows. The prefetcher admits them in that order as the spool budget frees, so the next epoch's
        first rows are extracted while this one's last steps train. ``every_rank``: every rank's run_plan (rank
        r's at r), from which the shared cache is planned (``plans_every_rank``; None: this rank's alone). The plan
        stays the epoch plans' arrays: the rows' sample counts (progress, epoch records) and the largest row (the
        budget's check) are walked from them here, and each row's slot is made when it is reached.

        First (rank 0, the others wait): what an earlier run left is deleted, the spool folders of ranks this job
        does not have (a job resumed on fewer ranks; outside every budget otherwise) and the cache, and the failures
        listed for the steps (and evaluations) this run trains again are dropped from online_errors.jsonl."""
        self._start_clean(epochs)
        held_out_samples = sum(len(r) for r in self.eval_rows)
        total = 0
        for p in epochs:
            self.plans[p.epoch], self.first_step[p.epoch] = p, p.first_step
            sizes = (np.diff(p.rows.starts) if isinstance(p.rows, PackedRows) else
                     np.fromiter((len(r) for r in p.rows), dtype=np.int64, count=len(p.rows)))  # [rows]
            real = p.plan.real  # [rows]
            evaluations = len(p.eval_steps) if self.val_dataset is not None else 0
            if len(p.rows) or (evaluations and self.eval_rows):
                counts = self._counts(p.epoch)
                counts["rows"] = len(p.rows)
                counts["total"] += int(sizes[real].sum()) + evaluations * held_out_samples
                total += int(sizes[real].sum()) + evaluations * held_out_samples
        mine = sum(1 for _ in self.plan_order(epochs))
        if self.cache_budget:
            self._plan_cache(every_rank or [epochs], mine)
        # the largest row's reservation, the plan walked once (each row's parts made and dropped)
        seen = np.zeros_like(self.cache_seen)
        self.check_budget(max((self._row_parts(key, seen)[-1] for key in self.plan_order(epochs)), default=0))
        self.progress.add_total(total)
        self.steps_done = epochs[0].first_step if epochs else 0
        self.order = self.plan_order(epochs)
        self._hand(self.next_planned)

    def _start_clean(self, epochs) -> None:
        """``plan``'s first part (rank 0 deletes and rewrites, every rank then opens the errors list)."""
        import torch.distributed as dist

        if self.ranks.main:
            ours = {self.dd.train_spool_rank(r) for r in range(self.ranks.world)}
            for folder in self.dd.train_spool_rank_folders():
                if folder not in ours:
                    log.info("online: deleting %s (the spool of a rank this job does not have)", folder)
                    shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(self.cache_dir, ignore_errors=True)
            path = self.dd.train_online_errors
            if epochs and path.exists():
                repair_jsonl(path)
                # a step's rows and the evaluation after it are redone when the step is after the checkpoint's
                first_step = epochs[0].first_step
                kept = [r for r in read_jsonl(path) if r.get("step", 0) <= first_step]
                write_jsonl_atomic(path, kept)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        self.errors_log = JsonlAppender(self.dd.train_online_errors, fsync_every=1)

    def _plan_cache(self, every_rank: list[list], mine: int) -> None:
        """This rank's part of the job's cache (``cache_owners`` over every rank's rows): which file each rank
        keeps; a row's roles (which samples it keeps, which it reuses) are asked when its slot is made, and its
        spool reservation then covers only the rest. ``mine``: this rank's rows in the plan."""
        assert len(every_rank) == self.ranks.world, "the cache is planned from every rank's plan (plans_every_rank)"
        eval_rows = self._every_rank_eval_rows()
        datasets = [self.dataset] + ([self.val_dataset] if self.val_dataset is not None else [])
        num_files = max(int(d.file_indices.max()) + 1 for d in datasets)
        upper = {d is self.val_dataset: hs_bytes_estimate(np.asarray(d.approx_lengths, dtype=np.int64), 1,
                                                          self.num_states, self.cfg.shared.hidden_size,
                                                          self.cfg.extract.storage_dtype)
                 for d in datasets}  # [samples]: each sample's upper bound of bytes

        def file_bytes(held_out: bool, i: int) -> tuple[int, int]:
            dataset = self.val_dataset if held_out else self.dataset
            return dataset.file_index(i), int(upper[held_out][i])

        counted = [0]

        def reads():
            for read in job_reads(every_rank, eval_rows, self.cfg.train.grad_accum):
                counted[0] += read[0] == self.ranks.rank
                yield read

        self.cache_owner, self.cache_reserved = cache_owners(reads(), file_bytes, self.cache_budget, num_files)
        self.cache_seen = np.zeros(num_files, dtype=bool)
        assert counted[0] == mine, "the rank's reads in the job's plan differ from its rows"
        kept = int((self.cache_owner >= 0).sum())
        log.info("online: train.cache_gb keeps %d samples (up to %.3f GB of %.3f GB; %d extracted by this rank); "
                 "later epochs read them from %s", kept, self.cache_reserved / 1e9, self.cache_budget / 1e9,
                 int((self.cache_owner == self.ranks.rank).sum()), self.cache_dir)

    def _every_rank_eval_rows(self) -> list[list[list[int]]]:
        """Every rank's held-out rows (train.make_batches gives rank r the packing's rows r::world)."""
        if self.val_dataset is None:
            return [[] for _ in range(self.ranks.world)]
        if self.ranks.world == 1:
            return [self.eval_rows]
        packing = packed_batches(self.val_dataset, self.cfg.train.total_seq_len, self.cfg.shared.seed, 0)
        out = [packing[r::self.ranks.world] for r in range(self.ranks.world)]
        assert out[self.ranks.rank] == [list(r) for r in self.eval_rows], "the held-out rows differ from make_batches'"
        return out

    def epoch(self, epoch: int, rows: list[list[int]]):
        """The host batches of ``rows`` (this rank's packed rows of the epoch, one per micro-step), in order."""
        assert epoch in self.plans, "plan() queues every epoch the loop reads"
        p = self.plans[epoch]
        assert rows is p.rows or [list(r) for r in rows] == [list(r) for r in p.rows], \
            "the epoch's rows differ from its plan"
        self.current_epoch, self.current_rows, self.handed = epoch, len(p.rows), 0  # stop_reason's view
        return self._batches(len(p.rows), lambda k: self.slot(self._train_key(epoch, k)))

    def _train_key(self, epoch: int, k: int) -> tuple[int, bool, int, int]:
        p = self.plans[epoch]
        return epoch, False, p.first_step + k // self.cfg.train.grad_accum + 1, k

    def evaluation(self, epoch: int, step: int):
        """The host batches of this rank's held-out rows, for the evaluation after optimizer step ``step`` (as
        offline: the held-out split's one packing, the rank's share)."""
        p = self.plans.get(epoch)
        if self.val_dataset is not None and p is not None and step in p.eval_steps:
            return self._batches(len(self.eval_rows), lambda k: self.slot((epoch, True, step, k)))
        slots = [self._row((epoch, True, step, k), None) for k in range(len(self.eval_rows))]
        self._queue(slots)
        return self._batches(len(slots), slots.__getitem__)

    def _wait(self, slot: Slot, counts: dict, abandoned: threading.Event | None = None) -> bool:
        """Waits for the slot's files (False when ``abandoned`` is set first); raises the prefetcher's error."""
        t0 = time.monotonic()
        while not slot.ready.wait(0.5):
            if self.error is not None:
                raise self.error
            if abandoned is not None and abandoned.is_set():
                return False
        counts["wait_s"] += time.monotonic() - t0
        if self.error is not None:
            raise self.error
        return True

    def _list_failures(self, slot: Slot, counts: dict) -> None:
        with self.list_lock:  # the packing thread and stop_reason (the training loop) may list the same slot
            for i, (reason, is_open) in sorted(slot.failed.items()) if not slot.repeat and not slot.listed else ():
                counts["open" if is_open else "dropped"] += 1
                row = self.dataset.online_rows[i]
                where = {"held_out": True, "step": slot.step} if slot.held_out else {"step": slot.step}
                self.errors_log.write({"epoch": slot.epoch, **where, "rank": self.ranks.rank,
                                       **DroppedRow(self.manifest.input, i,
                                                    f"{'retryable: ' if is_open else ''}{reason}", row.id).to_json()})
            slot.listed = True

    def _stop_message(self, slot: Slot) -> str:
        missing = slot.open_failures
        i = missing[0]
        where = f"the evaluation after step {slot.step}" if slot.held_out else f"step {slot.step}"
        return (f"epoch {slot.epoch + 1}: {len(missing)} sample(s) of {where} not extracted after "
                f"{1 + self.cfg.extract.max_retries} attempts (row {self.dataset.online_rows[i].id}, line {i + 1}: "
                f"{slot.failed[i][0]}); listed in {self.dd.train_online_errors}. A step never trains without a "
                "sample no server gave: 04 stops before it")

    def stop_reason(self) -> str | None:
        """Waits for the rows this rank hands out next (the step's, and on CUDA the one copied during it) and says
        whether one of them lacks a sample no server gave (SourceStopped's message; their failures are then listed),
        or None. Under torchrun every rank asks before each step and all stop at the same step (``train``)."""
        if self.current_epoch is None:
            return None
        window = [self.slot(self._train_key(self.current_epoch, k))
                  for k in range(self.handed, min(self.handed + self.rows_at_once, self.current_rows))]
        if not window:
            return None
        counts = self.epochs[window[0].epoch]
        for k, slot in enumerate(window):
            self._wait(slot, counts)
            if slot.open_failures:
                for earlier in window[:k + 1]:
                    self._list_failures(earlier, counts)
                return self._stop_message(slot)
        return None

    def _batches(self, count: int, slot_of: Callable[[int], Slot]):
        """The batch of each of ``count`` rows (``slot_of(k)``: row k's slot, asked as it is packed) once its files
        are there, packed one row ahead in a thread: reading and dequantising a row's files (~1 GB at K2.5's
        32768-token rows) in the training loop cost 12 % of the H200 step rate (BENCHMARKS.md, "One H200, K2.5
        draft dims"); offline, the DataLoader's workers do it beside the step."""
        abandoned = threading.Event()  # the loop stopped asking (an error, max_steps): the packer stops waiting
        packer = ThreadPoolExecutor(1, thread_name_prefix="online-pack")
        try:
            slot = slot_of(0) if count else None
            counts = self.epochs[slot.epoch] if slot is not None else {}
            ahead = packer.submit(self._pack, slot, counts, abandoned) if slot is not None else None
            for k in range(count):
                batch = ahead.result()
                if k + 1 < count:
                    nxt = slot_of(k + 1)
                    ahead = packer.submit(self._pack, nxt, counts, abandoned)
                if not slot.held_out:
                    self.handed += 1
                    counts["samples"] += 0 if slot.repeat else len(slot.samples) - len(slot.failed)
                    self.consumed.append(slot)
                yield batch
                if k + 1 < count:
                    slot = nxt
        finally:
            abandoned.set()
            packer.shutdown(wait=True, cancel_futures=True)

    def _pack(self, slot: Slot, counts: dict, abandoned: threading.Event):
        """Waits for the slot's files, lists its failures (stopping at a sample no server gave), packs its row."""
        if not self._wait(slot, counts, abandoned):
            return None
        self._list_failures(slot, counts)
        if slot.open_failures:
            raise SourceStopped(self._stop_message(slot))
        slot.dataset.transfer.hidden_states_path = slot.folder  # the reader's folder: this row's files
        batch = self.collate([slot.dataset[i] for i in slot.samples])  # [1, total_seq_len, ...] as offline
        if slot.held_out:
            self._release(slot)  # read once, by the collate: no optimizer step to wait for
        if self.pin:  # a pageable source would make the side-stream copy block the training loop (~0.1 s a row)
            batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return batch

    def _release(self, slot: Slot) -> None:
        """Deletes the row's files; its slot is forgotten (the spool's window moves on)."""
        shutil.rmtree(slot.folder, ignore_errors=True)
        with self.lock:
            self.reserved -= slot.reserved
            self.on_disk -= slot.written
        with self.plan_lock:
            if self.live.get(slot.key) is slot:
                del self.live[slot.key]

    def step_done(self) -> None:
        """Deletes the files of the rows of the step just done (the step's grad_accum rows, the oldest handed out)."""
        done, self.consumed = (self.consumed[:self.cfg.train.grad_accum],
                               self.consumed[self.cfg.train.grad_accum:])
        for slot in done:
            self._release(slot)
        self.steps_done += 1

    def epoch_record(self, epoch: int) -> dict | None:
        """The epoch's ``online`` record, every rank's counts together: under torchrun a collective, which every
        rank calls (rank 0 writes it). Counts are summed; the spool's high-water mark and the wait are the largest
        rank's (each rank has its own share); the cache's high-water mark is the sum of its owners'."""
        c = self.epochs.get(epoch)
        first = self.first_step.get(epoch, 0)
        mine = None if c is None else {
            "samples_trained": c["samples"], "samples_extracted": c["extracted"], "samples_dropped": c["dropped"],
            "samples_open": c["open"], "samples_from_cache": c["cached"], "extract_wait_s": c["wait_s"],
            # the prefetch across the boundary: the epoch's rows admitted to the spool before its first step began
            # (while the epoch before it trained), and the step count at its first row's admission
            "rows_admitted_early": c["rows"] - c["admitted_late"],
            "first_row_admitted_at_step": c["first_admitted"] if c["rows"] else None,
            "spool_high_water_bytes": self.high_water, "cache_high_water_bytes": self.cache_high_water}
        every = [mine]
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            every = [None] * self.ranks.world
            dist.all_gather_object(every, mine)
        every = [r for r in every if r is not None]
        if not every:
            return None
        out = {"kind": "online", "epoch": epoch, "ranks": self.ranks.world}
        for key in ("samples_trained", "samples_extracted", "samples_dropped", "samples_open", "samples_from_cache",
                    "rows_admitted_early", "cache_high_water_bytes"):
            out[key] = sum(r[key] for r in every)
        for key in ("extract_wait_s", "spool_high_water_bytes"):
            out[key] = max(r[key] for r in every)
        admitted = [r["first_row_admitted_at_step"] for r in every if r["first_row_admitted_at_step"] is not None]
        out["first_row_admitted_at_step"] = max(admitted) if admitted else None
        out["samples_trained_per_rank"] = [r["samples_trained"] for r in every]
        out.update({"first_step": first, "cache_budget_bytes": self.cache_budget,
                    "spool_budget_bytes": self.budget})  # the spool's: each rank's share
        return out

    def close(self) -> None:
        self.stopping = True
        if self.thread.is_alive():
            self.thread.join(timeout=60)
        if self.errors_log is not None:
            self.errors_log.close()
        self.progress.close()
        if self.server is not None:
            self.server.stop()
            self.server = None
        shutil.rmtree(self.dd.train_spool_rank(self.ranks.rank), ignore_errors=True)
        # the cache files this rank owns (every rank has read what it needs of them once it closes: its last step
        # or evaluation was a collective with the others, after they read their last row); the last one out
        # removes the folder
        for f in np.flatnonzero(self.cache_owner == self.ranks.rank).tolist():
            for path in (self.cache_dir / f"hs_{f}.safetensors", self.dd.train_spool_cache_word(f)):
                for p in (path, Path(f"{path}.lock")):
                    p.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.cache_dir.rmdir()
        log.info("online: spool high-water mark %.3f GB of %.3f GB (this rank's share of train.spool_gb)",
                 self.high_water / 1e9, self.budget / 1e9)

    # ---- the prefetcher thread

    def _thread(self, started: threading.Event) -> None:
        """The prefetcher's event loop, run as asyncio.run does (its tasks cancelled and awaited, its async
        generators and default executor shut down, the loop closed) whichever way ``_main`` ends."""
        try:
            with asyncio.Runner() as runner:
                self.loop = runner.get_loop()
                runner.run(self._main(started))
        except BaseException as e:  # noqa: BLE001 (handed to the training loop, which raises it)
            self.error = e if isinstance(e, (StageError, Exception)) else StageError(str(e))
        finally:
            started.set()

    async def _main(self, started: threading.Event) -> None:
        from .extract_vllm import Extractor, check_capture, refuse_rows_too_long, start_server
        from .verifier import OutputHead

        cfg, ex_cfg = self.cfg, self.cfg.extract
        self.queue = asyncio.Queue()
        urls = list(ex_cfg.extract_url)
        if not urls:
            if self.ranks.world > 1:
                raise StageError("train.data_source online under torchrun: start the extraction servers first "
                                 "(python -m eagle3pipe.extract_vllm --config ... prints the command) and pass each "
                                 "as --extract-url; one process starts its own")
            # room for every row (the held-out ones too, and those train.max_samples leaves out: the check below
            # refuses any row longer than the server takes)
            self.server = start_server(cfg, self.dd, self.manifest.num_layers,
                                       int(self.dataset.online_rows.lengths.max()) + 1)
            urls = [self.server.url]
        check_dir = self.dd.train_spool_rank(self.ranks.rank) / "capture_check"
        with JsonlAppender(self.dd.train_spool_rank(self.ranks.rank) / "capture_check.jsonl") as journal:
            async with Extractor(cfg, self.dd, 0, urls, self.manifest.num_layers, cfg.shared.hidden_size, self.progress,
                                 journal, out_dir=check_dir) as ex:
                model, max_model_len = await ex.server_info()
                items = RowSelection(self.dataset.online_rows, np.arange(len(self.dataset.online_rows)))
                refuse_rows_too_long(items, max_model_len, urls)
                if ex_cfg.verify_tokens:  # rank 0: every server before the first step; each rank: every server
                    await check_capture(ex, items, 0, OutputHead, now=self.ranks.main)  # its pool takes back
                    shutil.rmtree(check_dir, ignore_errors=True)
                log.info("online: states of the next rows from %s (model %s) into %s, %.3f GB for this rank, %d "
                         "requests in flight", ", ".join(urls), model, self.dd.train_spool_rank(self.ranks.rank),
                         self.budget / 1e9, ex_cfg.concurrency)
                started.set()
                await self._prefetch(ex)

    async def _prefetch(self, ex) -> None:
        """Admit the queued rows in order while the budget allows (the plan's: ``next_planned`` makes each row's
        slot as it comes); extract each admitted slot's samples. On the way out, the slots still extracting are
        cancelled and awaited (no task left pending)."""
        gate = asyncio.Semaphore(self.cfg.extract.concurrency)
        tasks: set[asyncio.Task] = set()
        try:
            while not self.stopping:
                try:
                    rows = await asyncio.wait_for(self.queue.get(), WAIT_POLL_S * 10)
                except asyncio.TimeoutError:
                    continue
                for slot in iter(rows, None) if callable(rows) else rows:
                    while not self.stopping:
                        with self.lock:
                            if self.reserved + slot.reserved <= self.budget:
                                self.reserved += slot.reserved
                                slot.admitted_step = self.steps_done
                                if not slot.held_out:
                                    counts = self._counts(slot.epoch)
                                    counts["admitted_late"] += slot.admitted_step >= self.first_step.get(slot.epoch, 0)
                                    if slot.index == 0:
                                        counts["first_admitted"] = slot.admitted_step
                                break
                        await asyncio.sleep(WAIT_POLL_S)
                    if self.stopping:
                        break
                    slot.folder.mkdir(parents=True, exist_ok=True)
                    task = asyncio.create_task(self._fill(ex, slot, gate))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
        finally:
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _owns(self, f: int) -> bool:
        """This rank extracts cached file ``f`` into the cache (``cache_owners``)."""
        return f < len(self.cache_owner) and int(self.cache_owner[f]) == self.ranks.rank

    async def _owner_word(self, f: int) -> int | None:
        """The bytes of cached file ``f`` as its owner wrote and checked it, once it has (None: it could not).
        This rank's own: from memory; another rank's: its word file, polled (the owner trains the row that keeps it
        in an earlier step than any row reusing it, so the word comes while this rank still trains)."""
        if self._owns(f):
            await self.cache_tried.setdefault(f, asyncio.Event()).wait()
            return self.cache_sizes.get(f)
        word, delay = self.dd.train_spool_cache_word(f), 0.005
        while True:
            try:
                said = json.loads(word.read_text())
                return said.get("bytes")
            except FileNotFoundError:
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.25)

    async def _fill(self, ex, slot: Slot, gate: asyncio.Semaphore) -> None:
        from .extract_vllm import BadSample, check_file

        rows = self.dataset.online_rows
        counts = self.epochs[slot.epoch]
        counted = not slot.repeat

        async def extract(i: int, path: Path) -> bool:
            """Sample i's states into ``path`` through stage 02's request; False (listed in slot.failed) if none."""
            async with gate:
                row = rows[i]  # its ids read now, as the request goes
                outcome = await ex.one((i, row.id, row.input_ids), i, path=path)
            if outcome.entry is None:
                slot.failed[i] = (f"{outcome.failure.kind}: {outcome.failure.message}", True)
            elif outcome.entry.local_index < 0:
                slot.failed[i] = (outcome.entry.reason, False)
            else:
                Path(f"{path}.lock").unlink(missing_ok=True)
                with self.lock:
                    if path.parent == self.cache_dir:
                        self.cache_on_disk += outcome.entry.bytes
                        self.cache_sizes[i] = outcome.entry.bytes
                        self.cache_high_water = max(self.cache_high_water, self.cache_on_disk)
                    else:
                        slot.written += outcome.entry.bytes
                        self.on_disk += outcome.entry.bytes
                        self.high_water = max(self.high_water, self.on_disk)
                    counts["held_out_extracted" if slot.held_out else "extracted"] += counted
                return True
            return False

        async def keep(i: int, cached: Path) -> bool:
            """Sample i extracted into the cache by its owner (this rank), its word then given to the others."""
            self.cache_sizes.pop(i, None)
            try:
                return await extract(i, cached)
            finally:
                size = self.cache_sizes.get(i)
                _say(self.dd.train_spool_cache_word(i), {"bytes": size} if size is not None else
                     {"failed": slot.failed.get(i, ("cancelled", True))[0]})

        async def from_cache(i: int, path: Path, cached: Path) -> None:
            """A sample an earlier row kept: its file checked again as stage 02 checks a written one, and its size
            against the one its owner wrote, then linked into the row's folder. A file changed or gone since is
            extracted again: into the cache by its owner, into the row's folder by another rank."""
            size = await self._owner_word(i)
            mine = self._owns(i)
            async with self.cache_locks.setdefault(i, asyncio.Lock()):
                old = cached.stat().st_size if cached.exists() else 0
                ok = False
                if size is not None:
                    try:
                        got, finite = check_file(cached, rows[i].input_ids, list(self.cfg.shared.aux_layer_ids),
                                                 self.manifest.num_layers, self.cfg.shared.hidden_size,
                                                 self.cfg.extract.storage_dtype)
                        ok = finite and got == size  # check_file reads no states: a cut tail
                    except BadSample as e:
                        if old:
                            log.warning("online: cached %s fails its check (%s): extracting it again", cached, e)
                if ok:
                    with self.lock:
                        counts["cached"] += counted
                    os.link(cached, path)
                elif not mine:  # the owner's file: left to its owner, this row gets its own
                    await extract(i, path)
                else:
                    with self.lock:
                        self.cache_on_disk -= old  # extract() deletes it first
                    if await keep(i, cached):
                        os.link(cached, path)

        async def one(i: int) -> None:  # i: the file index (the row of the rows dataset)
            path = slot.folder / f"hs_{i}.safetensors"  # the reader's name for file i (FileTransfer)
            cached = self.cache_dir / f"hs_{i}.safetensors"
            if i in slot.reuses:
                await from_cache(i, path, cached)
            elif i in slot.keeps:
                try:
                    if await keep(i, cached):
                        os.link(cached, path)
                finally:
                    self.cache_tried.setdefault(i, asyncio.Event()).set()
            else:
                await extract(i, path)

        if slot.keeps or slot.reuses:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        try:
            await asyncio.gather(*[one(i) for i in slot.files])
        except Exception as e:  # noqa: BLE001 (a config error of the server: the training loop raises it)
            self.error = e
        self.progress.update(0 if slot.repeat else len(slot.files) - len(slot.failed),
                             errors=0 if slot.repeat else len(slot.failed),
                             **{"spool GB": f"{self.on_disk / 1e9:.2f}", "cache GB": f"{self.cache_on_disk / 1e9:.2f}"})
        slot.ready.set()
