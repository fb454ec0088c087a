"""Stage 04 on CPU with the toy verifier: train, evaluate, checkpoint, resume, warm start, export (bf16 and fp8)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from memory_bound import in_a_fresh_process
from eagle3pipe import draft
from eagle3pipe.cli import StageError, run_stage
from eagle3pipe.records import DataDir, load_hidden_states, read_jsonl
from eagle3pipe.records_checkpoints import list_train_checkpoints
from eagle3pipe.train import build_data, run_train
from eagle3pipe.vocab import run_vocab
from tests.test_draft_fixtures import (
    TOY_AUX,
    make_flat_checkpoint,
    make_rows,
    toy_config,
    write_hidden_states,
    write_rows,
)

REPO = Path(__file__).resolve().parents[1]


def _prepare(data_dir, verifier, rows, storage="bf16", **train):
    write_rows(data_dir, rows)
    write_hidden_states(data_dir, verifier, rows, storage_dtype=storage)
    cfg = toy_config(data_dir, verifier, **train)
    run_vocab(cfg)
    return cfg


def _metrics(data_dir, kind):
    return [r for r in read_jsonl(DataDir(data_dir).train_metrics) if r["kind"] == kind]


def test_train_toy_end_to_end_through_the_door(tmp_path, toy_llama):
    rows = make_rows(24, seed=3)
    _prepare(tmp_path, toy_llama, rows)
    argv = ["--data-dir", str(tmp_path), "--verifier", str(toy_llama), "--vocab-size", "1088", "--hidden-size", "128",
            "--draft-vocab-size", "256", "--aux-layer-ids", "2", "4", "5", "--device", "cpu", "--epochs", "2",
            "--total-seq-len", "256", "--eval-fraction", "0.2", "--num-workers", "0", "--log-every", "1",
            "--checkpoint-every", "2", "--learning-rate", "3e-3", "--draft-num-heads", "4", "--draft-head-dim", "64",
            "--draft-intermediate-size", "256", "--max-seq-len", "256"]
    assert run_stage("train", "04_train", run_train, None, argv) == 0
    dd = DataDir(tmp_path)
    train = _metrics(tmp_path, "train")
    evals = _metrics(tmp_path, "eval")
    assert [r["step"] for r in train] == list(range(1, len(train) + 1)) and len(train) >= 4
    assert [r["epoch"] for r in evals] == [0, 1]  # one held-out evaluation per epoch
    for r in train + evals:
        assert all(k in r for k in ("loss_1", "loss_2", "loss_3", "acc_1", "acc_2", "acc_3"))
    assert train[-1]["loss"] < train[0]["loss"]  # it learns
    steps = [s for s, _ in list_train_checkpoints(dd.checkpoints)]
    assert steps[-1] == len(train) and all(s % 2 == 0 for s in steps[:-1])  # every 2 steps + the end
    assert dd.train_curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ck = draft.read_flat_checkpoint(dd.final_checkpoint)  # strict reader: the vLLM layout, complete
    assert ck.aux_layer_ids == TOY_AUX and ck.config["head_dim"] == 64
    # a second run without --resume refuses to overwrite; with --resume it finds nothing left to do
    assert run_stage("train", "04_train", run_train, None, argv) == 2
    assert run_stage("train", "04_train", run_train, None, argv + ["--resume"]) == 0
    assert len(_metrics(tmp_path, "train")) == len(train)


def test_resume_after_kill_continues_the_same_loss_curve(tmp_path, toy_llama):
    rows = make_rows(24, seed=4)
    a, b = tmp_path / "a", tmp_path / "b"
    cfg_a = _prepare(a, toy_llama, rows, checkpoint_every=2)
    run_train(cfg_a)  # uninterrupted
    cfg_b = _prepare(b, toy_llama, rows, checkpoint_every=2)
    dd = DataDir(b)
    config_file = tmp_path / "b.yaml"
    config_file.write_text(yaml.safe_dump(cfg_b.to_dict()))
    proc = subprocess.Popen([sys.executable, str(REPO / "04_train.py"), "--config", str(config_file)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list_train_checkpoints(dd.checkpoints) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # the kill: no chance to write anything more
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not dd.final_checkpoint.exists()
    killed_at = list_train_checkpoints(dd.checkpoints)[-1][0]
    total = len(_metrics(a, "train"))
    assert 2 <= killed_at < total
    cfg_b.train.resume = True
    run_train(cfg_b)
    full, resumed = _metrics(a, "train"), _metrics(b, "train")
    assert [r["step"] for r in resumed] == [r["step"] for r in full]  # each step logged once: the log reads as one run
    for x, y in zip(full, resumed):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6), x["step"]
        assert x["lr"] == pytest.approx(y["lr"])
    for x, y in zip(_metrics(a, "eval"), _metrics(b, "eval"), strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
    wa = load_file(str(DataDir(a).final_checkpoint / "model.safetensors"))
    wb = load_file(str(dd.final_checkpoint / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k].float(), wb[k].float(), rtol=0, atol=1e-2)


def test_fp8_hidden_states_are_dequantised_and_train(tmp_path, toy_llama):
    """fp8 files travel through the loader as e4m3 + per-token scales and are dequantised after the copy; the batch
    the draft sees equals, bit for bit, the one speculators' own path gives (FP8Transfer dequantises in the worker,
    then its CollateFn packs)."""
    from hs_connectors.transfer import FP8Transfer
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    from eagle3pipe.train_batches import EpochBatches, make_loader, packed_batches
    from eagle3pipe.train_data import device_batches

    rows = make_rows(12, seed=5)
    cfg = _prepare(tmp_path, toy_llama, rows, storage="fp8", epochs=1, eval_fraction=0.0)
    dd = DataDir(tmp_path)
    raw = load_file(str(dd.hs_file(0)))
    assert raw["hidden_states"].dtype == torch.float8_e4m3fn
    want = raw["hidden_states"].float() * raw["hidden_states_scales"].float()  # [T, 4, H]
    torch.testing.assert_close(load_hidden_states(dd.hs_file(0), torch.float32)["hidden_states"], want)
    train_ds, _, _ = build_data(cfg, torch.device("cpu"))
    assert train_ds[0]["hidden_states"].dtype == torch.float8_e4m3fn  # still quantised in the loader
    sampler = EpochBatches()
    sampler.set(packed_batches(train_ds, cfg.train.total_seq_len, cfg.shared.seed, 0))
    ours = [gpu for _, gpu in device_batches(make_loader(train_ds, sampler, cfg, torch.device("cpu")),
                                             torch.device("cpu"), torch.float32)]
    theirs_ds = ArrowDataset(max_len=cfg.train.total_seq_len, datapath=str(dd.hidden_states), on_missing="raise",
                             transfer=FP8Transfer(dd.hs_files, dequantize_dtype=torch.float32),
                             hidden_states_dtype=torch.float32)
    collate = CollateFn(cfg.train.total_seq_len, cfg.shared.hidden_size, dtype=torch.float32, preprocess=shift_batch)
    theirs = [collate([theirs_ds[i] for i in b]) for b in sampler]
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs):
        assert set(a) == {k for k, v in b.items() if isinstance(v, torch.Tensor)}
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    run_train(cfg)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in _metrics(tmp_path, "train"))


def test_finetune_with_zero_lr_exports_the_input_tensors(tmp_path, toy_llama):
    rows = make_rows(12, seed=6)
    src = make_flat_checkpoint(tmp_path / "aq", seed=7)
    data = tmp_path / "d"
    cfg = _prepare(data, toy_llama, rows, finetune_from=str(src), learning_rate=0.0, epochs=1, eval_fraction=0.0)
    out = run_train(cfg)
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert json.loads((out / "config.json").read_text())["head_dim"] == 64


def test_finetune_refuses_a_vocab_built_without_the_checkpoint(tmp_path, toy_llama):
    rows = make_rows(12, seed=8)
    src = make_flat_checkpoint(tmp_path / "aq")
    cfg = _prepare(tmp_path / "d", toy_llama, rows)  # vocab/ from our data only
    cfg.train.finetune_from = str(src)
    with pytest.raises(StageError, match="--finetune-from"):
        run_train(cfg)


def test_finetune_on_a_rebuilt_map_trains_from_remapped_rows(tmp_path, toy_llama):
    rows = make_rows(20, seed=9)
    src = make_flat_checkpoint(tmp_path / "aq", targets=list(range(1, 2 * 256, 2)), seed=8)  # odd ids only
    data = tmp_path / "d"
    write_rows(data, rows)
    write_hidden_states(data, toy_llama, rows)
    cfg = toy_config(data, toy_llama, finetune_from=str(src), learning_rate=0.0, epochs=1, eval_fraction=0.0)
    cfg.vocab.rebuild = True
    summary = run_vocab(cfg)
    assert summary.source == "rebuilt" and 0 < summary.shared_with_checkpoint < 256
    out = run_train(cfg)
    exported = draft.read_flat_checkpoint(out)
    ck = draft.read_flat_checkpoint(src)
    old = {int(i + ck.d2t[i]): ck.tensors["lm_head.weight"][i] for i in range(256)}
    new_targets = [int(i + exported.d2t[i]) for i in range(256)]
    kept = [i for i, tid in enumerate(new_targets) if tid in old]
    assert len(kept) == summary.shared_with_checkpoint
    for i in kept:
        assert torch.equal(exported.tensors["lm_head.weight"][i], old[new_targets[i]])


def _door_argv(data_dir, verifier, *extra: str) -> list[str]:
    """04_train.py's flags for the toy (the door's argv, parsed and validated like the script's)."""
    return ["--data-dir", str(data_dir), "--verifier", str(verifier), "--vocab-size", "1088", "--hidden-size", "128",
            "--draft-vocab-size", "256", "--aux-layer-ids", "2", "4", "5", "--device", "cpu", "--epochs", "1",
            "--total-seq-len", "256", "--max-seq-len", "256", "--eval-fraction", "0", "--num-workers", "0",
            "--log-every", "1", "--draft-num-heads", "4", "--draft-head-dim", "64", "--draft-intermediate-size",
            "256", *extra]


