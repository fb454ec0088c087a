"""Stage 04 online (``train.data_source: online``): the draft trains from states stage 02's vLLM servers extract as
training goes, on a bounded spool instead of a finished hidden_states/.

The rows are stage 02's (``extract.read_rows``: synthetic/ or prepared/, a partial 01b output refused); they are
written once as the rows dataset hidden_states/ would hold (``DataDir.train_spool_rows``, row i = input line i), so
speculators' reader, its packing and our collate are the offline ones: online and offline train the same packed
rows in the same order. The states come from the servers stage 02 starts (``extract.server_args``) or runs
(``--extract-url``) through stage 02's own client: ``extract_vllm.Extractor.one`` (the request naming the file, the
lock wait, ``check_file``, retries, ``ServerPool`` routing around a server that stops answering), and the capture
check (``extract_vllm.check_capture``) runs on every server before the first step.

A background thread runs an asyncio loop that walks this rank's packed rows of the whole run in the order the loop
reads them (``plan``: each epoch's rows, then its held-out rows when it is evaluated, so the spool keeps filling
across epoch boundaries) and extracts each row's samples into its own folder of the spool
(``DataDir.train_spool_slot``) while the rank's share of ``train.spool_gb`` allows (a row is admitted when the upper
bound of its files' bytes fits beside the rows already admitted); the training loop waits for a row's files, packs
it, trains, and deletes the files of a step once that optimizer step is done (a held-out row's once it is packed).
Each epoch re-extracts, except the samples ``train.cache_gb`` keeps: the first row of the plan to read a sample
extracts it into the cache (``DataDir.train_spool_cache``) while the cache's share allows, and later rows hard-link
the cached file into their folder after checking it again (stage 02's ``check_file`` and its written size).

What a failure becomes (stage 02's rules): a sample whose file keeps failing its content check, or whose states are
not finite, is trained without and listed (``DataDir.train_online_errors``); a sample a transient failure leaves
open after every retry (no server answers) is listed too, and once more of them than ``--max-error-share`` of the
epoch's samples are open, 04 saves a checkpoint at the last finished step and stops naming ``--resume`` (under
torchrun every rank asks ``stop_reason`` before a step, so all stop there and the save, a collective, runs). A resume
starts from the checkpoint's step with an empty spool (nothing from before is trusted).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cli import StageError, errors_allowed
from .config import PipelineConfig
from .progress import Progress
from .records import (
    DataDir,
    DroppedRow,
    HiddenStatesManifest,
    JsonlAppender,
    hs_bytes_estimate,
    save_hs_rows,
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
        num_samples=len(rows), num_tokens=sum(len(r.input_ids) for r in rows), num_dropped=0, bytes=0,
        input=str(src), config_hash=hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16],
        states=state_names(list(s.aux_layer_ids), num_layers))


def build_online_data(cfg: PipelineConfig, device: torch.device):
    """(train_dataset, held-out dataset or None, manifest) as ``train.build_data`` returns them, over the rows
    dataset of every input row split as offline (``train.held_out_split``: the last eval_fraction of the rows are
    held out); each dataset's files are read from the spool folder of the row being packed (``OnlineBatches``)."""
    from .extract import read_rows
    from .train import _datasets_without_video, check_lengths_fit, held_out_split, states_reader, train_dtype
    from .verifier import load_text_config

    _datasets_without_video()
    dd = DataDir(cfg.data_dir)
    src, rows = read_rows(cfg)
    text, _ = load_text_config(cfg.shared.verifier, cfg.shared.trust_remote_code)
    if text.hidden_size != cfg.shared.hidden_size:
        raise StageError(f"{cfg.shared.verifier}: hidden size {text.hidden_size}, shared.hidden_size is "
                         f"{cfg.shared.hidden_size}: fix --hidden-size")
    manifest = online_manifest(cfg, src, rows, text.num_hidden_layers)
    check_lengths_fit([len(r.input_ids) for r in rows], cfg)
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:  # one copy for every rank
        dd.train_spool_rows.mkdir(parents=True, exist_ok=True)
        save_hs_rows(dd.train_spool_rows, [(r.input_ids, r.loss_mask) for r in rows])
    if distributed:
        dist.barrier()
    train_ratio = held_out_split(len(rows), cfg.train.eval_fraction)

    def dataset(split: str):
        transfer, dataset_class, stored = states_reader(manifest, dd.train_spool_rank(0), train_dtype(device))
        out = dataset_class(max_len=cfg.train.total_seq_len, datapath=str(dd.train_spool_rows), transfer=transfer,
                            on_missing="warn", train_ratio=train_ratio, split=split, hidden_states_dtype=stored)
        out.online_rows = rows  # the input row of each file index (start_file_idx + dataset index), for the requests
        return out

    return dataset("train"), (dataset("val") if train_ratio < 1.0 else None), manifest


