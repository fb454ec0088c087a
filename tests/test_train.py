"""Stage 04 on CPU with the toy verifier: train, evaluate, checkpoint, resume, warm start, export (bf16 and fp8)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from eagle3pipe import draft
from eagle3pipe.cli import StageError, run_stage
from eagle3pipe.records import DataDir, list_train_checkpoints, load_hidden_states, read_jsonl
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
            "--draft-intermediate-size", "256"]
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

    from eagle3pipe.train import EpochBatches, make_loader, packed_batches
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
