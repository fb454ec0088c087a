"""run_all.sh: the stage plan and its hashes, skip-on-rerun markers, kill-and-restart, first failure stops the run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

from eagle3pipe.config import ConfigError, load_config
from eagle3pipe.records import DataDir, write_jsonl_atomic
from eagle3pipe.run_all import STAGES, plan, stage_hashes
from eagle3pipe.toy_reasoning import write_chat_datasets

from conftest import run_script_here
from test_generate import StubServer, write_questions
from test_locks import _run_all_config
from watch import run_watched, wait_until

REPO = Path(__file__).resolve().parents[1]


def write_config(tmp_path: Path, verifier: Path, **sections) -> Path:
    chats = tmp_path / "chats.jsonl"
    if not chats.exists():
        write_chat_datasets(chats, None, seed=0, size="ci", num_chats=40, num_eval=0)
    cfg = {
        "shared": {"data_dir": str(tmp_path / "data"), "verifier": str(verifier), "think_token_id": 1020,
                   "response_token_id": 1021, "aux_layer_ids": [2, 4, 5], "hidden_size": 128, "vocab_size": 1088,
                   "draft_vocab_size": 256, "max_seq_len": 1024, "progress_every_s": 1},
        "prepare": {"dataset": [str(chats)]},
        "extract": {"input": "synthetic", "device": "cpu", "model_dtype": "float32"},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_plan_skips_01b_without_url_and_hashes_cascade(tmp_path):
    cfg_path = write_config(tmp_path, tmp_path / "verifier")
    rows = plan(str(cfg_path), [], REPO, allow_human_answers=True)
    assert [r["name"] for r in rows] == [n for n, _, _ in STAGES if n != "01b_generate"]
    resolved = load_config(rows[0]["config"])  # every stage reads prepared/ (03 and 04 have no --input flag)
    assert all(r["config"] == rows[0]["config"] for r in rows) and resolved.extract.input == "prepared"
    assert resolved.to_dict() == {**load_config(cfg_path).to_dict(),
                                  "extract": {**load_config(cfg_path).to_dict()["extract"], "input": "prepared"}}
    assert {r["name"]: r["resume"] for r in rows} == {r["name"]: (["--resume"] if r["name"] == "04_train" else [])
                                                      for r in rows}  # 04 alone needs telling to continue its run
    assert all(r["started"] == str(DataDir(tmp_path / "data").stage_started(r["name"])) for r in rows)
    with_url = plan(str(cfg_path), ["http://127.0.0.1:1"], REPO)
    assert [r["name"] for r in with_url][:3] == ["01_prepare", "01b_generate", "02_extract"]
    # online: 04 extracts the states as it trains, so run_all does not run 02 first (its plan costs 02 nothing)
    online = write_config(tmp_path, tmp_path / "verifier", train={"data_source": "online"})
    assert [r["name"] for r in plan(str(online), ["http://127.0.0.1:1"], REPO)] == [
        n for n, _, _ in STAGES if n != "02_extract"]
    cfg_path = write_config(tmp_path, tmp_path / "verifier")  # the offline config again, for the hashes below
    assert all(r["config"] == str(cfg_path.resolve()) for r in with_url)

    base = load_config(cfg_path)
    h0 = stage_hashes(base)
    moved = load_config(cfg_path, {"shared": {"vllm_url": ["http://other:9"], "progress_every_s": 30.0}})
    assert stage_hashes(moved) == h0  # where the server is does not change what a stage computes
    train_changed = stage_hashes(load_config(cfg_path, {"train": {"epochs": 7}}))
    assert [train_changed[n] == h0[n] for n, _, _ in STAGES] == [True, True, True, True, False, False]
    prep_changed = stage_hashes(load_config(cfg_path, {"prepare": {"max_samples": 5}}))
    assert all(prep_changed[n] != h0[n] for n, _, _ in STAGES)


def _run_all(*args: str, **kw) -> subprocess.CompletedProcess:
    """run_all.sh under the stall watchdog (no fixed wall limit); stdout and stderr together in both fields."""
    with tempfile.TemporaryDirectory() as tmp:
        res = run_watched([str(REPO / "run_all.sh"), *args], log_file=Path(tmp) / "run_all.out", stall_s=300, **kw)
    return subprocess.CompletedProcess(res.args, res.returncode, res.stdout, res.stdout)


@pytest.mark.integration
def test_killed_in_stage_02_then_restarted_does_not_redo_01(tmp_path, toy_llama):
    from test_ops_status import status

    cfg_path = write_config(tmp_path, toy_llama)
    dd = DataDir(tmp_path / "data")
    extract_log = Path(next(r for r in plan(str(cfg_path), [], REPO, allow_human_answers=True)
                            if r["name"] == "02_extract")["log"])
    proc = subprocess.Popen([str(REPO / "run_all.sh"), "--config", str(cfg_path), "--to", "02_extract",
                             "--allow-human-answers"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def journals() -> list[str]:
        return [line for j in dd.hs_work.glob("shard_*/done.jsonl") for line in j.read_text().splitlines()]

    try:  # until stage 02 has journalled samples: run_all.sh --status then shows it running, with its progress
        wait_until(lambda: extract_log.exists() and journals(), proc, "a sample journalled by stage 02", poll_s=0.05)
        view, table = status(cfg_path)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # run_all.sh, the stage and tee, as a crash or `kill -9` would
        proc.wait()
    assert dd.stage_marker("01_prepare").read_text().strip()
    assert not dd.stage_marker("02_extract").exists(), "stage 02 finished before the kill: nothing was tested"
    st = {s["name"]: s for s in view["stages"]}["02_extract"]
    assert st["state"] == "running" and st["detail"].startswith("pid "), st  # issue 47: not "not started"
    assert st["unit"] == "samples" and st["total"] == 40 and 1 <= st["done"] <= 40, st  # journalled of the rows
    assert re.search(r"^02_extract\s+running\s+\d+/40 samples", table, re.M), table
    prepared_mtime = dd.prepared_data.stat().st_mtime_ns

    done = _run_all("--config", str(cfg_path), "--to", "02_extract", "--allow-human-answers")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "01_prepare: done before with this config" in done.stderr
    assert "02_extract: running" in done.stderr and "02_extract: finished" in done.stderr
    assert dd.prepared_data.stat().st_mtime_ns == prepared_mtime  # 01 not redone
    assert dd.stage_marker("02_extract").is_file()
    hs_files = list((dd.hidden_states).rglob("*.safetensors"))
    assert len(hs_files) == 40  # one per prepared row

    again = _run_all("--config", str(cfg_path), "--to", "02_extract", "--allow-human-answers")  # both skipped
    assert again.returncode == 0 and again.stderr.count("done before with this config") == 2

    forced = _run_all("--config", str(cfg_path), "--only", "02", "--force", "--allow-human-answers")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert "02_extract: running" in forced.stderr and "01_prepare:" not in forced.stderr
    assert dd.prepared_data.stat().st_mtime_ns == prepared_mtime


@pytest.mark.integration
def test_first_failing_stage_stops_the_run_and_names_its_log(tmp_path, toy_llama):
    cfg_path = write_config(tmp_path, toy_llama, prepare={"dataset": [str(tmp_path / "no_such.jsonl")]})
    dd = DataDir(tmp_path / "data")
    res = _run_all("--config", str(cfg_path), "--to", "04_train", "--allow-human-answers")
    assert res.returncode != 0
    assert f"FAILED at stage 01_prepare (exit status {res.returncode}): " in res.stderr
    assert "no_such.jsonl" in res.stderr.split("FAILED at stage 01_prepare")[1]  # the stage's own error, named
    assert f"its log: {dd.log_file('01_prepare')}" in res.stderr
    assert "02_extract: running" not in res.stderr
    assert not dd.stage_marker("01_prepare").exists()
    assert "no_such.jsonl" in (dd.logs / "run_all.log").read_text()  # the stage's own error is in the run log
    # --from 02: 01 (which would fail again) is not run; 02 is, and fails on its own missing input
    res = _run_all("--config", str(cfg_path), "--from", "02", "--to", "04", "--allow-human-answers")
    assert "01_prepare: before --from 02, not run" in res.stderr and "FAILED at stage 01_prepare" not in res.stderr
    assert "02_extract: running" in res.stderr and "FAILED at stage 02_extract" in res.stderr


def test_every_stage_run_all_will_run_checks_its_settings_before_the_first_starts(tmp_path):
    """Issue 47: without evaluate.prompts / benchmarks, 05 refused only once 01-04 had run (hours on K2.5). Now the
    whole run stops before 01, naming 05's own error; a run that stops before 05 (--to) or leaves 05 out is not
    held back by it, and one 05 accepts runs."""
    cfg_path = write_config(tmp_path, tmp_path / "verifier")
    dd = DataDir(tmp_path / "data")
    res = _run_all("--config", str(cfg_path), "--allow-human-answers")
    assert res.returncode == 2
    assert ("stage 05_evaluate would refuse this config, so nothing was started: evaluate.prompts and "
            "evaluate.benchmarks are empty") in res.stderr
    assert not dd.log_file("01_prepare").exists()  # nothing ran
    from eagle3pipe.run_all import check_stages

    stages = [n for n, _, _ in STAGES if n != "01b_generate"]
    check_stages(str(cfg_path), [], stages[:-1])  # --to 04_train: 05's settings are not its business
    with pytest.raises(ConfigError, match="stage 04_train would refuse"):
        check_stages(str(write_config(tmp_path, tmp_path / "verifier", train={"epochs": 0})), [], stages[:-1])
    check_stages(str(write_config(tmp_path, tmp_path / "verifier", evaluate={"benchmarks": ["gsm8k"]})), [], stages)


def test_unknown_stage_name_is_refused(tmp_path):
    cfg_path = write_config(tmp_path, tmp_path / "verifier")
    res = _run_all("--config", str(cfg_path), "--only", "07_deploy", "--allow-human-answers")
    assert res.returncode == 2 and "no stage '07_deploy'" in res.stderr


def test_no_url_with_thinking_refuses_unless_human_answers_are_allowed(tmp_path):
    cfg_path = write_config(tmp_path, tmp_path / "verifier")
    dd = DataDir(tmp_path / "data")
    res = _run_all("--config", str(cfg_path), "--to", "01_prepare")
    assert res.returncode == 2
    assert "--allow-human-answers" in res.stderr and "--vllm-url" in res.stderr and "1.17" in res.stderr
    assert "never these answers" in res.stderr  # says why
    assert not dd.log_file("01_prepare").exists()  # refused before any stage ran
    with pytest.raises(ConfigError, match="--allow-human-answers"):
        plan(str(cfg_path), [], REPO)
    assert plan(str(cfg_path), [], REPO, allow_human_answers=True)
    assert load_config(plan(str(write_config(tmp_path, tmp_path / "verifier", shared={"thinking": False})), [],
                            REPO)[0]["config"]).extract.input == "prepared"  # thinking off: human answers fit
    # an earlier 01b finished synthetic/: no URL needed, the stages read it (not prepared/)
    from eagle3pipe.records import write_synthetic_provenance

    cfg_path = write_config(tmp_path, tmp_path / "verifier")
    write_jsonl_atomic(dd.synthetic_data, [{"id": "a", "input_ids": [1, 2], "loss_mask": [0, 1], "source": ""}])
    write_synthetic_provenance(dd, config_hash="x", config={}, counts={}, started=0.0)
    rows = plan(str(cfg_path), [], REPO)
    assert all(r["config"] == str(cfg_path.resolve()) for r in rows) and "01b_generate" not in [r["name"] for r in rows]


@pytest.mark.integration
def test_run_all_stops_at_an_unfinished_01b_with_the_count_and_the_command_to_resume(tmp_path, toy_llama, toy_meta):
    cfg_path = _run_all_config(tmp_path, toy_llama, toy_meta)
    dd = DataDir(tmp_path / "data")
    write_questions(dd.root, 3)
    with StubServer("ok") as stub:
        stub.fail_for = {"what is 2 + 2?"}
        args = ("--config", str(cfg_path), "--vllm-url", stub.url, "--only", "01b")
        res = _run_all(*args)
        assert res.returncode == 2
        assert "FAILED at stage 01b_generate (exit status 2): 1 of 3 ids errored (http_5xx 1" in res.stderr
        assert f"resume with: {REPO / 'run_all.sh'} --config {cfg_path} --vllm-url {stub.url} --only 01b" in res.stderr
        assert not dd.stage_marker("01b_generate").exists()
        before = dict(stub.requests)
        stub.fail_for.clear()
        again = _run_all(*args)  # the resume command it printed
        assert again.returncode == 0, again.stderr[-3000:]
        sent_again = {p: n - before.get(p, 0) for p, n in stub.requests.items() if n != before.get(p, 0)}
    assert sent_again == {"what is 2 + 2?": 1}
    assert dd.stage_marker("01b_generate").is_file()


def test_plan_starts_04_under_torchrun_when_train_nproc_per_node_is_above_one(tmp_path, toy_llama):
    """Issue 17: train.nproc_per_node 2 gives 04 (and only 04) torchrun's launcher; 0 on a CPU config, 1 process."""
    repo = Path(__file__).resolve().parents[1]
    for nproc, want in ((2, ["torch.distributed.run", "--standalone", "--nproc-per-node", "2"]), (0, []), (1, [])):
        cfg = write_config(tmp_path, toy_llama, train={"nproc_per_node": nproc, "device": "cpu"})
        rows = {r["name"]: r for r in plan(str(cfg), ["http://127.0.0.1:1"], repo)}
        assert rows["04_train"]["launcher"] == want, nproc
        assert all(r["launcher"] == [] for name, r in rows.items() if name != "04_train")


