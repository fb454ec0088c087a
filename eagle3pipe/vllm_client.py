"""The one client for vLLM's OpenAI-compatible servers, used by every stage and by the tests; the servers themselves
are started by ``server.py`` (the launcher).

- ``make_async_client``: an ``AsyncOpenAI`` client. Base URLs are given WITHOUT ``/v1`` everywhere in the pipeline
  (``shared.vllm_url``); ``api_base`` is the one place that appends it. Every client, and every plain HTTP call here
  and in the launcher, sends ``Authorization: Bearer $VLLM_API_KEY`` when that variable is set (``API_KEY_ENV``:
  vLLM's own name, so a server started with it in its environment requires it too).
- ``make_session`` / ``post_json``: stage 01b's transport (aiohttp: about half the client CPU a request of the openai
  client, measured), its errors classified into the same ``RequestFailure`` kinds as the openai client's.
- ``ServerPool``: the routing of stages 01b, 02 and 04 online over one or more servers: fewest requests in flight
  among the servers that answer; a server whose request fails to connect is set aside (logged), probed on
  ``/health`` with backoff and taken back when it answers, serves the run's model (``/v1/models`` read again) and
  passes the stage's check (02 and 04 online: the capture check); a retry waiting because no server answered is
  sent at once then (``wait_to_retry``); a reply to a request that was in flight when its server was set aside is
  not used (``check_reply``: it may come from a server restarted on that port, unchecked). The stage starts with
  the servers that answer and stops only when none does.
- ``read_metrics`` / ``aread_metrics``: the server's ``/metrics`` (Prometheus text) as ``ServerMetrics``: running and
  waiting requests, generated tokens, queue-time histogram sums, speculative-decoding counters.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import re
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import httpx2  # the HTTP library the openai client is built on

log = logging.getLogger(__name__)

API_KEY_ENV = "VLLM_API_KEY"  # the servers' API key: vLLM reads this variable itself, our clients send it


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
    if isinstance(error, (NoServerAnswers, ServerLostMidRequest)):
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


class ServerLostMidRequest(Exception):
    """A reply came from a server that was set aside while the request was in flight (``ServerPool.check_reply``):
    whatever listens on its port now may be a restarted server, not yet checked, so the reply is not used (kind
    ``connection``, retried like NoServerAnswers)."""


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
        self.times_aside = [0] * len(self.urls)  # per server: how often it was set aside (check_reply)
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

    def check_reply(self, idx: int, times_aside: int) -> None:
        """Raise ServerLostMidRequest when server ``idx`` was set aside since ``times_aside`` (``self.times_aside[idx]``
        when its request was sent): the request may have reached a server restarted on the same port, which no
        ``/v1/models`` and no admit check has seen yet (another model, a shorter context)."""
        if self.times_aside[idx] != times_aside:
            raise ServerLostMidRequest(f"{self.urls[idx]} stopped answering while this request was in flight; its "
                                       f"reply is not used (probed on /health; flag {self.flag})")

    async def wait_to_retry(self, delay_s: float, error: BaseException | None) -> None:
        """Sleep ``delay_s`` before a request that failed with ``error`` is sent again. When no server answered
        (NoServerAnswers, or a connection failure: ``report_failure`` set its server aside), wake as soon as the
        pool takes a server back: a restarted server is used at once, not at the end of a backoff that doubled
        while it was down. Any other failure (``error`` None: a bad file; a 5xx, a late reply) waits the whole
        delay: a busy or broken server is not hammered."""
        if error is None or not (isinstance(error, (NoServerAnswers, ServerLostMidRequest))
                                 or is_connection_failure(error)):
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
        self.times_aside[idx] += 1
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

    # vLLM's own decode timings, histograms (_sum seconds, _count observations): the inter-token latency is observed
    # once per request per engine step that gave it tokens (with a draft, one speculation step: draft + verify), the
    # per-request time per output token once per finished request (its decode time / (its tokens - 1))
    @property
    def step_latency_sum_s(self) -> float:
        return self.value("vllm:inter_token_latency_seconds_sum")

    @property
    def step_latency_count(self) -> float:
        return self.value("vllm:inter_token_latency_seconds_count")

    @property
    def tpot_sum_s(self) -> float:
        return self.value("vllm:request_time_per_output_token_seconds_sum")

    @property
    def tpot_count(self) -> float:
        return self.value("vllm:request_time_per_output_token_seconds_count")

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
