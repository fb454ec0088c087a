"""Stage 01b: regenerate every answer with the target itself, through vLLM's OpenAI-compatible server.

Reads ``prepared/questions.jsonl``; writes ``synthetic/responses.jsonl`` (one line per finished request, with the
server's exact prompt and completion token ids), ``synthetic/data.jsonl`` (training rows: prompt ids + completion
ids, loss mask on the completion) and ``synthetic/errors.jsonl`` (requests that failed after every retry). Each line
is appended and flushed when its request ends; a rerun of the same command resumes: finished ids are skipped,
errored ids retried, no id is written twice.

Known silent failures it guards against: reading ``reasoning_content`` when vLLM >= 0.16 sends ``reasoning``
(every record looks fine, reasoning is empty: the empty-reasoning guard stops the run); client timeouts because
requests queue in the server (the /metrics monitor warns and suggests a concurrency the server sustains);
re-tokenized text that differs from what the model produced (ids come from ``return_token_ids``).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import time
from dataclasses import dataclass

from .chat import load_tokenizer, resolve_special_ids
from .cli import StageError
from .config import PipelineConfig
from .generate_requests import Generator, trainable, training_row
from .progress import Progress
from .records import (
    DataDir,
    JsonlAppender,
    check_synthetic,
    load_questions,
    load_request_errors,
    read_jsonl,
    read_provenance,
    repair_jsonl,
    write_jsonl_atomic,
    write_provenance,
)

log = logging.getLogger(__name__)

SAMPLING_KEYS = ("served_model_name", "max_completion_tokens", "min_completion_tokens", "temperature", "top_p",
                 "include_truncated", "request_extra_json")  # changing these mid-run would mix two datasets


# ---------------------------------------------------------------------------------------------------------------
# Resume bookkeeping


def sampling_hash(cfg: PipelineConfig) -> str:
    s, g = cfg.shared, cfg.generate
    payload = {"verifier": s.verifier, "tokenizer": s.tokenizer, "thinking": s.thinking, "max_seq_len": s.max_seq_len,
               **{k: getattr(g, k) for k in SAMPLING_KEYS}}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _prepare_output_dir(dd: DataDir, cfg: PipelineConfig) -> None:
    """Refuse to mix sampling settings in one synthetic/ folder; --overwrite starts it afresh."""
    outputs = (dd.responses, dd.synthetic_data, dd.synthetic_errors, dd.provenance(dd.synthetic))
    if cfg.generate.overwrite:
        for path in outputs:
            if path.exists():
                log.warning("--overwrite: deleting %s", path)
                path.unlink()
        return
    prov = read_provenance(dd.provenance(dd.synthetic))
    if prov and prov.get("config_hash") != sampling_hash(cfg) and dd.responses.exists():
        old = prov.get("config", {}).get("generate", {})
        changed = [k for k in SAMPLING_KEYS if old.get(k) != getattr(cfg.generate, k)]
        raise StageError(
            f"{dd.synthetic} was generated with different settings (changed: {', '.join(changed) or 'shared'}); "
            "rerun with the original settings to resume, pass --overwrite to start afresh, or use another --data-dir"
        )


@dataclass
class ResumeState:
    finished: set[str]  # ids with a response line
    previous_attempts: dict[str, int]  # attempts spent on ids that errored in earlier runs
    data_rows_added: int  # data rows restored for responses written just before a crash


def _resume(dd: DataDir, sources: dict[str, str], include_truncated: bool) -> ResumeState:
    """Repair torn lines, restore data rows a crash skipped, drop errors of ids this run retries or finished."""
    for path in (dd.responses, dd.synthetic_data, dd.synthetic_errors):
        repair_jsonl(path)
    data_ids = {d["id"] for d in read_jsonl(dd.synthetic_data)} if dd.synthetic_data.exists() else set()
    finished: set[str] = set()
    added = 0
    if dd.responses.exists():
        with JsonlAppender(dd.synthetic_data) as data_out:
            for d in read_jsonl(dd.responses):
                finished.add(d["id"])
                # a crash between the response line and its data line: write the data line now
                if d["id"] not in data_ids and trainable(d["flags"], include_truncated):
                    data_out.write(training_row(d["id"], d["prompt_token_ids"], d["completion_token_ids"],
                                                 sources.get(d["id"], "")).to_json())
                    data_ids.add(d["id"])
                    added += 1
    previous_attempts: dict[str, int] = {}
    if dd.synthetic_errors.exists():
        kept = []
        for err in load_request_errors(dd.synthetic_errors):
            if err.id in finished:
                continue  # finished on a later run: the error is stale
            if err.id in sources:
                previous_attempts[err.id] = previous_attempts.get(err.id, 0) + err.attempts  # retried now
            else:
                kept.append(err.to_json())  # outside this run's questions (e.g. a smaller --max-samples)
        write_jsonl_atomic(dd.synthetic_errors, kept)
    return ResumeState(finished=finished, previous_attempts=previous_attempts, data_rows_added=added)


def run_generate(cfg: PipelineConfig) -> dict:
    """Stage 01b entry point; returns the run summary (also logged and written into provenance.json)."""
    started = time.time()
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # one INFO line per request otherwise
    dd = DataDir(cfg.data_dir)
    g = cfg.generate
    if not dd.questions.exists():
        raise FileNotFoundError(f"{dd.questions} not found: run 01_prepare_data.py first (same --data-dir)")
    questions = list(load_questions(dd.questions))
    if g.max_samples:
        questions = questions[: g.max_samples]
    ids = [q.id for q in questions]
    if len(set(ids)) != len(ids):
        dup = collections.Counter(ids).most_common(1)[0][0]
        raise StageError(f"{dd.questions} holds id {dup!r} more than once; rerun stage 01")
    tokenizer = load_tokenizer(cfg.tokenizer_path, cfg.shared.trust_remote_code)
    special = resolve_special_ids(tokenizer, cfg.shared.think_token_id, cfg.shared.response_token_id)
    _prepare_output_dir(dd, cfg)
    resume = _resume(dd, {q.id: q.source for q in questions}, g.include_truncated)
    todo = [q for q in questions if q.id not in resume.finished]
    log.info("01b: %d questions; %d already finished, %d to send (%d retried after earlier errors)%s",
             len(questions), len(questions) - len(todo), len(todo), len(resume.previous_attempts),
             f"; restored {resume.data_rows_added} data rows" if resume.data_rows_added else "")
    progress = Progress(len(questions), unit="req", initial=len(questions) - len(todo),
                        every_s=cfg.shared.progress_every_s, desc="Progress")
    interrupted: BaseException | None = None
    with JsonlAppender(dd.responses) as responses_out, JsonlAppender(dd.synthetic_data) as data_out, \
            JsonlAppender(dd.synthetic_errors) as errors_out:
        gen = Generator(cfg, tokenizer, special, resume.previous_attempts, progress,
                        responses_out, data_out, errors_out)
        try:
            if todo:
                asyncio.run(gen.run(todo))
        except BaseException as e:  # the guard, Ctrl-C: what was written stays; the summary is still logged
            interrupted = e
        finally:
            progress.close()
    check = check_synthetic(dd, ids)
    summary = {**gen.stats.summary(), "questions": len(questions), "skipped_finished": len(questions) - len(todo),
               "ids": check.figures(), "elapsed_s": round(time.time() - started, 1)}
    _log_summary(summary, dd)
    if interrupted is not None:
        raise interrupted
    if not check.ok():
        raise StageError(f"{dd.synthetic}: id bookkeeping broken ({check.figures()}; duplicated "
                         f"{check.duplicated[:5]}, data without response {check.data_without_response[:5]})")
    write_provenance(dd.provenance(dd.synthetic), stage="generate", config_hash=sampling_hash(cfg),
                     config={"shared": cfg.to_dict()["shared"], "generate": cfg.to_dict()["generate"]},
                     inputs=[str(dd.questions)], counts=summary, started=started)
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
