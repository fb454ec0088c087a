"""Stage 04 data-parallel under torchrun (issue 17), on CPU with gloo and the toy verifier.

One dataset whose epochs pack into an odd number of rows (9, checked against speculators' own packer below), so the
last step of every epoch holds one row for two processes. Runs, each through the 04 door:
  a: torchrun, 2 processes x grad_accum 1, uninterrupted;
  b: 1 process x grad_accum 2 (no torchrun);
  c: torchrun, 2 processes, rank 1 SIGKILLed after the first checkpoint, then --resume on 2 processes.
a, b and c must give the same draft, loss curve and held-out evaluation within fp32 reduction-order tolerance
(rtol 1e-5, atol 1e-6 on every fp32 checkpoint tensor; on this machine they come out bit-identical: DDP's average
of two gradients and grad_accum's sum of two halves round alike). Issue 29's settings ride along: a log line every
2 steps (means over the steps since the line before, pooled over ranks), a held-out evaluation every 3 steps (in
the middle of epochs too), and hidden-state noise seeded by the packed row (so every rank layout adds the same).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from eagle3pipe.cli import run_stage
from eagle3pipe.records import DataDir, read_jsonl
from eagle3pipe.records_checkpoints import list_train_checkpoints, load_train_checkpoint
from eagle3pipe.train import rank_rows, run_train
from eagle3pipe.vocab import run_vocab
from tests.test_draft_fixtures import make_rows, toy_config, write_hidden_states, write_rows

from watch import kill_group, wait_until

REPO = Path(__file__).resolve().parents[1]
ROWS = dict(num_rows=30, seed=31)
TRAIN = dict(total_seq_len=128, epochs=2, eval_fraction=0.2, checkpoint_every=2, cpu_threads=1, learning_rate=3e-3,
             keep_checkpoints=0, log_every=2, eval_every_steps=3, hidden_noise_std=0.05)
EPOCH_ROWS = 9  # packed rows per epoch (asserted against speculators' packer)
STEPS = 2 * math.ceil(EPOCH_ROWS / 2)
LOGGED = list(range(2, STEPS + 1, 2))  # log_every 2 (checkpoint_every 2 too: a resume starts a line's window)
EVALUATED = [3, 6, 9, 10]  # eval_every_steps 3 and the last step


def _prepare(data_dir: Path, verifier: Path, **train) -> Path:
    """Stages 02 and 03's outputs for the shared rows; returns a config file for the 04 door."""
    rows = make_rows(ROWS["num_rows"], seed=ROWS["seed"])
    write_rows(data_dir, rows)
    write_hidden_states(data_dir, verifier, rows)
    cfg = toy_config(data_dir, verifier, **{**TRAIN, **train})
    run_vocab(cfg)
    path = data_dir.parent / f"{data_dir.name}.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return path


def _torchrun(config: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(REPO / "04_train.py"), "--config", str(config), *flags]


def _env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


def _metrics(data_dir: Path, kind: str) -> list[dict]:
    return [r for r in read_jsonl(DataDir(data_dir).train_metrics) if r["kind"] == kind]


def _weights(data_dir: Path, step: int) -> dict:
    return load_train_checkpoint(DataDir(data_dir).checkpoint_step(step))[0]


