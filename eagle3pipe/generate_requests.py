"""Stage 01b, the request side: send questions to vLLM with bounded concurrency, read each reply, write it at once.

``Generator`` spreads requests over one or more servers (``vllm_client.ServerPool``: fewest in flight among those that
answer; one that refuses connections is set aside until it answers again), retries timeouts, connection
errors and 5xx with exponential backoff, reads reasoning from ``reasoning`` then ``reasoning_content`` then any
reasoning-like field, takes the server's exact token ids (``return_token_ids``) or rebuilds them from text, flags
truncated/short records, trips the empty-reasoning guard, and shows the servers' own /metrics in the progress line.
``eagle3pipe/generate.py`` owns the files, the resume bookkeeping and the summary.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import time
from dataclasses import dataclass, field

import httpx2  # the HTTP library the openai client is built on
import numpy as np

from .chat import SpecialIds, prompt_token_ids, rebuild_completion_ids
from .cli import StageError
from .config import PipelineConfig
from .progress import Progress
from .records import (
    RESPONSE_FLAGS,
    RESPONSE_NO_COMPLETION,
    RESPONSE_OTHER_FLAG,
    IndexedJsonlWriter,
    JsonlAppender,
    KeyCounts,
    RequestError,
    Response,
    TrainingRow,
    flag_bits,
)
from .vllm_client import (
    NoServerAnswers,
    RequestFailed,
    ServerLostMidRequest,
    ServerMetrics,
    ServerPool,
    api_base,
    aread_metrics,
    backoff_delay_s,
    classify_request_error,
    make_session,
    post_json,
)

log = logging.getLogger(__name__)

TRUNCATED_FINISH_REASONS = ("length", "abort", "repetition")
EMPTY_REASONING_FLAG = "empty_reasoning"  # thinking on, no reasoning came back: not trained on unless allowed
GUARD_MIN_SAMPLE = 20  # the empty-reasoning guard never judges fewer responses than this
GUARD_Z = 2.576  # the guard trips when the 99% lower confidence bound of the empty share passes the allowed share
REASONING_FIELDS = ("reasoning", "reasoning_content")  # vLLM >= 0.16, then older vLLM / other servers
MAX_BACKOFF_S = 60.0
METRICS_EVERY_S = 15.0  # cap on the /metrics scrape interval (progress lines may be rarer)
QUEUE_WARN_SHARE = 0.25  # warn when requests wait in the server's queue this share of the timeout


class EmptyReasoningError(StageError):
    """Too many responses came back without reasoning: the server or the field read is wrong."""


class BadResponse(ValueError):
    """A 200 reply that is not a usable chat completion (no choices, ...)."""


# ---------------------------------------------------------------------------------------------------------------
# Reading one completion


@dataclass
class ParsedCompletion:
    reasoning: str | None
    reasoning_field: str  # where the reasoning came from ("" when none)
    content: str | None
    finish_reason: str
    usage: dict
    prompt_token_ids: list[int] | None  # None when the server did not return ids
    completion_token_ids: list[int] | None
    message_fields: dict  # what the message held, for the guard's error message: {field: short description}


def _describe(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"str({len(value)} chars)" if value else "empty str"
    return type(value).__name__


def parse_completion(body: dict) -> ParsedCompletion:
    """Read one chat-completion reply (its JSON body, as vLLM sent it).

    Reasoning from ``reasoning`` (vLLM >= 0.16), then ``reasoning_content`` (older vLLM, other servers), then any
    other string field of the message named like reasoning/thinking. Token ids from vLLM's ``return_token_ids``.
    """
    choices = body.get("choices") if isinstance(body, dict) else None
    if not choices or not isinstance(choices[0].get("message"), dict):
        raise BadResponse(f"reply has no choices[0].message (keys: {sorted(body) if isinstance(body, dict) else body})")
    choice = choices[0]
    msg = choice["message"]
    reasoning, reasoning_field = None, ""
    for name in REASONING_FIELDS:
        if msg.get(name):
            reasoning, reasoning_field = msg[name], name
            break
    if reasoning is None:  # an unknown server: any string field named like reasoning/thinking
        for name, value in msg.items():
            if isinstance(value, str) and value and ("reason" in name or "think" in name):
                reasoning, reasoning_field = value, name
                break
    return ParsedCompletion(
        reasoning=reasoning,
        reasoning_field=reasoning_field,
        content=msg.get("content"),
        finish_reason=choice.get("finish_reason") or "unknown",
        usage={k: v for k, v in (body.get("usage") or {}).items() if v is not None},
        prompt_token_ids=body.get("prompt_token_ids"),
        completion_token_ids=choice.get("token_ids"),
        message_fields={k: _describe(v) for k, v in msg.items()},
    )


# ---------------------------------------------------------------------------------------------------------------
# Sending questions


def wire_messages(messages: list[dict]) -> list[dict]:
    """Messages as the OpenAI API sends them: tool-call arguments as JSON strings (stage 01 keeps them parsed; vLLM
    parses them back into the same object, key order included, before rendering)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
                c["function"]["arguments"], ensure_ascii=False)}} for c in m["tool_calls"]]}
        out.append(m)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Training rows