def _train_door(argv, capsys) -> tuple[int, str]:
    code = run_stage("train", "04_train", run_train, None, argv)
    return code, capsys.readouterr().err


# -- issue 12 item 5: rows longer than a packed training row --------------------------------------------------------


def test_speculators_cuts_a_sample_longer_than_a_packed_row(tmp_path, toy_llama):
    """What the refusal below prevents, pinned on speculators 0.9 itself: a sample longer than total_seq_len is
    packed alone (its sampler clips the length) and its collate keeps only the first total_seq_len tokens."""
    from speculators.train.data import ArrowDataset

    from eagle3pipe.train_batches import EpochBatches, make_loader, packed_batches

    rows = make_rows(6, seed=20, min_len=30, max_len=50) + make_rows(1, seed=21, min_len=120, max_len=120)
    cfg = _prepare(tmp_path, toy_llama, rows, total_seq_len=64, epochs=1, eval_fraction=0.0)
    ds = ArrowDataset(max_len=64, datapath=str(DataDir(tmp_path).hidden_states), on_missing="raise",
                      hidden_states_dtype=torch.float32)
    batches = packed_batches(ds, 64, seed=0, epoch=0)
    alone = [b for b in batches if 6 in b]
    assert alone == [[6]]  # the 120-token sample fills a row by itself
    sampler = EpochBatches()
    sampler.set(alone)
    batch = next(iter(make_loader(ds, sampler, cfg, torch.device("cpu"))))
    kept = int((batch["document_ids"] == 0).sum())
    assert kept == 64  # 64 of its 120 (119 after the one-token shift) positions reach the loss; the rest never do
    assert torch.equal(batch["input_ids"][0, :kept], torch.tensor(rows[6].input_ids[1:65]))