@pytest.mark.integration
def test_killed_in_stage_04_the_printed_command_continues_the_run_to_the_uninterrupted_draft(tmp_path, toy_llama):
    """Issue 26 item 11: run_all killed with its stage (SIGKILL to the group, as a lost node) once 04 wrote a step_N
    checkpoint. The command run_all printed when it started, run exactly as printed, continues 04 from that
    checkpoint (no --overwrite, no YAML edit: run_all passes --resume to a 04 it started with this config and that
    did not finish), and the draft equals what 04 run uninterrupted on the same inputs gives."""
    import json
    import re

    from safetensors.torch import load_file
    from test_ops_status import DROPPED_CHATS, assert_status_of_a_finished_run

    from eagle3pipe.records import read_jsonl
    from eagle3pipe.records_checkpoints import list_train_checkpoints

    train = {"device": "cpu", "total_seq_len": 1024, "epochs": 3, "checkpoint_every": 2, "eval_fraction": 0.0,
             "num_workers": 0, "cpu_threads": 1, "log_every": 1, "learning_rate": 3e-3, "draft_num_heads": 4,
             "draft_num_kv_heads": 4, "draft_head_dim": 32, "draft_intermediate_size": 256}
    cfg_path = write_config(tmp_path, toy_llama, train=train)
    with open(tmp_path / "chats.jsonl", "a") as f:  # rows 01 drops, for run_all --status on the finished run
        f.writelines(json.dumps(chat) + "\n" for chat in DROPPED_CHATS)
    dd = DataDir(tmp_path / "data")
    out = tmp_path / "killed.out"
    with open(out, "wb") as fh:
        proc = subprocess.Popen([str(REPO / "run_all.sh"), "--config", str(cfg_path), "--to", "04_train",
                                 "--allow-human-answers"], stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: bool(list_train_checkpoints(dd.checkpoints)), proc, "a step_N checkpoint", poll_s=0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # run_all.sh, the stage and tee at once
        proc.wait()
    killed_at = list_train_checkpoints(dd.checkpoints)[-1][0]
    assert not dd.final_checkpoint.exists() and not dd.stage_marker("04_train").exists(), "04 ended before the kill"
    printed = re.search(r"run_all: to resume after an interruption, run: (.+)$", out.read_text(), re.M)
    assert printed, out.read_text()[-3000:]

    resumed = _run_all_command(printed.group(1))  # exactly the printed line, through a shell as a user would
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "04_train: continuing the run an earlier run_all started" in resumed.stderr
    assert f"resuming from {dd.checkpoint_step(killed_at)}" in resumed.stderr
    assert "02_extract: done before with this config" in resumed.stderr  # nothing upstream redone
    assert dd.stage_marker("04_train").is_file()
    resumed_steps = [r for r in read_jsonl(dd.train_metrics) if r["kind"] == "train"]
    resumed_draft = load_file(str(dd.final_checkpoint / "model.safetensors"))
    assert_status_of_a_finished_run(cfg_path)  # test_ops_status.py's assertions on this finished run

    # the uninterrupted run on the same inputs: 04 from scratch (--overwrite deletes the resumed run's checkpoints),
    # through 04's door in this process (issue 30: the killed and the resumed 04 above are where a process matters)
    code, stderr = run_script_here("04_train.py", ["--config", cfg_path, "--overwrite"])
    assert code == 0, stderr[-3000:]
    fresh_steps = [r for r in read_jsonl(dd.train_metrics) if r["kind"] == "train"]
    assert [r["step"] for r in resumed_steps] == [r["step"] for r in fresh_steps]  # each step trained once
    assert killed_at < len(fresh_steps)
    for x, y in zip(fresh_steps, resumed_steps):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6), x["step"]
        assert x["tokens"] == y["tokens"], x["step"]  # issue 47: the count went on, not from 0
    fresh_draft = load_file(str(dd.final_checkpoint / "model.safetensors"))
    assert set(fresh_draft) == set(resumed_draft)
    for k in fresh_draft:
        torch.testing.assert_close(fresh_draft[k].float(), resumed_draft[k].float(), rtol=0, atol=1e-2)


