"""Stage 01b: regenerate every answer with the target itself, through vLLM's OpenAI-compatible server.

Reads ``prepared/questions.jsonl``; writes ``synthetic/responses.jsonl`` (one line per finished request, with the
server's exact prompt and completion token ids), ``synthetic/data.jsonl`` (training rows: prompt ids + completion
ids, loss mask on the completion) and ``synthetic/errors.jsonl`` (requests that failed after every retry). Each line
is appended and flushed when its request ends; a rerun of the same command resumes: finished ids are skipped,
errored ids retried (unless their kind is in ``permanent_error_kinds``), no id is written twice. responses.jsonl
and data.jsonl are written with their row indexes (records.py, "Row index"), and the resume works on those and on
questions.jsonl's: ids as arrays of 8-byte keys, flags as bits, each question read from its line when it is sent, so
that 10^6 questions cost tens of megabytes and no parsing of the finished ones.

The servers: ``--vllm-url`` (repeatable: one per node), or, without one, a server this stage starts on this machine
with ``generate.server_args`` (``--tensor-parallel-size 8 --reasoning-parser kimi_k2 ...``) and stops when it ends,
as stages 02 and 05 do (``server.VllmServer``: its log in ``logs/01b_vllm_server.log``, a guard process that stops
it if this one dies, the free-GPU-memory check first), so ``run_all.sh`` goes 01 -> 05 on one node unattended.

The run's sampling settings go into ``synthetic/run.json`` before the first request, so a resume with other settings
is refused by name. ``provenance.json`` is written only when the run is complete (every id finished or errored with
an accepted kind, at most ``max_error_share`` others) and is removed when a rerun starts adding to the folder:
stages 02 and 03 read synthetic/ only while it is there (``records.check_synthetic_finished``).

Known silent failures it guards against: reading ``reasoning_content`` when vLLM >= 0.16 sends ``reasoning``
(every record looks fine, reasoning is empty: such records are flagged and never trained on, and the
empty-reasoning guard, judging every response of the run, stops it); client timeouts because
requests queue in the server (the /metrics monitor warns and suggests a concurrency the server sustains);
re-tokenized text that differs from what the model produced (ids come from ``return_token_ids``).
"""

from __future__ import annotations

import asyncio
import collections
import datetime as _dt
import hashlib
import json
import logging
import time
import array
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .chat import load_tokenizer, resolve_special_ids
from .cli import StageError, errors_allowed
from .config import PipelineConfig
from .generate_requests import EmptyReasoningError, Generator, trainable_mask, training_row
from .progress import Progress
from .server import ServerError, VllmServer, default_vllm_python, probe_vllm
from .records import (
    RESPONSE_EMPTY_REASONING,
    DataDir,
    IndexedJsonlWriter,
    JsonlAppender,
    KeyCounts,
    KeySet,
    Question,
    atomic_write_json,
    check_synthetic,
    id_key,
    load_request_errors,
    open_row_index,
    read_provenance,
    remove_indexed_jsonl,
    repair_jsonl,
    rewrite_without,
    write_jsonl_atomic,
    write_synthetic_provenance,
)

log = logging.getLogger(__name__)

SAMPLING_KEYS = ("served_model_name", "max_completion_tokens", "min_completion_tokens", "temperature", "top_p",
                 "include_truncated", "request_extra_json")  # changing these mid-run would mix two datasets


# ---------------------------------------------------------------------------------------------------------------
# Resume bookkeeping


def _path(p: str) -> str:
    return str(Path(p).resolve()) if p else ""


def sampling_settings(cfg: PipelineConfig) -> dict:
    """What decides the responses (flat ``section.key`` names): one synthetic/ folder holds one setting of these."""
    s, g = cfg.shared, cfg.generate
    return {"shared.verifier": _path(s.verifier), "shared.tokenizer": _path(s.tokenizer),
            "shared.thinking": s.thinking, "shared.max_seq_len": s.max_seq_len,
            **{f"generate.{k}": getattr(g, k) for k in SAMPLING_KEYS}}


def sampling_hash(cfg: PipelineConfig) -> str:
    return hashlib.sha256(json.dumps(sampling_settings(cfg), sort_keys=True).encode()).hexdigest()[:16]