def test_samples_longer_than_a_packed_row_are_refused(tmp_path, toy_llama, capsys):
    rows = make_rows(12, seed=22, min_len=40, max_len=60)
    _prepare(tmp_path, toy_llama, rows)
    code, err = _train_door(_door_argv(tmp_path, toy_llama, "--total-seq-len", "48", "--max-seq-len", "48"), capsys)
    longest = max(len(r.input_ids) for r in rows)
    assert code == 2 and "longer than train.total_seq_len 48" in err and f"longest {longest}" in err, err
    assert not DataDir(tmp_path).final_checkpoint.exists()
    # the config check names both keys before anything runs (every stage that keeps or uses rows)
    code, err = _train_door(_door_argv(tmp_path, toy_llama, "--total-seq-len", "48", "--max-seq-len", "64"), capsys)
    assert code == 2 and "shared.max_seq_len 64 exceeds train.total_seq_len 48" in err, err


# -- issue 12 item 9: states from another verifier / config; the first update's rate; lm_head -----------------------


def test_hidden_states_from_another_verifier_or_config_are_refused(tmp_path, toy_llama, capsys):
    import shutil

    from eagle3pipe.toy import build_toy_verifier

    rows = make_rows(12, seed=23)
    data = tmp_path / "d"
    _prepare(data, toy_llama, rows)  # manifest: states from toy_llama
    other = build_toy_verifier(tmp_path / "other", "llama", seed=5)  # same architecture, other weights
    code, err = _train_door(_door_argv(data, other), capsys)
    assert code == 2 and f"extracted from verifier {toy_llama.resolve()}" in err and f"--verifier is {other}" in err
    copy = tmp_path / "copy"
    shutil.copytree(toy_llama, copy)  # the same checkpoint at another path is accepted
    config_file = tmp_path / "c.yaml"
    config_file.write_text(yaml.safe_dump({"extract": {"storage_dtype": "fp8"}}))
    code, err = _train_door(["--config", str(config_file), *_door_argv(data, copy)], capsys)
    assert code == 2 and "storage_dtype bf16" in err and "extract.storage_dtype fp8" in err, err  # config != states
    assert _train_door(_door_argv(data, copy, "--max-steps", "1"), capsys)[0] == 0


