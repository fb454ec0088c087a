"""Stage 04's data sources, below the trainer: what the training loop asks of a source (``BatchSource``), the
offline source (``OfflineBatches``: DataLoaders over hidden_states/), and the pieces the offline and the online source
(``train_online.OnlineBatches``) both build on: the states reader (``states_reader``, over ``train_data``'s checked
reader), the held-out split, the length check, speculators' packing (``packed_batches``) and collate
(``make_collate``), the stop signal (``SourceStopped``, ``agree_stop``) and the job's ranks (``Ranks``).

``train.py`` picks the source (``build_data``, ``make_batches``) and runs the loop; ``train_online.py`` imports from
here, never from ``train.py``. speculators and hs_connectors are imported where used (``train_data``), so importing
this module (and ``04_train.py --help``) stays fast.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from .cli import StageError
from .config import PipelineConfig
from .records import DataDir

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------
# The job and the seam


@dataclass
class Ranks:
    """This process's place in the job: torchrun sets WORLD_SIZE, RANK, LOCAL_RANK; without it one process."""

    world: int = 1
    rank: int = 0
    local_rank: int = 0
    distributed: bool = False  # a process group exists (under torchrun, also with one process)

    @property
    def main(self) -> bool:
        return self.rank == 0


class RankRows:
    """A rank's packed rows of an epoch, one per micro-step (``train.rank_rows``), as two arrays (issue 27):
    ``positions`` int64 [M], each row's position in the epoch's packing, and ``real`` bool [M], False for a weight-0
    placeholder row (another rank's, re-read). ``plan[k]`` is (position, real) as Python values; ``len``, iteration
    and slices (a ``RankRows``) as the list of (position, real) tuples it stands for: 9 bytes a row instead of a
    tuple and an int (~90), for every epoch of the run's plan."""

    def __init__(self, positions: np.ndarray, real: np.ndarray):
        assert positions.shape == real.shape, "a position and a flag a row"
        self.positions, self.real = positions, real

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return RankRows(self.positions[k], self.real[k])
        return int(self.positions[k]), bool(self.real[k])

    def __iter__(self):
        return zip(self.positions.tolist(), self.real.tolist())

    def __repr__(self) -> str:
        return f"RankRows({len(self)} rows, {int((~self.real).sum())} placeholders)"


@dataclass
class EpochPlan:
    """What this rank will read of one epoch, known before the run starts (the packing is seeded per epoch)."""

    epoch: int
    plan: RankRows  # rank_rows of the epoch, cut where train.max_steps ends the run
    rows: "PackedRows | list[list[int]]"  # the packed rows of ``plan``, one per micro-step
    eval_steps: list[int]  # the run's step counts after which the held-out rows are evaluated (``eval_due``)
    first_step: int  # optimizer steps done (the run's count) when the epoch's first step begins


class BatchSource(Protocol):
    """What the training loop asks of a data source, offline (``OfflineBatches``) or online
    (``train_online.OnlineBatches``): the whole run's plan first, then each epoch's and each evaluation's host batches
    in order, whether the next step can run, and a word when a step is done."""

    # the source plans the whole job (online with train.cache_gb: one cache from every rank's reads), so ``plan``
    # needs every rank's plan; otherwise only this rank's is built (``train.plan_epochs``)
    plans_every_rank: bool

    def plan(self, epochs: list[EpochPlan], every_rank: list[list[EpochPlan]] | None = None) -> None:
        """Every epoch's rows the run will read (``train.run_plan``), in order, before the first; ``every_rank``:
        every rank's (None unless ``plans_every_rank``)."""

    def epoch(self, epoch: int, rows: list[list[int]]):
        """The host batches of ``rows`` (this rank's packed rows of the epoch, one per micro-step), in order."""

    def evaluation(self, epoch: int, step: int):
        """The host batches of this rank's held-out rows, for the evaluation after optimizer step ``step``."""

    def stop_reason(self) -> str | None:
        """Why the source cannot give the next step's rows (``SourceStopped``'s message), or None."""

    def step_done(self) -> None:
        """The optimizer step that used the batches handed out so far is done."""

    def epoch_record(self, epoch: int) -> dict | None:
        """A metrics.jsonl record of the source for the epoch, or None."""

    def close(self) -> None:
        """Stop whatever the source runs in the background."""


