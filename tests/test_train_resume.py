"""Stage 04 --resume continues only the same draft on the same data (issue 12): through the door, on CPU."""

from __future__ import annotations

from eagle3pipe.cli import run_stage
from eagle3pipe.records import DataDir, list_train_checkpoints
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
