"""Stage 02 end to end (CPU): resume after a kill, data-parallel workers, and speculators 0.9 training on our output
(its own dataset class, transfer backends and Trainer, unchanged)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3pipe import extract as extract_mod
from eagle3pipe.extract import run_extract
from eagle3pipe.records import DataDir, check_hidden_states_file, load_hidden_states, load_hs_journal, load_hs_rows

from test_extract import AUX, make_cfg, write_rows
from watch import run_watched, wait_until

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def _door_argv(data_dir: Path, verifier: Path, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "02_extract_hidden_states.py"), "--data-dir", str(data_dir), "--verifier",
            str(verifier), "--input", "prepared", "--aux-layer-ids", *map(str, AUX), "--hidden-size", "128",
            "--device", "cpu", "--model-dtype", "float32", *extra]


def _files_equal(a: Path, b: Path, n: int) -> None:
    for i in range(n):
        x, y = load_hidden_states(DataDir(a).hs_file(i)), load_hidden_states(DataDir(b).hs_file(i))
        assert torch.equal(x["token_ids"], y["token_ids"]), i
        assert torch.equal(x["hidden_states"], y["hidden_states"]), i


def test_resume_after_kill_skips_finished_and_leaves_nothing_half_written(tmp_path, toy_deepseek, monkeypatch):
    n = 14
    rows = write_rows(tmp_path / "killed", n, min_len=16, max_len=40)
    write_rows(tmp_path / "clean", n, min_len=16, max_len=40)
    dd = DataDir(tmp_path / "killed")
    proc = subprocess.Popen(_door_argv(tmp_path / "killed", toy_deepseek, "--batch-tokens", "1",
                                       "--writer-threads", "1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    journal = dd.hs_shard_journal(0)
    wait_until(lambda: journal.exists() and journal.read_text().count("\n") >= 3, proc, "3 journalled samples",
               poll_s=0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not dd.hs_manifest.exists()  # not finished, and nothing says it is
    done = load_hs_journal(journal)
    assert 3 <= len(done) < n
    # every file under a final name is complete; partial ones can only sit under a temporary name
    for f in dd.hs_shard(0).glob("hs_*.safetensors"):
        check_hidden_states_file(f, num_states=4, hidden_size=128)

    extracted: list[int] = []
    real_extract_shard = extract_mod.extract_shard
    monkeypatch.setattr(extract_mod, "extract_shard",
                        lambda job: (extracted.extend(p for p, _, _ in job.items), real_extract_shard(job))[1])
    manifest = run_extract(make_cfg(tmp_path / "killed", toy_deepseek, batch_tokens=1))
    assert sorted(extracted) == sorted(set(range(n)) - {e.position for e in done})  # finished ones skipped
    assert manifest.num_samples == n and not list(dd.hs_work.rglob("*.safetensors")) and not list(
        dd.hs_work.rglob(".*tmp*"))
    run_extract(make_cfg(tmp_path / "clean", toy_deepseek, batch_tokens=1))
    _files_equal(tmp_path / "killed", tmp_path / "clean", n)  # same bytes as a run that was never killed
    assert [r.tolist() for r in load_hs_rows(dd.hidden_states)["input_ids"]] == [r["input_ids"] for r in rows]


def test_two_worker_processes_give_the_same_output_as_one(tmp_path, toy_llama, monkeypatch):
    n = 9
    write_rows(tmp_path / "one", n)
    write_rows(tmp_path / "two", n)
    # one torch thread per worker in both runs: fp32 matmul sums in a thread-count-dependent order
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    m1 = run_extract(make_cfg(tmp_path / "one", toy_llama, num_workers=1, batch_tokens=1))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    m2 = run_extract(make_cfg(tmp_path / "two", toy_llama, num_workers=2, batch_tokens=1))
    assert len(list(DataDir(tmp_path / "two").hs_work.glob("shard_*"))) == 2  # really two workers
    for shard in (0, 1):
        assert load_hs_journal(DataDir(tmp_path / "two").hs_shard_journal(shard))  # each did a share
    assert (m1.num_samples, m1.num_tokens, m1.bytes) == (m2.num_samples, m2.num_tokens, m2.bytes) == (
        n, m1.num_tokens, m1.bytes)
    _files_equal(tmp_path / "one", tmp_path / "two", n)


SPECULATORS_TRAIN = """
import sys
import torch
import speculators.train.trainer as trainer_module