class SourceStopped(Exception):
    """The data source cannot go on (online: no server answers, or more samples failed than allowed): 04 saves a
    checkpoint at the last finished step and stops, naming --resume. ``agreed``: every rank stops at this step
    (``agree_stop``), so the save, a collective, can run."""

    def __init__(self, message: str, agreed: bool = False):
        super().__init__(message)
        self.agreed = agreed


def agree_stop(source, ranks: Ranks) -> None:
    """Before a step: raises SourceStopped on every rank when any rank's source would stop in it (one small
    all_gather a step, online under torchrun only), so all ranks save the same checkpoint together instead of one
    leaving the others in the step's gradient all-reduce."""
    reason = source.stop_reason()
    if ranks.distributed and isinstance(source, OfflineBatches):
        return
    if ranks.distributed:
        import torch.distributed as dist

        reasons = [None] * ranks.world
        dist.all_gather_object(reasons, reason)
        reason = next((m if r == ranks.rank else f"rank {r}: {m}" for r, m in enumerate(reasons) if m), None)
    if reason is not None:
        raise SourceStopped(reason, agreed=True)


# ---------------------------------------------------------------------------------------------------------------
# Reading states (both sources)


def datasets_without_video() -> None:
    """Shim: datasets 4.4's torch formatter imports ``torchvision.io.VideoReader`` for every row once torchvision
    is imported, and torchvision >= 0.26 (the H200 image here) no longer has it, so every read of hidden_states/
    fails. Our rows hold no video; tell datasets torchvision is absent."""
    import datasets.config

    datasets.config.TORCHVISION_AVAILABLE = False