@dataclass
class Slot:
    """One packed row of the rank's plan: its samples' files in their own spool folder."""

    epoch: int
    index: int  # micro-step of the rank's epoch plan (held out: position in the rank's held-out rows)
    samples: list[int]  # indices into ``dataset``
    dataset: object  # the split the row packs (its file index of sample i: dataset.start_file_idx + i)
    folder: Path
    reserved: int  # upper bound of its files' bytes
    held_out: bool = False  # a row of the evaluation after the epoch, not trained
    ready: threading.Event = field(default_factory=threading.Event)
    repeat: bool = False  # the step's first row again, weight 0 (train.rank_rows' placeholder): not counted
    failed: dict[int, tuple[str, bool]] = field(default_factory=dict)  # file index: (reason, open: transient)
    written: int = 0  # bytes of the files written
    admitted_step: int = -1  # optimizer steps the run had finished when the prefetcher admitted the row
    listed: bool = False  # its failures are counted and in online_errors.jsonl
    keeps: set[int] = field(default_factory=set)  # file indices it extracts into the cache (train.cache_gb)
    reuses: set[int] = field(default_factory=set)  # file indices it takes from the cache, kept by an earlier row

    @property
    def files(self) -> list[int]:
        return [self.dataset.start_file_idx + i for i in self.samples]