# -- issue 19 item 2: every file read is checked against the layers the manifest says -----------------------------


@pytest.mark.parametrize("case", ["other_layer_ids", "no_metadata"])
def test_a_file_of_other_layers_is_refused_as_it_is_read(tmp_path, toy_llama, capsys, case):
    """One file among the manifest's holds states of layer ids [1, 3, 4, 8] (a server of the other convention), or
    no metadata at all: 04 stops on it, naming the file and both id lists, instead of training on it."""
    from eagle3pipe.records import hs_file_metadata, save_hidden_states

    rows = make_rows(12, seed=24)
    _prepare(tmp_path, toy_llama, rows)
    bad = DataDir(tmp_path).hs_file(3)
    data = load_file(str(bad))
    meta = hs_file_metadata([1, 3, 4, 8], 8) if case == "other_layer_ids" else None
    save_hidden_states(bad, data["hidden_states"], data["token_ids"], "bf16", metadata=meta)
    code, err = _train_door(_door_argv(tmp_path, toy_llama), capsys)
    assert code == 2 and f"{bad}: " in err, err
    if case == "other_layer_ids":
        assert "states of layer ids [1, 3, 4, 8] from a 8-layer verifier" in err and "stores [2, 4, 5, 8]" in err
    else:
        assert "its metadata lacks ['layer_ids', 'num_layers', 'all_finite']" in err
    assert not DataDir(tmp_path).final_checkpoint.exists()


