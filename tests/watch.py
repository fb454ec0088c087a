"""Running a command under a watchdog that measures work, not wall time (for tests that drive whole scripts).

A fixed timeout fails a test on a busy machine (the demo test died at 1,500 s while still working, and left its
server behind). ``run_watched`` instead stops the command when it has stalled: no new output and no CPU used by its
process group for ``stall_s`` seconds. The command runs in its own process group, which is killed on a stall, on an
error and when the test is interrupted, so nothing it started outlives the test (vLLM servers in their own groups
are stopped by their owners or, if those are killed, by their guards: eagle3pipe.server).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from eagle3pipe.server import group_cpu_seconds


class Stalled(AssertionError):
    """The command made no progress (no output, no CPU) for stall_s seconds; the message holds its last output."""


def kill_group(pgid: int, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def run_watched(cmd: list[str], *, log_file: Path, stall_s: float = 600.0, env: dict | None = None,
                cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` (stdout and stderr into ``log_file``) until it exits; raise ``Stalled`` (after killing its process
    group) if neither its output grew nor its processes used CPU for ``stall_s`` seconds."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    last = (-1, -1.0)
    last_progress = time.monotonic()
    try:
        while proc.poll() is None:
            now = (log_file.stat().st_size, group_cpu_seconds(proc.pid))
            if now[0] > last[0] or now[1] > last[1] + 0.5:
                last, last_progress = now, time.monotonic()
            elif time.monotonic() - last_progress > stall_s:
                raise Stalled(f"{cmd[0]} made no progress for {stall_s:.0f} s (no output, no CPU); its last output:\n"
                              + log_file.read_text(errors="replace")[-4000:])
            try:  # a 2 s look at its progress, and back at once when it exits
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
    finally:
        kill_group(proc.pid)  # whatever it left running in its group (nothing, when it ended cleanly)
        proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, log_file.read_text(errors="replace"), "")


def wait_until(condition, proc: subprocess.Popen, what: str, stall_s: float = 300.0, poll_s: float = 0.05) -> None:
    """Wait until ``condition()`` holds while ``proc`` (the leader of its own process group) keeps working; fail
    when it ends first, or when its group used no CPU for ``stall_s`` seconds (stuck: no fixed wall limit)."""
    last_cpu, last_progress = -1.0, time.monotonic()
    while not condition():
        assert proc.poll() is None, f"the process ended (status {proc.returncode}) before {what}"
        cpu = group_cpu_seconds(proc.pid)
        if cpu > last_cpu + 0.5:
            last_cpu, last_progress = cpu, time.monotonic()
        elif time.monotonic() - last_progress > stall_s:
            raise Stalled(f"no {what}, and the process used no CPU for {stall_s:.0f} s")
        time.sleep(poll_s)