def trainable(flags: list[str], include_truncated: bool, allow_empty_reasoning: bool = False) -> bool:
    """A record goes into data.jsonl unless flagged; truncated ones too with --include-truncated, ones with empty
    reasoning too with --allow-empty-reasoning."""
    rest = set(flags)
    if include_truncated:
        rest -= set(TRUNCATED_FINISH_REASONS)
    if allow_empty_reasoning:
        rest.discard(EMPTY_REASONING_FLAG)
    return not rest


def trainable_mask(bits: np.ndarray, include_truncated: bool, allow_empty_reasoning: bool = False) -> np.ndarray:
    """bool [n]: ``trainable`` and a completion, for the ``flags`` column of responses' row index (its bits)."""
    allowed = flag_bits(TRUNCATED_FINISH_REASONS) if include_truncated else 0
    if allow_empty_reasoning:
        allowed |= flag_bits([EMPTY_REASONING_FLAG])
    blocking = (flag_bits(RESPONSE_FLAGS) | RESPONSE_OTHER_FLAG | RESPONSE_NO_COMPLETION) & ~allowed
    return (np.asarray(bits, dtype=np.uint32) & np.uint32(blocking)) == 0


def empty_reasoning_tripped(empty: int, judged: int, max_share: float) -> bool:
    """Whether the share of responses without reasoning is clearly above ``max_share``: at least GUARD_MIN_SAMPLE
    responses judged, and the Wilson lower bound (99%) of the share above it. A server that drops the reasoning
    trips it at GUARD_MIN_SAMPLE; a few legitimately empty answers among many never do."""
    if judged < GUARD_MIN_SAMPLE or empty == 0:
        return False
    p, n, z2 = empty / judged, judged, GUARD_Z**2
    lower = (p + z2 / (2 * n) - GUARD_Z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))) / (1 + z2 / n)
    return lower > max_share


def training_row(qid: str, prompt_ids: list[int], completion_ids: list[int], source: str) -> TrainingRow:
    """Prompt ids (loss 0) then the completion exactly as generated (loss 1)."""
    return TrainingRow(id=qid, input_ids=list(prompt_ids) + list(completion_ids),
                       loss_mask=[0] * len(prompt_ids) + [1] * len(completion_ids), source=source)


# ---------------------------------------------------------------------------------------------------------------
# Requests


@dataclass
class RunStats:
    finished: int = 0
    errors: int = 0
    retries: int = 0
    empty_reasoning: int = 0
    guard_seen: int = 0  # responses the guard has judged: the whole run's, finished before this process included
    guard_empty: int = 0  # of those, how many came back without reasoning
    prompt_tokens: int = 0
    completion_tokens: int = 0
    data_rows: int = 0
    rebuilt_ids: int = 0
    finish_reasons: collections.Counter = field(default_factory=collections.Counter)
    flags: collections.Counter = field(default_factory=collections.Counter)
    error_kinds: collections.Counter = field(default_factory=collections.Counter)
    first_empty: dict | None = None  # the first empty-reasoning reply, described for the guard's message

    def summary(self) -> dict:
        return {
            "finished": self.finished, "errors": self.errors, "retries": self.retries,
            "finish_reasons": dict(self.finish_reasons), "flags": dict(self.flags),
            "error_kinds": dict(self.error_kinds), "data_rows": self.data_rows,
            "empty_reasoning": self.empty_reasoning,
            "empty_reasoning_share": round(self.empty_reasoning / self.finished, 4) if self.finished else 0.0,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "rebuilt_token_ids": self.rebuilt_ids,
        }