@pytest.fixture(scope="module")
def runs(toy_llama, tmp_path_factory):
    """Data dirs of runs a (2 processes), b (1 process x grad_accum 2) and c (2 processes killed, resumed), with
    c's killed job's result and output."""
    root = tmp_path_factory.mktemp("ddp")
    out: dict = {}
    a = _prepare(root / "a", toy_llama)
    res = subprocess.run(_torchrun(a), cwd=REPO, env=_env(), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    out["a"] = root / "a"
    _prepare(root / "b", toy_llama, grad_accum=2)
    run_train(toy_config(root / "b", toy_llama, **{**TRAIN, "grad_accum": 2}))
    out["b"] = root / "b"
    c = _prepare(root / "c", toy_llama)
    dd = DataDir(root / "c")
    log = open(root / "c_killed.out", "wb")
    proc = subprocess.Popen(_torchrun(c), cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_until(lambda: list_train_checkpoints(dd.checkpoints), proc, "a first checkpoint")
        rank1 = int(re.search(r"rank 1 of 2 \(local rank 1, pid (\d+)\)",
                              dd.log_file("04_train.rank1").read_text()).group(1))
        os.kill(rank1, signal.SIGKILL)  # as the OOM killer would: no chance to write anything more
        wait_until(lambda: proc.poll() is not None, proc, "the job's exit after rank 1 died", stall_s=90)
    finally:
        kill_group(proc.pid)
        proc.wait()
        log.close()
    out["c_killed"] = (proc.returncode, (root / "c_killed.out").read_text(errors="replace"),
                       [s for s, _ in list_train_checkpoints(dd.checkpoints)], dd.final_checkpoint.exists())
    res = subprocess.run(_torchrun(c, "--resume"), cwd=REPO, env=_env(), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    out["c"] = root / "c"
    return out


def test_epochs_pack_into_an_odd_row_count(runs):
    """The premise of the tests below, from speculators' packer itself (num_replicas 1, as 04 packs)."""
    from speculators.train.data import ArrowDataset
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    ds = ArrowDataset(max_len=128, datapath=str(DataDir(runs["a"]).hidden_states), on_missing="raise",
                      train_ratio=0.8, split="train", hidden_states_dtype=torch.float32)
    for epoch in range(2):
        sampler = MultipackDistributedBatchSamplerV2(batch_max_length=128, lengths=ds.approx_lengths,
                                                     num_replicas=1, rank=0, seed=0)
        batches = sampler._generate_batches(epoch)  # noqa: SLF001
        assert len(batches) == EPOCH_ROWS  # odd: not a multiple of world size x grad_accum (2)
        assert sorted(i for b in batches for i in b) == list(range(len(ds)))  # every sample once


def test_two_processes_train_what_one_process_with_grad_accum_2_does(runs):
    a, b = runs["a"], runs["b"]
    ta, tb = _metrics(a, "train"), _metrics(b, "train")
    assert [r["step"] for r in ta] == [r["step"] for r in tb] == LOGGED
    for x, y in zip(ta, tb):
        for key in ("loss", "loss_1", "loss_3", "acc_1", "lr", "acc_1_tokens", "acc_3_tokens", "window_steps"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), (x["step"], key)
        assert x["tokens"] == y["tokens"]  # tokens summed over ranks
    # each line pools its 2 steps' rows; an epoch's last step holds one row: 1 counted, not 2 (the other rank's
    # placeholder row adds nothing): steps of [2, 2, 2, 2, 1] rows an epoch
    assert [r["rows"] for r in ta] == [4, 4, 3, 4, 3]
    ea, eb = _metrics(a, "eval"), _metrics(b, "eval")
    assert [r["step"] for r in ea] == [r["step"] for r in eb] == EVALUATED
    for x, y in zip(ea, eb, strict=True):  # held-out rows split over ranks
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5) and x["acc_1"] == pytest.approx(y["acc_1"], abs=1e-6)
        assert x["simulated_acceptance_length"] == pytest.approx(y["simulated_acceptance_length"], abs=1e-6)
    wa, wb = _weights(a, STEPS), _weights(b, STEPS)
    assert set(wa) == set(wb)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)
    first = _weights(a, 2)  # and training moved them: the comparison is not between two untouched drafts
    assert any(not torch.equal(first[k], wa[k]) for k in wa)


def test_every_packed_row_is_trained_once_by_exactly_one_rank(runs):
    """9 rows per epoch over 2 ranks: rank 0 takes rows 0, 2, .., 8, rank 1 rows 1, .., 7 and, in the last step, a
    placeholder of weight 0; each epoch trains all 24 training samples once (the 20% held out are not trained)."""
    train_samples = 24
    for name, per_rank in (("a", [5, 4]), ("b", [9])):
        records = _metrics(runs[name], "rows")
        assert [r["epoch"] for r in records] == [0, 1]
        for r in records:
            assert r["rows"] == r["packed_rows"] == EPOCH_ROWS and r["samples"] == train_samples
            assert r["rows_per_rank"] == per_rank, name
    # the split itself, independently: the union of the ranks' real rows is the packing's rows, each once
    for world, accum in ((2, 1), (1, 2), (2, 2), (3, 1)):
        real = [p for r in range(world) for p, is_real in rank_rows(EPOCH_ROWS, world, accum, r) if is_real]
        assert sorted(real) == list(range(EPOCH_ROWS)), (world, accum)
        steps = {len(rank_rows(EPOCH_ROWS, world, accum, r)) for r in range(world)}
        assert steps == {math.ceil(EPOCH_ROWS / (world * accum)) * accum}  # every rank runs the same micro-steps


def test_a_killed_rank_stops_the_job_naming_it_and_resume_finishes_the_same_draft(runs):
    code, output, steps, exported = runs["c_killed"]
    assert code != 0 and not exported
    root_cause = output[output.index("Root Cause"):]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root_cause) and "SIGKILL" in root_cause, root_cause
    assert steps and steps[-1] < STEPS  # a checkpoint before the kill, intact (the resume below loads it)
    a, c = runs["a"], runs["c"]
    ta, tc = _metrics(a, "train"), _metrics(c, "train")
    assert [r["step"] for r in tc] == LOGGED  # each line exactly once
    for x, y in zip(ta, tc):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6), x["step"]
    ec = _metrics(c, "eval")  # the evaluations before the checkpoint kept, those after it made again, once
    assert [r["step"] for r in ec] == EVALUATED
    for x, y in zip(_metrics(a, "eval"), ec):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5), x["step"]
    wa, wc = _weights(a, STEPS), _weights(c, STEPS)
    for k in wa:
        torch.testing.assert_close(wa[k], wc[k], rtol=1e-5, atol=1e-6)
    assert DataDir(c).final_checkpoint.is_dir()
    assert "rank 1" in DataDir(c).log_file("04_train.rank1").read_text()  # rank 1 logs to its own file
    assert "Training:" not in DataDir(c).log_file("04_train.rank1").read_text()  # progress: rank 0 alone


