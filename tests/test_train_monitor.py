"""Stage 04's monitoring, recipe and exports (issue 29), on CPU with the toy verifier: tensorboard and wandb (offline)
read back with their own libraries, means since the last log line, held-out evaluations every N steps with the
simulated acceptance length, curves redrawn at each evaluation, export best, --export-from beside a running training,
and the recipe (loss by name, AdamW settings, hidden-state noise) in the config and refused on --resume."""

from __future__ import annotations

import json
import logging
import os
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3pipe import draft
from eagle3pipe.cli import run_stage
from eagle3pipe.locks import StageLock
from eagle3pipe.progress import Progress
from eagle3pipe.records import DataDir, read_jsonl, read_provenance
from eagle3pipe.records_checkpoints import list_train_checkpoints, load_train_checkpoint
from eagle3pipe.train import add_hidden_noise, run_train, train_log_name
from eagle3pipe.train_metrics import ACCEPTANCE_KEY, simulated_acceptance_length
from eagle3pipe.vocab import run_vocab
from tests.test_draft_fixtures import make_rows, toy_config, write_hidden_states, write_rows

# the monitored run: 3 epochs of ~4 steps (19 training samples, 5 held out, rows of 256 tokens)
MONITORED = dict(epochs=3, log_every=2, eval_every_steps=5, learning_rate=3e-2, checkpoint_every=4,
                 keep_checkpoints=1, export="best", report_to=["tensorboard", "wandb"], cpu_threads=1)


def _prepare(data_dir: Path, verifier: Path, rows=None, **train):
    rows = rows if rows is not None else make_rows(24, seed=3)
    write_rows(data_dir, rows)
    write_hidden_states(data_dir, verifier, rows)
    cfg = toy_config(data_dir, verifier, **train)
    run_vocab(cfg)
    return cfg


def _records(data_dir: Path, kind: str | None = None) -> list[dict]:
    return [r for r in read_jsonl(DataDir(data_dir).train_metrics) if kind is None or r["kind"] == kind]


def _door_argv(cfg) -> list[str]:
    """The flags that rebuild ``cfg`` (toy_config's) through 04's door."""
    s, t = cfg.shared, cfg.train
    return ["--data-dir", str(s.data_dir), "--verifier", s.verifier, "--vocab-size", str(s.vocab_size),
            "--hidden-size", str(s.hidden_size), "--draft-vocab-size", str(s.draft_vocab_size), "--aux-layer-ids",
            *map(str, s.aux_layer_ids), "--device", "cpu", "--epochs", str(t.epochs), "--total-seq-len",
            str(t.total_seq_len), "--max-seq-len", str(s.max_seq_len), "--eval-fraction", str(t.eval_fraction),
            "--num-workers", "0", "--draft-num-heads", str(t.draft_num_heads), "--draft-num-kv-heads",
            str(t.draft_num_kv_heads), "--draft-head-dim", str(t.draft_head_dim), "--draft-intermediate-size", str(t.draft_intermediate_size),
            "--learning-rate", str(t.learning_rate), "--think-token-id", str(s.think_token_id),
            "--response-token-id", str(s.response_token_id), "--checkpoint-every", str(t.checkpoint_every),
            "--log-every", str(t.log_every), "--keep-checkpoints", str(t.keep_checkpoints)]


def read_wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of an offline wandb run, decoded by wandb's own protobuf Record. wandb 0.31 keeps no Python
    reader of its .wandb files (its Go core writes them); the framing is LevelDB's log format with a 7-byte file
    header (":W&B", magic, version): 32 KiB blocks of records, each a 7-byte header (crc32, length, type:
    1 full, 2 first, 3 middle, 4 last) and its bytes."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data, block, pos = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    payloads, pending = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left - 7
            continue
        chunk, pos = data[pos:pos + length], pos + length
        if kind == 1:
            payloads.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            payloads.append(pending + chunk)
    rows = []
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def expected_scalars(records: list[dict]) -> dict[tuple[str, int], float]:
    """Every number metrics.jsonl holds, as (tracker tag, optimizer step): computed here from the file itself
    (kind/key, lists by index; a record without a step sits at the step of the record before it)."""
    out, step = {}, 0
    for r in records:
        step = r.get("step", step)
        for key, value in r.items():
            if key in ("kind", "step"):
                continue
            for i, v in (enumerate(value) if isinstance(value, list) else [(None, value)]):
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[(f"{r['kind']}/{key}" + ("" if i is None else f"/{i}"), step)] = v
    return out