def test_first_update_runs_at_a_nonzero_rate_and_metrics_log_the_rate_used(tmp_path, toy_llama):
    import math

    rows = make_rows(24, seed=24)
    src = make_flat_checkpoint(tmp_path / "aq", seed=25)
    data = tmp_path / "d"
    peak, warmup_ratio = 1e-3, 0.3
    cfg = _prepare(data, toy_llama, rows, finetune_from=str(src), learning_rate=peak, epochs=2, eval_fraction=0.0,
                   warmup_ratio=warmup_ratio, total_seq_len=256, max_steps=1)
    out = run_train(cfg)  # one update only
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    moved = [k for k in a if k not in ("d2t", "t2d", "lm_head.weight") and not torch.equal(a[k], b[k])]
    assert "fc.weight" in moved and "midlayer.self_attn.q_proj.weight" in moved  # the first update changed weights
    # a full run: every row's lr is the rate its own update used (independent schedule: linear warm-up from
    # 1/W of the peak, then cosine to 0 after the last update)
    cfg.train.max_steps, cfg.train.overwrite = 0, True
    run_train(cfg)
    train = _metrics(data, "train")
    total = len(train)
    warmup = math.ceil(warmup_ratio * total)
    assert warmup >= 2
    for row in train:
        i = row["step"] - 1  # update index
        want = peak * ((i + 1) / warmup if i < warmup else
                       0.5 * (1 + math.cos(math.pi * (i - warmup) / (total - warmup))))
        assert row["lr"] == pytest.approx(want, rel=1e-9), row["step"]
    assert train[0]["lr"] == pytest.approx(peak / warmup) and train[-1]["lr"] > 0


def test_train_lm_head_trains_the_draft_head_only_when_asked(tmp_path, toy_llama, capsys):
    rows = make_rows(16, seed=26)
    verifier_head = load_file(str(toy_llama / "model.safetensors"))["lm_head.weight"]
    heads = {}
    for flag in ("--no-train-lm-head", "--train-lm-head"):
        data = tmp_path / flag.strip("-")
        _prepare(data, toy_llama, rows)
        code, err = _train_door(_door_argv(data, toy_llama, flag, "--learning-rate", "3e-3"), capsys)
        assert code == 0, err
        ck = draft.read_flat_checkpoint(DataDir(data).final_checkpoint)
        rows_of_draft_vocab = verifier_head[torch.arange(256) + ck.d2t]  # the verifier's rows of the draft tokens
        heads[flag] = (ck.tensors["lm_head.weight"], rows_of_draft_vocab)
    frozen, rows_v = heads["--no-train-lm-head"]
    assert torch.equal(frozen, rows_v)  # speculators' default: the verifier's rows, untrained
    trained, rows_v = heads["--train-lm-head"]
    assert not torch.equal(trained, rows_v)
    assert (trained.float() - rows_v.float()).abs().max() > 1e-3


def test_finetune_without_aux_ids_takes_the_verifier_default(tmp_path, toy_llama, caplog):
    rows = make_rows(12, seed=27)
    src = make_flat_checkpoint(tmp_path / "aq", seed=28)
    config = json.loads((src / "config.json").read_text())
    del config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]  # as some SpecForge exports ship
    (src / "config.json").write_text(json.dumps(config))
    cfg = _prepare(tmp_path / "d", toy_llama, rows, finetune_from=str(src), learning_rate=0.0, epochs=1,
                   eval_fraction=0.0)
    with caplog.at_level("WARNING"):
        out = run_train(cfg)
    # the toy verifier has 8 layers: default (2, 8 // 2, 8 - 3) = (2, 4, 5), the layers our states hold
    assert "names no aux layer ids" in caplog.text and "[2, 4, 5]" in caplog.text
    assert draft.read_flat_checkpoint(out).aux_layer_ids == TOY_AUX


