"""test.sh's vLLM zygote (tests/vllm_zygote.py) stands where a server's own process would: the door the launcher
starts carries the server's output, directory, environment and exit (status or signal), a SIGTERM to the door
reaches the server, a SIGKILL of the door takes the server with it, and an environment the zygote did not import
vLLM with gets a fresh interpreter instead. Every vLLM server the suite starts through tests/vllm_python is forked
this way (test_server_lifecycle.py's excepted), so the servers' own drills prove the rest; these run small modules
of the test's own through the same door, with no server to start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

import vllm_zygote

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration
GONE_WITHIN_S = 60  # a bound for a process left running, not a timing

PRINTS_AND_EXITS = '''import os, sys
mark = os.environ["EAGLE3PIPE_TEST_ZYGOTE_MARK"]
print("argv", sys.argv[1:], "cwd", os.getcwd(), "mark", mark, "pid", os.getpid(), flush=True)
sys.exit(7)
'''
WAITS = '''import os, sys, time
with open(sys.argv[1], "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)
'''


@pytest.fixture(scope="module")
def zygote(tmp_path_factory) -> str:
    """test.sh's zygote; under a plain pytest, one of this module's own."""
    if os.environ.get(vllm_zygote.ZYGOTE_ENV):
        yield os.environ[vllm_zygote.ZYGOTE_ENV]
        return
    path = tmp_path_factory.mktemp("zygote") / "zygote.sock"
    proc = subprocess.Popen([str(REPO / ".venv-vllm" / "bin" / "python"), str(REPO / "tests" / "vllm_zygote.py"),
                             "serve", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not path.exists():
            assert proc.poll() is None, "the zygote exited while importing the API server"
            time.sleep(0.2)
        yield str(path)
    finally:
        proc.terminate()
        proc.wait()


def _door(zygote: str, tmp_path: Path, module: str, source: str, *args: str, **popen) -> subprocess.Popen:
    """``python -m module args`` through the door, the module written to ``tmp_path`` (found on PYTHONPATH, as the
    zygote sets it up for the server)."""
    (tmp_path / f"{module}.py").write_text(source)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), EAGLE3PIPE_TEST_ZYGOTE_MARK="m-42",
               **{vllm_zygote.ZYGOTE_ENV: zygote})
    python = REPO / ".venv-vllm" / "bin" / "python"
    return subprocess.Popen([str(python), "-I", "-S", str(REPO / "tests" / "vllm_zygote.py"), "run", module, *args],
                            env=env, cwd=tmp_path, **popen)


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited, not yet reaped by the zygote
            return True
        time.sleep(0.1)
    return False


def _forked_pid(pid_file: Path, door: subprocess.Popen) -> int:
    while not pid_file.exists() or not pid_file.read_text():
        assert door.poll() is None, f"the door exited ({door.returncode}) before its module started"
        time.sleep(0.1)
    return int(pid_file.read_text())


def test_the_door_carries_output_directory_environment_and_exit_status(zygote, tmp_path):
    door = _door(zygote, tmp_path, "prints_and_exits", PRINTS_AND_EXITS, "--flag", "x", stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True)
    out, err = door.communicate(timeout=120)
    assert door.returncode == 7, err
    assert f"argv ['--flag', 'x'] cwd {tmp_path} mark m-42 pid " in out, (out, err)
    assert "a fresh interpreter" not in err, err  # names what differs: this test process's environment drifted
    assert int(out.split(" pid ")[1]) != door.pid  # run by a process the zygote forked, not by the door


def test_sigterm_to_the_door_ends_the_server_and_the_door_dies_as_it_did(zygote, tmp_path):
    door = _door(zygote, tmp_path, "waits", WAITS, str(tmp_path / "pid"))
    try:
        forked = _forked_pid(tmp_path / "pid", door)
        assert forked != door.pid  # else the zygote declined: the door's stderr (captured) says why
        cmdline = Path(f"/proc/{forked}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert f"-m waits {tmp_path / 'pid'} (forked by vllm_zygote)" in cmdline  # as ps and suite_cpu.py see it
        door.send_signal(signal.SIGTERM)
        assert door.wait(timeout=GONE_WITHIN_S) == -signal.SIGTERM  # the module died of the SIGTERM relayed
        assert _gone(forked)
    finally:
        door.kill()  # a failed test leaves nothing behind: the zygote kills the module with its door
        door.wait()


def test_sigkill_of_the_door_takes_the_server_with_it(zygote, tmp_path):
    door = _door(zygote, tmp_path, "waits", WAITS, str(tmp_path / "pid"))
    try:
        forked = _forked_pid(tmp_path / "pid", door)
        assert forked != door.pid  # else the zygote declined: the door's stderr (captured) says why
    finally:
        door.kill()  # the door can relay nothing: the zygote sees its connection close
        door.wait()
    assert _gone(forked), f"the forked module (pid {forked}) outlived its door by {GONE_WITHIN_S} s"


def test_an_environment_read_at_import_gets_a_fresh_interpreter(zygote):
    """OMP_NUM_THREADS is read when torch's OpenMP library loads: a forked server would keep the zygote's."""
    env = dict(os.environ, OMP_NUM_THREADS=str(int(os.environ.get("OMP_NUM_THREADS", "1")) + 1))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(zygote)
        vllm_zygote.send_request(conn, ["json.tool"], env, os.getcwd())
        answer = conn.makefile("r").readline()
    assert answer.startswith("fresh ") and "OMP_NUM_THREADS" in answer.split(" differs")[0], answer