def test_resume_under_another_number_of_rows_per_step_is_refused_naming_both(runs, toy_llama, capsys):
    argv = ["--config", str(runs["a"].parent / "a.yaml"), "--resume"]
    assert run_stage("train", "04_train", run_train, None, argv + ["--grad-accum", "3"]) == 2
    err = capsys.readouterr().err
    assert "rows per step (world size x train.grad_accum): 2 (2 x 1) then, 3 (1 x 3) now" in err, err
    # the same rows per step under another world size x grad_accum resumes exactly: nothing left to train here
    assert run_stage("train", "04_train", run_train, None, argv + ["--grad-accum", "2"]) == 0
    assert [r["step"] for r in _metrics(runs["a"], "train")] == LOGGED
    assert json.loads(DataDir(runs["a"]).train_run.read_text())["layout"] == "2 x 1"


def test_grad_accum_and_the_new_train_keys_are_checked_at_start():
    from eagle3pipe.config import ConfigError, load_config

    for key, value in (("grad_accum", 0), ("keep_checkpoints", -1), ("nproc_per_node", -1), ("min_free_gb", -1.0)):
        with pytest.raises(ConfigError, match=r"train.grad_accum must be >= 1"):
            load_config(None, {"train": {key: value}, "shared": {"max_seq_len": 1024}}).validate("train")