# CPU shims (REFERENCE.md): the stock Trainer moves the model to device <local_rank> (cuda) and its step timer
# synchronises an accelerator; nothing else is changed.
trainer_module.get_local_rank = lambda: "cpu"
torch.accelerator.synchronize = lambda *args, **kwargs: None
from speculators.train.cli import main
from speculators.train.config import TrainConfig

main(TrainConfig.resolve(sys.argv[1:]))
"""


def speculators_reads(data_dir: Path, rows: list[dict], storage_dtype: str = "bf16") -> None:
    """speculators 0.9's own dataset class and transfer backend over ``data_dir``'s hidden states: every row read,
    ids and masks as written, the draft input = our aux states in layer-id order, the verifier state = our final."""
    from hs_connectors.transfer import FileTransfer, FP8Transfer
    from speculators.train.data import ArrowDataset

    data_path = DataDir(data_dir).hidden_states
    transfer = (FP8Transfer if storage_dtype == "fp8" else FileTransfer)(data_path / "hidden_states")
    ds = ArrowDataset(max_len=512, datapath=data_path, transfer=transfer, on_missing="raise")
    assert len(ds) == len(rows)
    for i, row in enumerate(rows):
        item = ds[i]  # SampleUnavailable (token mismatch) would have no dict keys
        ours = load_hidden_states(DataDir(data_dir).hs_file(i))["hidden_states"]
        t = len(row["input_ids"])
        assert item["input_ids"].tolist() == row["input_ids"] and item["loss_mask"].tolist() == row["loss_mask"]
        assert item["hidden_states"].shape == (t, 3 * 128)
        assert torch.equal(item["hidden_states"], ours[:, :3].flatten(1))  # aux states, layer-id order
        assert torch.equal(item["verifier_last_hidden_states"], ours[:, 3])  # final pre-norm state


def speculators_trains(data_dir: Path, verifier: Path, work: Path, storage_dtype: str) -> None:
    """``speculators train`` (its CLI and Trainer, CPU shims only) for 3 steps on ``data_dir``'s hidden states."""
    import re

    script = work / "speculators_train.py"
    script.write_text(SPECULATORS_TRAIN)
    save = work / "ckpt"
    out = run_watched(
        [sys.executable, str(script), "--verifier-name-or-path", str(verifier), "--data-path",
         str(DataDir(data_dir).hidden_states), "--speculator-type", "eagle3", "--save-path", str(save), "--epochs",
         "1", "--max-steps", "3", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers",
         "0", "--total-seq-len", "128", "--on-missing", "raise", "--target-layer-ids", *map(str, AUX),
         "--hidden-states-backend", storage_dtype if storage_dtype == "fp8" else "file", "--hidden-states-dtype",
         "bfloat16", "--train-data-ratio", "0.7"],
        log_file=work / "speculators_train.out", stall_s=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"},
    )
    log = out.stdout  # stdout and stderr together
    assert out.returncode == 0, log[-3000:]
    assert "Training epoch 1/1 completed" in log
    losses = [float(x) for x in re.findall(r"val/loss_epoch=([0-9.e+-]+)", log)]
    assert losses and all(0 < v < 1e3 for v in losses), log[-2000:]
    assert (save / "checkpoint_best").exists()


@pytest.mark.parametrize("storage_dtype", ["bf16", "fp8"])
def test_speculators_reads_and_trains_on_our_output(tmp_path, toy_deepseek, storage_dtype):
    rows = write_rows(tmp_path / "d", 6, min_len=12, max_len=40)
    run_extract(make_cfg(tmp_path / "d", toy_deepseek, storage_dtype=storage_dtype, model_dtype="bfloat16"))
    speculators_reads(tmp_path / "d", rows, storage_dtype)
    if storage_dtype == "fp8":  # one training run (the trainer's own FP8 backend reading our files): a short suite
        speculators_trains(tmp_path / "d", toy_deepseek, tmp_path, storage_dtype)