def train_dtype(device: torch.device) -> torch.dtype:
    """dtype of the hidden states the draft reads: bf16 under CUDA autocast, fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def states_reader(manifest, files: Path, dtype: torch.dtype):
    """(transfer, dataset class, dtype the states are collated in) reading the per-sample files in ``files``: fp8
    stays e4m3 with its scales until the device; each file's layer ids are checked against ``manifest``, and a
    file whose states are not one row per token id or whose token ids are not its row's is skipped and listed
    (train_data.CheckedArrowDataset). The offline and the online source (spool files) both read through it."""
    if manifest.storage_dtype == "fp8":  # e4m3 + scales through the loader, dequantised on the device
        from .train_data import Fp8KeptTransfer, Fp8ScaledDataset

        return Fp8KeptTransfer(files, manifest), Fp8ScaledDataset, torch.float8_e4m3fn
    # each file's layer ids checked against the manifest, its states length and token ids against its row
    from .train_data import CheckedArrowDataset, CheckedFileTransfer

    return CheckedFileTransfer(files, manifest), CheckedArrowDataset, dtype


def split_files(n: int, eval_fraction: float, seed: int,
                max_samples: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
    """(the files that train, the files held out or None) of ``n`` samples, each in file order: a random share of
    ``eval_fraction`` (n - int(n x (1 - eval_fraction)) files) drawn with ``seed`` (shared.seed), so that a dataset
    ordered by source is judged on all of its sources, not on the last one. None (with a warning when some were
    asked for) when ``n`` is too small for either side to be non-empty. ``max_samples`` (train.max_samples) then
    cuts the training files alone (``cut_training``): the held-out files do not depend on it."""
    held = n - int(n * (1.0 - eval_fraction))
    if eval_fraction > 0 and 0 < held < n:
        rng = np.random.default_rng([seed, HELD_OUT_STREAM])
        out = np.zeros(n, dtype=bool)
        out[rng.permutation(n)[:held]] = True
        return cut_training(np.flatnonzero(~out), max_samples, seed), np.flatnonzero(out)
    if eval_fraction > 0:
        log.warning("%d samples: too few to hold out %.1f%% for evaluation; training on all", n, 100 * eval_fraction)
    return cut_training(np.arange(n), max_samples, seed), None


def cut_training(files: np.ndarray, max_samples: int, seed: int) -> np.ndarray:
    """``max_samples`` of the training ``files`` (train.max_samples; 0 or more than there are: all), in file order:
    the first ``max_samples`` of one permutation of them drawn with ``seed``. Every rank draws the same."""
    if not max_samples:
        return files
    if max_samples > len(files):
        log.warning("train.max_samples %d: the training split holds only %d samples; training on all of them",
                    max_samples, len(files))
        return files
    # a seeded draw, not the first N in file order (rows ordered by source would give a small N one source); one
    # permutation cut at N, so each N's samples hold every smaller N's: a data curve adds samples, never swaps them
    order = np.random.default_rng([seed, TRAIN_CUT_STREAM]).permutation(len(files))
    kept = np.sort(files[order[:max_samples]])
    log.info("train.max_samples %d: training on %d of the training split's %d samples (drawn with shared.seed)",
             max_samples, len(kept), len(files))
    return kept


HELD_OUT_STREAM = 0x4E1D  # the held-out draw's own RNG stream: no other draw of shared.seed moves it
TRAIN_CUT_STREAM = 0x4E1E  # train.max_samples' draw's own stream, likewise


def check_lengths_fit(lengths, cfg: PipelineConfig) -> None:
    """Refuse samples longer than a packed row: speculators 0.9's sampler clips such a sample's length to
    ``total_seq_len`` and its collate copies only the first ``total_seq_len`` tokens, so the rest (extracted and
    stored) would never be trained, without an error."""
    limit = cfg.train.total_seq_len
    lengths = np.asarray(lengths, dtype=np.int64)  # [n]
    long = lengths[lengths > limit]
    if long.size:
        raise StageError(f"{long.size} of {len(lengths)} samples in {DataDir(cfg.data_dir).hidden_states} are longer "
                         f"than train.total_seq_len {limit} (longest {long.max()}): training would cut them and never "
                         f"see {int(long.sum()) - limit * long.size} of their tokens. Raise --total-seq-len to at "
                         f"least {long.max()}, or rebuild the rows with shared.max_seq_len <= {limit}")


# ---------------------------------------------------------------------------------------------------------------
# Packing and collate (both sources)


class PackedRows:
    """One epoch's packed rows as two arrays (issue 27): ``samples`` int64 [S], the dataset indices row after row,
    and ``starts`` int64 [R + 1], where each row begins in it. ``rows[i]`` is row i's list of sample indices, made
    when it is asked for; ``len``, iteration and slices (lists) as the list of lists it stands for. 8 bytes a sample
    and a row instead of a Python list of ints per row (~40 bytes a sample), for every epoch of the run's plan."""

    def __init__(self, samples: np.ndarray, starts: np.ndarray):
        self.samples, self.starts = samples, starts

    @classmethod
    def from_rows(cls, rows) -> "PackedRows":
        """From a sequence of index arrays or lists (one per row)."""
        sizes = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        starts = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(sizes, out=starts[1:])
        samples = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows]) if len(rows) else starts[:0]
        return cls(samples, starts)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"packed row {i} of {len(self)}")
        return self.samples[self.starts[i]:self.starts[i + 1]].tolist()

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def take(self, positions) -> "PackedRows":
        """The rows at ``positions``, in that order."""
        positions = np.asarray(positions, dtype=np.int64)
        sizes = self.starts[positions + 1] - self.starts[positions]  # [k]
        starts = np.zeros(len(positions) + 1, dtype=np.int64)
        np.cumsum(sizes, out=starts[1:])
        picks = np.repeat(self.starts[positions] - starts[:-1], sizes) + np.arange(int(starts[-1]))  # [k samples]
        return PackedRows(self.samples[picks], starts)


