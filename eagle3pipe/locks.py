"""One lock per stage in the data dir, so two copies of a stage never write the same files.

``<data_dir>/locks/<stage>.lock`` (``DataDir.stage_lock``) holds the holder's pid, host, start time and command as
JSON while the stage runs. A second copy refuses and names them. A lock whose holder is gone (its pid no longer runs
on this host, e.g. after ``kill -9``) is taken over with a warning; a lock held from another host is never taken
over, since its pid cannot be checked from here. Taking and releasing happen under an ``flock`` on
``locks/.guard``, so two copies starting at the same moment cannot both win.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from .records import atomic_write_json

log = logging.getLogger(__name__)


class StageLockedError(RuntimeError):
    """Another live copy of the stage holds the lock; the message names it."""


@dataclass
class LockHolder:
    pid: int
    host: str
    started: str  # local time the holder took the lock, ISO format
    command: str  # the holder's command line
    pid_start: str = ""  # the pid's start time in clock ticks (/proc/<pid>/stat), so a reused pid is not the holder

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}, command: {self.command}"


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _pid_start(pid: int) -> str:
    fields = _proc_stat(pid)
    return fields[19] if fields else ""  # field 22 of stat(5), "starttime"


def holder_alive(holder: LockHolder) -> bool:
    """Whether the holder (on this host) still runs: the pid exists, is no zombie, and started when the holder did."""
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    fields = _proc_stat(holder.pid)
    if fields is None:
        return not Path("/proc").is_dir()  # without /proc (not Linux) trust os.kill; with it, the pid just ended
    if fields[0] == "Z":
        return False  # exited, not yet reaped by its parent
    return not holder.pid_start or fields[19] == holder.pid_start


class StageLock:
    """The lock of one stage: ``acquire()`` or raise StageLockedError; ``release()`` removes it if still ours."""

    def __init__(self, path: Path, stage: str):
        self.path, self.stage = Path(path), stage
        self.holder: LockHolder | None = None

    @contextmanager
    def _guard(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.parent / ".guard", "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(guard, fcntl.LOCK_UN)

    def _read(self) -> LockHolder | None:
        if not self.path.exists():
            return None
        try:
            return LockHolder(**json.loads(self.path.read_text()))
        except (json.JSONDecodeError, TypeError) as e:
            raise StageLockedError(f"{self.path} is not a lock this pipeline wrote ({e}); delete it if no copy of "
                                   f"stage {self.stage} runs") from None

    def acquire(self) -> LockHolder:
        me = LockHolder(pid=os.getpid(), host=socket.gethostname(),
                        started=_dt.datetime.now().isoformat(timespec="seconds"),
                        command=shlex.join([sys.executable, *sys.argv]), pid_start=_pid_start(os.getpid()))
        with self._guard():
            other = self._read()
            if other is not None and other.host != me.host:
                raise StageLockedError(
                    f"stage {self.stage} is locked by another copy ({other.describe()}); it runs on another host, "
                    f"so this one cannot check it: wait for it, or delete {self.path} if no copy runs there")
            if other is not None and holder_alive(other):
                raise StageLockedError(
                    f"stage {self.stage} is already running in this data dir ({other.describe()}). Two copies "
                    f"would write the same files: wait for it to finish, or stop it (kill {other.pid}) and rerun "
                    f"(lock: {self.path})")
            if other is not None:
                log.warning("taking over the stale lock %s of stage %s: its holder is gone (%s); the stage resumes "
                            "what that run left", self.path, self.stage, other.describe())
            atomic_write_json(self.path, asdict(me))
        self.holder = me
        return me

    def release(self) -> None:
        if self.holder is None:
            return
        with self._guard():
            try:
                other = self._read()
            except StageLockedError:
                other = None  # not ours any more: leave it
            if other is not None and (other.pid, other.host) == (self.holder.pid, self.holder.host):
                self.path.unlink()
        self.holder = None