@pytest.mark.parametrize("per_state", [False, True])
def test_fp8_device_dequantisation_equals_hs_connectors(per_state):
    """train_data.to_device on a collated fp8 batch == hs_connectors' dequantize_fp8_tensor per sample, bit for bit,
    for one scale per token ([T, 1, 1]) and one per token and state ([T, 4, 1])."""
    from hs_connectors.fp8_utils import dequantize_fp8_tensor
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    from eagle3pipe.train_data import FP8_SCALES, shift_batch_with_scales, to_device

    g = torch.Generator().manual_seed(0)
    h, lengths, max_len = 16, (7, 5), 16
    ours, ref = [], []
    for t in lengths:
        values = (torch.randn(t, 4, h, generator=g) * 40).to(torch.float8_e4m3fn)
        scales = torch.rand(t, 4 if per_state else 1, 1, generator=g) + 0.01
        deq = dequantize_fp8_tensor(values, scales, dtype=torch.float32)  # [T, 4, H]
        common = {"input_ids": torch.arange(t), "loss_mask": torch.ones(t, dtype=torch.long),
                  "lengths": torch.tensor([t]), "position_ids": torch.arange(t)}
        ours.append({**common, "hidden_states": values[:, :3].flatten(1), "verifier_last_hidden_states": values[:, 3],
                     FP8_SCALES: scales.reshape(t, -1)})
        ref.append({**common, "hidden_states": deq[:, :3].flatten(1), "verifier_last_hidden_states": deq[:, 3]})
    a = to_device(CollateFn(max_len, h, dtype=torch.float8_e4m3fn, preprocess=shift_batch_with_scales)(ours),
                  torch.device("cpu"), torch.float32)
    b = CollateFn(max_len, h, dtype=torch.float32, preprocess=shift_batch)(ref)
    for key in ("hidden_states", "verifier_last_hidden_states"):
        assert a[key].dtype == torch.float32 and torch.equal(a[key], b[key]), key


# -- issue 27: the plan of every epoch as arrays --------------------------------------------------------------------


@in_a_fresh_process
def test_the_plan_of_every_epoch_keeps_tens_of_bytes_a_sample():
    """Issue 27: 04 plans every epoch's packed rows before its first step (``packed_batches`` per epoch, each rank's
    ``run_plan``); they are kept as arrays (``PackedRows``: 8 bytes a sample and a row), not a Python list per row.
    What the plan of 3 epochs keeps (tracemalloc, what stays allocated while it is held; speculators' own packing
    allocates ~76 bytes a sample for a moment, per epoch) at 5 000 and 20 000 samples of 8-16 tokens, rank 0 of 8:
    under 40 bytes a sample (the lists before: ~150). The plan is the lists' plan: the same rows, in the same order."""
    import gc
    import tracemalloc
    from types import SimpleNamespace

    from eagle3pipe.records_checkpoints import TrainingState
    from eagle3pipe.train import run_plan
    from eagle3pipe.train_batches import packed_batches

    def kept(n: int) -> int:
        ds = SimpleNamespace(approx_lengths=[8 + i % 9 for i in range(n)])
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            epochs = [packed_batches(ds, 256, 0, e) for e in range(3)]
            plans = run_plan(epochs, TrainingState(0, 0, 0, 0), 0, 8, 1, 0)
            gc.collect()
            return tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
            del epochs, plans

    packed_batches(SimpleNamespace(approx_lengths=[8] * 64), 256, 0, 0)  # import speculators' sampler untraced:
    kept(5000)  # ~20 s under tracemalloc; then warm what else happens once per process
    per_sample = (kept(20000) - kept(5000)) / 15000
    print(f"\nthe plan of 3 epochs keeps {per_sample:.1f} bytes a sample")
    assert per_sample < 40

    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    ds = SimpleNamespace(approx_lengths=[8 + i % 9 for i in range(3000)])
    for epoch in range(2):  # independently: speculators' batches as lists
        reference = [b.tolist() for b in MultipackDistributedBatchSamplerV2(
            batch_max_length=256, lengths=ds.approx_lengths, num_replicas=1, rank=0, seed=0)._generate_batches(epoch)]
        packed = packed_batches(ds, 256, 0, epoch)
        assert list(packed) == reference and len(packed) == len(reference) and packed[-1] == reference[-1]
        plan = run_plan([packed], TrainingState(0, 0, 0, 0), 0, 3, 2, 1)[0]
        assert list(plan.rows) == [reference[i] for i, _ in plan.plan]


