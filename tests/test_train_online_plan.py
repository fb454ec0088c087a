"""Issue 27, stage 04 online: the plan of every epoch's packed rows (and the held-out rows of each evaluation) is the
epoch plans' arrays; the online source makes a row's bookkeeping (``train_online.Slot``) only when the prefetcher
reaches it or the training loop asks for it, and drops it when the row's files are deleted. No server: the
prefetcher's thread is replaced by one that only hands the source a loop to queue on."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from memory_bound import in_a_fresh_process
from eagle3pipe.config import load_config
from eagle3pipe.records_checkpoints import TrainingState
from eagle3pipe.train import run_plan
from eagle3pipe.train_batches import PackedRows, Ranks

EPOCHS = 3
SAMPLES_A_ROW = 4  # rows of 4 samples of 8-16 tokens (64-token rows)
EVAL_SAMPLES = 40


def tiny_rows(num_rows: int, epoch: int) -> PackedRows:
    """An epoch's packing of num_rows x SAMPLES_A_ROW samples, shuffled per epoch (speculators' packing of 10^5
    rows takes minutes in Python; the plan does not care how the rows were packed)."""
    samples = np.random.default_rng(epoch).permutation(num_rows * SAMPLES_A_ROW)
    return PackedRows(samples, np.arange(0, num_rows * SAMPLES_A_ROW + 1, SAMPLES_A_ROW, dtype=np.int64))


class Split(SimpleNamespace):
    """A split's stand-in as the plan reads it (train_data.CheckedArrowDataset): lengths, and each sample's file."""

    def file_index(self, i: int) -> int:
        return int(self.file_indices[i])


def datasets(num_rows: int):
    n = num_rows * SAMPLES_A_ROW
    train = Split(approx_lengths=[8 + i % 9 for i in range(n)], file_indices=np.arange(n),
                  hidden_states_dtype=torch.bfloat16, online_rows=None)
    val = Split(approx_lengths=[8 + i % 9 for i in range(EVAL_SAMPLES)], file_indices=np.arange(n, n + EVAL_SAMPLES),
                hidden_states_dtype=torch.bfloat16, online_rows=None)
    return train, val


def no_prefetcher(monkeypatch):
    """The source's thread gives it a loop whose queue drops what it is handed (nothing is extracted)."""
    from eagle3pipe import train_online

    def thread(self, started):
        self.loop = SimpleNamespace(call_soon_threadsafe=lambda f, *a: f(*a))
        self.queue = SimpleNamespace(put_nowait=lambda item: None)
        started.set()

    monkeypatch.setattr(train_online.OnlineBatches, "_thread", thread)


def online_source(data_dir, num_rows: int, world: int = 1, rank: int = 0, accum: int = 1, eval_every: int = 0,
                  cache_gb: float = 0.0):
    """(an OnlineBatches without a prefetcher, every rank's run_plan of EPOCHS epochs of num_rows rows, every
    rank's held-out rows: train.make_batches' share of speculators' packing of the held-out samples)."""
    from eagle3pipe.train_batches import packed_batches
    from eagle3pipe.train_online import OnlineBatches

    cfg = load_config(overrides={
        "shared": {"data_dir": str(data_dir), "aux_layer_ids": [1, 2, 3], "hidden_size": 64,
                   "progress_every_s": 0.0},
        "train": {"data_source": "online", "spool_gb": 1.0, "cache_gb": cache_gb, "total_seq_len": 64,
                  "grad_accum": accum, "eval_every_steps": eval_every, "device": "cpu"}})
    train, val = datasets(num_rows)
    epochs = [tiny_rows(num_rows, e) for e in range(EPOCHS)]
    every_rank = [run_plan(epochs, TrainingState(0, 0, 0, 0), 0, world, accum, r, eval_every) for r in range(world)]
    packing = packed_batches(val, cfg.train.total_seq_len, cfg.shared.seed, 0)
    eval_rows = [packing[r::world] for r in range(world)]
    source = OnlineBatches(cfg, train, SimpleNamespace(input="rows", num_layers=4), Ranks(world, rank),
                           torch.device("cpu"), val, eval_rows[rank])
    return source, every_rank, eval_rows