REDUCE_TOKENS = """
import os, torch, torch.distributed as dist
from eagle3pipe.train_metrics import metric_keys, reduce_metrics
dist.init_process_group("gloo")
rank = dist.get_rank()
keys = metric_keys(1)
sums = {k: torch.tensor(1.0) for k in keys}
totals, (tokens,) = reduce_metrics(sums, keys, torch.device("cpu"), [1_500_000_001 + rank], distributed=True)
print(f"rank {rank} tokens {tokens!r} loss_total {totals['loss_total']!r}", flush=True)
dist.destroy_process_group()
"""


def test_the_token_count_is_reduced_exactly(tmp_path):
    """Issue 26 item 12: the logged token count is all-reduced with the metric sums; in float32 its counts past
    2**24 round (3e9 tokens to a multiple of 256). Alone, and over 2 gloo ranks under torchrun, it stays exact."""
    from eagle3pipe.train_metrics import metric_keys, reduce_metrics

    keys = metric_keys(1)
    assert reduce_metrics(None, keys, torch.device("cpu"), [3_000_000_001])[1] == [3_000_000_001]
    script = tmp_path / "reduce_tokens.py"
    script.write_text(REDUCE_TOKENS)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], cwd=REPO, env=dict(_env(), PYTHONPATH=str(REPO)), capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    want = (1_500_000_001 + 1_500_000_002)  # each rank's count, summed: 3_000_000_003
    for rank in range(2):
        assert f"rank {rank} tokens {float(want)!r} loss_total 2.0" in res.stdout, res.stdout


# -- issue 31: a DFlash draft under torchrun: its random anchors are drawn per packed row -------------------------


@pytest.fixture(scope="module")
def dflash_runs(toy_llama, tmp_path_factory):
    """A DFlash draft trained by 2 torchrun processes and by 1 process x grad_accum 2 on the same rows."""
    from tests.test_draft_fixtures import dflash_config

    root = tmp_path_factory.mktemp("ddp_dflash")
    rows = make_rows(ROWS["num_rows"], seed=ROWS["seed"])
    for name, accum in (("a", 1), ("b", 2)):
        write_rows(root / name, rows)
        write_hidden_states(root / name, toy_llama, rows)
        cfg = dflash_config(root / name, toy_llama, **{**TRAIN, "grad_accum": accum})
        run_vocab(cfg)
        (root / f"{name}.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    res = subprocess.run(_torchrun(root / "a.yaml"), cwd=REPO, env=_env(), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    run_train(dflash_config(root / "b", toy_llama, **{**TRAIN, "grad_accum": 2}))
    return root / "a", root / "b"


def test_dflash_two_processes_train_what_one_process_with_grad_accum_2_does(dflash_runs):
    """Each packed row's anchors come from its place in the packing, not from the rank that trains it: the loss,
    expected acceptance length and held-out figures of 2 ranks equal 1 process x grad_accum 2, and so do the
    weights."""
    a, b = dflash_runs
    ta, tb = _metrics(a, "train"), _metrics(b, "train")
    assert [r["step"] for r in ta] == [r["step"] for r in tb] == LOGGED
    for x, y in zip(ta, tb):
        for key in ("loss", "eal", "acc", "pos_acc_1", "blocks", "block_tokens", "lr", "window_steps"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), (x["step"], key)
    assert [r["rows"] for r in ta] == [4, 4, 3, 4, 3]  # steps of [2, 2, 2, 2, 1] rows an epoch, 2 steps a line
    ea, eb = _metrics(a, "eval"), _metrics(b, "eval")
    assert [r["step"] for r in ea] == [r["step"] for r in eb] == EVALUATED
    for x, y in zip(ea, eb, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5) and x["eal"] == pytest.approx(y["eal"], rel=1e-5)
        assert x["simulated_acceptance_length"] == x["eal"]  # what train.export best chooses a DFlash draft by
    wa, wb = _weights(a, STEPS), _weights(b, STEPS)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(_weights(a, 2)[k], wa[k]) for k in wa)  # it trained