@pytest.fixture(scope="module")
def monitored(toy_llama, tmp_path_factory):
    """One run: tensorboard + wandb (offline), a log line every 2 steps, an evaluation every 5 steps, export best;
    plot_curves watched (a spy that calls the real one) to see when curves.png is drawn."""
    import eagle3pipe.train_drafts as train_module  # the draft family draws curves.png (train_drafts.plot_curves)

    root = tmp_path_factory.mktemp("monitored")
    cfg = _prepare(root, toy_llama, **MONITORED)
    cfg.shared.progress_every_s = 0.0  # a plain progress line every step (no terminal under pytest)
    drawn = []
    real_plot = train_module.plot_curves

    def watched(metrics_path, out_png, *args, **kwargs):
        real_plot(metrics_path, out_png, *args, **kwargs)
        drawn.append(([r["step"] for r in read_jsonl(metrics_path) if r["kind"] == "eval"],
                      out_png.read_bytes()[:8]))

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    package_log = logging.getLogger("eagle3pipe")
    level = package_log.level
    package_log.addHandler(handler)
    package_log.setLevel(logging.INFO)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.setattr(train_module, "plot_curves", watched)
        try:
            run_train(cfg)
        finally:
            package_log.removeHandler(handler)
            package_log.setLevel(level)
    # the run's steps, from the packing of its training split (one packed row a step on one process)
    from eagle3pipe.train import build_data
    from eagle3pipe.train_batches import packed_batches

    train_ds = build_data(cfg, torch.device("cpu"))[0]
    steps = sum(len(packed_batches(train_ds, cfg.train.total_seq_len, cfg.shared.seed, e))
                for e in range(cfg.train.epochs))
    return {"dir": root, "cfg": cfg, "drawn": drawn, "lines": lines, "steps": steps}