class _KeepsEveryRank:
    """A source that keeps every rank's plan, as the online source's shared cache plan needs (train.cache_gb > 0)."""

    plans_every_rank = True
    every_rank = None

    def plan(self, epochs, every_rank=None):
        self.every_rank = every_rank


@in_a_fresh_process
def test_the_plan_of_every_epoch_keeps_a_few_bytes_a_packed_row_at_every_world_size(tmp_path):
    """Issue 27: ``plan_epochs`` (each rank's ``run_plan`` of 3 epochs: its rows' positions in the packing and
    whether each is real or a weight-0 placeholder, and its rows) at 5 000 and 20 000 packed rows of 4 samples an
    epoch (tracemalloc peak, per packed row an epoch), at world 1 and 4, this rank's plan and every rank's. The rows
    alone are 40 bytes a packed row over every rank (``PackedRows``: 8 a sample and a row). The plan's positions and
    flags are arrays (9 bytes a row), and only this rank's plan is built unless the source plans the whole job
    (online with train.cache_gb: every rank's reads). Measured: 59 bytes at world 1 (the arrays being packed for a
    moment count in the peak), 55 every rank's and 18 this rank's at world 4 (62, 51 and 15 at 20 000 and 80 000). Before (main at eb98b8b): a Python list of (position, real) tuples a rank, every rank's
    built on every rank whatever the source: 156 bytes at world 1, 141 at world 4."""
    from memory_bound import bytes_per_row

    from eagle3pipe.config import load_config
    from eagle3pipe.records_checkpoints import TrainingState
    from eagle3pipe.train import plan_epochs
    from eagle3pipe.train_batches import EpochBatches, OfflineBatches, PackedRows, Ranks

    cfg = load_config(overrides={"shared": {"data_dir": str(tmp_path)}, "train": {"epochs": 3, "device": "cpu"}})

    def epochs(num_rows: int) -> list[PackedRows]:
        return [PackedRows(np.random.default_rng(e).permutation(4 * num_rows),
                           np.arange(0, 4 * num_rows + 1, 4, dtype=np.int64)) for e in range(3)]

    # one fresh process for the 4 cases (a process start costs more than the measures)
    for world, every_rank in ((1, False), (4, False), (1, True), (4, True)):
        def setup(num_rows: int):
            packing = epochs(num_rows)
            source = _KeepsEveryRank() if every_rank else OfflineBatches(None, EpochBatches())
            return lambda: plan_epochs(cfg, packing, TrainingState(0, 0, 0, 0), Ranks(world, world - 1), source,
                                       held_out=False)

        per_row = bytes_per_row(setup, 5000, 20000) / 3
        print(f"\nthe plan of 3 epochs at world {world} ({'every rank' if every_rank else 'this rank'}) keeps "
              f"{per_row:.1f} bytes a packed row an epoch")
        # every rank's positions, flags and rows (~49 bytes a packed row, and what packing them holds for a
        # moment), or this rank's share of them
        assert per_row < (80 if every_rank else 80 / world + 4), (world, every_rank)