def packed_batches(dataset, total_seq_len: int, seed: int, epoch: int) -> PackedRows:
    """speculators' packing of whole samples into rows of ``total_seq_len`` tokens, shuffled by seed + epoch."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=dataset.approx_lengths,
                                                 num_replicas=1, rank=0, seed=seed)
    # its public iterator hides epoch; kept as arrays: every epoch's rows are planned at the start
    return PackedRows.from_rows(sampler._generate_batches(epoch))  # noqa: SLF001


def make_collate(dataset, cfg: PipelineConfig):
    """speculators' CollateFn as both sources pack a row with it: hidden states collated in the dtype stored (fp8
    stays e4m3 until train_data.to_device on the device), the draft's layers of those stored, shifted for EAGLE-3
    (train_data.DraftStates); the samples the read checks skipped listed in the batch (train_data.ListingCollateFn)."""
    from .train_data import DraftStates, ListingCollateFn

    preprocess = DraftStates(cfg.shared.aux_layer_ids, cfg.draft_layer_ids, shift=cfg.train.draft != "dflash")
    return ListingCollateFn(cfg.train.total_seq_len, cfg.shared.hidden_size,
                            num_target_layers=len(cfg.draft_layer_ids), dtype=dataset.hidden_states_dtype,
                            preprocess=preprocess)


# ---------------------------------------------------------------------------------------------------------------
# The offline source


class EpochBatches:
    """A batch sampler whose batch list is set per epoch (with a start offset for resume), so one DataLoader and
    its persistent workers serve every epoch."""

    def __init__(self):
        self.batches: PackedRows | list = []
        self.start = 0

    def set(self, batches: PackedRows | list, start: int = 0) -> None:
        # kept as given (PackedRows: arrays), each row's list made as the loader asks for it
        self.batches, self.start = batches, start

    def __iter__(self):
        return (list(self.batches[i]) for i in range(self.start, len(self.batches)))

    def __len__(self) -> int:
        return max(0, len(self.batches) - self.start)


def _worker_init(worker_id: int) -> None:  # noqa: ARG001
    datasets_without_video()
    torch.set_num_threads(1)  # workers only read and copy; intra-op threads would oversubscribe the cores


def make_loader(dataset, sampler: EpochBatches, cfg: PipelineConfig, device: torch.device):
    from torch.utils.data import DataLoader

    workers = cfg.train.num_workers
    collate = make_collate(dataset, cfg)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=workers,
                      pin_memory=device.type == "cuda", prefetch_factor=4 if workers else None,
                      persistent_workers=workers > 0, multiprocessing_context="spawn" if workers else None,
                      worker_init_fn=_worker_init if workers else None)


class OfflineBatches(BatchSource):
    """The data-source seam, offline: an epoch's packed rows read from hidden_states/ by the DataLoader. The online
    source (train_online.OnlineBatches) has the same methods."""

    plans_every_rank = False  # the loader reads this rank's rows only

    def __init__(self, loader, sampler: EpochBatches, val_loader=None):
        self.loader, self.sampler, self.val_loader = loader, sampler, val_loader

    def plan(self, epochs: list[EpochPlan], every_rank: list[list[EpochPlan]] | None = None) -> None:
        """Every epoch's rows the run will read, in order, before the first (the loader reads ahead by itself);
        ``every_rank``: None (``plans_every_rank``)."""

    def epoch(self, epoch: int, rows: list[list[int]]):  # noqa: ARG002
        """The host batches of ``rows`` (this rank's packed rows of the epoch, one per micro-step), in order."""
        self.sampler.set(rows)
        return self.loader

    def evaluation(self, epoch: int, step: int):  # noqa: ARG002
        """The host batches of this rank's held-out rows, for the evaluation after optimizer step ``step``."""
        return self.val_loader

    def stop_reason(self) -> str | None:
        """Why the source cannot give the next step's rows (``SourceStopped``'s message), or None: offline, never."""
        return None

    def step_done(self) -> None:
        """The optimizer step that used the batches handed out so far is done."""

    def epoch_record(self, epoch: int) -> dict | None:  # noqa: ARG002
        """A metrics.jsonl record of the source for the epoch, or None."""
        return None

    def close(self) -> None:
        pass