def _settings_before(dd: DataDir) -> dict | None:
    """The settings synthetic/ was generated with: run.json (written at start), else a finished run's provenance."""
    if dd.synthetic_run.exists():
        return json.loads(dd.synthetic_run.read_text())["settings"]
    prov = read_provenance(dd.provenance(dd.synthetic))
    if prov:  # written by a version without run.json: rebuild the flat names from its config
        config = prov.get("config", {})
        return {f"{section}.{k}": (_path(v) if k in ("verifier", "tokenizer") else v)
                for section in ("shared", "generate") for k, v in config.get(section, {}).items()}
    return None


def _prepare_output_dir(dd: DataDir, cfg: PipelineConfig) -> None:
    """Refuse to mix sampling settings in one synthetic/ folder, naming what differs; --overwrite starts afresh.
    Records this run's settings in run.json before any request, so a crash then a changed rerun is caught too."""
    if cfg.generate.overwrite:
        for path in (dd.responses, dd.synthetic_data):
            remove_indexed_jsonl(path)  # and its row index
        for path in (dd.synthetic_errors, dd.provenance(dd.synthetic), dd.synthetic_run):
            if path.exists():
                log.warning("--overwrite: deleting %s", path)
                path.unlink()
    now = sampling_settings(cfg)
    before = _settings_before(dd)
    has_output = dd.responses.exists() or dd.synthetic_errors.exists()
    if before is not None and has_output:
        changed = [f"{k} ({before.get(k)!r} then, {now[k]!r} now)" for k in now if before.get(k, now[k]) != now[k]]
        if changed:
            raise StageError(
                f"{dd.synthetic} holds responses generated with other settings: {'; '.join(changed)}. Rerun with "
                "the original settings to resume, pass --overwrite to start afresh (deletes synthetic/), or use "
                "another --data-dir")
    elif has_output:
        log.warning("%s holds responses but no record of their settings (%s): assuming this run's", dd.synthetic,
                    dd.synthetic_run.name)
    atomic_write_json(dd.synthetic_run, {"config_hash": sampling_hash(cfg), "settings": now,
                                         "started": _dt.datetime.now().isoformat(timespec="seconds")})


class RunQuestions:
    """The questions of this run, the first ``generate.max_samples`` lines of questions.jsonl, through its row
    index: their ids as arrays of keys (8 bytes a question), each Question read from its line when it is sent."""

    def __init__(self, dd: DataDir, max_samples: int):
        index = open_row_index(dd.questions, "questions")
        self.index = index.subset(slice(0, max_samples)) if max_samples else index
        self.keys = self.index.keys  # uint64 [n], file order (a view of the index)
        self.ids = KeySet(self.keys)  # sorted, for membership
        if len(self.ids) != len(self.index):
            self._refuse_repeated(dd)

    def __len__(self) -> int:
        return len(self.index)

    def _refuse_repeated(self, dd: DataDir) -> None:
        distinct, counts = np.unique(self.keys, return_counts=True)
        first, second = np.flatnonzero(self.keys == distinct[counts > 1][0])[:2]
        ids = [self.index.record(int(first))["id"], self.index.record(int(second))["id"]]
        if ids[0] == ids[1]:
            raise StageError(f"{dd.questions} holds id {ids[0]!r} more than once; rerun stage 01")
        raise StageError(f"{dd.questions}: ids {ids[0]!r} and {ids[1]!r} share one 64-bit key (records.id_key); "
                         "rerun stage 01, whose ids never do")

    def question(self, i: int) -> Question:
        return Question.from_json(self.index.record(i), where=f"{self.index.jsonl_path} row {i}")

    def source_of(self, row_id: str) -> str:
        """The source of a question of this run, "" for an id that is not one."""
        at = int(self.index.find(np.array([id_key(row_id)], dtype=np.uint64))[0])
        return self.question(at).source if at >= 0 else ""

    def at(self, positions: np.ndarray) -> "QuestionsAt":
        return QuestionsAt(self, positions)


class QuestionsAt:
    """The questions at some positions, in order, each read when it is taken (what Generator.run sends)."""

    def __init__(self, questions: RunQuestions, positions: np.ndarray):
        self.questions, self.positions = questions, positions

    def __len__(self) -> int:
        return int(self.positions.size)

    def __iter__(self):
        for i in self.positions.tolist():
            yield self.questions.question(i)