def test_tensorboard_and_wandb_hold_every_metric_of_metrics_jsonl(monitored):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dd = DataDir(monitored["dir"])
    records = _records(monitored["dir"])
    assert {r["kind"] for r in records} == {"train", "eval", "rows"}
    want = expected_scalars(records)
    assert len(want) > 100
    # tensorboard: its own reader, every tag at every step (float32 on disk)
    events = EventAccumulator(str(dd.train_reports / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    got = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    # wandb: the offline run's history rows, each with its optimizer step
    (run_dir,) = (dd.train_reports / "wandb").glob("offline-run-*")
    seen = {}
    for row in read_wandb_history(run_dir):
        step = row["optimizer_step"]
        seen.update({(k, step): v for k, v in row.items() if "/" in k})
    assert set(seen) == set(want)
    for key, value in want.items():
        assert seen[key] == pytest.approx(value, rel=1e-12), key


def test_evaluations_every_n_steps_carry_the_simulated_acceptance_length(monitored):
    evals = _records(monitored["dir"], "eval")
    last_step = monitored["steps"]
    assert [r["step"] for r in evals] == [5, 10, last_step]  # every 5 steps and after the run's last step
    for r in evals:
        # independently: the per-position conditional accuracies from the logged cumulative ones (acc@k = P(the
        # first k draft tokens right)), then SpecForge's / TorchSpec's geometric sum, plus vLLM's bonus token
        acc = [r[f"acc_{k}"] for k in (1, 2, 3)]
        conditional = [acc[0]] + [acc[k] / acc[k - 1] if acc[k - 1] else 0.0 for k in (1, 2)]
        expected = 1.0
        for k in range(3):
            expected += float(torch.tensor(conditional[:k + 1], dtype=torch.float64).prod())
        assert 1.0 >= acc[0] >= acc[1] >= acc[2] >= 0.0  # cumulative: so 1 <= the length <= k + 1
        assert r[ACCEPTANCE_KEY] == pytest.approx(expected, rel=1e-12)
    assert any(r[ACCEPTANCE_KEY] > 1.0 for r in evals)  # the figures are not all the trivial 1


def test_acc_at_k_is_cumulative_as_speculators_counts_it():
    """The contract the acceptance length reads (its "cumulative" kind, and the monotone acc@k asserted above):
    speculators' full_acc_i, summed into our acc@k by train_metrics.summarize, is the share of positions whose draft
    tokens 1..k are all right, computed here independently from known right/wrong patterns whose cumulative,
    conditional and marginal shares all differ."""
    from speculators.models.metrics import compute_accuracy_single_step

    from eagle3pipe.train_metrics import summarize

    right = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)  # TTT step x position
    target = torch.arange(4)[None]
    prev_correct = torch.ones(1, 4, dtype=torch.bool)  # as speculators' Eagle3 forward starts it (no loss mask)
    sums = {"loss_sum": 1.0, "loss_total": 1.0}
    for i, step in enumerate(right):
        pred = torch.where(step[None], target, target + 1)
        full_correct, full_total, _, _ = compute_accuracy_single_step(pred, target, None, prev_correct)
        sums.update({f"loss_{i}_sum": 1.0, f"full_acc_{i}_sum": float(full_correct),
                     f"full_acc_{i}_total": float(full_total)})
    out = summarize(sums, 3)
    cumulative = [right[:k + 1].all(0).float().mean().item() for k in range(3)]  # [0.75, 0.5, 0.25]
    assert [out[f"acc_{k}"] for k in (1, 2, 3)] == pytest.approx(cumulative)
    assert out[ACCEPTANCE_KEY] == pytest.approx(1 + sum(cumulative))  # 2.5; read as conditional it would be 2.22


def test_simulated_acceptance_length_reads_cumulative_and_conditional_accuracies():
    # a draft whose tokens are right with probability 0.8, 0.5 (given the first), 0.25 (given both)
    conditional = [0.8, 0.5, 0.25]
    cumulative = [0.8, 0.4, 0.1]
    assert simulated_acceptance_length(conditional, "conditional") == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert simulated_acceptance_length(cumulative, "cumulative") == pytest.approx(2.3)
    assert simulated_acceptance_length([1.0] * 3, "conditional") == 4.0  # k + 1: every draft token accepted
    with pytest.raises(ValueError, match="marginal"):
        simulated_acceptance_length(cumulative, "marginal")


def test_curves_are_redrawn_at_each_evaluation(monitored):
    drawn, last_step = monitored["drawn"], monitored["steps"]
    png = b"\x89PNG\r\n\x1a\n"
    # one drawing right after each evaluation (its record already in metrics.jsonl), then the export's
    assert [steps for steps, _ in drawn] == [[5], [5, 10], [5, 10, last_step], [5, 10, last_step]]
    assert all(head == png for _, head in drawn)


def test_export_best_exports_the_checkpoint_it_names_and_keeps_it(monitored):
    dd, last_step = DataDir(monitored["dir"]), monitored["steps"]
    evals = _records(monitored["dir"], "eval")
    best = max(evals, key=lambda r: (r[ACCEPTANCE_KEY], -r["step"]))  # the earliest of equals
    assert best["step"] != last_step  # the premise: the best is not the last (lr 3e-2 overshoots on the toy)
    saved = [s for s, _ in list_train_checkpoints(dd.checkpoints)]
    assert best["step"] in saved and saved[-1] == last_step and len(saved) == 2  # keep_checkpoints 1, plus the best
    prov = read_provenance(dd.provenance(dd.checkpoints))
    assert prov["counts"]["steps"] == best["step"] and prov["counts"]["trained_steps"] == last_step
    assert prov["counts"][ACCEPTANCE_KEY] == best[ACCEPTANCE_KEY]
    # the export's tensors are that checkpoint's (speculators names -> the flat layout's)
    exported = load_file(str(dd.final_checkpoint / "model.safetensors"))
    best_state = load_train_checkpoint(dd.checkpoint_step(best["step"]))[0]
    last_state = load_train_checkpoint(dd.checkpoint_step(last_step))[0]
    torch.testing.assert_close(exported["fc.weight"], best_state["fc.weight"].to(exported["fc.weight"].dtype))
    assert not torch.equal(best_state["fc.weight"], last_state["fc.weight"])


def test_training_progress_lines_say_no_meaningless_error_count(monitored):
    lines = [ln for ln in monitored["lines"] if ln.startswith("Training:")]
    assert lines and not any("error" in ln for ln in lines), lines[:3]
    progress = Progress(10, unit="steps", errors_label="skipped samples", show_zero_errors=False, use_tty=False)
    progress.update(1)
    assert progress.line().startswith("Progress: 1/10, ")
    progress.errors = 2
    assert "1/10 (2 skipped samples), " in progress.line()
    assert "(0 errors)" in Progress(10, use_tty=False).line()  # the other stages keep their error count


def test_logged_loss_and_acc_are_means_since_the_last_log_line(tmp_path, toy_llama):
    """log_every 3 against log_every 1 of the same seeded run: each line of the first is the mean of the steps since
    the line before, weighted as a step's metrics are (loss by packed rows, acc@k by supervised tokens)."""
    rows = make_rows(24, seed=3)
    every = {}
    for n in (1, 3):
        run_train(_prepare(tmp_path / f"every{n}", toy_llama, rows, max_steps=7, log_every=n, cpu_threads=1))
        every[n] = _records(tmp_path / f"every{n}", "train")
    assert [r["step"] for r in every[1]] == list(range(1, 8)) and [r["step"] for r in every[3]] == [3, 6, 7]
    windows = {3: every[1][0:3], 6: every[1][3:6], 7: every[1][6:7]}
    for line in every[3]:
        window = windows[line["step"]]
        rows_in = sum(r["rows"] for r in window)
        assert line["rows"] == rows_in and line["window_steps"] == len(window)
        for key in ("loss", "loss_1", "loss_3"):
            assert line[key] == pytest.approx(sum(r[key] * r["rows"] for r in window) / rows_in, rel=1e-6), key
        for k in (1, 2, 3):
            tokens = sum(r[f"acc_{k}_tokens"] for r in window)
            assert line[f"acc_{k}_tokens"] == tokens
            assert line[f"acc_{k}"] == pytest.approx(sum(r[f"acc_{k}"] * r[f"acc_{k}_tokens"] for r in window)
                                                     / tokens, rel=1e-6, abs=1e-9)
        assert line["lr"] == window[-1]["lr"]  # the rate of the line's own step
    # eval_every_steps 0: after each epoch's last step (4 steps an epoch), and after the step --max-steps ends on
    assert [r["step"] for r in _records(tmp_path / "every3", "eval")] == [4, 7]


def test_export_from_a_step_equals_its_export_and_leaves_a_running_training_alone(tmp_path, toy_llama, capsys):
    cfg = _prepare(tmp_path, toy_llama, max_steps=4, checkpoint_every=2, keep_checkpoints=0, log_every=1)
    run_train(cfg)  # final/ = the export of step 4
    dd = DataDir(tmp_path)
    argv = _door_argv(cfg) + ["--max-steps", "4"]
    before = {p: p.read_bytes() for p in (dd.train_metrics, dd.train_run, dd.checkpoint_step(2) / "model.safetensors")}
    running = StageLock(dd.stage_lock("04_train"), "04_train")  # a training that holds its lock, as one running does
    running.acquire()
    try:
        assert run_stage("train", train_log_name, run_train, None, argv + ["--export-from", "step_4"]) == 0
        other = tmp_path / "served" / "mid_run"
        assert run_stage("train", train_log_name, run_train, None,
                         argv + ["--export-from", str(dd.checkpoint_step(2)), "--export-to", str(other)]) == 0
        assert run_stage("train", train_log_name, run_train, None, argv + ["--export-from", "step_3"]) == 2
    finally:
        running.release()
    assert "--export-from step_3" in capsys.readouterr().err
    ours = dd.train_export(4)
    a, b = draft.read_flat_checkpoint(ours), draft.read_flat_checkpoint(dd.final_checkpoint)
    assert a.config == b.config
    ta, tb = load_file(str(ours / "model.safetensors")), load_file(str(dd.final_checkpoint / "model.safetensors"))
    assert set(ta) == set(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    mid = load_file(str(other / "model.safetensors"))
    assert not torch.equal(mid["fc.weight"], ta["fc.weight"])  # step 2's draft, not step 4's
    assert read_provenance(other / "provenance.json")["counts"]["steps"] == 2
    assert not list((tmp_path / "served").glob(".*"))  # no temporary folder left beside it
    for path, content in before.items():  # the run's own files untouched
        assert path.read_bytes() == content, path
    assert dd.log_file("04_export").is_file()
    from eagle3pipe.evaluate import check_served_draft

    check_served_draft(other, cfg, "--draft")  # what 05 checks before it starts vLLM on a draft


def test_a_missing_tracker_library_is_named_before_training(tmp_path, toy_llama, capsys, monkeypatch):
    cfg = _prepare(tmp_path, toy_llama)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed: import raises
    assert run_stage("train", "04_train", run_train, None, _door_argv(cfg) + ["--report-to", "tensorboard"]) == 2
    err = capsys.readouterr().err
    assert "train.report_to tensorboard: the tensorboard library is not installed" in err, err
    assert not DataDir(tmp_path).checkpoints.exists()  # refused before anything was written


def test_the_recipe_reaches_the_optimizer_and_is_refused_on_resume(tmp_path, toy_llama, capsys):
    cfg = _prepare(tmp_path, toy_llama, max_steps=2, checkpoint_every=2)
    argv = _door_argv(cfg) + ["--max-steps", "2", "--weight-decay", "0.05", "--adam-betas", "0.8", "0.95",
                              "--hidden-noise-std", "0.02", "--loss", "jsd"]
    assert run_stage("train", "04_train", run_train, None, argv) == 0
    groups = json.loads((DataDir(tmp_path).checkpoint_step(2) / "optimizer.json").read_text())
    assert groups[0]["weight_decay"] == 0.05 and groups[0]["betas"] == [0.8, 0.95]
    for change, named in ((["--weight-decay", "0.01"], "train.weight_decay: 0.05 then, 0.01 now"),
                          (["--loss", "kl_div"], "train.loss: 'jsd' then, 'kl_div' now"),
                          (["--hidden-noise-std", "0"], "train.hidden_noise_std: 0.02 then, 0.0 now"),
                          (["--max-grad-norm", "0.5"], "train.max_grad_norm: 1.0 then, 0.5 now")):
        flags = [f for f in argv]
        for i in range(0, len(change), 2):
            if change[i] in flags:
                j = flags.index(change[i])
                del flags[j:j + 2]
        assert run_stage("train", "04_train", run_train, None, flags + change + ["--resume", "--max-steps", "4"]) == 2
        err = capsys.readouterr().err
        assert named in err, err
    assert run_stage("train", "04_train", run_train, None, argv + ["--resume"]) == 0  # the same recipe resumes


def test_the_loss_is_speculators_by_name_with_its_weights(tmp_path, toy_llama, capsys):
    rows = make_rows(24, seed=3)
    first = {}
    for name, loss in (("kl", "kl_div"), ("half", '{"kl_div": 0.5}')):
        run_train(_prepare(tmp_path / name, toy_llama, rows, max_steps=1, loss=loss))
        first[name] = _records(tmp_path / name, "train")[0]
    for key in ("loss", "loss_1", "loss_2", "loss_3"):  # the first step's loss, before any update: exactly half
        assert first["half"][key] == pytest.approx(0.5 * first["kl"][key], rel=1e-6)
    assert first["half"]["acc_1"] == first["kl"]["acc_1"]
    cfg = _prepare(tmp_path / "bad", toy_llama, rows)
    assert run_stage("train", "04_train", run_train, None, _door_argv(cfg) + ["--loss", "kl"]) == 2
    err = capsys.readouterr().err
    assert "train.loss 'kl': Unknown loss function 'kl'" in err and "kl_div" in err, err


def test_hidden_noise_is_uniform_in_std_on_the_aux_states_only_and_seeded_by_the_row():
    batch = {"hidden_states": torch.zeros(64, 3 * 128), "verifier_last_hidden_states": torch.zeros(64, 128),
             "input_ids": torch.arange(64)}
    noisy = add_hidden_noise(batch, 0.05, seed=7)
    delta = noisy["hidden_states"] - batch["hidden_states"]
    assert delta.abs().max() <= 0.05 and delta.abs().max() > 0.045  # uniform over [-std, std]
    assert abs(float(delta.mean())) < 0.002 and float(delta.std()) == pytest.approx(0.05 / 3 ** 0.5, rel=0.05)
    assert torch.equal(noisy["verifier_last_hidden_states"], batch["verifier_last_hidden_states"])  # the targets'
    assert torch.equal(noisy["input_ids"], batch["input_ids"]) and torch.equal(batch["hidden_states"],
                                                                              torch.zeros(64, 3 * 128))
    assert torch.equal(add_hidden_noise(batch, 0.05, seed=7)["hidden_states"], noisy["hidden_states"])
    assert not torch.equal(add_hidden_noise(batch, 0.05, seed=8)["hidden_states"], noisy["hidden_states"])


def test_the_recipe_fields_are_checked_at_start():
    from eagle3pipe.config import ConfigError, load_config

    def validate(**train):
        load_config(None, {"train": train, "shared": {"max_seq_len": 1024}}).validate("train")

    for train, message in (({"report_to": ["mlflow"]}, "unknown tracker 'mlflow'"),
                           ({"export": "first"}, "train.export must be 'last' or 'best'"),
                           ({"export": "best", "eval_fraction": 0.0}, "train.eval_fraction is 0"),
                           ({"adam_betas": [0.9]}, "train.adam_betas must be two numbers"),
                           ({"eval_every_steps": -1}, "train.eval_every_steps must be >= 0"),
                           ({"export_to": "x"}, "pass --export-from step_N too")):
        with pytest.raises(ConfigError, match=message):
            validate(**train)
    validate(report_to=["tensorboard", "wandb"], export="best", eval_every_steps=100)
    assert os.environ.get("WANDB_MODE") != "online"  # the suite never talks to wandb's servers