def _run_all_command(command: str) -> subprocess.CompletedProcess:
    """A command line run_all printed, run through bash under the stall watchdog; output in both fields."""
    with tempfile.TemporaryDirectory() as tmp:
        res = run_watched(["bash", "-c", command], log_file=Path(tmp) / "run_all.out", stall_s=300)
    return subprocess.CompletedProcess(res.args, res.returncode, res.stdout, res.stdout)


def test_every_stage_logs_and_locks_under_its_run_all_name(tmp_path, monkeypatch):
    """Issue 47: each door's log and lock name (what it passes to cli.run_stage) is its run_all stage name, which
    run_all.sh's plan names its log after and --status looks for (02 once logged as 02_extract_hidden_states, and
    --status showed it "not started" for the whole of its run)."""
    import runpy

    import eagle3pipe.cli

    passed = {}

    def record(stage, log_name, fn, description, argv=None):  # noqa: ARG001 (the door's own call, recorded)
        cfg = load_config(write_config(tmp_path, tmp_path / "verifier"))
        passed[stage] = log_name(cfg) if callable(log_name) else log_name
        return 0

    monkeypatch.setattr(eagle3pipe.cli, "run_stage", record)
    for name, pattern, section in STAGES:
        script = next(p for p in REPO.glob(pattern) if p.name.split("_", 1)[0] == name.split("_", 1)[0])
        with pytest.raises(SystemExit):
            runpy.run_path(str(script), run_name="__main__")
        assert passed.pop(section) == name, script.name
        # each door runs as ./NN_name.py too (01 and 05 did; 01b-04 were not executable, 02 had no #! line)
        assert os.access(script, os.X_OK) and script.read_text().startswith("#!/usr/bin/env python3\n"), script.name
    rows = plan(str(write_config(tmp_path, tmp_path / "verifier")), ["http://127.0.0.1:1"], REPO)
    assert {r["name"]: r["log"] for r in rows} == {r["name"]: str(DataDir(tmp_path / "data").log_file(r["name"]))
                                                   for r in rows}
