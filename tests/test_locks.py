"""Two copies of a stage never run at once (the per-stage lock every door takes), and stopping run_all.sh stops the
stage it runs (no orphan left writing): real processes, real signals, a local stub server that answers slowly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_generate import StubServer, _door, door_argv, write_questions

from eagle3pipe.records import DataDir

REPO = Path(__file__).resolve().parents[1]


def _wait_for(what: str, condition, timeout_s: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc is None or proc.poll() is None, f"the process ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Runs and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _children(pid: int, needle: str) -> list[int]:
    """Pids whose parent is ``pid`` and whose command line contains ``needle``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if ppid == pid and needle in cmdline:
            out.append(int(stat.parent.name))
    return out


def test_second_copy_of_a_stage_refuses_and_a_dead_holder_is_taken_over(tmp_path, toy_llama, toy_meta, capsys):
    write_questions(tmp_path, 3)
    dd = DataDir(tmp_path)
    with StubServer("ok", delay_s=600) as stub:  # the first copy stays busy on its first request
        argv = door_argv(tmp_path, toy_llama, toy_meta, stub.url, "--concurrency", "1")
        first = subprocess.Popen([sys.executable, str(REPO / "01b_generate_synthetic.py"), *argv], cwd=REPO,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_for("request from the first copy", lambda: stub.requests, proc=first)
            # a second copy of 01b on the same data dir refuses, naming the first (short timeout: were it to run,
            # it would end soon with errors instead of waiting on the slow server)
            assert _door(tmp_path, toy_llama, toy_meta, stub.url, "--concurrency", "1", "--request-timeout-s", "2",
                         "--max-retries", "0") == 2
            lock = dd.stage_lock("01b_generate")
            holder = json.loads(lock.read_text())
            assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()
            err = capsys.readouterr().err
            assert f"pid {first.pid} on {socket.gethostname()}, started {holder['started']}" in err
            assert "01b_generate_synthetic.py" in err and f"kill {first.pid}" in err
            assert sum(stub.requests.values()) == 1  # the refused copy sent nothing
        finally:
            first.kill()  # as kill -9 or a crash would: the lock stays behind
            first.wait()
        assert json.loads(lock.read_text())["pid"] == first.pid
        stub.delay_s = 0
        assert _door(tmp_path, toy_llama, toy_meta, stub.url, "--concurrency", "1") == 0  # stale: taken over
    assert "taking over the stale lock" in capsys.readouterr().err
    assert not lock.exists()  # released at the end


def test_lock_held_from_another_host_is_never_taken_over(tmp_path):
    from eagle3pipe.locks import StageLock, StageLockedError

    path = DataDir(tmp_path).stage_lock("02_extract")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pid": 1, "host": "gpu-node-7", "started": "2026-12-01T10:00:00",
                                "command": "python 02_extract_hidden_states.py --config k25.yaml"}))
    try:
        StageLock(path, "02_extract").acquire()
        raise AssertionError("took a lock held from another host")
    except StageLockedError as e:
        assert "pid 1 on gpu-node-7" in str(e) and "another host" in str(e) and str(path) in str(e)
    assert json.loads(path.read_text())["host"] == "gpu-node-7"


def _run_all_config(tmp_path: Path, verifier: Path, meta: dict) -> Path:
    # the toy's own dims (issue 47: run_all's disk check sizes the draft 04 would build from them)
    cfg = {"shared": {"data_dir": str(tmp_path / "data"), "verifier": str(verifier),
                      "think_token_id": meta["think_token_id"], "response_token_id": meta["response_token_id"],
                      "progress_every_s": 0.5, "aux_layer_ids": meta["aux_layer_ids"],
                      "hidden_size": meta["hidden_size"], "vocab_size": meta["vocab_size"], "draft_vocab_size": 256},
           "generate": {"served_model_name": "stub", "min_completion_tokens": 1, "concurrency": 1}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _sigint_default() -> None:
    # run_all as a user's shell starts it: a test process started in the background (`./test.sh &`) ignores SIGINT,
    # its children inherit that, and bash can never trap a signal ignored on entry
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.integration
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopping_run_all_stops_its_stage_and_leaves_no_orphan(tmp_path, toy_llama, toy_meta, sig):
    cfg_path = _run_all_config(tmp_path, toy_llama, toy_meta)
    dd = DataDir(tmp_path / "data")
    write_questions(dd.root, 3)
    with StubServer("ok", delay_s=600) as stub:
        run_all = subprocess.Popen([str(REPO / "run_all.sh"), "--config", str(cfg_path), "--vllm-url", stub.url,
                                    "--only", "01b"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True, preexec_fn=_sigint_default)
        try:
            _wait_for("request from stage 01b", lambda: stub.requests, proc=run_all)
            (stage,) = _children(run_all.pid, "01b_generate_synthetic.py")
            run_all.send_signal(sig)  # to run_all alone, as `kill PID` would (Ctrl-C: SIGINT)
            _out, err = run_all.communicate(timeout=120)
        finally:
            try:
                os.killpg(run_all.pid, signal.SIGKILL)  # never leave this test's processes behind (a failed run)
            except ProcessLookupError:
                pass  # the whole group is gone: the passing case
            run_all.wait()
    assert run_all.returncode == 128 + sig, err[-3000:]
    assert not _alive(stage), "run_all exited but its stage still runs"
    name = signal.Signals(sig).name
    assert f"stopped by {name} during 01b_generate" in err and "to resume:" in err and "--only 01b" in err
    assert "01b_generate stopped by SIGTERM" in dd.log_file("01b_generate").read_text()  # the stage unwound
    assert not dd.stage_lock("01b_generate").exists() and not dd.stage_marker("01b_generate").exists()