@pytest.mark.parametrize("world,accum,start", [(1, 1, 0), (1, 3, 2), (4, 1, 0), (4, 2, 1), (3, 4, 0)])
def test_the_plan_s_arrays_are_the_row_split(tmp_path, world, accum, start):
    """``rank_rows`` as arrays (``RankRows``) is the row split it was as a list of (position, real) tuples (an
    independent loop here): every rank its rows s*G + a*world + r, a placeholder at the step's first row past the
    epoch's end; Python values out of it; ``plan_epochs`` builds only this rank's plan for an offline source, the
    same as ``run_plan``'s, and every rank's for a source that plans the whole job."""
    from eagle3pipe.config import load_config
    from eagle3pipe.records_checkpoints import TrainingState
    from eagle3pipe.train import plan_epochs, rank_rows, run_plan
    from eagle3pipe.train_batches import EpochBatches, OfflineBatches, PackedRows, Ranks

    num_rows = 23
    group = world * accum
    for rank in range(world):
        reference = [(s * group + a * world + rank, True) if s * group + a * world + rank < num_rows
                     else (s * group, False)
                     for s in range(start, -(-num_rows // group)) for a in range(accum)]
        got = rank_rows(num_rows, world, accum, rank, start)
        assert list(got) == reference and len(got) == len(reference)
        assert [got[k] for k in range(len(got))] == reference and list(got[1:3]) == reference[1:3]
        assert all(type(p) is int and type(r) is bool for p, r in got) and (not got or type(got[0][0]) is int)

    cfg = load_config(overrides={"shared": {"data_dir": str(tmp_path)},
                                 "train": {"epochs": 2, "device": "cpu", "grad_accum": accum}})
    packing = [PackedRows(np.arange(2 * num_rows), np.arange(0, 2 * num_rows + 1, 2)) for _ in range(2)]
    state = TrainingState(0, 0, 0, 0)
    for rank in range(world):
        mine = [(p.epoch, list(p.plan), list(p.rows)) for p in run_plan(packing, state, 0, world, accum, rank)]
        offline = OfflineBatches(None, EpochBatches())
        plans = plan_epochs(cfg, packing, state, Ranks(world, rank), offline, held_out=False)
        assert [(p.epoch, list(p.plan), list(p.rows)) for p in plans.values()] == mine
        whole = _KeepsEveryRank()
        plan_epochs(cfg, packing, state, Ranks(world, rank), whole, held_out=False)
        assert len(whole.every_rank) == world
        assert [(p.epoch, list(p.plan), list(p.rows)) for p in whole.every_rank[rank]] == mine


@pytest.mark.parametrize("world,accum", [(1, 1), (2, 1), (3, 2)])
def test_the_epoch_s_rows_record_counts_every_row_once(world, accum):
    """``check_rows_trained`` (the epoch's "rows" record, counted with arrays): every packed row from the resumed
    step on trained once over the ranks gives its counts; a row trained twice, one not trained, or a position
    outside the epoch's rows is a StageError."""
    from eagle3pipe.cli import StageError
    from eagle3pipe.train import check_rows_trained, rank_rows
    from eagle3pipe.train_batches import PackedRows

    sizes = [1 + i % 4 for i in range(23)]
    rows = PackedRows(np.arange(sum(sizes)), np.concatenate([[0], np.cumsum(sizes)]))
    group = world * accum
    for start in range(-(-len(sizes) // group) + 1):
        trained = [[p for p, real in rank_rows(len(sizes), world, accum, r, start) if real] for r in range(world)]
        first = start * group
        want = {"kind": "rows", "epoch": 1, "rows": max(0, len(sizes) - first), "packed_rows": len(sizes),
                "from_row": first if first < len(sizes) else 0, "samples": sum(sizes[first:]),
                "rows_per_rank": [len(r) for r in trained]}
        assert check_rows_trained(trained, rows, start, group, 1) == want
        assert check_rows_trained(trained, list(rows), start, group, 1) == want
        if first < len(sizes):
            for wrong in ([trained[0] + trained[0][:1]] + trained[1:], [trained[0][1:]] + trained[1:],
                          [trained[0] + [len(sizes)]] + trained[1:]):
                with pytest.raises(StageError, match="a bug in the row split"):
                    check_rows_trained(wrong, rows, start, group, 1)
