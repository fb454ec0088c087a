"""Stage 04's read checks and the samples it skips (issue 26 items 2 and 3), on CPU with the toy verifier.

- A states file with the right token ids and metadata but 16 fewer state rows is skipped, not packed: every other
  sample of its packed row stays aligned with its own tokens (checked against the files themselves), offline and
  through the online source's reader.
- Every skipped sample (short file, two swapped files, a short held-out file) is listed once with its file and
  reason in checkpoints/skipped.jsonl, counted in the epoch's rows record, the eval record, the train records and
  the provenance; past --max-error-share of an epoch's samples 04 stops with a checkpoint, and --resume with a
  larger share finishes. Under torchrun the count is the ranks' sum: one skip per rank stops a run that allows one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from eagle3pipe.cli import run_stage
from eagle3pipe.records import DataDir, hs_file_metadata, hs_layer_ids, read_jsonl, read_provenance, save_tensors_atomic
from eagle3pipe.records_checkpoints import list_train_checkpoints, load_skipped_samples
from eagle3pipe.train import build_data, run_train
from eagle3pipe.train_batches import EpochBatches, make_loader, packed_batches
from eagle3pipe.train_data import SKIPPED_KEY, SkippedFile
from eagle3pipe.vocab import run_vocab
from tests.test_draft_fixtures import TOY_AUX, make_rows, toy_config, write_hidden_states, write_rows

REPO = Path(__file__).resolve().parents[1]
SHORT_BY = 16


def _prepare(data_dir: Path, verifier: Path, rows, **train):
    write_rows(data_dir, rows)
    write_hidden_states(data_dir, verifier, rows)
    cfg = toy_config(data_dir, verifier, **train)
    run_vocab(cfg)
    return cfg


def _shorten(path: Path, by: int = SHORT_BY) -> int:
    """Rewrites ``path`` with its token ids and metadata but ``by`` fewer state rows (as a torn or altered file would
    be); returns its token count."""
    data = load_file(str(path))
    ids = data["token_ids"]
    states = data["hidden_states"][:-by].contiguous()
    metadata = hs_file_metadata(hs_layer_ids(TOY_AUX, 8), 8)
    save_tensors_atomic(path, {"token_ids": ids, "hidden_states": states}, metadata)  # records' writer refuses it
    return ids.shape[0]


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name("swap.tmp")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def _door(data_dir: Path, verifier: Path, *extra: str) -> list[str]:
    return ["--data-dir", str(data_dir), "--verifier", str(verifier), "--vocab-size", "1088", "--hidden-size", "128",
            "--draft-vocab-size", "256", "--aux-layer-ids", "2", "4", "5", "--device", "cpu", "--epochs", "2",
            "--total-seq-len", "256", "--max-seq-len", "256", "--num-workers", "0", "--log-every", "1",
            "--draft-num-heads", "4", "--draft-head-dim", "64", "--draft-intermediate-size", "256", *extra]


def _expected_row(dd: DataDir, files: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """What a packed row of ``files`` must hold, from the files alone: each sample's input states at positions
    0..T-2 next to its token ids 1..T-1 (speculators' one-token shift), samples one after another."""
    states, ids = [], []
    for f in files:
        data = load_file(str(dd.hs_file(f)))
        states.append(data["hidden_states"][:-1, :3].flatten(1).float())  # [T-1, 3H]
        ids.append(data["token_ids"][1:])
    return torch.cat(states), torch.cat(ids)


def test_a_states_file_shorter_than_its_tokens_is_skipped_and_its_row_stays_aligned(tmp_path, toy_llama):
    rows = make_rows(12, seed=40)
    cfg = _prepare(tmp_path, toy_llama, rows, epochs=1, eval_fraction=0.0)
    dd = DataDir(tmp_path)
    train_ds, _, _ = build_data(cfg, torch.device("cpu"))
    packed = packed_batches(train_ds, cfg.train.total_seq_len, cfg.shared.seed, 0)
    row = next(r for r in packed if len(r) >= 3)
    short = row[len(row) // 2]  # a sample with another after it in its packed row
    tokens = _shorten(dd.hs_file(short))
    sampler = EpochBatches()
    sampler.set([row])
    cfg.train.num_workers = 1  # read in a DataLoader worker process, as 04 does: the skip's listing crosses over
    (batch,) = list(make_loader(train_ds, sampler, cfg, torch.device("cpu")))
    want_states, want_ids = _expected_row(dd, [i for i in row if i != short])
    n = want_ids.shape[0]
    assert torch.equal(batch["input_ids"][0, :n], want_ids)
    assert torch.equal(batch["hidden_states"][0, :n].float(), want_states)  # every other sample on its own tokens
    assert int((batch["document_ids"] != -1).sum()) == n and batch["error_records"] == 1
    assert batch[SKIPPED_KEY] == [{"file": str(dd.hs_file(short)), "index": short,
                                   "reason": f"hidden states for {tokens - SHORT_BY} tokens, token_ids hold {tokens}: "
                                             "a torn or altered file"}]


def test_the_online_source_reads_spool_files_through_the_same_check(tmp_path, toy_llama):
    """The online source's datasets (train_online.build_online_data) read a spool folder's files with the reader
    offline uses (train_batches.states_reader): a short file there is skipped with the same reason."""
    from eagle3pipe.config import load_config
    from eagle3pipe.train_online import build_online_data

    rows = make_rows(8, seed=41)
    write_rows(tmp_path, rows, which="prepared")
    base = toy_config(tmp_path, toy_llama, epochs=1, eval_fraction=0.0).to_dict()
    base["train"]["data_source"] = "online"
    base["extract"].update(input="prepared", backend="vllm", extract_url=["http://127.0.0.1:9"])
    cfg = load_config(None, base)
    train_ds, _, _ = build_online_data(cfg, torch.device("cpu"))
    folder = tmp_path / "spool_row"
    write_hidden_states(tmp_path / "states", toy_llama, rows)  # the files a server would have written
    folder.mkdir()
    for i in (2, 3):
        os.link(DataDir(tmp_path / "states").hs_file(i), folder / f"hs_{i}.safetensors")
    tokens = _shorten(folder / "hs_3.safetensors")
    train_ds.transfer.hidden_states_path = folder  # what OnlineBatches sets before packing a row
    good = train_ds[2]
    assert isinstance(good, dict) and good["hidden_states"].shape[0] == len(rows[2].input_ids)
    bad = train_ds[3]
    assert isinstance(bad, SkippedFile) and bad.file == str(folder / "hs_3.safetensors") and bad.index == 3
    assert bad.reason.startswith(f"hidden states for {tokens - SHORT_BY} tokens, token_ids hold {tokens}")


def test_skipped_samples_are_listed_counted_and_stop_the_run_past_the_share(tmp_path, toy_llama, capsys):
    rows = make_rows(12, seed=42)
    cfg = _prepare(tmp_path, toy_llama, rows)
    dd = DataDir(tmp_path)
    # eval_fraction 0.25: 9 samples train, 3 drawn with shared.seed are held out (train_batches.split_files)
    from eagle3pipe.train_batches import split_files

    trains, helds = split_files(12, 0.25, cfg.shared.seed)
    assert (len(trains), len(helds)) == (9, 3)
    short, a, b, held = int(trains[1]), int(trains[4]), int(trains[5]), int(helds[1])
    tokens = _shorten(dd.hs_file(short))
    _swap(dd.hs_file(a), dd.hs_file(b))  # each holds the other's token ids
    held_tokens = _shorten(dd.hs_file(held))
    argv = _door(tmp_path, toy_llama, "--eval-fraction", "0.25")
    code = run_stage("train", "04_train", run_train, None, argv)
    err = capsys.readouterr().err
    # --max-error-share 0 (the default): the first step that skipped a sample stops the run, with a checkpoint
    assert code == 2, err
    steps = [s for s, _ in list_train_checkpoints(dd.checkpoints)]
    assert len(steps) == 1 and not dd.final_checkpoint.exists()
    assert ("epoch 1: " in err and "of its 12 samples skipped as they were read (allowed 0: --max-error-share 0)"
            in err and str(dd.train_skipped) in err and f"Checkpoint {dd.checkpoint_step(steps[0])}" in err
            and "--resume --max-error-share" in err), err
    first = load_skipped_samples(dd.train_skipped)
    assert first and all(s.step <= steps[0] for s in first)
    # a share that allows the 4 skips of an epoch (3 trained, 1 held out, of 12): the resumed run finishes
    assert run_stage("train", "04_train", run_train, None, argv + ["--resume", "--max-error-share", "0.34"]) == 0
    listed = load_skipped_samples(dd.train_skipped)
    by_epoch = {e: sorted((s.index, s.held_out, s.reason) for s in listed if s.epoch == e) for e in (0, 1)}
    mismatch = "its token_ids are not the row's input_ids"
    for e in (0, 1):  # each skipped sample listed once per epoch: the stop's step is not listed twice
        assert [(i, h) for i, h, _ in by_epoch[e]] == sorted([(short, False), (a, False), (b, False), (held, True)]), \
            by_epoch[e]
        reasons = {i: r for i, _, r in by_epoch[e]}
        assert reasons[short].startswith(f"hidden states for {tokens - SHORT_BY} tokens, token_ids hold {tokens}")
        assert reasons[a].startswith(mismatch) and reasons[b].startswith(mismatch)
        assert reasons[held].startswith(f"hidden states for {held_tokens - SHORT_BY} tokens, token_ids hold "
                                        f"{held_tokens}")
    files = {s.index: s.file for s in listed}
    assert files[short] == str(dd.hs_file(short)) and files[held] == str(dd.hs_file(held))
    metrics = list(read_jsonl(dd.train_metrics))
    (rows_2,) = [r for r in metrics if r["kind"] == "rows" and r["epoch"] == 1]  # the resumed run's whole epoch
    assert rows_2["packed_samples"] == 9 and rows_2["skipped_samples"] == 3 and rows_2["samples"] == 6
    assert [r["skipped_samples"] for r in metrics if r["kind"] == "eval"] == [1, 1]
    train = [r for r in metrics if r["kind"] == "train"]
    assert train[-1]["skipped_samples"] == 6  # every epoch's, the part before the resume included
    counts = read_provenance(dd.provenance(dd.checkpoints))["counts"]
    assert counts["skipped_samples"] == 6 and counts["skipped_held_out"] == 2
    # run_all.sh --status lists every one of them (issue 47: it read a log line nothing writes any more)
    from eagle3pipe.status import format_status, run_status, skip_kind

    stages, drops = run_status(cfg)
    listed_drops = [(d.id, d.reason, d.listed_in) for d in drops if d.stage == "04_train"]
    assert sorted(listed_drops) == sorted((f"row {s.index}", skip_kind(s.reason), "checkpoints/skipped.jsonl")
                                          for s in listed)
    assert {d.reason for d in drops} == {"hidden states for N tokens, token_ids hold N",
                                         "its token_ids are not the row's input_ids"}
    st = next(st for st in stages if st.name == "04_train")
    assert st.state == "done" and sum(st.drops.values()) == len(listed) == 8
    assert "dropped: 8 samples in all" in format_status(cfg, stages, drops)


def test_under_torchrun_the_share_counts_every_rank_s_skips(tmp_path, toy_llama):
    """2 processes: one swapped pair of files, one sample read by each rank. Each rank alone skips 1 (the share
    allows 1 of the epoch's 12), the job 2: it stops, and rank 0 lists rank 1's sample too."""
    rows = make_rows(12, seed=43)
    cfg = _prepare(tmp_path, toy_llama, rows, epochs=1, eval_fraction=0.0, cpu_threads=1, checkpoint_every=1000)
    dd = DataDir(tmp_path)
    train_ds, _, _ = build_data(cfg, torch.device("cpu"))
    packed = packed_batches(train_ds, cfg.train.total_seq_len, cfg.shared.seed, 0)
    # world 2, grad_accum 1: rank r trains the packed rows at positions r, r + 2, ... (train.rank_rows)
    a = packed[0][0]
    b = next(r for k, row in enumerate(packed) if k % 2 == 1 for r in row)
    _swap(dd.hs_file(a), dd.hs_file(b))
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(cfg.to_dict()))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    share = 1.5 / 12  # int(share x 12) = 1 allowed
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(REPO / "04_train.py"), "--config", str(config), "--max-error-share", str(share)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode != 0, res.stderr[-3000:]
    assert "epoch 1: 2 of its 12 samples skipped as they were read (allowed 1" in res.stderr, res.stderr[-3000:]
    listed = load_skipped_samples(dd.train_skipped)
    assert sorted((s.index, s.rank) for s in listed) == sorted([(a, 0), (b, 1)])
    assert not dd.final_checkpoint.exists() and list_train_checkpoints(dd.checkpoints)
    assert json.loads(dd.train_run.read_text())["layout"] == "2 x 1"