class Generator:
    """Sends the questions with bounded concurrency over one or more servers and writes each result at once."""

    def __init__(self, cfg: PipelineConfig, tokenizer, special: SpecialIds, previous_attempts: KeyCounts,
                 progress: Progress, responses_out: IndexedJsonlWriter, data_out: IndexedJsonlWriter,
                 errors_out: JsonlAppender, urls: list[str] | None = None):
        self.cfg, self.g = cfg, cfg.generate
        self.tokenizer, self.special, self.progress = tokenizer, special, progress
        self.previous_attempts = previous_attempts  # attempts spent on an id by earlier runs (errors.jsonl)
        self.responses_out, self.data_out, self.errors_out = responses_out, data_out, errors_out
        self.urls = [u.rstrip("/") for u in (urls or cfg.shared.vllm_url)]  # urls: a server 01b started itself
        extra = json.loads(self.g.request_extra_json) if self.g.request_extra_json else {}
        # spaces_between_special_tokens off: with a slow tokenizer (Kimi's) vLLM otherwise puts a space between
        # <think> and the text after it, so the reasoning text would not be what the ids say. The user's
        # chat_template_kwargs are merged with thinking (config validation refuses a conflicting one).
        self.extra_body = {"return_token_ids": True, "spaces_between_special_tokens": False, **extra,
                           "chat_template_kwargs": {**extra.get("chat_template_kwargs", {}),
                                                    "thinking": cfg.shared.thinking}}
        self.pool: ServerPool | None = None  # set by run()
        self.sessions: list = []  # per server, set by run(): the aiohttp sessions post_json sends through
        self.endpoints = [api_base(u) + "/chat/completions" for u in self.urls]
        self.stats = RunStats()
        self.prompt_checked = False
        self.started = time.monotonic()

    # -- one request ------------------------------------------------------------------------------------------
    def request_body(self, model: str, q) -> dict:
        """The JSON body of one chat-completion request (the sampling fields and extras are the same for all)."""
        body = {"model": model, "messages": wire_messages(q.messages),
                "max_completion_tokens": self.g.max_completion_tokens, "temperature": self.g.temperature,
                "top_p": self.g.top_p, **self.extra_body}
        if q.tools:
            body["tools"] = q.tools  # needs a server with --enable-auto-tool-choice
        return body

    async def _ask(self, idx: int, model: str, q) -> dict:
        # vllm_client.post_json (aiohttp), not the openai client: the least client CPU a request of the clients measured
        # (bench/bench_transport.py), and the raw JSON keeps every field vLLM sent. It raises RequestFailed with
        # the kinds and retry decisions classify_request_error gives the openai client's errors.
        return await post_json(self.sessions[idx], self.endpoints[idx], self.request_body(model, q),
                               self.g.request_timeout_s)

    async def run_one(self, q, model: str) -> None:
        attempts_allowed = 1 + self.g.max_retries
        kind, message, url = "", "", ""
        for attempt in range(attempts_allowed):
            idx, url, error = None, "", None  # error: what failed, for the pool's wait before the retry
            t0 = time.monotonic()
            try:
                idx = self.pool.acquire()
                url, times_aside = self.urls[idx], self.pool.times_aside[idx]
                resp = await self._ask(idx, model, q)
                self.pool.check_reply(idx, times_aside)
            except (RequestFailed, NoServerAnswers, ServerLostMidRequest) as e:
                failure = classify_request_error(e, self.g.request_timeout_s)
                if failure is None:
                    raise
                if idx is not None:
                    self.pool.report_failure(idx, e)
                kind, message, retry, error = failure.kind, failure.message, failure.retryable, e
            except BadResponse as e:
                kind, message, retry = "bad_response", str(e), False
            else:
                try:
                    self._finish(q, parse_completion(resp), url, time.monotonic() - t0)
                    return
                except BadResponse as e:
                    kind, message, retry = "bad_response", str(e), False
            finally:
                if idx is not None:
                    self.pool.release(idx)
            if not retry or attempt + 1 == attempts_allowed:
                break
            self.stats.retries += 1
            delay = backoff_delay_s(attempt, self.g.retry_backoff_s, MAX_BACKOFF_S)
            log.debug("%s: %s on %s (attempt %d), retrying within %.1f s", q.id, kind, url, attempt + 1, delay)
            await self.pool.wait_to_retry(delay, error)
        attempts = attempt + 1 + self.previous_attempts.get(q.id, 0)
        self.errors_out.write(RequestError(id=q.id, kind=kind, message=message, attempts=attempts,
                                           server=url).to_json())
        self.stats.errors += 1
        self.stats.error_kinds[kind] += 1
        self.progress.update(0, errors=1, **self._fields())

    # -- one result -------------------------------------------------------------------------------------------
    def _finish(self, q, p: ParsedCompletion, url: str, latency_s: float) -> None:
        source = "server"
        prompt_ids, completion_ids = p.prompt_token_ids, p.completion_token_ids
        if prompt_ids is None:
            prompt_ids = prompt_token_ids(self.tokenizer, q.messages, thinking=self.cfg.shared.thinking, tools=q.tools)
        elif not self.prompt_checked:
            self._check_prompt_ids(q, prompt_ids)
        if completion_ids is None:
            # No ids from the server (return_token_ids unsupported or off, include_reasoning=false, another
            # server): rebuild them from the text with the verifier's tokenizer. Only as exact as the text (the
            # parser trims reasoning whitespace; BPE may re-merge), hence marked in the record.
            source = "rebuilt"
            completion_ids = rebuild_completion_ids(self.tokenizer, self.special, p.reasoning, p.content,
                                                    finished=p.finish_reason == "stop",
                                                    thinking=self.cfg.shared.thinking)
            self.stats.rebuilt_ids += 1
        flags = []
        if source == "rebuilt" and p.finish_reason == "tool_calls":
            flags.append("unrebuildable")  # the server parsed the tool-call tokens out of the text: not rebuilt
        if p.finish_reason in TRUNCATED_FINISH_REASONS:
            flags.append(p.finish_reason)
        if not completion_ids:
            flags.append("empty")
        elif len(completion_ids) < self.g.min_completion_tokens:
            flags.append("short")
        if len(prompt_ids) + len(completion_ids) > self.cfg.shared.max_seq_len:
            flags.append("too_long")
        empty = not (p.reasoning or "").strip()
        if empty and self.cfg.shared.thinking:
            flags.append(EMPTY_REASONING_FLAG)
        record = Response(id=q.id, messages=q.messages, reasoning=p.reasoning, content=p.content,
                          finish_reason=p.finish_reason, usage=p.usage, prompt_token_ids=list(prompt_ids),
                          completion_token_ids=list(completion_ids), server=url, latency_s=round(latency_s, 3),
                          token_ids_source=source, flags=flags, reasoning_field=p.reasoning_field)
        self.responses_out.write(record.to_json())
        if completion_ids and trainable(flags, self.g.include_truncated, self.g.allow_empty_reasoning):
            # vars(): the flat record as is; asdict() would deep-copy every id list (measurable client CPU)
            self.data_out.write(vars(training_row(q.id, prompt_ids, completion_ids, q.source)))
            self.stats.data_rows += 1
        st = self.stats
        st.finished += 1
        st.finish_reasons[p.finish_reason] += 1
        st.flags.update(flags)
        st.prompt_tokens += len(prompt_ids)
        st.completion_tokens += len(completion_ids)
        st.empty_reasoning += empty
        self.progress.update(1, **self._fields())
        if self.cfg.shared.thinking:
            st.guard_seen += 1
            if empty:
                st.guard_empty += 1
                st.first_empty = st.first_empty or {"id": q.id, "fields": p.message_fields,
                                                    "finish_reason": p.finish_reason}
            self.check_guard()

    def check_guard(self) -> None:
        """Stop the run when clearly more than the allowed share of the whole run's responses (finished earlier
        included: ``stats.guard_seen``/``guard_empty`` start from them) came back without reasoning."""
        st, share = self.stats, self.g.empty_reasoning_max_share
        if not empty_reasoning_tripped(st.guard_empty, st.guard_seen, share):
            return
        fe = st.first_empty or {"id": "?", "fields": {}, "finish_reason": "?"}
        fields = ", ".join(f"{k}={v}" for k, v in fe["fields"].items())
        allow = "" if self.g.allow_empty_reasoning else (
            " They are kept in responses.jsonl with the flag empty_reasoning and are not trained on.")
        raise EmptyReasoningError(
            f"reasoning came back empty in {st.guard_empty} of the {st.guard_seen} responses of this run (finished "
            f"ones included; allowed: {share:.0%}).{allow} Fields read: {', '.join(REASONING_FIELDS)}, then any "
            f"*reason*/*think* field. The server sent (request {fe['id']}, finish_reason {fe['finish_reason']}): "
            f"{fields}. Start the server with --reasoning-parser kimi_k2 (vLLM >= 0.16 names the field "
            "`reasoning`) and do not pass include_reasoning=false; then rerun with --retry-empty-reasoning, which "
            f"asks only those {st.guard_empty} questions again and keeps every other finished response. If the "
            "model really answers these without reasoning, raise --empty-reasoning-max-share (and pass "
            "--allow-empty-reasoning to train on them)."
        )

    def _check_prompt_ids(self, q, server_prompt_ids: list[int]) -> None:
        """Once: the server's prompt ids should equal our rendering; a mismatch means another tokenizer/template."""
        self.prompt_checked = True
        ours = prompt_token_ids(self.tokenizer, q.messages, thinking=self.cfg.shared.thinking, tools=q.tools)
        if list(server_prompt_ids) != ours:
            at = next((i for i, (a, b) in enumerate(zip(ours, server_prompt_ids)) if a != b), min(len(ours),
                                                                                               len(server_prompt_ids)))
            log.warning("the server's prompt ids for %s differ from the verifier tokenizer's rendering at position "
                        "%d (server %d ids, ours %d): is --verifier the model the server serves? Training uses the "
                        "server's ids.", q.id, at, len(server_prompt_ids), len(ours))
        if self.cfg.shared.thinking and (not server_prompt_ids or server_prompt_ids[-1] != self.special.think):
            log.warning("the server's prompt for %s does not end with <think> (id %d) although thinking is on",
                        q.id, self.special.think)

    # -- progress and /metrics -----------------------------------------------------------------------------------
    def _fields(self) -> dict:
        st = self.stats
        elapsed = max(1e-6, time.monotonic() - self.started)
        out = {"retries": str(st.retries), "gen tok/s": f"{st.completion_tokens / elapsed:.0f}"}
        if st.finished:
            out["avg completion"] = f"{st.completion_tokens / st.finished:.0f} tokens"
        return out

    async def monitor(self) -> None:
        """Scrape every server's /metrics; show running/waiting/tok/s and warn when queueing eats the timeout."""
        interval = min(METRICS_EVERY_S, self.cfg.shared.progress_every_s)
        prev: dict[str, ServerMetrics] = {}
        last_warning = -1e9
        async with httpx2.AsyncClient() as http:
            while True:
                await asyncio.sleep(interval)
                snaps = [m for m in [await aread_metrics(http, u) for u in self.urls] if m is not None]
                if not snaps:
                    continue
                running = sum(m.running for m in snaps)
                waiting = sum(m.waiting for m in snaps)
                tok_s, queue_s = 0.0, 0.0
                for m in snaps:
                    before = prev.get(m.url)
                    if before is not None:
                        dt = m.taken_at - before.taken_at
                        tok_s += (m.generation_tokens - before.generation_tokens) / dt
                        left_queue = m.queue_time_count - before.queue_time_count
                        if left_queue > 0:
                            queue_s = max(queue_s, (m.queue_time_sum_s - before.queue_time_sum_s) / left_queue)
                    prev[m.url] = m
                self.progress.set_fields(server=f"{running:.0f} running / {waiting:.0f} waiting, {tok_s:.0f} tok/s")
                warn_at = QUEUE_WARN_SHARE * self.g.request_timeout_s
                if waiting > 0 and queue_s > warn_at and time.monotonic() - last_warning > 300:
                    last_warning = time.monotonic()
                    log.warning(
                        "requests wait %.0f s on average in the servers' queues (%d waiting, %d running; timeout "
                        "%.0f s): timeouts will follow. The servers run about %d requests at once: lower "
                        "--concurrency to about %d, or raise --request-timeout-s.",
                        queue_s, waiting, running, self.g.request_timeout_s, running, max(1, running))

    # -- driver ---------------------------------------------------------------------------------------------------
    async def run(self, todo) -> None:
        """Send ``todo`` (a sized iterable of Questions, each read when a slot takes it)."""
        self.pool = ServerPool(self.urls, self.g.request_timeout_s, self.g.concurrency + 8, flag="--vllm-url")
        try:
            served = await self.pool.open()  # the servers that answer; the others are set aside and probed
        except BaseException:
            await self.pool.close()
            raise
        model = self.pool.model = self.g.served_model_name or next(iter(served.values())).name
        # one worker per slot (below), each pulling the next question as soon as its reply is written: measured
        # against a semaphore over one task per question, which kept the server no fuller (bench_transport.py)
        self.sessions = [make_session(self.g.request_timeout_s, self.g.concurrency + 8) for _ in self.urls]
        log.info("sending %d requests to %s (model %s), %d in flight", len(todo), ", ".join(self.urls), model,
                 self.g.concurrency)
        questions = iter(todo)  # shared by the slots: next() runs between awaits, so each question goes once

        async def worker() -> None:
            for q in questions:
                await self.run_one(q, model)

        monitor = asyncio.create_task(self.monitor())
        workers = [asyncio.create_task(worker()) for _ in range(min(self.g.concurrency, len(todo)))]
        try:
            await asyncio.gather(*workers)
        finally:
            for t in [*workers, monitor]:
                t.cancel()
            await asyncio.gather(*workers, monitor, return_exceptions=True)
            for session in self.sessions:
                await session.close()
            await self.pool.close()