@dataclass
class ResumeState:
    finished: KeySet  # ids with a response line
    permanent: KeySet  # ids of this run that errored with a kind the user accepted as permanent (not retried)
    previous_attempts: KeyCounts  # attempts spent on ids that errored in earlier runs
    data_rows_added: int  # data rows restored for responses written just before a crash (or now trainable)
    data_rows_removed: int  # data rows no longer trainable under this run's settings
    judged: int  # finished responses of this run's ids the empty-reasoning guard counts (thinking on)
    empty: int  # of those, how many have empty reasoning
    first_empty: dict | None  # the first of them, described for the guard's message


def _resume(dd: DataDir, questions: RunQuestions, cfg: PipelineConfig) -> ResumeState:
    """Repair torn lines; with --retry-empty-reasoning drop the responses without reasoning (asked again); make
    data.jsonl hold exactly the responses trainable under this run's settings (restoring rows a crash skipped);
    keep errors of accepted kinds, drop the others (retried now) and stale ones; count the guard's sample.

    Works on the row indexes of responses.jsonl and data.jsonl (their id keys and flags, as arrays): a resume of
    10^6 finished questions parses none of them, only the lines it rewrites or restores."""
    g, thinking = cfg.generate, cfg.shared.thinking
    for path in (dd.responses, dd.synthetic_data, dd.synthetic_errors):
        repair_jsonl(path)
    responses = open_row_index(dd.responses, "responses", missing_ok=True)
    in_run = questions.ids.contains(responses.keys)  # bool [R]: a response to a question of this run
    empty = (responses.flags & RESPONSE_EMPTY_REASONING) != 0  # bool [R]
    if g.retry_empty_reasoning and thinking and bool((in_run & empty).any()):
        retried = in_run & empty
        log.warning("--retry-empty-reasoning: %d responses without reasoning are asked again (their records "
                    "leave %s; every other finished response is kept)", int(retried.sum()), dd.responses)
        responses = rewrite_without(responses, retried)
        in_run, empty = in_run[~retried], empty[~retried]
    finished = KeySet(responses.keys)
    trainable_now = trainable_mask(responses.flags, g.include_truncated, g.allow_empty_reasoning)  # bool [R]
    wanted = KeySet(responses.keys[trainable_now])  # ids whose response is trainable under this run's settings
    judged = int(in_run.sum()) if thinking else 0
    n_empty = int((in_run & empty).sum()) if thinking else 0
    first_empty = None
    if n_empty:
        d = responses.record(int(np.flatnonzero(in_run & empty)[0]))
        first_empty = {"id": d["id"], "finish_reason": d["finish_reason"],
                       "fields": {"reasoning": "empty (stored record)", "content": f"{len(d['content'] or '')} chars"}}
    data = open_row_index(dd.synthetic_data, "rows", missing_ok=True)
    stale = ~wanted.contains(data.keys)  # bool [D]
    removed = int(np.unique(data.keys[stale]).size)
    if removed:  # e.g. --allow-empty-reasoning or --include-truncated turned off since the rows were written
        data = rewrite_without(data, stale)
    # a crash between the response line and its data line, or a setting that now trains on it: the first trainable
    # response of each id that has no data row
    lacking = np.flatnonzero(trainable_now & ~KeySet(data.keys).contains(responses.keys))
    _, first = np.unique(responses.keys[lacking], return_index=True)
    restore = np.sort(lacking[first])
    if restore.size:
        with IndexedJsonlWriter(dd.synthetic_data, "rows") as data_out:
            for _, d in responses.records_at(restore):
                data_out.write(training_row(d["id"], d["prompt_token_ids"], d["completion_token_ids"],
                                            questions.source_of(d["id"])).to_json())
    retried_keys, retried_attempts, permanent_keys = array.array("Q"), array.array("q"), array.array("Q")
    if dd.synthetic_errors.exists():
        def kept_errors():
            for err in load_request_errors(dd.synthetic_errors):
                key = id_key(err.id)
                if finished.has(key):
                    continue  # finished on a later run: the error is stale
                if questions.ids.has(key) and err.kind not in g.permanent_error_kinds:
                    retried_keys.append(key)  # retried now
                    retried_attempts.append(err.attempts)
                    continue
                # an accepted permanent error, or an id outside this run's questions (a smaller --max-samples)
                if questions.ids.has(key):
                    permanent_keys.append(key)
                yield err.to_json()

        write_jsonl_atomic(dd.synthetic_errors, kept_errors())
    return ResumeState(finished=finished, permanent=KeySet(np.frombuffer(permanent_keys, dtype=np.uint64)),
                       previous_attempts=KeyCounts(np.frombuffer(retried_keys, dtype=np.uint64),
                                                   np.frombuffer(retried_attempts, dtype=np.int64)),
                       data_rows_added=int(restore.size), data_rows_removed=removed, judged=judged, empty=n_empty,
                       first_empty=first_empty)


