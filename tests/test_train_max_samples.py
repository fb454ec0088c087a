"""train.max_samples (issue 46 item 4, the data curve): 04 trains on N samples of the training split while the
held-out split stays the one of the whole rows file, offline and online; the steps, the plan and the run's records
follow N; a resume with another N is refused. On CPU, no server: seconds."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

from eagle3pipe.cli import run_stage
from eagle3pipe.config import load_config
from eagle3pipe.records import DataDir, read_jsonl, read_provenance
from eagle3pipe.train import build_data, run_train
from eagle3pipe.train_batches import TRAIN_CUT_STREAM, split_files
from eagle3pipe.vocab import run_vocab
from tests.test_draft_fixtures import make_rows, toy_config, write_hidden_states, write_rows


def test_max_samples_cuts_the_training_split_alone_to_a_nested_seeded_draw(caplog):
    n, fraction, seed = 1000, 0.05, 3
    whole, held = split_files(n, fraction, seed)  # max_samples 0: the whole training split
    assert len(whole) == 950 and len(held) == 50
    drawn = {}
    for cap in (125, 500, 950):
        trains, helds = split_files(n, fraction, seed, cap)
        assert np.array_equal(helds, held)  # the held-out rows do not move with the cap
        # the training rows: a draw of cap of the training split on their own stream of shared.seed, in file order
        want = np.sort(whole[np.random.default_rng([seed, TRAIN_CUT_STREAM]).permutation(len(whole))[:cap]])
        assert np.array_equal(trains, want) and len(trains) == cap
        assert set(trains.tolist()) <= set(whole.tolist()) and not set(trains.tolist()) & set(held.tolist())
        drawn[cap] = set(trains.tolist())
    assert drawn[125] < drawn[500] < drawn[950] == set(whole.tolist())  # each N holds every smaller N's
    few = np.array(sorted(drawn[125]))
    assert few.min() < 250 and few.max() >= 750  # drawn over the whole file, not its head
    assert not np.array_equal(split_files(n, fraction, seed + 1, 125)[0][:10], few[:10])  # another seed, another draw
    # more than the split: all of it, and the log says so
    with caplog.at_level(logging.INFO, logger="eagle3pipe.train_batches"):
        trains, helds = split_files(n, fraction, seed, 2000)
    assert np.array_equal(trains, whole) and np.array_equal(helds, held)
    assert "train.max_samples 2000: the training split holds only 950 samples; training on all of them" in caplog.text
    # nothing held out: the cut is of every row
    trains, helds = split_files(40, 0.0, seed, 10)
    assert helds is None and len(trains) == 10 and set(trains.tolist()) < set(range(40))


ROWS = make_rows(12, seed=21)
HELD_OUT = 3  # eval_fraction 0.25 of 12 rows


def _prepare(data_dir, verifier) -> None:
    """Stages 01b, 02 and 03's outputs for ROWS."""
    write_rows(data_dir, ROWS)
    write_hidden_states(data_dir, verifier, ROWS)
    run_vocab(toy_config(data_dir, verifier))


def _files(ds) -> list[int]:
    return [ds.file_index(i) for i in range(len(ds))]


@pytest.mark.parametrize("source", ["offline", "online"])
def test_04s_datasets_hold_the_same_held_out_rows_and_the_drawn_training_rows(tmp_path, toy_llama, source):
    """Offline over hidden_states/, online over the rows file (no server: only the datasets are built): for every
    max_samples the held-out dataset reads the same rows, the training one exactly the drawn ones (their lengths
    from the rows themselves)."""
    _prepare(tmp_path, toy_llama)
    held_seen, trained = [], {}
    for cap in (0, 4, 6, 100):
        cfg = toy_config(tmp_path, toy_llama, eval_fraction=0.25, max_samples=cap, data_source=source)
        train_ds, val_ds, manifest = build_data(cfg, torch.device("cpu"))
        assert manifest.num_samples == len(ROWS)
        held_seen.append(_files(val_ds))
        assert val_ds.approx_lengths == [len(ROWS[i].input_ids) for i in held_seen[-1]]
        trained[cap] = _files(train_ds)
        assert train_ds.approx_lengths == [len(ROWS[i].input_ids) for i in trained[cap]]
        if source == "online":  # the server 04 starts takes the longest of every row, not of the drawn ones
            assert int(train_ds.online_rows.lengths.max()) == max(len(r.input_ids) for r in ROWS)
    assert len(held_seen[0]) == HELD_OUT and all(h == held_seen[0] for h in held_seen)
    everything = sorted(trained[0] + held_seen[0])
    assert everything == list(range(len(ROWS)))
    assert trained[100] == trained[0]  # more than the split: all of it
    assert len(trained[4]) == 4 and set(trained[4]) < set(trained[6]) < set(trained[0])
    assert trained[4] == sorted(trained[4])


