"""Stage 04 --resume continues only the same draft on the same data (issue 12): through the door, on CPU."""

from __future__ import annotations

import re
from pathlib import Path

from eagle3pipe.cli import run_stage
from eagle3pipe.records import DataDir, read_jsonl
from eagle3pipe.records_checkpoints import list_train_checkpoints
from eagle3pipe.train import run_train
from eagle3pipe.vocab import run_vocab
from tests.test_draft_fixtures import make_rows, toy_config, write_hidden_states, write_rows


def _prepare(data_dir, verifier, rows) -> None:
    """Stages 02 and 03's outputs for ``rows``."""
    write_rows(data_dir, rows)
    write_hidden_states(data_dir, verifier, rows)
    run_vocab(toy_config(data_dir, verifier))


def test_resume_with_another_draft_or_other_data_is_refused_by_name(tmp_path, toy_llama, capsys):
    _prepare(tmp_path, toy_llama, make_rows(12, seed=6))
    argv = ["--data-dir", str(tmp_path), "--verifier", str(toy_llama), "--vocab-size", "1088", "--hidden-size", "128",
            "--draft-vocab-size", "256", "--aux-layer-ids", "2", "4", "5", "--device", "cpu", "--epochs", "2",
            "--total-seq-len", "256", "--max-seq-len", "256", "--eval-fraction", "0", "--num-workers", "0",
            "--checkpoint-every", "1",
            "--max-steps", "1", "--draft-num-heads", "4", "--draft-head-dim", "64", "--draft-intermediate-size", "256"]
    assert run_stage("train", "04_train", run_train, None, argv) == 0
    dd = DataDir(tmp_path)
    assert [s for s, _ in list_train_checkpoints(dd.checkpoints)] == [1]
    capsys.readouterr()
    # another draft architecture
    assert run_stage("train", "04_train", run_train, None, argv + ["--draft-intermediate-size", "512", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "train.draft_intermediate_size: 256 then, 512 now" in err and "--overwrite" in err
    # other data: stages 02 and 03 redone on other rows under the same checkpoints
    _prepare(tmp_path, toy_llama, make_rows(14, seed=7))
    assert run_stage("train", "04_train", run_train, None, argv + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert "hidden_states (stage 02)" in err and "vocab (stage 03)" in err
    assert [s for s, _ in list_train_checkpoints(dd.checkpoints)] == [1]  # nothing trained on the wrong data
    # the same settings resume; --overwrite starts over on the new data
    assert run_stage("train", "04_train", run_train, None, argv + ["--overwrite"]) == 0
    assert run_stage("train", "04_train", run_train, None, argv + ["--max-steps", "2", "--resume"]) == 0
    assert [s for s, _ in list_train_checkpoints(dd.checkpoints)] == [1, 2]


def _door(tmp_path, toy_llama, *extra) -> list[str]:
    return ["--data-dir", str(tmp_path), "--verifier", str(toy_llama), "--vocab-size", "1088", "--hidden-size", "128",
            "--draft-vocab-size", "256", "--aux-layer-ids", "2", "4", "5", "--device", "cpu", "--epochs", "2",
            "--total-seq-len", "256", "--max-seq-len", "256", "--eval-fraction", "0", "--num-workers", "0",
            "--checkpoint-every", "1", "--draft-num-heads", "4", "--draft-head-dim", "64",
            "--draft-intermediate-size", "256", *extra]


def test_resume_refuses_a_changed_packing_schedule_split_unroll_or_lm_head_naming_the_keys(tmp_path, toy_llama,
                                                                                           capsys):
    """Issue 19 item 6: each of these changes the packing, the schedule or the split (the resumed run would skip or
    repeat samples), or which tensors the optimizer holds (train_lm_head: a raw ValueError from its state)."""
    _prepare(tmp_path, toy_llama, make_rows(12, seed=6))
    assert run_stage("train", "04_train", run_train, None, _door(tmp_path, toy_llama, "--max-steps", "1")) == 0
    capsys.readouterr()
    changes = {"shared.seed": ["--seed", "1"], "train.total_seq_len": ["--total-seq-len", "512"],
               "train.epochs": ["--epochs", "3"], "train.warmup_ratio": ["--warmup-ratio", "0.5"],
               "train.eval_fraction": ["--eval-fraction", "0.25"], "train.ttt_steps": ["--ttt-steps", "2"],
               "train.train_lm_head": ["--train-lm-head"],
               # issue 26 item 12: the optimizer and scheduler state a resume loads hold the peak rate, so another
               # --learning-rate was silently ignored
               "train.learning_rate": ["--learning-rate", "5e-4"]}
    for key, flags in changes.items():
        argv = _door(tmp_path, toy_llama, "--max-steps", "2", "--resume", *flags)
        assert run_stage("train", "04_train", run_train, None, argv) == 2, key
        err = capsys.readouterr().err
        assert f"{key}: " in err and "then" in err and "--overwrite" in err, (key, err)
        if key == "train.learning_rate":
            assert "train.learning_rate: 0.0001 then, 0.0005 now" in err, err
        assert "ValueError" not in err and [s for s, _ in list_train_checkpoints(DataDir(tmp_path).checkpoints)] == [1]
    # with none of them changed it resumes (max_steps, log and checkpoint cadence may change)
    argv = _door(tmp_path, toy_llama, "--max-steps", "2", "--resume", "--log-every", "3")
    assert run_stage("train", "04_train", run_train, None, argv) == 0
    assert [s for s, _ in list_train_checkpoints(DataDir(tmp_path).checkpoints)] == [1, 2]


def test_checkpoints_are_pruned_to_keep_checkpoints_and_final_is_kept(tmp_path, toy_llama):
    """Issue 19 item 8: only the newest train.keep_checkpoints step_N folders stay (and final/); a temporary folder
    a killed save left behind is removed."""
    _prepare(tmp_path, toy_llama, make_rows(24, seed=8))
    dd = DataDir(tmp_path)
    torn = dd.checkpoints / ".step_1.tmp-999999"  # what a save killed mid-write leaves
    torn.mkdir(parents=True)
    (torn / "model.safetensors").write_bytes(b"half")
    assert run_stage("train", "04_train", run_train, None, _door(tmp_path, toy_llama, "--keep-checkpoints", "2",
                                                                 "--log-every", "1")) == 0
    steps = [s for s, _ in list_train_checkpoints(dd.checkpoints)]
    total = len([r for r in read_jsonl(dd.train_metrics) if r["kind"] == "train"])
    assert total >= 4 and steps == [total - 1, total]
    assert not torn.exists() and dd.final_checkpoint.is_dir()
    assert {p.name for p in dd.checkpoints.iterdir() if p.name.startswith(("step_", ".step_"))} == \
        {f"step_{total - 1}", f"step_{total}"}


def test_a_save_that_would_fill_the_disk_stops_before_writing(tmp_path, toy_llama, capsys):
    """Issue 19 item 8: the free-space check runs before each save against the disk's real free space; here the
    margin (train.min_free_gb) is set past any disk, so the save at step 2 is refused with one error line naming the
    space and the keys, and step_1 stays complete and resumable."""
    _prepare(tmp_path, toy_llama, make_rows(12, seed=9))
    dd = DataDir(tmp_path)
    assert run_stage("train", "04_train", run_train, None, _door(tmp_path, toy_llama, "--max-steps", "1")) == 0
    before = {p.name: p.read_bytes() for p in (dd.checkpoints / "step_1").iterdir()}
    capsys.readouterr()
    argv = _door(tmp_path, toy_llama, "--max-steps", "2", "--resume", "--min-free-gb", "1e9")
    assert run_stage("train", "04_train", run_train, None, argv) == 2
    err = capsys.readouterr().err
    assert re.search(r"error: .*checkpoints: [\d.]+ GB free, a checkpoint needs [\d.]+ GB and train.min_free_gb 1e\+09",
                     err) and "train.keep_checkpoints" in err, err
    assert sorted(p.name for p in dd.checkpoints.iterdir() if "step_" in p.name) == ["step_1"]  # nothing torn
    assert {p.name: p.read_bytes() for p in (dd.checkpoints / "step_1").iterdir()} == before
    assert run_stage("train", "04_train", run_train, None, _door(tmp_path, toy_llama, "--max-steps", "2",
                                                                 "--resume")) == 0
    assert [s for s, _ in list_train_checkpoints(dd.checkpoints)] == [1, 2]


def test_resume_with_max_steps_already_reached_has_nothing_to_do_and_keeps_the_export(tmp_path, toy_llama, capsys):
    """Issue 26 item 10: --resume with a --max-steps the checkpoint already reached (mid-epoch, at an epoch's end,
    or below it) trains nothing and exits 0 with the export in place: kept when final/ holds that step's export,
    written when it is missing."""
    import torch

    from eagle3pipe.train import build_data
    from eagle3pipe.train_batches import packed_batches

    _prepare(tmp_path, toy_llama, make_rows(12, seed=10))
    dd = DataDir(tmp_path)
    train_ds, _, _ = build_data(toy_config(tmp_path, toy_llama, eval_fraction=0.0), torch.device("cpu"))
    epoch_steps = len(packed_batches(train_ds, 256, 0, 0))  # one packed row a step
    assert epoch_steps >= 2
    argv = _door(tmp_path, toy_llama, "--log-every", "1")
    assert run_stage("train", "04_train", run_train, None, argv + ["--max-steps", "1"]) == 0
    export = (dd.final_checkpoint / "model.safetensors").read_bytes()
    stamp = (dd.final_checkpoint / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()

    def resume(max_steps: int) -> str:
        code = run_stage("train", "04_train", run_train, None, argv + ["--max-steps", str(max_steps), "--resume"])
        err = capsys.readouterr().err
        assert code == 0, err
        return dd.log_file("04_train").read_text()

    log = resume(1)  # mid-epoch: the checkpoint is at step 1
    assert "--max-steps 1: nothing left to train" in log
    assert (dd.final_checkpoint / "model.safetensors").stat().st_mtime_ns == stamp  # kept as it was
    import shutil

    shutil.rmtree(dd.final_checkpoint)  # e.g. a run killed between its last checkpoint and the export
    resume(1)
    assert (dd.final_checkpoint / "model.safetensors").read_bytes() == export  # written again, the same draft
    resume(epoch_steps)  # trains on to the end of the first epoch
    assert [s for s, _ in list_train_checkpoints(dd.checkpoints)][-1] == epoch_steps
    trained = [r["step"] for r in read_jsonl(dd.train_metrics) if r["kind"] == "train"]
    assert trained == list(range(1, epoch_steps + 1))
    at_end = (dd.final_checkpoint / "model.safetensors").read_bytes()
    for max_steps in (epoch_steps, 1):  # at the epoch's end (the next epoch's plan is empty), and below it
        log = resume(max_steps)
        assert f"is at step {epoch_steps}, --max-steps {max_steps}: nothing left to train" in log
        assert (dd.final_checkpoint / "model.safetensors").read_bytes() == at_end
    assert [r["step"] for r in read_jsonl(dd.train_metrics) if r["kind"] == "train"] == trained


def test_after_resume_the_cumulative_token_count_goes_on_as_in_the_uninterrupted_run(tmp_path, toy_llama):
    """Issue 47: metrics.jsonl's cumulative "tokens" started again from 0 after --resume (an online run resumed at
    step 12 read 387 at step 13 where the uninterrupted run read 5,100), so every curve drawn from it was wrong. A
    run stopped at step 1 and resumed twice (once from a checkpoint written before TrainingState kept the count,
    which falls back on the last logged record) logs the uninterrupted run's counts at every step."""
    import json

    _prepare(tmp_path, toy_llama, make_rows(16, seed=11))
    dd = DataDir(tmp_path)
    argv = _door(tmp_path, toy_llama, "--log-every", "1", "--epochs", "1")
    assert run_stage("train", "04_train", run_train, None, argv) == 0
    whole = [(r["step"], r["tokens"]) for r in read_jsonl(dd.train_metrics) if r["kind"] == "train"]
    assert len(whole) >= 3 and all(b[1] > a[1] for a, b in zip(whole, whole[1:]))
    assert run_stage("train", "04_train", run_train, None, argv + ["--overwrite", "--max-steps", "1"]) == 0
    state = json.loads((dd.checkpoint_step(1) / "training_state.json").read_text())
    assert state["tokens"] == whole[0][1]  # the checkpoint keeps the count
    assert run_stage("train", "04_train", run_train, None, argv + ["--resume", "--max-steps", "2"]) == 0
    older = dd.checkpoint_step(2) / "training_state.json"  # as a checkpoint of an earlier version
    older.write_text(json.dumps({k: v for k, v in json.loads(older.read_text()).items() if k != "tokens"}))
    assert run_stage("train", "04_train", run_train, None, argv + ["--resume"]) == 0
    assert [(r["step"], r["tokens"]) for r in read_jsonl(dd.train_metrics) if r["kind"] == "train"] == whole


def test_held_out_rows_are_a_seeded_share_of_every_part_of_the_rows(tmp_path, toy_llama, capsys):
    """Issue 47: the held-out rows were the last eval_fraction of the rows file, so for rows ordered by source the
    held-out score (and train.export best) judged one source. They are now a share drawn with shared.seed: the same
    for the same seed, another for another, spread over the file, the two splits complementary; 04's datasets read
    exactly those files. A run.json from before (the last rows held out) is not resumed onto the new split."""
    import json

    import numpy as np
    import torch

    from eagle3pipe.train import HELD_OUT_KEY, build_data
    from eagle3pipe.train_batches import split_files

    trains, held = split_files(1000, 0.05, 0)
    assert len(held) == 50 and len(trains) == 950 and sorted({*trains, *held}) == list(range(1000))
    assert np.array_equal(held, split_files(1000, 0.05, 0)[1])
    assert not np.array_equal(held, split_files(1000, 0.05, 1)[1])
    assert held.min() < 250 and held.max() >= 750  # drawn from the whole file, not its tail
    assert split_files(1000, 0.0, 0)[1] is None and split_files(1, 0.5, 0)[1] is None

    _prepare(tmp_path, toy_llama, make_rows(12, seed=12))
    cfg = toy_config(tmp_path, toy_llama, eval_fraction=0.25)
    train_ds, val_ds, _ = build_data(cfg, torch.device("cpu"))
    want_train, want_held = split_files(12, 0.25, cfg.shared.seed)
    assert [train_ds.file_index(i) for i in range(len(train_ds))] == want_train.tolist()
    assert [val_ds.file_index(i) for i in range(len(val_ds))] == want_held.tolist()
    assert val_ds.approx_lengths == [len(r.input_ids) for k, r in enumerate(make_rows(12, seed=12))
                                     if k in set(want_held.tolist())]

    argv = _door(tmp_path, toy_llama, "--eval-fraction", "0.25")
    assert run_stage("train", "04_train", run_train, None, argv + ["--max-steps", "1"]) == 0
    dd = DataDir(tmp_path)
    run = json.loads(dd.train_run.read_text())
    assert run["settings"][HELD_OUT_KEY] == "drawn with shared.seed"
    del run["settings"][HELD_OUT_KEY]  # as a run started before issue 47 wrote it
    dd.train_run.write_text(json.dumps(run))
    capsys.readouterr()
    assert run_stage("train", "04_train", run_train, None, argv + ["--resume", "--max-steps", "2"]) == 2
    assert "held-out rows: 'the last rows' then, 'drawn with shared.seed' now" in capsys.readouterr().err


def test_checkpoints_reach_the_disk_before_their_name_and_resume_skips_a_torn_one(tmp_path, toy_llama, capsys,
                                                                                 monkeypatch):
    """Issue 47: checkpoints were renamed into place without an fsync of their files and folder, so after a power
    cut a listed step_N could be empty and --resume failed on it. Every file and the temporary folder are fsynced
    before the rename, checkpoints/ after it; a step_N whose files are empty or short (what such a cut leaves) is
    moved aside by --resume, which says so and continues from the newest whole one, to the uninterrupted draft."""
    import os

    from safetensors.torch import load_file

    from eagle3pipe import records_checkpoints

    _prepare(tmp_path, toy_llama, make_rows(12, seed=13))
    dd = DataDir(tmp_path)
    synced, renamed = [], []  # every fsync'd path, and each rename with the fsyncs before it
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(records_checkpoints.os, "fsync",
                        lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
    monkeypatch.setattr(records_checkpoints.os, "replace",
                        lambda a, b: (renamed.append((str(a), str(b), len(synced))), real_replace(a, b))[1])
    argv = _door(tmp_path, toy_llama, "--log-every", "1")  # 2 epochs of 2 steps (12 rows): 3 steps end in the 2nd
    assert run_stage("train", "04_train", run_train, None, argv + ["--max-steps", "3"]) == 0
    monkeypatch.undo()
    renamed = [r for r in renamed if Path(r[1]).name.startswith("step_")]  # (os is every module's: locks too)
    assert {Path(b).name for _, b, _ in renamed} == {"step_1", "step_2", "step_3"}
    for tmp, final, synced_before in renamed:
        files = {Path(x).name for x in synced[:synced_before] if Path(x).parent == Path(tmp)}
        assert files == set(records_checkpoints.CKPT_FILES), files  # each file on disk before the rename
        assert tmp in synced[:synced_before]  # the folder's entries too
        assert str(Path(final).parent) in synced[synced_before:]  # and checkpoints/ after it
    whole = load_file(str(dd.final_checkpoint / "model.safetensors"))
    steps = [r for r in read_jsonl(dd.train_metrics) if r["kind"] == "train"]

    # a cut that left step_3's optimizer state short and its model file empty
    optimizer = dd.checkpoint_step(3) / "optimizer.safetensors"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
    assert "optimizer.safetensors holds" in records_checkpoints.check_train_checkpoint(dd.checkpoint_step(3))
    (dd.checkpoint_step(3) / "model.safetensors").write_bytes(b"")
    capsys.readouterr()
    assert run_stage("train", "04_train", run_train, None, argv + ["--max-steps", "3", "--resume"]) == 0
    log = dd.log_file("04_train").read_text()
    assert f"--resume: {dd.checkpoint_step(3)} is not whole (model.safetensors holds 0 bytes" in log
    assert f"resuming from {dd.checkpoint_step(2)}" in log
    assert (dd.checkpoints / "step_3.torn").is_dir() and [s for s, _ in list_train_checkpoints(dd.checkpoints)] == \
        [1, 2, 3]
    assert [r["loss"] for r in read_jsonl(dd.train_metrics) if r["kind"] == "train"] == [r["loss"] for r in steps]
    again = load_file(str(dd.final_checkpoint / "model.safetensors"))
    assert all(torch_equal(whole[k], again[k]) for k in whole)


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)