def _check_errors(dd: DataDir, cfg: PipelineConfig, questions: RunQuestions) -> dict:
    """Errored ids after the run: those of accepted kinds are final; more of the others than --max-error-share
    allows stop the stage (exit status 2) with the count and how to resume. Returns counts for the provenance."""
    g = cfg.generate
    accepted: collections.Counter = collections.Counter()
    open_errors: collections.Counter = collections.Counter()
    for e in load_request_errors(dd.synthetic_errors) if dd.synthetic_errors.exists() else ():
        if questions.ids.has(id_key(e.id)):
            (accepted if e.kind in g.permanent_error_kinds else open_errors)[e.kind] += 1
    allowed = errors_allowed(g.max_error_share, len(questions))
    n_open = sum(open_errors.values())
    if n_open > allowed:
        kinds = ", ".join(f"{k} {v}" for k, v in open_errors.most_common())
        final = [k for k in open_errors if k == "context_too_long" or (k.startswith("http_4") and k != "http_408")]
        hint = (f" Kinds that fail the same way on every try ({', '.join(final)}): accept them as permanently bad "
                f"with --permanent-error-kinds {' '.join(final)} (they stay listed in {dd.synthetic_errors.name})."
                if final else "")
        raise StageError(
            f"{n_open} of {len(questions)} ids errored ({kinds}; listed in {dd.synthetic_errors}); allowed: "
            f"{allowed} (--max-error-share {g.max_error_share:g}). synthetic/ is not finished and stages 02/03 "
            f"refuse it. Rerun the same command to retry exactly these {n_open} ids (finished ones are not sent "
            f"again).{hint}")
    if n_open:
        log.warning("%d ids errored (within --max-error-share %g): synthetic/ is finished without them; a rerun "
                    "retries them", n_open, g.max_error_share)
    return {"errored": n_open, "errored_kinds": dict(open_errors), "accepted_permanent": dict(accepted)}


@contextmanager
def own_server(cfg: PipelineConfig, dd: DataDir, needed: bool):
    """Without ``--vllm-url``: start the verifier's server with ``generate.server_args`` (when there is anything to
    send), yield its URL list, stop it on the way out whatever happens. With one: yield None (the URLs given)."""
    g = cfg.generate
    if cfg.shared.vllm_url or not needed:
        yield None
        return
    python = default_vllm_python()
    try:
        cpu = probe_vllm(python).platform == "cpu"
    except ServerError as e:
        raise StageError(str(e)) from None
    server = VllmServer(cfg.shared.verifier, extra_args=g.server_args,
                        served_model_name=g.served_model_name or None, log_file=dd.logs / "01b_vllm_server.log",
                        python=python, enforce_eager=cpu, kv_cache_gib=1 if cpu else None, gpu_memory_check=not cpu,
                        startup_timeout_s=g.server_start_timeout_s, trust_remote_code=cfg.shared.trust_remote_code)
    log.info("no --vllm-url: starting the verifier's server with generate.server_args (log %s)", server.log_file)
    try:
        server.start()
    except ServerError as e:  # a known failure: the message holds the log's tail, not a traceback
        raise StageError(f"{e}\n(generate.server_args, generate.server_start_timeout_s)") from None
    try:
        yield [server.url]
    finally:
        server.stop()
        log.info("stopped the server this stage started (pid %d)", server.pid)