def _door(tmp_path, toy_llama, *extra) -> list[str]:
    return ["--data-dir", str(tmp_path), "--verifier", str(toy_llama), "--vocab-size", "1088", "--hidden-size", "128",
            "--draft-vocab-size", "256", "--aux-layer-ids", "2", "4", "5", "--device", "cpu", "--epochs", "2",
            "--total-seq-len", "128", "--max-seq-len", "128", "--eval-fraction", "0.25", "--num-workers", "0",
            "--checkpoint-every", "1000", "--log-every", "1", "--draft-num-heads", "4", "--draft-head-dim", "64",
            "--draft-intermediate-size", "256", *extra]


def test_the_steps_and_records_follow_max_samples_and_a_resume_with_another_is_refused(tmp_path, toy_llama,
                                                                                        capsys):
    """Through 04's door: a run of 4 samples packs exactly those 4 each epoch (the rows record), trains one step per
    packed row, evaluates on the same held-out tokens as a run on every sample, and records the counts in
    provenance.json; --resume with another max_samples (or onto a run.json written before the field) is refused
    naming it."""
    _prepare(tmp_path, toy_llama)
    dd = DataDir(tmp_path)
    runs = {}
    for cap in (0, 4):
        assert run_stage("train", "04_train", run_train, None,
                         _door(tmp_path, toy_llama, "--max-samples", str(cap), "--overwrite")) == 0
        records = list(read_jsonl(dd.train_metrics))
        rows = [r for r in records if r["kind"] == "rows"]
        steps = [r["step"] for r in records if r["kind"] == "train"]
        held_tokens = [{k: v for k, v in r.items() if k.endswith("_tokens")} for r in records if r["kind"] == "eval"]
        counts = read_provenance(dd.provenance(dd.checkpoints))["counts"]
        runs[cap] = rows, steps, held_tokens, counts
    want = len(ROWS) - HELD_OUT
    for cap, (rows, steps, held_tokens, counts) in runs.items():
        trained = cap or want
        assert [r["samples"] for r in rows] == [trained, trained] and [r["packed_samples"] for r in rows] == \
            [trained, trained]
        # one packed row a step (1 process x grad_accum 1): the steps are the packed rows of the cut split
        assert steps == list(range(1, sum(r["packed_rows"] for r in rows) + 1))
        assert (counts["samples"], counts["train_samples"], counts["held_out_samples"], counts["max_samples"]) == \
            (len(ROWS), trained, HELD_OUT, cap)
        assert held_tokens and held_tokens[0] and all(h == runs[0][2][0] for h in held_tokens)  # the same rows judged
    assert len(runs[4][1]) < len(runs[0][1])
    log = dd.log_file("04_train").read_text()
    assert "(12 samples, 4 trained (train.max_samples 4); hidden states bf16)" in log
    assert "train.max_samples 4: training on 4 of the training split's 9 samples (drawn with shared.seed)" in log

    capsys.readouterr()
    assert run_stage("train", "04_train", run_train, None,
                     _door(tmp_path, toy_llama, "--max-samples", "6", "--resume", "--max-steps", "99")) == 2
    assert "train.max_samples: 4 then, 6 now" in capsys.readouterr().err
    run = json.loads(dd.train_run.read_text())
    assert run["settings"]["train.max_samples"] == 4
    del run["settings"]["train.max_samples"]  # as a run started before the field: it trained on every sample
    dd.train_run.write_text(json.dumps(run))
    assert run_stage("train", "04_train", run_train, None,
                     _door(tmp_path, toy_llama, "--max-samples", "4", "--resume")) == 2
    assert "train.max_samples: 0 then, 4 now" in capsys.readouterr().err


def test_the_plan_counts_the_steps_of_the_cut_training_split(tmp_path):
    """run_all.sh --plan (costs.estimate): 04's training tokens, packed rows and steps are those of max_samples rows
    when it cuts the training split, the whole split's otherwise; 02 extracts every row either way."""
    from eagle3pipe.costs import estimate

    def plan(cap: int):
        cfg = load_config(None, {
            "shared": {"data_dir": str(tmp_path), "max_seq_len": 8192},
            "prepare": {"max_samples": 1000}, "generate": {"max_samples": 1000},
            "train": {"max_samples": cap, "eval_fraction": 0.05, "epochs": 2, "total_seq_len": 8192,
                      "nproc_per_node": 1, "grad_accum": 1},
            "plan": {"prompt_tokens": 512, "completion_tokens": 1536, "checkpoint_gb": 1.0, "packing_fill": 0.5}})
        return {s.name: s for s in estimate(cfg).stages}

    per_row = 2048
    for cap, rows in ((0, 950), (125, 125), (500, 500), (5000, 950)):
        stages = plan(cap)
        assert stages["02_extract"].rows == 1000
        train_tokens = math.floor(1000 * per_row * 0.95) if rows == 950 else rows * per_row
        packed = math.ceil(train_tokens / (8192 * 0.5))  # packed rows an epoch
        assert stages["04_train"].rows == 2 * packed and stages["04_train"].tokens == 2 * train_tokens, cap
        assert f"{2 * packed} steps on 1 process(es)" in stages["04_train"].how
        assert ("train.max_samples" in stages["04_train"].how) == (rows < 950)