@in_a_fresh_process
def test_the_online_plan_of_every_epoch_holds_tens_of_bytes_a_packed_row(tmp_path, monkeypatch):
    """Issue 27: ``OnlineBatches.plan`` (every epoch's rows handed to the prefetcher, their sample counts for the
    progress line and the epoch records, the spool budget checked against the largest row; with train.cache_gb the
    whole job's cache plan, every rank's reads walked) allocates under 32 bytes a packed row (tracemalloc peak of
    ``plan`` at 5 000 and 20 000 rows of 4 samples an epoch, 3 epochs, held-out rows evaluated after each): 5.3
    without a cache, 20.4 with one (5.7 and 24.3 at 20 000 and 80 000) (an owner and two flags a file, each sample's upper bound of bytes). The code
    before made a Slot (an Event, two sets, a dict, a list of the row's samples, a Path) for every row of every
    epoch before the first step: 2,639 bytes a packed row measured here (main at b43fe38, no cache), ~7.9 GB at
    10^6 rows x 3 epochs a rank."""
    from memory_bound import bytes_per_row

    no_prefetcher(monkeypatch)
    made = iter(range(10**6))

    for cache_gb in (0.0, 1.0):  # one fresh process for both (its start costs more than the measures)
        def setup(num_rows: int):
            source, every_rank, _ = online_source(tmp_path / f"run{next(made)}", num_rows, cache_gb=cache_gb)
            return lambda: source.plan(every_rank[0], every_rank)

        per_row = bytes_per_row(setup, 5000, 20000) / EPOCHS
        print(f"\n04 online's plan (train.cache_gb {cache_gb:g}) allocates {per_row:.1f} bytes a packed row")
        assert per_row < 32, cache_gb


def reference_cache_plan(reads, file_bytes, budget):
    """The cache plan as 04 computed it before (each read's roles decided as the job's reads are walked), the
    reference ``plan_cache``'s rule (roles from the owners alone) must give."""
    owners, roles, reserved = {}, [], 0
    for rank, held_out, real, samples in reads:
        keeps, reuses = set(), set()
        for i in samples:
            f, need = file_bytes(held_out, i)
            if f in owners:
                reuses.add(f)
            elif real and reserved + need <= budget:
                owners[f], reserved = rank, reserved + need
                keeps.add(f)
        roles.append((rank, keeps, reuses))
    return owners, roles, reserved


def test_the_online_plan_is_made_row_by_row_in_the_run_order_with_the_cache_roles(tmp_path, monkeypatch):
    """Rank 1 of 2, grad_accum 2 (an epoch's last step has placeholder rows), an evaluation every 3 steps, a cache
    of about half the samples: the slots the prefetcher (``next_planned``) and the training loop (``slot``) get
    are made row by row in the order of the job's reads (``job_reads``, rank 1's), with the samples, placeholder
    flag, cache roles and spool reservation the whole-job plan gives each read (the rule before: roles decided while
    walking every read); the prefetcher and the loop get the same slot whichever asks first; a slot is forgotten
    once its files are deleted, so no more slots exist than rows in the window; the epochs' sample totals are the
    plan's."""
    from eagle3pipe.train_online import job_reads, plan_cache

    no_prefetcher(monkeypatch)
    world, rank, accum = 2, 1, 2
    source, every_rank, eval_rows = online_source(tmp_path / "run", 51, world, rank, accum, eval_every=3,
                                                  cache_gb=1e-3)
    assert len(eval_rows[rank]) > 1

    def file_bytes(held_out, i):
        dataset = source.val_dataset if held_out else source.dataset
        return dataset.file_index(i), source.row_bytes([i], dataset)

    reads = list(job_reads(every_rank, eval_rows, accum))
    owners, roles, _ = reference_cache_plan(reads, file_bytes, source.cache_budget)
    assert 0 < len(owners) < len({f for _, h, _, s in reads for f in (file_bytes(h, i)[0] for i in s)})
    assert any(not real for _, _, real, _ in reads) and any(h for _, h, _, _ in reads)
    got = plan_cache(reads, file_bytes, source.cache_budget)
    assert got[0] == owners and got[1] == roles

    source.plan(every_rank[rank], every_rank)
    assert {int(f) for f in np.flatnonzero(source.cache_owner >= 0)} == set(owners)
    mine = [(read, role) for read, role in zip(reads, roles) if read[0] == rank]
    keys = list(source.plan_order(every_rank[rank]))
    assert len(keys) == len(mine)
    pulled, most, totals = [], 0, {}
    for n, (key, ((_, held_out, real, samples), (_, keeps, reuses))) in enumerate(zip(keys, mine)):
        while (n // 10) % 2 == 0 and len(pulled) < 3:  # the prefetcher 3 rows ahead, then the loop asking first
            pulled.append(source.next_planned())
        slot = source.slot(key)
        assert slot is (pulled.pop(0) if pulled else source.next_planned())
        assert (slot.key, slot.held_out, slot.samples, slot.repeat) == (key, held_out, list(samples), not real)
        assert (slot.keeps, slot.reuses) == (keeps, reuses)
        assert slot.reserved == source.row_bytes(
            [i for i in samples if file_bytes(held_out, i)[0] not in keeps | reuses], slot.dataset)
        totals[key[0]] = totals.get(key[0], 0) + (len(samples) if real else 0)
        most = max(most, len(source.live))
        source._release(slot)
    assert source.next_planned() is None and not source.live and most == 3
    assert {e: c["total"] for e, c in source.epochs.items()} == totals
    assert source.progress.total == sum(totals.values())
    assert [source.epochs[p.epoch]["rows"] for p in every_rank[rank]] == [len(p.rows) for p in every_rank[rank]]