class OnlineBatches:
    """The data-source seam, online (``train.OfflineBatches``' methods): a prefetcher thread fills the spool with
    the states of this rank's next packed rows, the whole run's plan queued in order (``plan``: each epoch's rows,
    then its held-out rows), so it keeps filling across epoch boundaries; ``epoch`` and ``evaluation`` hand out each
    row packed by the offline collate once its files are there; ``step_done`` deletes the files of the step just
    trained, an evaluation row's files go once it is packed."""

    def __init__(self, cfg: PipelineConfig, dataset, manifest: HiddenStatesManifest, ranks, device: torch.device,
                 val_dataset=None, eval_rows: list[list[int]] = ()):
        from .train import make_collate

        self.cfg, self.dataset, self.manifest, self.ranks = cfg, dataset, manifest, ranks
        self.val_dataset, self.eval_rows = val_dataset, list(eval_rows)
        self.dd = DataDir(cfg.data_dir)
        self.collate = make_collate(dataset, cfg)
        self.planned: dict[int, tuple[list[Slot], dict[int, list[Slot]]]] = {}  # epoch: (its rows, {step: the
        # held-out rows of the evaluation after that optimizer step})
        self.first_step: dict[int, int] = {}  # epoch: optimizer steps done when it begins
        self.steps_done = 0  # the run's optimizer steps (from the resumed step on)
        self.current: list[Slot] = []  # the epoch's rows being handed out, and how many were
        self.handed = 0
        # train.cache_gb: the first row of the plan to read a sample extracts it into the cache while the cache's
        # upper-bound bytes allow; every later row reading it links the cached file (checked again) into its folder
        self.cache_budget = int(cfg.train.cache_gb * 1e9 / ranks.world)
        self.cache_dir = self.dd.train_spool_cache(ranks.rank)
        self.cache_reserved = self.cache_on_disk = self.cache_high_water = 0
        self.cache_owner: dict[int, Slot] = {}  # file index: the slot that extracts it into the cache
        self.cache_tried: dict[int, asyncio.Event] = {}  # file index: its first extraction has ended (loop thread)
        self.cache_sizes: dict[int, int] = {}  # file index: the bytes of the file as written and checked
        self.cache_locks: dict[int, asyncio.Lock] = {}  # file index: one check or re-extraction at a time
        self.budget = int(cfg.train.spool_gb * 1e9 / ranks.world)  # this rank's share of the spool
        # a step's rows must fit at once, and on CUDA the next row too (device_batches copies it during the step)
        self.rows_at_once = cfg.train.grad_accum + (device.type == "cuda")
        self.pin = device.type == "cuda"  # pinned, as the offline DataLoader's: device_batches' copy is then async
        self.num_states = len(cfg.shared.aux_layer_ids) + 1
        # before any server starts (K2.5 loads for tens of minutes): full rows; ``epoch`` checks the real ones
        self.check_budget(hs_bytes_estimate(cfg.train.total_seq_len, 1, self.num_states, cfg.shared.hidden_size,
                                            cfg.extract.storage_dtype))
        self.lock = threading.Lock()
        self.list_lock = threading.Lock()
        self.reserved = self.on_disk = self.high_water = 0
        self.consumed: list[Slot] = []  # handed out, files not yet deleted
        self.epochs: dict[int, dict] = {}  # epoch: counts for its metrics record
        self.server = None
        self.stopping = False
        self.error: BaseException | None = None
        self.errors_log = JsonlAppender(self.dd.train_online_errors, fsync_every=1)
        # the samples of the rows queued (trained and held out), each counted once its files are in the spool
        self.progress = Progress(0, unit="samples", every_s=cfg.shared.progress_every_s, desc="online states")
        shutil.rmtree(self.dd.train_spool_rank(ranks.rank), ignore_errors=True)  # never trusted: refilled
        self.dd.train_spool_rank(ranks.rank).mkdir(parents=True, exist_ok=True)
        self.loop = asyncio.new_event_loop()
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

    def _slots(self, epoch: int, rows: list[list[int]], held_out: bool, step: int = 0) -> list[Slot]:
        """``held_out``: the rows of the evaluation after optimizer step ``step``."""
        dataset = self.val_dataset if held_out else self.dataset
        folder = (lambda rank, _, k: self.dd.train_spool_eval_slot(rank, step, k)) if held_out else \
            self.dd.train_spool_slot
        return [Slot(epoch, k, list(r), dataset, folder(self.ranks.rank, epoch, k), self.row_bytes(r, dataset),
                     held_out=held_out, repeat=r in rows[:k]) for k, r in enumerate(rows)]

    def _queue(self, slots: list[Slot]) -> None:
        """Hands ``slots`` to the prefetcher, after every slot queued before them."""
        self.check_budget(max((s.reserved for s in slots), default=0))
        for slot in slots:
            # the epoch's samples (trained and held out) are the share --max-error-share is taken of
            self.epochs.setdefault(slot.epoch, {"samples": 0, "extracted": 0, "dropped": 0, "open": 0,
                                                "wait_s": 0.0, "total": 0, "held_out_extracted": 0,
                                                "cached": 0})
            self.epochs[slot.epoch]["total"] += 0 if slot.repeat else len(slot.samples)
        self.progress.add_total(sum(0 if s.repeat else len(s.samples) for s in slots))
        self.loop.call_soon_threadsafe(self.queue.put_nowait, slots)

    def plan(self, epochs) -> None:
        """Queues every row the run will read (``train.run_plan``), in the order the loop reads them: each epoch's
        packed rows, with the held-out rows of each evaluation after the rows of the step it follows
        (``EpochPlan.eval_steps``). The prefetcher admits them in that order as the spool budget frees, so the next
        epoch's first rows are extracted while this one's last steps train."""
        queued: list[Slot] = []
        accum = self.cfg.train.grad_accum
        for p in epochs:
            self.first_step[p.epoch] = p.first_step
            rows = self._slots(p.epoch, p.rows, False)
            evals = ({step: self._slots(p.epoch, self.eval_rows, True, step) for step in p.eval_steps}
                     if self.val_dataset is not None else {})
            self.planned[p.epoch] = (rows, evals)
            done = 0
            for step in sorted(evals):
                upto = (step - p.first_step) * accum  # the rows of the steps up to this evaluation
                queued += rows[done:upto] + evals[step]
                done = upto
            queued += rows[done:]
        if self.cache_budget:
            self._plan_cache(queued)
        self.steps_done = epochs[0].first_step if epochs else 0
        self._queue(queued)

    def _plan_cache(self, slots: list[Slot]) -> None:
        """Which row keeps which sample in the cache (in plan order, while its upper-bound bytes fit in this rank's
        share of train.cache_gb), which rows reuse it; a row's spool reservation then covers only the rest."""
        for slot in slots:
            for i, f in zip(slot.samples, slot.files):
                if f in self.cache_owner:
                    slot.reuses.add(f)
                    continue
                need = self.row_bytes([i], slot.dataset)
                if self.cache_reserved + need <= self.cache_budget:
                    self.cache_owner[f] = slot
                    slot.keeps.add(f)
                    self.cache_reserved += need
            slot.reserved = self.row_bytes([i for i, f in zip(slot.samples, slot.files)
                                            if f not in slot.keeps | slot.reuses], slot.dataset)
        log.info("online: train.cache_gb keeps %d samples (up to %.3f GB of %.3f GB for this rank); later epochs "
                 "read them from %s", len(self.cache_owner), self.cache_reserved / 1e9, self.cache_budget / 1e9,
                 self.cache_dir)

    def epoch(self, epoch: int, rows: list[list[int]]):
        """The host batches of ``rows`` (this rank's packed rows of the epoch, one per micro-step), in order."""
        if epoch in self.planned:
            slots = self.planned[epoch][0]
            assert [s.samples for s in slots] == [list(r) for r in rows], "the epoch's rows differ from its plan"
        else:
            slots = self._slots(epoch, rows, False)
            self._queue(slots)
        self.current, self.handed = slots, 0  # stop_reason's view of the rows handed out next
        return self._batches(slots)

    def evaluation(self, epoch: int, step: int):
        """The host batches of this rank's held-out rows, for the evaluation after optimizer step ``step`` (as
        offline: the held-out split's one packing, the rank's share)."""
        if step in self.planned.get(epoch, ([], {}))[1]:
            slots = self.planned[epoch][1][step]
        else:
            slots = self._slots(epoch, self.eval_rows, True, step)
            self._queue(slots)
        return self._batches(slots)

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
                self.errors_log.write({"epoch": slot.epoch, **({"held_out": True} if slot.held_out else {}),
                                       **DroppedRow(self.manifest.input, i,
                                                    f"{'retryable: ' if is_open else ''}{reason}", row.id).to_json()})
            slot.listed = True

    def _stop_message(self, slot: Slot, counts: dict, allowed: int) -> str:
        i = next(i for i, (_, o) in slot.failed.items() if o)
        return (f"epoch {slot.epoch + 1}: {counts['open']} samples not extracted after "
                f"{1 + self.cfg.extract.max_retries} attempts (row {self.dataset.online_rows[i].id}, line "
                f"{i + 1}: {slot.failed[i][0]}); allowed: {allowed} (--max-error-share "
                f"{self.cfg.extract.max_error_share:g}); listed in {self.dd.train_online_errors}")

    def stop_reason(self) -> str | None:
        """Waits for the rows this rank hands out next (the step's, and on CUDA the one copied during it) and says
        whether handing them out would stop the source (SourceStopped's message; their failures are then listed),
        or None. Under torchrun every rank asks before each step and all stop at the same step (``train``)."""
        window = self.current[self.handed:self.handed + self.rows_at_once]
        if not window:
            return None
        counts = self.epochs[window[0].epoch]
        allowed = errors_allowed(self.cfg.extract.max_error_share, counts["total"])
        opened = counts["open"]
        for k, slot in enumerate(window):
            self._wait(slot, counts)
            opened += 0 if slot.repeat or slot.listed else sum(o for _, o in slot.failed.values())
            if opened > allowed:
                for earlier in window[:k + 1]:
                    self._list_failures(earlier, counts)
                return self._stop_message(slot, counts, allowed)
        return None

    def _batches(self, slots: list[Slot]):
        """Each slot's batch once its files are there, packed one row ahead in a thread: reading and dequantising a
        row's files (~1 GB at K2.5's 32768-token rows) in the training loop cost 12 % of the H200 step rate
        (BENCHMARKS.md, "One H200, K2.5 draft dims"); offline, the DataLoader's workers do it beside the step."""
        counts = self.epochs[slots[0].epoch] if slots else {}
        allowed = errors_allowed(self.cfg.extract.max_error_share, counts.get("total", 0))
        abandoned = threading.Event()  # the loop stopped asking (an error, max_steps): the packer stops waiting
        packer = ThreadPoolExecutor(1, thread_name_prefix="online-pack")
        try:
            ahead = packer.submit(self._pack, slots[0], counts, allowed, abandoned) if slots else None
            for k, slot in enumerate(slots):
                batch = ahead.result()
                if k + 1 < len(slots):
                    ahead = packer.submit(self._pack, slots[k + 1], counts, allowed, abandoned)
                if not slot.held_out:
                    self.handed += 1
                    counts["samples"] += 0 if slot.repeat else len(slot.samples) - len(slot.failed)
                    self.consumed.append(slot)
                yield batch
        finally:
            abandoned.set()
            packer.shutdown(wait=True, cancel_futures=True)

    def _pack(self, slot: Slot, counts: dict, allowed: int, abandoned: threading.Event):
        """Waits for the slot's files, lists its failures (stopping past --max-error-share), packs its row."""
        if not self._wait(slot, counts, abandoned):
            return None
        self._list_failures(slot, counts)
        if counts["open"] > allowed:
            from .train import SourceStopped

            raise SourceStopped(self._stop_message(slot, counts, allowed))
        slot.dataset.transfer.hidden_states_path = slot.folder  # the reader's folder: this row's files
        batch = self.collate([slot.dataset[i] for i in slot.samples])  # [1, total_seq_len, ...] as offline
        if slot.held_out:
            self._release(slot)  # read once, by the collate: no optimizer step to wait for
        if self.pin:  # a pageable source would make the side-stream copy block the training loop (~0.1 s a row)
            batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return batch

    def _release(self, slot: Slot) -> None:
        shutil.rmtree(slot.folder, ignore_errors=True)
        with self.lock:
            self.reserved -= slot.reserved
            self.on_disk -= slot.written

    def step_done(self) -> None:
        """Deletes the files of the rows of the step just done (the step's grad_accum rows, the oldest handed out)."""
        done, self.consumed = (self.consumed[:self.cfg.train.grad_accum],
                               self.consumed[self.cfg.train.grad_accum:])
        for slot in done:
            self._release(slot)
        self.steps_done += 1

    def epoch_record(self, epoch: int) -> dict | None:
        c = self.epochs.get(epoch)
        if c is None:
            return None
        rows = self.planned.get(epoch, ([], {}))[0]
        first = self.first_step.get(epoch, 0)
        return {"kind": "online", "epoch": epoch, "samples_trained": c["samples"], "samples_extracted": c["extracted"],
                "samples_dropped": c["dropped"], "samples_open": c["open"], "extract_wait_s": c["wait_s"],
                # the prefetch across the boundary: the epoch's rows admitted to the spool before its first step
                # began (while the epoch before it trained), and the step count at its first row's admission
                "rows_admitted_early": sum(s.admitted_step < first for s in rows),
                "first_row_admitted_at_step": rows[0].admitted_step if rows else None, "first_step": first,
                "samples_from_cache": c["cached"], "cache_high_water_bytes": self.cache_high_water,
                "cache_budget_bytes": self.cache_budget,
                "spool_high_water_bytes": self.high_water, "spool_budget_bytes": self.budget,
                "rank": self.ranks.rank}

    def close(self) -> None:
        self.stopping = True
        if self.thread.is_alive():
            self.thread.join(timeout=60)
        self.errors_log.close()
        self.progress.close()
        if self.server is not None:
            self.server.stop()
            self.server = None
        shutil.rmtree(self.dd.train_spool_rank(self.ranks.rank), ignore_errors=True)
        log.info("online: spool high-water mark %.3f GB of %.3f GB (this rank's share of train.spool_gb)",
                 self.high_water / 1e9, self.budget / 1e9)

    # ---- the prefetcher thread

    def _thread(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main(started))
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
            self.server = start_server(cfg, self.dd, self.manifest.num_layers,
                                       max(self.dataset.approx_lengths) + 1)
            urls = [self.server.url]
        check_dir = self.dd.train_spool_rank(self.ranks.rank) / "capture_check"
        with JsonlAppender(self.dd.train_spool_rank(self.ranks.rank) / "capture_check.jsonl") as journal:
            async with Extractor(cfg, self.dd, 0, urls, self.manifest.num_layers, cfg.shared.hidden_size, self.progress,
                                 journal, out_dir=check_dir) as ex:
                model, max_model_len = await ex.server_info()
                items = [(i, r.id, r.input_ids) for i, r in enumerate(self.dataset.online_rows)]
                refuse_rows_too_long(items, max_model_len, urls)
                if self.ranks.main and ex_cfg.verify_tokens:
                    await check_capture(ex, items, 0, OutputHead)  # every server, before the first step
                    shutil.rmtree(check_dir, ignore_errors=True)
                log.info("online: states of the next rows from %s (model %s) into %s, %.3f GB for this rank, %d "
                         "requests in flight", ", ".join(urls), model, self.dd.train_spool_rank(self.ranks.rank),
                         self.budget / 1e9, ex_cfg.concurrency)
                started.set()
                await self._prefetch(ex)

    async def _prefetch(self, ex) -> None:
        """Admit the queued slots in order while the budget allows; extract each admitted slot's samples."""
        gate = asyncio.Semaphore(self.cfg.extract.concurrency)
        tasks: set[asyncio.Task] = set()
        while not self.stopping:
            try:
                slots = await asyncio.wait_for(self.queue.get(), WAIT_POLL_S * 10)
            except asyncio.TimeoutError:
                continue
            for slot in slots:
                while not self.stopping:
                    with self.lock:
                        if self.reserved + slot.reserved <= self.budget:
                            self.reserved += slot.reserved
                            slot.admitted_step = self.steps_done
                            break
                    await asyncio.sleep(WAIT_POLL_S)
                if self.stopping:
                    break
                slot.folder.mkdir(parents=True, exist_ok=True)
                task = asyncio.create_task(self._fill(ex, slot, gate))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        for task in list(tasks):
            task.cancel()

    async def _fill(self, ex, slot: Slot, gate: asyncio.Semaphore) -> None:
        from .extract_vllm import BadSample, check_file

        rows = self.dataset.online_rows
        counts = self.epochs[slot.epoch]
        counted = not slot.repeat

        async def extract(i: int, path: Path) -> bool:
            """Sample i's states into ``path`` through stage 02's request; False (listed in slot.failed) if none."""
            async with gate:
                outcome = await ex.one((i, rows[i].id, rows[i].input_ids), i, path=path)
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

        async def from_cache(i: int, path: Path, cached: Path) -> None:
            """A sample another row kept: its file checked again as stage 02 checks a written one, and its size
            against the one written (a file changed or gone since is extracted into the cache again), then linked
            into the row's folder."""
            await self.cache_tried.setdefault(i, asyncio.Event()).wait()
            async with self.cache_locks.setdefault(i, asyncio.Lock()):
                old = cached.stat().st_size if cached.exists() else 0
                try:
                    size, finite = check_file(cached, rows[i].input_ids, list(self.cfg.shared.aux_layer_ids),
                                              self.manifest.num_layers, self.cfg.shared.hidden_size,
                                              self.cfg.extract.storage_dtype)
                    ok = finite and size == self.cache_sizes.get(i)  # check_file reads no states: a cut tail
                except BadSample as e:
                    ok = False
                    if old:
                        log.warning("online: cached %s fails its check (%s): extracting it again", cached, e)
                if not ok:
                    with self.lock:
                        self.cache_on_disk -= old  # extract() deletes it first
                    if not await extract(i, cached):
                        return
                else:
                    with self.lock:
                        counts["cached"] += counted
                os.link(cached, path)

        async def one(i: int) -> None:  # i: the file index (the row of the rows dataset)
            path = slot.folder / f"hs_{i}.safetensors"  # the reader's name for file i (FileTransfer)
            cached = self.cache_dir / f"hs_{i}.safetensors"
            if i in slot.reuses:
                await from_cache(i, path, cached)
            elif i in slot.keeps:
                try:
                    if await extract(i, cached):
                        os.link(cached, path)
                finally:
                    self.cache_tried.setdefault(i, asyncio.Event()).set()
            else:
                await extract(i, path)

        if slot.keeps:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        try:
            await asyncio.gather(*[one(i) for i in slot.files])
        except Exception as e:  # noqa: BLE001 (a config error of the server: the training loop raises it)
            self.error = e
        self.progress.update(0 if slot.repeat else len(slot.files) - len(slot.failed),
                             errors=0 if slot.repeat else len(slot.failed),
                             **{"spool GB": f"{self.on_disk / 1e9:.2f}", "cache GB": f"{self.cache_on_disk / 1e9:.2f}"})
        slot.ready.set()
