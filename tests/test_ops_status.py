"""``run_all.sh --status`` (eagle3pipe/status.py): each stage's state, progress and drops, read from the data dir alone,
while a stage runs, after it was killed, after it failed and after a finished run (test_run_all.py's, which calls
assert_status_of_a_finished_run); every drop of every stage in one list, counted against the stages' own files."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3pipe.config import load_config
from eagle3pipe.records import DataDir, DroppedRow, read_jsonl, write_jsonl_atomic, write_provenance
from eagle3pipe.status import reason_key

from conftest import run_script_here
from test_generate import StubServer, write_questions
from test_run_all import _run_all, write_config
from watch import wait_until

REPO = Path(__file__).resolve().parents[1]


def status(cfg_path: Path, *flags: str) -> tuple[dict, str]:
    """(the JSON view, from run_all.sh --status --json, the table as printed by run_all.sh --status ``flags``)."""
    def run(*extra: str) -> str:
        return subprocess.run([str(REPO / "run_all.sh"), "--config", str(cfg_path), "--status", *extra],
                              capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable},
                              timeout=120, check=True).stdout

    return json.loads(run("--json")), run(*flags)


def by_stage(view: dict) -> dict[str, dict]:
    return {s["name"]: s for s in view["stages"]}


def test_reason_key_is_the_kind_before_the_details():
    assert reason_key("too long: 40000 tokens > max_seq_len 32768 (truncation: drop)") == "too long"
    assert reason_key("non-finite hidden states (NaN/Inf)") == "non-finite hidden states"
    assert reason_key("retryable: connection refused (a rerun of 02 retries it)") == "retryable: connection refused"
    assert reason_key("duplicate conversation") == "duplicate conversation"


def _prepared(dd: DataDir, n: int) -> list[dict]:
    """Stage 01's output as 01 writes it (records' writers): n questions, two rows it dropped, its provenance."""
    write_questions(dd.root, n)
    dropped = [DroppedRow("chats.jsonl", 7, "too long: 2000 tokens > max_seq_len 1024 (truncation: drop)", "c7"),
               DroppedRow("chats.jsonl", 9, "malformed: no messages", "")]
    write_jsonl_atomic(dd.prepared_data, [])
    write_jsonl_atomic(dd.prepared_errors, [d.to_json() for d in dropped])
    write_provenance(dd.provenance(dd.prepared), stage="prepare", config_hash="x", config={}, inputs=[], counts={},
                     started=time.time() - 5)
    return [d.to_json() for d in dropped]


def _generate(cfg_path: Path, url: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "01b_generate_synthetic.py"), "--config", str(cfg_path),
                             "--vllm-url", url, *extra], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


@pytest.mark.integration
def test_an_online_run_s_stage_02_says_run_all_does_not_run_it(tmp_path):
    from eagle3pipe.config import load_config
    from eagle3pipe.status import stage_status

    dd = DataDir(tmp_path / "data")
    online = load_config(write_config(tmp_path, tmp_path / "verifier", train={"data_source": "online"}))
    st = stage_status(dd, online, "02_extract", [])
    assert st.state == "not started" and "train.data_source online" in st.detail
    offline = load_config(write_config(tmp_path, tmp_path / "verifier", train={"data_source": "offline"}))
    assert not stage_status(dd, offline, "02_extract", []).detail


def test_status_while_01b_runs_after_it_is_killed_fails_and_finishes(tmp_path, toy_llama, toy_meta):
    import yaml

    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "shared": {"data_dir": str(tmp_path / "data"), "verifier": str(toy_llama), "progress_every_s": 0.3,
                   "think_token_id": toy_meta["think_token_id"], "response_token_id": toy_meta["response_token_id"]},
        "generate": {"served_model_name": "stub", "min_completion_tokens": 1, "concurrency": 1, "max_retries": 0,
                     "empty_reasoning_max_share": 0.9}}))
    dd = DataDir(tmp_path / "data")
    prepared_drops = _prepared(dd, 30)
    with StubServer("ok", delay_s=0.3) as stub:
        stub.fail_for = {"what is 0 + 0?"}  # answered 500 once: errored (max_retries 0)
        stub.empty_for = {"what is 1 + 1?"}  # no reasoning: kept in responses, left out of data.jsonl
        proc = _generate(cfg_path, stub.url)
        try:
            wait_until(lambda: dd.responses.is_file() and len(dd.responses.read_text().splitlines()) >= 5, proc,
                       "five responses", poll_s=0.1)
            log = dd.log_file("01b_generate")
            wait_until(lambda: log.is_file() and "Progress: " in log.read_text(), proc, "a progress line", poll_s=0.1)
            running, table = status(cfg_path)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # as kill -9 or an OOM kill would: its lock stays behind
            proc.wait()
        st = by_stage(running)["01b_generate"]
        assert st["state"] == "running" and f"pid {proc.pid}" in st["detail"]
        assert st["total"] == 30 and 5 <= st["done"] < 30 and st["unit"] == "requests"
        assert st["rate"].endswith(" req/s") and st["eta"]
        assert by_stage(running)["01_prepare"]["state"] == "done"
        assert [by_stage(running)[n]["state"] for n in ("02_extract", "03_vocab", "04_train", "05_evaluate")] == \
            ["not started"] * 4
        assert "01b_generate  running" in table and f"pid {proc.pid}" in table

        killed, table = status(cfg_path)
        st = by_stage(killed)["01b_generate"]
        answered = {json.loads(line)["id"] for path in (dd.responses, dd.synthetic_errors) if path.exists()
                    for line in path.read_text().splitlines() if line.endswith("}")}
        assert st["state"] == "crashed" and f"pid {proc.pid}" in st["detail"] and dd.stage_lock("01b_generate").exists()
        assert (st["done"], st["total"]) == (len(answered), 30)
        assert "when it stopped" in st["eta"]
        assert st["drops"] == {"http_5xx": 1, "empty_reasoning": 1}
        assert "01b_generate  crashed" in table

        # resumed (through the door, in this process: conftest.run_script_here), it ends with the errored id (exit 2):
        # failed, naming its error line
        assert run_script_here("01b_generate_synthetic.py", ["--config", cfg_path, "--vllm-url", stub.url])[0] == 2
        after_failure, table = status(cfg_path)
        st = by_stage(after_failure)["01b_generate"]
        assert st["state"] == "failed" and "1 of 30 ids errored" in st["detail"] and st["done"] == 30

        assert run_script_here("01b_generate_synthetic.py", ["--config", cfg_path, "--vllm-url", stub.url,
                                                             "--max-error-share", "0.1"])[0] == 0
    done, table = status(cfg_path, "--drops")  # issue 47: run_all.sh refused --drops and --json
    st = by_stage(done)["01b_generate"]
    assert st["state"] == "done" and (st["done"], st["total"]) == (30, 30)
    # one list of drops, counted against each stage's own file
    drops = done["drops"]
    assert [(d["stage"], d["id"], d["reason"]) for d in drops if d["stage"] == "01_prepare"] == \
        [("01_prepare", p["id"] or f"{p['source']} row {p['row']}", reason_key(p["reason"])) for p in prepared_drops]
    errors = list(read_jsonl(dd.synthetic_errors))
    trained = {d["id"] for d in read_jsonl(dd.synthetic_data)}
    left_out = [(r["id"], "+".join(r["flags"])) for r in read_jsonl(dd.responses) if r["id"] not in trained]
    assert sorted((d["id"], d["reason"]) for d in drops if d["stage"] == "01b_generate") == \
        sorted([(e["id"], e["kind"]) for e in errors] + left_out)
    assert left_out == [("q001", "empty_reasoning")] and [e["id"] for e in errors] == ["q000"]
    assert f"dropped: {len(drops)} samples in all" in table
    assert "01b_generate  http_5xx" in table and "synthetic/errors.jsonl (first: q000)" in table
    listed = [line.split("\t") for line in table.splitlines() if line.count("\t") == 4]  # --drops: one line each
    assert [(d["stage"], d["id"], d["reason"]) for d in drops] == [(x[0], x[1], x[2]) for x in listed]


# Bad rows stage 01 drops, with their reasons: the finished run below appends them to its chats before it starts.
DROPPED_CHATS = [{"messages": []}, {"messages": [{"role": "user", "content": "x" * 9000},
                                                 {"role": "assistant", "content": "y" * 9000}]}]


def assert_status_of_a_finished_run(cfg_path: Path) -> None:
    """``run_all.sh --status`` after ``run_all.sh --to 04_train --allow-human-answers`` finished on chats that held
    DROPPED_CHATS. Called by test_run_all.py's kill-and-resume test on its finished run (issue 30: this file's own
    01 -> 04 run for it cost ~30 CPU-s; the assertions are the ones it made)."""
    dd = DataDir(load_config(cfg_path).shared.data_dir)
    view, table = status(cfg_path)
    st = by_stage(view)
    assert [st[n]["state"] for n in ("01_prepare", "02_extract", "03_vocab", "04_train")] == ["done"] * 4
    assert st["01b_generate"]["state"] == "not started" and st["05_evaluate"]["state"] == "not started"
    manifest = json.loads(dd.hs_manifest.read_text())
    assert (st["02_extract"]["done"], st["02_extract"]["total"]) == (manifest["num_samples"],) * 2
    steps = [d["step"] for d in read_jsonl(dd.train_metrics) if d["kind"] == "train"]
    trained = json.loads(dd.provenance(dd.checkpoints).read_text())["counts"]["steps"]
    assert st["04_train"]["done"] == steps[-1] == trained >= 1
    assert all(st[n]["detail"].startswith("took ") for n in ("01_prepare", "02_extract", "04_train"))
    dropped = list(read_jsonl(dd.prepared_errors))
    assert len(dropped) == len(DROPPED_CHATS)
    assert st["01_prepare"]["drops"] == dict(collections.Counter(reason_key(d["reason"]) for d in dropped))
    assert len(view["drops"]) == 2 and "dropped: 2 samples in all" in table
    for name in ("01_prepare", "02_extract", "03_vocab", "04_train"):
        assert f"{name:<13} done" in table


def test_progress_lines_read_back_as_written():
    from eagle3pipe.progress import Progress, parse_line

    bar = Progress(25000, unit="req", use_tty=False, desc="shard 3", initial=2000)
    bar.update(680, errors=22, avg_completion="1263 tokens")
    line = bar.line()
    parsed = parse_line(f"2026-12-02 10:00:00 INFO eagle3pipe.progress: {line}")
    assert parsed["desc"] == "shard 3" and (parsed["done"], parsed["total"], parsed["errors"]) == (2680, 25000, 22)
    assert parsed["unit"] == "req" and f"{parsed['rate']:.1f} req/s" in line and line.endswith(f"eta: {parsed['eta']}")
    assert parse_line("2026-12-02 10:00:00 INFO eagle3pipe: 01b: 30 questions") is None