def run_generate(cfg: PipelineConfig) -> dict:
    """Stage 01b entry point; returns the run summary (also logged and written into provenance.json)."""
    started = time.time()
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # one INFO line per request otherwise
    dd = DataDir(cfg.data_dir)
    g = cfg.generate
    if not dd.questions.exists():
        raise FileNotFoundError(f"{dd.questions} not found: run 01_prepare_data.py first (same --data-dir)")
    questions = RunQuestions(dd, g.max_samples)
    tokenizer = load_tokenizer(cfg.tokenizer_path, cfg.shared.trust_remote_code)
    special = resolve_special_ids(tokenizer, cfg.shared.think_token_id, cfg.shared.response_token_id)
    _prepare_output_dir(dd, cfg)
    resume = _resume(dd, questions, cfg)
    done = resume.finished.contains(questions.keys)  # bool [n]
    todo = questions.at(np.flatnonzero(~(done | resume.permanent.contains(questions.keys))))
    log.info("01b: %d questions; %d already finished, %d errored with an accepted kind, %d to send (%d retried "
             "after earlier errors)%s%s", len(questions), int(done.sum()), len(resume.permanent),
             len(todo), len(resume.previous_attempts),
             f"; restored {resume.data_rows_added} data rows" if resume.data_rows_added else "",
             f"; removed {resume.data_rows_removed} data rows no longer trainable" if resume.data_rows_removed else "")
    if len(todo) or resume.data_rows_added or resume.data_rows_removed:
        dd.provenance(dd.synthetic).unlink(missing_ok=True)  # the folder changes: not finished until this run is
    previous_attempts, guard_sample = resume.previous_attempts, (resume.judged, resume.empty, resume.first_empty)
    del resume, done  # arrays of every id: not held through the run and the check after it
    progress = Progress(len(questions), unit="req", initial=len(questions) - len(todo),
                        every_s=cfg.shared.progress_every_s, desc="Progress")
    interrupted: BaseException | None = None
    with own_server(cfg, dd, bool(len(todo))) as urls, \
            IndexedJsonlWriter(dd.responses, "responses") as responses_out, \
            IndexedJsonlWriter(dd.synthetic_data, "rows") as data_out, JsonlAppender(dd.synthetic_errors) as errors_out:
        gen = Generator(cfg, tokenizer, special, previous_attempts, progress,
                        responses_out, data_out, errors_out, urls=urls)
        # the guard judges the whole run: it starts from the responses finished before
        gen.stats.guard_seen, gen.stats.guard_empty, gen.stats.first_empty = guard_sample
        try:
            gen.check_guard()  # the finished responses alone may already show the reasoning is being dropped
            if len(todo):
                asyncio.run(gen.run(todo))
        except BaseException as e:  # the guard, Ctrl-C: what was written stays; the summary is still logged
            interrupted = e
        finally:
            progress.close()
    check = check_synthetic(dd, questions.index)
    summary = {**gen.stats.summary(), "questions": len(questions), "skipped_finished": len(questions) - len(todo),
               "ids": check.figures(), "elapsed_s": round(time.time() - started, 1)}
    _log_summary(summary, dd)
    st = gen.stats
    if cfg.shared.thinking and st.guard_empty and not isinstance(interrupted, EmptyReasoningError):
        log.warning("%d of the %d responses of this run have empty reasoning: %s", st.guard_empty, st.guard_seen,
                    "trained on (--allow-empty-reasoning)" if g.allow_empty_reasoning else
                    "flagged empty_reasoning in responses.jsonl and not trained on")
    if interrupted is not None:
        raise interrupted
    if not check.ok():
        raise StageError(f"{dd.synthetic}: id bookkeeping broken ({check.figures()}; duplicated "
                         f"{check.duplicated[:5]}, data without response {check.data_without_response[:5]})")
    summary.update(_check_errors(dd, cfg, questions))
    write_synthetic_provenance(dd, config_hash=sampling_hash(cfg), counts=summary, started=started,
                               config={"shared": cfg.to_dict()["shared"], "generate": cfg.to_dict()["generate"]})
    return summary


def _log_summary(s: dict, dd: DataDir) -> None:
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["finish_reasons"].items())) or "none"
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(s["error_kinds"].items())) or "none"
    excluded = ", ".join(f"{k} {v}" for k, v in sorted(s["flags"].items())) or "none"
    log.info("01b summary: this run finished %d (%s), errors %d (%s), retries %d; empty reasoning %.1f%%; "
             "tokens: prompt %d, completion %d; data rows %d (flagged: %s); ids rebuilt from text: %d",
             s["finished"], reasons, s["errors"], kinds, s["retries"], 100 * s["empty_reasoning_share"],
             s["prompt_tokens"], s["completion_tokens"], s["data_rows"], excluded, s["rebuilt_token_ids"])
    log.info("01b totals: %s; outputs in %s; elapsed %.0f s", s["ids"], dd.synthetic, s["elapsed_s"])
