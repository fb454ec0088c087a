"""The on-disk formats of the pipeline: folder layout, file names, record fields, and their save/load/check.

Writer and reader of each file import this module, or for a format only one stage writes its own module beside it
(``records_vocab``: vocab/, ``records_checkpoints``: checkpoints/, ``records_eval``: eval/), so a format is defined
exactly once. The layout of every folder (``DataDir``) is here. Layout of a data dir::

    <data_dir>/
      prepared/     data.jsonl (TrainingRow)  questions.jsonl (Question)  errors.jsonl (DroppedRow)  provenance.json
                    data.index  questions.index (row indexes, see "Row index")
      synthetic/    responses.jsonl (Response)  data.jsonl (TrainingRow)  errors.jsonl (RequestError)  provenance.json
                    (written only when 01b finished)  run.json (01b's sampling settings, written at its start)
                    responses.index  data.index (row indexes)
      hidden_states/  speculators-readable dataset + per-sample safetensors + manifest.json (see extract section)
      vocab/        draft vocabulary: counts, d2t, t2d (records_vocab.py)
      checkpoints/  step_N/ training checkpoints, final/ exported draft, metrics.jsonl, skipped.jsonl
                    (SkippedSample), run.json, provenance.json (records_checkpoints.py)
      eval/         report.json, report.md, acceptance.png (records_eval.py)
      logs/         <stage>.log, one per stage, appended
      locks/        <stage>.lock while a stage runs (StageLock: pid, host, start, command)
      run_all/      <stage>.done markers of run_all.sh

JSONL files are appended one flushed line per record; a crash can leave at most one torn last line, which
``repair_jsonl`` removes before the next run appends (the record it held is redone, never half-kept).

The JSONL files later stages read row by row (training rows, questions, responses) have a row index beside them
(``data.jsonl`` -> ``data.index``): 28 bytes a row (byte offset, length, tokens, id key, flags) that a process
memory-maps instead of holding the rows, reading a row's line when it needs it. Why an index and not an Arrow copy
(what speculators and SpecForge keep): see the "Row index" section.
"""

from __future__ import annotations

import array
import bisect
import datetime as _dt
import hashlib
import itertools
import json
import logging
import os
import platform
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


class FormatError(ValueError):
    """A file does not hold what its format says; the message names the file, line and field."""


# ---------------------------------------------------------------------------------------------------------------
# Layout


@dataclass(frozen=True)
class DataDir:
    """Paths of every artifact under one data dir. No other module spells these file names."""

    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    # stage 01 (the folders are cached_property: stage 02's finalize joins two paths a file, for 10^6 files)
    @cached_property
    def prepared(self) -> Path:
        return self.root / "prepared"

    @property
    def prepared_data(self) -> Path:
        return self.prepared / "data.jsonl"

    @property
    def questions(self) -> Path:
        return self.prepared / "questions.jsonl"

    @property
    def prepared_errors(self) -> Path:
        return self.prepared / "errors.jsonl"

    # stage 01b
    @cached_property
    def synthetic(self) -> Path:
        return self.root / "synthetic"

    @property
    def responses(self) -> Path:
        return self.synthetic / "responses.jsonl"

    @property
    def synthetic_data(self) -> Path:
        return self.synthetic / "data.jsonl"

    @property
    def synthetic_errors(self) -> Path:
        return self.synthetic / "errors.jsonl"

    @property
    def synthetic_run(self) -> Path:
        """Settings of the 01b run that writes synthetic/, written at its start (a resume must match them)."""
        return self.synthetic / "run.json"

    # stages 02-05
    @cached_property
    def hidden_states(self) -> Path:
        return self.root / "hidden_states"

    # stage 02 (hidden states section below): D = hidden_states/ is what `speculators train --data-path` takes
    @cached_property
    def hs_files(self) -> Path:
        return self.hidden_states / "hidden_states"

    def hs_file(self, index: int) -> Path:
        return self.hs_files / f"hs_{index}.safetensors"

    @property
    def hs_manifest(self) -> Path:
        return self.hidden_states / "manifest.json"

    @property
    def hs_errors(self) -> Path:
        return self.hidden_states / "errors.jsonl"

    @cached_property
    def hs_work(self) -> Path:
        return self.hidden_states / "work"

    @property
    def hs_run(self) -> Path:
        """Config hash and input identity of the extraction in progress (resume refuses a different one)."""
        return self.hs_work / "run.json"

    def hs_shard(self, shard: int) -> Path:
        return self.hs_work / f"shard_{shard}"

    def hs_shard_file(self, shard: int, local_index: int) -> Path:
        return self.hs_shard(shard) / f"hs_{local_index}.safetensors"

    def hs_shard_journal(self, shard: int) -> Path:
        return self.hs_shard(shard) / "done.jsonl"

    @property
    def hs_finalize_plan(self) -> Path:
        """Which shard file becomes which hs_{i}: written before finalize's first rename (``save_hs_finalize_plan``)."""
        return self.hs_work / "finalize_plan.npy"

    @property
    def hs_finalize_plan_v1(self) -> Path:
        """The finalize plan as eagle3pipe wrote it before issue 27 (JSON): read when an interrupted finalize of that
        version left one, replaced by ``hs_finalize_plan`` at the next save."""
        return self.hs_work / "finalize.json"

    # stage 04 online (train.data_source: online): the states of the next rows only. Inside hs_work because the
    # extraction servers' connector writes only inside its storage folder (hs_work, or a folder above it)
    @property
    def train_spool(self) -> Path:
        return self.hs_work / "train_spool"

    @property
    def train_spool_rows(self) -> Path:
        """The rows dataset (input_ids, loss_mask, seq_len) of every input row, as hidden_states/ holds it."""
        return self.train_spool / "rows"

    def train_spool_rank(self, rank: int) -> Path:
        return self.train_spool / f"rank_{rank}"

    def train_spool_rank_folders(self) -> list[Path]:
        """The rank folders on disk: this job's, and any an earlier job with more ranks left."""
        return sorted(p for p in self.train_spool.glob("rank_*") if p.is_dir())

    def train_spool_slot(self, rank: int, epoch: int, slot: int) -> Path:
        """The files hs_{i} (i = row index in train_spool_rows) of one packed row of the rank's epoch plan."""
        return self.train_spool_rank(rank) / f"epoch_{epoch}_row_{slot}"

    def train_spool_eval_slot(self, rank: int, step: int, slot: int) -> Path:
        """The files hs_{i} of one packed row of the rank's held-out rows, for the evaluation after optimizer step
        ``step`` (several an epoch with train.eval_every_steps)."""
        return self.train_spool_rank(rank) / f"step_{step}_eval_{slot}"

    @property
    def train_spool_cache(self) -> Path:
        """train.cache_gb: the files hs_{i} kept for later epochs, one folder for every rank (each file extracted by
        one rank, its owner, and linked by any rank that reads it later, after checking it again)."""
        return self.train_spool / "cache"

    def train_spool_cache_word(self, file_index: int) -> Path:
        """The owner's word on cached file ``file_index`` for the other ranks: {"bytes": n} once written and checked,
        {"failed": reason} when it could not be."""
        return self.train_spool_cache / f"hs_{file_index}.word.json"

    @property
    def train_online_errors(self) -> Path:
        """Samples an online epoch trained without, with the reason (one JSON line each, the epoch included)."""
        return self.checkpoints / "online_errors.jsonl"

    @property
    def vocab(self) -> Path:
        return self.root / "vocab"

    @property
    def vocab_mapping(self) -> Path:
        return self.vocab / "mapping.safetensors"

    @property
    def vocab_counts(self) -> Path:
        return self.vocab / "token_counts.safetensors"

    @property
    def vocab_summary(self) -> Path:
        return self.vocab / "summary.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def final_checkpoint(self) -> Path:
        return self.checkpoints / "final"

    def checkpoint_step(self, step: int) -> Path:
        return self.checkpoints / f"step_{step}"

    @property
    def train_metrics(self) -> Path:
        return self.checkpoints / "metrics.jsonl"

    @property
    def train_skipped(self) -> Path:
        """Samples stage 04 trained or evaluated without because their states file failed a read check (one
        SkippedSample line each)."""
        return self.checkpoints / "skipped.jsonl"

    @property
    def train_run(self) -> Path:
        """Architecture and data of the training run in checkpoints/ (``--resume`` refuses other ones)."""
        return self.checkpoints / "run.json"

    @property
    def train_curves(self) -> Path:
        return self.checkpoints / "curves.png"

    @property
    def train_reports(self) -> Path:
        """The trackers' own files (train.report_to): tensorboard/ event files, wandb/ runs, wandb_run_id."""
        return self.checkpoints / "reports"

    def train_export(self, step: int) -> Path:
        """Where ``04_train.py --export-from step_N`` exports a checkpoint (a draft vLLM serves; final/ is apart)."""
        return self.checkpoints / f"export_step_{step}"

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    # stage 05 (formats in the "Stage 05: evaluation report" section)
    @property
    def eval_report(self) -> Path:
        return self.eval / "report.json"

    @property
    def eval_markdown(self) -> Path:
        return self.eval / "report.md"

    @property
    def eval_plot(self) -> Path:
        return self.eval / "acceptance.png"

    def eval_server_log(self, kind: str) -> Path:
        """Log of a vLLM server stage 05 started (``kind``: draft, baseline_draft_<name>, or baseline = the verifier
        alone)."""
        return self.logs / f"05_vllm_{kind}.log"

    # run_all.sh: a stage's done-marker, written only on success, holding the config hash it ran with
    def stage_marker(self, stage: str) -> Path:
        return self.root / "run_all" / f"{stage}.done"

    # run_all.sh: written (the config hash) when it starts a stage, removed once the stage finished; still there on
    # the next run_all = that stage was interrupted with this config (04 then continues with --resume)
    def stage_started(self, stage: str) -> Path:
        return self.root / "run_all" / f"{stage}.started"

    # every stage door (cli.run_stage): held while the stage runs, so two copies of a stage never share a data dir
    def stage_lock(self, stage: str) -> Path:
        return self.root / "locks" / f"{stage}.lock"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log_file(self, stage: str) -> Path:
        return self.logs / f"{stage}.log"

    def provenance(self, stage_dir: Path) -> Path:
        return stage_dir / "provenance.json"


# ---------------------------------------------------------------------------------------------------------------
# Atomic writes and JSONL


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary name beside ``path``, fsync, then rename: readers see all or nothing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode())


def tmp_path_for(path: Path) -> Path:
    """The temporary name a file is written under before ``os.replace`` gives it its real name."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def repair_jsonl(path: Path) -> int:
    """Drop a torn last line (no trailing newline) left by a crash. Returns the number of bytes removed.

    A complete line that is not valid JSON is not a crash artifact but corruption: that raises FormatError.
    """
    path = Path(path)
    if not path.exists():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return 0
        # Walk back to the last newline; everything after it is the torn record.
        block = 1 << 16
        pos = size
        keep = 0
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            idx = chunk.rfind(b"\n")
            if idx >= 0:
                keep = start + idx + 1
                break
            pos = start
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    removed = size - keep
    log.warning("repaired %s: removed a torn last line of %d bytes left by an interrupted run", path, removed)
    return removed


def read_jsonl(path: Path) -> Iterator[dict]:
    """Yield one dict per line; a line that is not JSON raises FormatError naming file and line."""
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if not line.endswith("\n"):
                raise FormatError(f"{path}:{lineno}: torn last line (no newline); run the stage again to repair it")
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise FormatError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None


class JsonlAppender:
    """Append records to a JSONL file, one flushed line each. Repairs a torn last line on open.

    ``fsync_every`` bounds how many records the OS may still hold in its cache at a power loss; a process crash
    loses nothing that was written, since every line is flushed.
    """

    def __init__(self, path: Path, fsync_every: int = 64):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_jsonl(self.path)
        self._f = open(self.path, "a", encoding="utf-8")
        self._fsync_every = fsync_every
        self._since_sync = 0

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()
        self._since_sync += 1
        if self._since_sync >= self._fsync_every:
            os.fsync(self._f.fileno())
            self._since_sync = 0

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()

    def __enter__(self) -> "JsonlAppender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_jsonl_atomic(path: Path, records: Iterator[dict] | list[dict]) -> int:
    """Write a whole JSONL file under a temporary name, then rename. Returns the number of records."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(path)
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return n


# ---------------------------------------------------------------------------------------------------------------
# Records: prepared/ and synthetic/


@dataclass
class TrainingRow:
    """One training sample: token ids and a 0/1 loss mask of the same length (1 = supervised position)."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]
    source: str

    def to_json(self) -> dict:
        return dict(vars(self))  # flat: asdict() deep-copies both id lists (6 ms a 4,000-token row, 10x json.dumps)

    @classmethod
    def from_json(cls, d: dict, where: str = "") -> "TrainingRow":
        try:
            row = cls(id=d["id"], input_ids=d["input_ids"], loss_mask=d["loss_mask"], source=d.get("source", ""))
        except KeyError as e:
            raise FormatError(f"{where}: training row lacks field {e}") from None
        row.check(where)
        return row

    def check(self, where: str = "") -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise FormatError(
                f"{where}: row {self.id}: input_ids has {len(self.input_ids)} tokens, loss_mask {len(self.loss_mask)}"
            )
        if not set(self.loss_mask) <= {0, 1}:  # set(): C speed (a Python loop was ~1 us a token)
            raise FormatError(f"{where}: row {self.id}: loss_mask holds values other than 0/1")
        if not any(self.loss_mask):
            raise FormatError(f"{where}: row {self.id}: no supervised token (loss_mask all 0)")


@dataclass
class Question:
    """A prompt that stage 01b sends: the conversation up to (and including) its last user or tool turn."""

    id: str
    messages: list[dict]  # [{"role": "system"|"user"|"assistant"|"tool", "content": str | None, ...}, ...]
    source: str
    tools: list[dict] | None = None  # OpenAI function tools the conversation declares (sent as the request's tools)

    def to_json(self) -> dict:
        d = dict(vars(self))  # shallow, as the writer serializes it at once; asdict() deep-copies every message
        if d["tools"] is None:
            del d["tools"]  # rows without tools keep the original record shape
        return d

    @classmethod
    def from_json(cls, d: dict, where: str = "") -> "Question":
        try:
            q = cls(id=d["id"], messages=d["messages"], source=d.get("source", ""), tools=d.get("tools"))
        except KeyError as e:
            raise FormatError(f"{where}: question lacks field {e}") from None
        if not q.messages or q.messages[-1].get("role") not in ("user", "tool"):
            raise FormatError(f"{where}: question {q.id} does not end with a user or tool turn")
        return q


@dataclass
class DroppedRow:
    """A dataset row that stage 01 did not keep, with the reason. Nothing is dropped without one of these."""

    source: str
    row: int  # row number in the source dataset (0-based)
    reason: str
    id: str = ""  # the row's id when it could be computed

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Response:
    """One finished generation request of stage 01b (server's exact token ids included)."""

    id: str
    messages: list[dict]
    reasoning: str | None
    content: str | None
    finish_reason: str
    usage: dict
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    server: str
    latency_s: float
    token_ids_source: str = "server"  # "server" (return_token_ids) or "rebuilt" (from text via the tokenizer)
    flags: list[str] = field(default_factory=list)  # why it is left out of data.jsonl, e.g. ["length"]
    reasoning_field: str = ""  # message field the reasoning was read from ("reasoning", "reasoning_content", ...)

    def to_json(self) -> dict:
        return dict(vars(self))  # flat record: no deep copy of the id lists (asdict costs ms per long response)

    @classmethod
    def from_json(cls, d: dict, where: str = "") -> "Response":
        try:
            return cls(**d)
        except TypeError as e:
            raise FormatError(f"{where}: response record does not match the Response format ({e})") from None


# kinds of RequestError; also "http_NNN" for another HTTP status (e.g. http_400)
REQUEST_ERROR_KINDS = ("timeout", "connection", "http_5xx", "bad_response", "context_too_long")


@dataclass
class RequestError:
    """A question whose request failed after all retries (retried again on the next run, unless its kind is one
    the user accepted as permanent: generate.permanent_error_kinds)."""

    id: str
    kind: str  # one of REQUEST_ERROR_KINDS or http_NNN
    message: str
    attempts: int
    server: str

    def to_json(self) -> dict:
        return asdict(self)


def load_training_rows(path: Path) -> Iterator[TrainingRow]:
    for i, d in enumerate(read_jsonl(path), 1):
        yield TrainingRow.from_json(d, where=f"{path}:{i}")


def load_questions(path: Path) -> Iterator[Question]:
    for i, d in enumerate(read_jsonl(path), 1):
        yield Question.from_json(d, where=f"{path}:{i}")


# ---------------------------------------------------------------------------------------------------------------
# Row index (issue 27): a compact index beside every JSONL file a later stage reads row by row
#
#   prepared/data.index        of prepared/data.jsonl        kind "rows"       written by 01
#   prepared/questions.index   of prepared/questions.jsonl   kind "questions"  written by 01
#   synthetic/data.index       of synthetic/data.jsonl       kind "rows"       written by 01b
#   synthetic/responses.index  of synthetic/responses.jsonl  kind "responses"  written by 01b
#
#   A 32-byte header (ROW_INDEX_MAGIC, then the kind in ASCII, space-padded to 24 bytes), then one ROW_INDEX_DTYPE
#   record (28 bytes, little-endian, packed) per record line of the JSONL file, in file order:
#     offset      int64   byte offset of the line in the JSONL file
#     num_bytes   uint32  length of the line, its newline included
#     num_tokens  uint32  rows: len(input_ids); responses: prompt + completion ids; questions: 0
#     key         uint64  id_key(record["id"])
#     flags       uint32  responses: response_bits(record); 0 for the other kinds
#
# Why an index into data.jsonl and not an Arrow copy beside it (speculators and SpecForge keep prepared rows as an
# HF `datasets` Arrow table, memory-mapped, made by `Dataset.map(num_proc=...)` + `save_to_disk`): what makes their
# readers cheap is that a process maps the rows instead of holding them, and this index gives our stages the same
# (a memory map of 28 bytes a row; a rank maps the pages of its own rows) while data.jsonl stays the one record.
# An Arrow copy would hold every token a second time, and data.jsonl is not written once: 01b appends to it for
# days (a torn last line repaired after a crash, rows removed when a resume's settings change), which an Arrow table
# can follow only by being rewritten whole. The index follows each line in step (an append per line; after a crash
# it is brought up to date by parsing only the lines past its end) and is rewritten with the file when the file is.
# One row's ids and mask cost a pread and a json.loads of its line when it is needed (~0.2 ms per thousand tokens
# on the project's CPU machine, bench/bench_scale.py), small beside what a stage then does with the row (a forward
# pass, a request, a training step); lengths (num_tokens) and ids (key) are columns read without parsing.
# Stage 02 still writes speculators' own Arrow rows dataset for its trainer (save_hs_rows above).

ROW_INDEX_MAGIC = b"E3RIDX01"  # the last two bytes are the index format's version
ROW_INDEX_HEADER_BYTES = 32
ROW_INDEX_DTYPE = np.dtype([("offset", "<i8"), ("num_bytes", "<u4"), ("num_tokens", "<u4"), ("key", "<u8"),
                            ("flags", "<u4")])  # packed: 28 bytes
_ROW_INDEX_RECORD = struct.Struct("<qIIQI")  # the same record, for appends
assert _ROW_INDEX_RECORD.size == ROW_INDEX_DTYPE.itemsize
ROW_INDEX_KINDS = ("rows", "questions", "responses")
ROW_INDEX_SPOT_CHECKS = 8  # lines parsed on open to check the index still describes the file (first, last, spread)

# responses: the bits of ``flags`` (a flag 01b writes into Response.flags is bit RESPONSE_FLAGS.index(flag))
RESPONSE_FLAGS = ("length", "abort", "repetition", "empty", "short", "too_long", "empty_reasoning", "unrebuildable")
RESPONSE_OTHER_FLAG = 1 << 28  # a flag not in RESPONSE_FLAGS (written by a later version): never trainable here
RESPONSE_NO_COMPLETION = 1 << 29  # completion_token_ids is empty
RESPONSE_EMPTY_REASONING = 1 << 30  # the reasoning text is empty or whitespace

_HEX_DIGITS = frozenset("0123456789abcdef")


def row_index_path(jsonl_path: Path) -> Path:
    """The index beside a JSONL file: ``data.jsonl`` -> ``data.index``."""
    return Path(jsonl_path).with_suffix(".index")


def id_key(row_id: str) -> int:
    """The 64-bit key of a row id. Stage 01's ids (16 lowercase hex digits) are their own value, so its keys are
    exact; any other id (tests, hand-made files) keys on the first 8 bytes of its blake2b: two distinct ids among
    10^6 share one with probability ~3e-8, and stage 01b checks its questions' keys are distinct."""
    if len(row_id) == 16 and _HEX_DIGITS.issuperset(row_id):
        return int(row_id, 16)
    return int.from_bytes(hashlib.blake2b(row_id.encode("utf-8"), digest_size=8).digest(), "little")


def id_keys(row_ids) -> np.ndarray:
    """uint64 [n]: id_key of each id."""
    return np.fromiter((id_key(i) for i in row_ids), dtype=np.uint64)


def flag_bits(flags) -> int:
    """The RESPONSE_FLAGS bits of a list of flag names (RESPONSE_OTHER_FLAG for a name not listed)."""
    bits = 0
    for name in flags:
        bits |= (1 << RESPONSE_FLAGS.index(name)) if name in RESPONSE_FLAGS else RESPONSE_OTHER_FLAG
    return bits


def response_bits(d: dict) -> int:
    """The ``flags`` column of one response record: its flags, no completion ids, empty reasoning."""
    bits = flag_bits(d.get("flags") or ())
    if not d["completion_token_ids"]:
        bits |= RESPONSE_NO_COMPLETION
    if not (d.get("reasoning") or "").strip():
        bits |= RESPONSE_EMPTY_REASONING
    return bits


def describe_record(kind: str, d: dict, where: str = "") -> tuple[int, int, int]:
    """(key, num_tokens, flags) of one record of a file of ``kind``: what its index record holds."""
    try:
        if kind == "rows":
            return id_key(d["id"]), len(d["input_ids"]), 0
        if kind == "questions":
            return id_key(d["id"]), 0, 0
        if kind == "responses":
            return id_key(d["id"]), len(d["prompt_token_ids"]) + len(d["completion_token_ids"]), response_bits(d)
    except (KeyError, TypeError) as e:
        raise FormatError(f"{where}: not a {kind} record (lacks or mistypes {e})") from None
    raise ValueError(f"unknown row index kind {kind!r} (one of {ROW_INDEX_KINDS})")


def _index_header(kind: str) -> bytes:
    header = ROW_INDEX_MAGIC + kind.encode("ascii").ljust(ROW_INDEX_HEADER_BYTES - len(ROW_INDEX_MAGIC))
    assert len(header) == ROW_INDEX_HEADER_BYTES, kind
    return header


class KeySet:
    """A set of row ids as a sorted uint64 array of their keys (8 bytes an id): ``key in s``, ``s.contains(keys)``."""

    def __init__(self, keys: np.ndarray | None = None, *, sorted_unique: bool = False):
        keys = np.asarray(keys if keys is not None else (), dtype=np.uint64)
        self.keys = keys if sorted_unique else np.unique(keys)  # sorted_unique: taken as they are (no copy)

    def __len__(self) -> int:
        return int(self.keys.size)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """bool [n]: which of ``keys`` are in the set."""
        keys = np.asarray(keys, dtype=np.uint64)
        if not self.keys.size:
            return np.zeros(keys.shape, dtype=bool)
        at = np.searchsorted(self.keys, keys)
        np.minimum(at, self.keys.size - 1, out=at)
        return self.keys[at] == keys

    def has(self, key: int) -> bool:
        """Whether one key is in the set."""
        k = np.uint64(key)
        at = int(np.searchsorted(self.keys, k))
        return at < self.keys.size and bool(self.keys[at] == k)

    def __contains__(self, row_id: str) -> bool:
        return self.has(id_key(row_id))


class KeyCounts:
    """A count per row id, as two arrays (sorted keys, counts): ``counts.get(row_id, 0)``."""

    def __init__(self, keys: np.ndarray, counts: np.ndarray):
        keys = np.asarray(keys, dtype=np.uint64)
        self.keys, inverse = np.unique(keys, return_inverse=True)
        self.counts = np.bincount(inverse, weights=np.asarray(counts, dtype=np.float64),
                                  minlength=self.keys.size).astype(np.int64)

    def __len__(self) -> int:
        return int(self.keys.size)

    def get(self, row_id: str, default: int = 0) -> int:
        key = np.uint64(id_key(row_id))
        at = int(np.searchsorted(self.keys, key))
        return int(self.counts[at]) if at < self.keys.size and self.keys[at] == key else default


class RowIndex:
    """The index of one JSONL file (``open_row_index``): its columns as arrays, each line read when it is needed.

    For the stages that read rows (02 and 04 next): ``lengths`` (tokens per row, no parsing), ``row(i)`` (one
    TrainingRow: a pread and a json.loads of its line), ``rows(positions)`` (many, read in file order),
    ``rank_share(rank, world_size)`` (the contiguous block of rows of one torchrun rank: its records alone are
    touched), ``subset(positions)``, ``find(keys)`` / ``contains(keys)`` (positions of ids, by key)."""

    def __init__(self, jsonl_path: Path, kind: str, records: np.ndarray, positions_base: int = 0):
        self.jsonl_path, self.kind, self.records = Path(jsonl_path), kind, records
        self.positions_base = positions_base  # position of record 0 in the whole file's index (rank_share)
        self._fd: int | None = None
        self._fd_pid = -1
        self._order: np.ndarray | None = None  # argsort of keys, made by the first find()
        self._sorted_keys: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.records.shape[0])

    @property
    def offsets(self) -> np.ndarray:
        return self.records["offset"]

    @property
    def num_bytes(self) -> np.ndarray:
        return self.records["num_bytes"]

    @property
    def lengths(self) -> np.ndarray:
        """uint32 [n]: tokens per row (rows: input_ids; responses: prompt + completion; questions: 0)."""
        return self.records["num_tokens"]

    @property
    def keys(self) -> np.ndarray:
        return self.records["key"]

    @property
    def flags(self) -> np.ndarray:
        return self.records["flags"]

    @property
    def data_bytes(self) -> int:
        """Bytes of the JSONL file the records cover (from 0 up to the end of the last line indexed)."""
        if not len(self):
            return 0
        return int(self.offsets[-1]) + int(self.num_bytes[-1])

    def subset(self, which) -> "RowIndex":
        """The index of some of the rows (a slice: a view, no copy; positions: a copy of their records)."""
        base = self.positions_base + (which.indices(len(self))[0] if isinstance(which, slice) else 0)
        return RowIndex(self.jsonl_path, self.kind, self.records[which], base if isinstance(which, slice) else 0)

    def rank_share(self, rank: int, world_size: int) -> "RowIndex":
        """Rows [rank * n // world_size, (rank + 1) * n // world_size): one rank's contiguous block."""
        n = len(self)
        return self.subset(slice(rank * n // world_size, (rank + 1) * n // world_size))

    def _descriptor(self) -> int:
        if self._fd is None or self._fd_pid != os.getpid():  # a forked child opens its own
            self._fd, self._fd_pid = os.open(self.jsonl_path, os.O_RDONLY), os.getpid()
        return self._fd

    def close(self) -> None:
        if self._fd is not None and self._fd_pid == os.getpid():
            os.close(self._fd)
        self._fd = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def line(self, i: int) -> bytes:
        """The bytes of row ``i``'s line, newline included."""
        offset, size = int(self.offsets[i]), int(self.num_bytes[i])
        data = os.pread(self._descriptor(), size, offset)
        if len(data) != size or not data.endswith(b"\n"):
            raise FormatError(f"{self.jsonl_path}: the line at byte {offset} is not what its index "
                              f"({row_index_path(self.jsonl_path).name}) says: the file changed; delete the index "
                              "to have it rebuilt")
        return data

    def record(self, i: int) -> dict:
        """Row ``i``'s JSON record."""
        try:
            d = json.loads(self.line(i))
        except json.JSONDecodeError as e:
            raise FormatError(f"{self.jsonl_path}: row {self.positions_base + i} (byte {int(self.offsets[i])}): "
                              f"not valid JSON ({e.msg})") from None
        if id_key(d.get("id", "")) != int(self.keys[i]):
            raise FormatError(f"{self.jsonl_path}: row {self.positions_base + i} holds id {d.get('id')!r}, not the "
                              f"one its index names: the file changed; delete {row_index_path(self.jsonl_path)}")
        return d

    def row(self, i: int) -> TrainingRow:
        """Row ``i`` as a checked TrainingRow (kind rows)."""
        return TrainingRow.from_json(self.record(i), where=f"{self.jsonl_path} row {self.positions_base + i}")

    def records_at(self, positions=None) -> Iterator[tuple[int, dict]]:
        """(position, record) of the rows at ``positions`` (all when None), read in ascending file order."""
        todo = np.arange(len(self)) if positions is None else np.sort(np.asarray(positions, dtype=np.int64))
        for i in todo:
            yield int(i), self.record(int(i))

    def rows(self, positions=None) -> Iterator[TrainingRow]:
        for i, d in self.records_at(positions):
            yield TrainingRow.from_json(d, where=f"{self.jsonl_path} row {self.positions_base + i}")

    def __getitem__(self, i: int) -> TrainingRow:
        """``index[i]``: row i, read now (``row``), as a list of rows would give it."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        return self.row(i % len(self))

    def __iter__(self) -> Iterator[TrainingRow]:
        return self.rows()

    def find(self, keys: np.ndarray) -> np.ndarray:
        """int64 [n]: the position of each key's first row, -1 where no row has it."""
        keys = np.asarray(keys, dtype=np.uint64)
        if not len(self):
            return np.full(keys.shape, -1, dtype=np.int64)
        if self._order is None:
            self._order = np.argsort(self.keys, kind="stable")  # [n]: equal keys keep file order
            self._sorted_keys = np.asarray(self.keys)[self._order]  # [n]
        at = np.searchsorted(self._sorted_keys, keys).clip(max=len(self) - 1)
        return np.where(self._sorted_keys[at] == keys, self._order[at], -1).astype(np.int64)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        return self.find(keys) >= 0


class RowSelection:
    """Some rows of a rows index, by position, in an order of their own: what stage 02 sends and 04 online requests.
    It keeps 12 bytes a row (position, length); ``selection[k]`` reads the k-th row's line when it is taken:
    (position, id, input_ids), the item stage 02's clients send. Picklable (a spawned worker reopens the index)."""

    def __init__(self, index: RowIndex, positions, lengths: np.ndarray | None = None):
        self.index = index
        self.positions = np.asarray(positions, dtype=np.int64)  # [n]
        self.lengths = (np.asarray(index.lengths[self.positions], dtype=np.uint32) if lengths is None
                        else lengths)  # [n] tokens of each

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    def __getitem__(self, k: int) -> tuple[int, str, list[int]]:
        position = int(self.positions[k])
        row = self.index.row(position)
        return position, row.id, row.input_ids

    def __iter__(self) -> Iterator[tuple[int, str, list[int]]]:
        for k in range(len(self)):
            yield self[k]

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))

    def take(self, which) -> "RowSelection":
        """The rows at ``which`` (indices into this selection, or a bool mask), in that order."""
        return RowSelection(self.index, self.positions[which], self.lengths[which])

    def longest_first(self) -> "RowSelection":
        """The same rows, longest first, ties in this selection's order (as a stable sort by length would)."""
        return self.take(np.argsort(-self.lengths.astype(np.int64), kind="stable"))

    def __getstate__(self) -> dict:
        return {"jsonl_path": str(self.index.jsonl_path), "kind": self.index.kind, "positions": self.positions,
                "lengths": self.lengths}

    def __setstate__(self, state: dict) -> None:
        self.index = open_row_index(Path(state["jsonl_path"]), state["kind"])
        self.positions, self.lengths = state["positions"], state["lengths"]


def _empty_records() -> np.ndarray:
    return np.empty(0, dtype=ROW_INDEX_DTYPE)


def _read_index_file(index_path: Path, kind: str) -> tuple[np.ndarray | None, bool]:
    """(records of an index file as a read-only memory map, or None when it is missing or not of ``kind``; whether
    the file holds exactly them: False after a crash in the middle of appending a record, left out)."""
    try:
        size = index_path.stat().st_size
        with open(index_path, "rb") as f:
            header = f.read(ROW_INDEX_HEADER_BYTES)
    except FileNotFoundError:
        return None, False
    if header != _index_header(kind):
        return None, False
    n, partial = divmod(size - ROW_INDEX_HEADER_BYTES, ROW_INDEX_DTYPE.itemsize)
    if n <= 0:
        return _empty_records(), not partial
    records = np.memmap(index_path, dtype=ROW_INDEX_DTYPE, mode="r", offset=ROW_INDEX_HEADER_BYTES, shape=(n,))
    return records, not partial


def _index_describes(jsonl_path: Path, kind: str, records: np.ndarray) -> bool:
    """Whether ``records`` still describe the start of the file: lines in ascending, non-overlapping order, and
    the lines of a spread of them (first, last, between) hold the ids and lengths they name."""
    if not len(records):
        return True
    offsets, sizes = records["offset"], records["num_bytes"]
    if int(offsets[0]) < 0:
        return False
    for start in range(0, len(records) - 1, 1 << 20):  # in blocks: a few MB of temporaries whatever the rows
        stop = min(start + (1 << 20), len(records) - 1)
        if not bool((offsets[start + 1: stop + 1] >= offsets[start:stop] + sizes[start:stop]).all()):
            return False
    picks = np.unique(np.linspace(0, len(records) - 1, ROW_INDEX_SPOT_CHECKS).astype(np.int64))
    with open(jsonl_path, "rb") as f:
        for i in picks:
            offset, size = int(offsets[i]), int(sizes[i])
            if offset > 0:
                f.seek(offset - 1)
                if f.read(1) != b"\n":
                    return False
            else:
                f.seek(0)
            line = f.read(size)
            if len(line) != size or not line.endswith(b"\n"):
                return False
            try:
                described = describe_record(kind, json.loads(line))
            except (ValueError, FormatError):
                return False
            if described != (int(records["key"][i]), int(records["num_tokens"][i]), int(records["flags"][i])):
                return False
    return True


def _scan_lines(jsonl_path: Path, kind: str, start: int) -> Iterator[bytes]:
    """The packed index record of each line of ``jsonl_path`` from byte ``start`` on (parsing each), blank lines
    skipped. A torn last line raises FormatError (a writer repairs it first: repair_jsonl)."""
    with open(jsonl_path, "rb") as f:
        f.seek(start)
        offset = start
        for line in f:
            size = len(line)
            if line.strip():
                if not line.endswith(b"\n"):
                    raise FormatError(f"{jsonl_path}: torn last line (no newline, at byte {offset}); run the stage "
                                      "that writes it again to repair it")
                where = f"{jsonl_path} (line at byte {offset})"
                try:
                    d = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise FormatError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})") from None
                if not isinstance(d, dict):
                    raise FormatError(f"{where}: not a JSON object")
                key, num_tokens, flags = describe_record(kind, d, where)
                yield _ROW_INDEX_RECORD.pack(offset, size, num_tokens, key, flags)
            offset += size


def _record_chunks(records: np.ndarray) -> Iterator[bytes]:
    for start in range(0, len(records), 1 << 20):  # a memory map copied a few MB at a time
        yield np.ascontiguousarray(records[start: start + (1 << 20)]).tobytes()


def _write_index_atomic(index_path: Path, kind: str, parts) -> None:
    """Write an index file from its records, given as byte strings (packed records, in order)."""
    tmp = tmp_path_for(index_path)
    try:
        with open(tmp, "wb") as f:
            f.write(_index_header(kind))
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, index_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def open_row_index(jsonl_path: Path, kind: str, *, missing_ok: bool = False) -> RowIndex:
    """The index of a JSONL file, checked against it and brought up to date.

    A missing index, or one that no longer describes the file (the file replaced or edited) is rebuilt by parsing
    the file once, streamed into a new index file (atomically); one that stops short of the file's end (a crash
    after a line, before its index record) is completed by parsing the lines past its end. Records past the file's
    end (lost by a power cut with their lines) are dropped. Where the index cannot be saved (a read-only copy) it
    is kept in this process's memory. ``missing_ok``: an absent JSONL file is an empty index instead of an error."""
    jsonl_path = Path(jsonl_path)
    index_path = row_index_path(jsonl_path)
    if not jsonl_path.exists():
        if missing_ok:
            return RowIndex(jsonl_path, kind, _empty_records())
        raise FileNotFoundError(f"{jsonl_path} not found")
    size = jsonl_path.stat().st_size
    records, whole = _read_index_file(index_path, kind)
    kept = records
    if records is not None:
        # records whose line ends within the file (lines end in ascending order: a binary search, no array)
        within = bisect.bisect_right(range(len(records)), size,
                                     key=lambda i: int(records["offset"][i]) + int(records["num_bytes"][i]))
        kept = records[:within]
        if not _index_describes(jsonl_path, kind, kept):
            log.warning("%s does not describe %s any more (the file was replaced or edited): rebuilding it",
                        index_path, jsonl_path)
            kept = None
    started = time.monotonic()
    if kept is None:
        parts, tail_from, rebuilt = [], 0, True
    else:
        end = int(kept["offset"][-1]) + int(kept["num_bytes"][-1]) if len(kept) else 0
        parts, tail_from, rebuilt = _record_chunks(kept), end, False
    tail = _scan_lines(jsonl_path, kind, tail_from)
    if not rebuilt:
        first = next(tail, None)
        if first is None and len(kept) == len(records) and whole:
            return RowIndex(jsonl_path, kind, kept)  # up to date
        tail = itertools.chain([first] if first is not None else [], tail)
    try:
        _write_index_atomic(index_path, kind, itertools.chain(parts, tail))
    except OSError as e:  # a read-only copy of the data: the index is kept in memory for this process
        log.warning("could not save %s (%s): kept in memory", index_path, e)
        buf = bytearray(b"".join(_record_chunks(kept)) if kept is not None else b"")
        for record in _scan_lines(jsonl_path, kind, tail_from):
            buf += record
        return RowIndex(jsonl_path, kind, np.frombuffer(bytes(buf), dtype=ROW_INDEX_DTYPE))
    records, _ = _read_index_file(index_path, kind)
    if rebuilt:
        log.info("indexed %s: %d rows in %.1f s (%s)", jsonl_path, len(records), time.monotonic() - started,
                 index_path.name)
    return RowIndex(jsonl_path, kind, records)


class IndexedJsonlWriter:
    """Writes records to a JSONL file and its row index in step: each record one line, then its index record.

    Appending (default): continues the file (a torn last line repaired, the index brought up to date first); every
    line is flushed as it is written, the index records at each fsync and on close (after a crash the next open
    indexes the lines past the index's end). ``new=True``: writes a fresh file and index under temporary names;
    ``commit()`` puts them in place (the old index removed first, so an index is never left beside a file it does
    not describe); closing without ``commit()`` deletes them."""

    def __init__(self, path: Path, kind: str, *, new: bool = False, fsync_every: int = 64):
        if kind not in ROW_INDEX_KINDS:
            raise ValueError(f"unknown row index kind {kind!r}")
        self.path, self.kind, self.new = Path(path), kind, new
        self.index_path = row_index_path(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows = 0  # records written by this writer
        self._fsync_every, self._since_sync = fsync_every, 0
        self._committed = False
        if new:
            self._data_path, self._index_target = tmp_path_for(self.path), tmp_path_for(self.index_path)
            self._data = open(self._data_path, "wb")
            self._index = open(self._index_target, "wb")
            self._index.write(_index_header(kind))
            self._size = 0
        else:
            self._data_path, self._index_target = self.path, self.index_path
            repair_jsonl(self.path)
            if self.path.exists():
                open_row_index(self.path, kind).close()  # brought up to date with the file, saved
            else:
                self.index_path.unlink(missing_ok=True)  # an index left without its file
                _write_index_atomic(self.index_path, kind, ())
            self._data = open(self.path, "ab")
            self._index = open(self.index_path, "ab")
            self._size = self.path.stat().st_size if self.path.exists() else 0

    def write(self, record: dict) -> None:
        key, num_tokens, flags = describe_record(self.kind, record, str(self.path))
        self.write_line((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"), key, num_tokens, flags)

    def write_line(self, line: bytes, key: int, num_tokens: int, flags: int = 0) -> None:
        """Write one already serialised record (``json.dumps(record, ensure_ascii=False) + "\\n"``, UTF-8) with the
        fields of its index record (describe_record)."""
        self._data.write(line)
        if not self.new:
            self._data.flush()
        self._index.write(_ROW_INDEX_RECORD.pack(self._size, len(line), num_tokens, key, flags))
        self._size += len(line)
        self.rows += 1
        self._since_sync += 1
        if not self.new and self._since_sync >= self._fsync_every:
            self._sync()

    def _sync(self) -> None:
        self._data.flush()
        os.fsync(self._data.fileno())
        self._index.flush()
        self._since_sync = 0

    def commit(self) -> None:
        """new=True: put the file and its index in place (the old index removed first). Appending: close."""
        if not self.new:
            self.close()
            return
        for f in (self._data, self._index):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        self.index_path.unlink(missing_ok=True)
        os.replace(self._data_path, self.path)
        os.replace(self._index_target, self.index_path)
        self._committed = True

    def close(self) -> None:
        if self._data.closed:
            return
        if self.new and not self._committed:
            self._data.close()
            self._index.close()
            self._data_path.unlink(missing_ok=True)
            self._index_target.unlink(missing_ok=True)
            return
        self._sync()
        self._data.close()
        self._index.close()

    def __enter__(self) -> "IndexedJsonlWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def rewrite_without(index: RowIndex, drop: np.ndarray) -> RowIndex:
    """Rewrite ``index``'s JSONL file without the rows where ``drop`` is True, copying the other lines' bytes as
    they are (no parsing), and its index; both atomically, the old index removed first. Returns the new index."""
    path, index_path = index.jsonl_path, row_index_path(index.jsonl_path)
    keep = ~np.asarray(drop, dtype=bool)
    records = np.array(index.records[keep])  # [kept]
    sizes = records["num_bytes"].astype(np.int64)
    old_offsets = records["offset"].copy()
    records["offset"] = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if len(records) else sizes
    tmp = tmp_path_for(path)
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for offset, size in zip(old_offsets.tolist(), sizes.tolist()):
            src.seek(offset)
            dst.write(src.read(size))
        dst.flush()
        os.fsync(dst.fileno())
    index.close()
    index_path.unlink(missing_ok=True)
    os.replace(tmp, path)
    _write_index_atomic(index_path, index.kind, _record_chunks(records))
    return RowIndex(path, index.kind, records)


def remove_indexed_jsonl(path: Path) -> None:
    """Delete a JSONL file and its index (an --overwrite)."""
    for p in (Path(path), row_index_path(path)):
        if p.exists():
            log.warning("--overwrite: deleting %s", p)
            p.unlink()


# ---------------------------------------------------------------------------------------------------------------
# Synthetic (stage 01b): responses.jsonl / data.jsonl / errors.jsonl, one id in at most one of responses / errors


def load_responses(path: Path) -> Iterator[Response]:
    for i, d in enumerate(read_jsonl(path), 1):
        yield Response.from_json(d, where=f"{path}:{i}")


def load_request_errors(path: Path) -> Iterator[RequestError]:
    for i, d in enumerate(read_jsonl(path), 1):
        try:
            yield RequestError(**d)
        except TypeError as e:
            raise FormatError(f"{path}:{i}: error record does not match the RequestError format ({e})") from None


CHECK_EXAMPLES = 20  # ids SyntheticCheck lists per problem (the counts are whole)


@dataclass
class SyntheticCheck:
    """Id bookkeeping of a synthetic/ folder against the ids that were asked for."""

    expected: int  # ids the run was asked to finish
    finished: int  # distinct ids in responses.jsonl
    errored: int  # distinct ids in errors.jsonl
    trained: int  # distinct ids in data.jsonl
    num_duplicated: int  # ids written twice in one file, or present in both responses and errors
    num_missing: int  # expected ids in neither responses nor errors
    num_data_without_response: int  # ids in data.jsonl with no response record
    duplicated: list[str] = field(default_factory=list)  # up to CHECK_EXAMPLES of each, for messages
    missing: list[str] = field(default_factory=list)
    data_without_response: list[str] = field(default_factory=list)

    def ok(self) -> bool:
        return not (self.num_duplicated or self.num_missing or self.num_data_without_response)

    def figures(self) -> str:
        return (f"ids sent {self.expected}, finished {self.finished}, errored {self.errored}, "
                f"in data {self.trained}, duplicated {self.num_duplicated}, missing {self.num_missing}")


def _unique_and_repeated(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct keys, sorted keys that occur more than once)."""
    distinct, counts = np.unique(np.asarray(keys, dtype=np.uint64), return_counts=True)
    return distinct, distinct[counts > 1]


def _jsonl_ids(path: Path) -> Iterator[str]:
    return (d["id"] for d in read_jsonl(path)) if Path(path).exists() else iter(())


def _jsonl_id_keys(path: Path) -> np.ndarray:
    """uint64 [n]: the keys of the ids of a JSONL file without an index (errors.jsonl), in file order."""
    keys = array.array("Q", (id_key(i) for i in _jsonl_ids(path)))
    return np.frombuffer(keys, dtype=np.uint64)


def check_synthetic(dd: "DataDir", expected: "list[str] | RowIndex") -> SyntheticCheck:
    """Every expected id in exactly one of responses/errors, none twice; every data row backed by a response.

    ``expected``: the ids asked for, as a list or as the questions' RowIndex (what 01b passes: no id is held as a
    string). Works on the id keys of the files' row indexes: arrays, 8 bytes an id."""
    responses = open_row_index(dd.responses, "responses", missing_ok=True)
    data = open_row_index(dd.synthetic_data, "rows", missing_ok=True)
    r_keys, r_dup = _unique_and_repeated(responses.keys)
    answered = KeySet(r_keys, sorted_unique=True)
    e_keys, e_dup = _unique_and_repeated(_jsonl_id_keys(dd.synthetic_errors))
    d_keys, d_dup = _unique_and_repeated(data.keys)
    duplicated = np.union1d(np.union1d(r_dup, e_dup), np.union1d(d_dup, e_keys[answered.contains(e_keys)]))
    without = d_keys[~answered.contains(d_keys)]
    trained, errored = int(d_keys.size), int(e_keys.size)
    del d_keys  # one array of every id at a time besides the answered ones
    expected_distinct = np.unique(expected.keys if isinstance(expected, RowIndex) else id_keys(expected))
    missing = expected_distinct[~answered.contains(expected_distinct)]
    missing = missing[~KeySet(e_keys, sorted_unique=True).contains(missing)]

    def ids_of(keys: np.ndarray, *sources) -> list[str]:
        """The ids of the first CHECK_EXAMPLES keys, read from the first source that holds them: a RowIndex, or a
        function giving ids (read only when a key is in no index)."""
        out = []
        for key in keys[:CHECK_EXAMPLES].tolist():
            for source in sources:
                if isinstance(source, RowIndex):
                    at = int(source.find(np.array([key], dtype=np.uint64))[0])
                    found = source.record(at)["id"] if at >= 0 else None
                else:
                    found = next((i for i in source() if id_key(i) == key), None)
                if found is not None:
                    out.append(found)
                    break
        return out

    expected_ids = expected if isinstance(expected, RowIndex) else (lambda: iter(expected))
    return SyntheticCheck(expected=int(expected_distinct.size), finished=len(answered), errored=errored,
                          trained=trained, num_duplicated=int(duplicated.size), num_missing=int(missing.size),
                          num_data_without_response=int(without.size),
                          duplicated=ids_of(duplicated, responses, data, lambda: _jsonl_ids(dd.synthetic_errors)),
                          missing=ids_of(missing, expected_ids), data_without_response=ids_of(without, data))


# ---------------------------------------------------------------------------------------------------------------
# Provenance: a small JSON beside each stage's output


def _git_revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def package_versions(names: tuple[str, ...] = ("torch", "transformers", "datasets", "speculators", "vllm")) -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in names:
        for dist in (name, f"{name}-cpu"):
            try:
                out[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def write_provenance(path: Path, *, stage: str, config_hash: str, config: dict, inputs: list[str],
                     counts: dict, started: float) -> None:
    atomic_write_json(
        path,
        {
            "format_version": FORMAT_VERSION,
            "stage": stage,
            "config_hash": config_hash,
            "config": config,
            "argv": sys.argv,
            "git_revision": _git_revision(),
            "packages": package_versions(),
            "inputs": inputs,
            "counts": counts,
            "started": _dt.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
            "finished": _dt.datetime.now().isoformat(timespec="seconds"),
            "elapsed_s": round(time.time() - started, 1),
        },
    )


def read_provenance(path: Path) -> dict | None:
    path = Path(path)
    if not path.exists():
        return None
    return json.loads(path.read_text())


def write_synthetic_provenance(dd: DataDir, *, config_hash: str, config: dict, counts: dict,
                               started: float) -> None:
    """Mark synthetic/ as a finished 01b output: its provenance, with the size of data.jsonl as finished."""
    data_bytes = dd.synthetic_data.stat().st_size if dd.synthetic_data.exists() else 0
    write_provenance(dd.provenance(dd.synthetic), stage="generate", config_hash=config_hash, config=config,
                     inputs=[str(dd.questions)], counts={**counts, "data_bytes": data_bytes}, started=started)


def check_synthetic_finished(dd: DataDir) -> None:
    """Raise FormatError unless synthetic/ is a finished 01b output.

    Stage 01b writes synthetic/provenance.json (with the size of data.jsonl) only when every id finished or was
    accepted as permanently bad, and deletes it before a rerun adds to the folder; anything else is partial."""
    prov = read_provenance(dd.provenance(dd.synthetic))
    fix = ("rerun 01b_generate_synthetic.py with the same settings until it exits 0 (finished ids are not sent "
           "again), or read prepared/ with --input prepared")
    if prov is None:
        raise FormatError(f"{dd.synthetic} is not a finished stage 01b output (no {dd.provenance(dd.synthetic).name}: "
                          f"01b stopped with errors, was interrupted, or is still running): {fix}")
    size = prov.get("counts", {}).get("data_bytes")
    now = dd.synthetic_data.stat().st_size if dd.synthetic_data.exists() else None
    if size is None or now != size:
        raise FormatError(f"{dd.synthetic_data} is not what stage 01b finished ({size} bytes then, {now} now): {fix}")


# ---------------------------------------------------------------------------------------------------------------
# Hidden states (stage 02): the layout `speculators train --data-path <data_dir>/hidden_states` trains from
#
#   hidden_states/                        D: an HF `save_to_disk` dataset, torch format, one row per written sample
#     data-*.arrow state.json dataset_info.json   columns input_ids int64 [T], loss_mask int64 [T], seq_len int
#     hidden_states/hs_{i}.safetensors    i = row index in D. hidden_states [T, 4, H]: the aux layer states in
#                                         ascending layer id (id k = residual stream entering decoder layer k),
#                                         then the last decoder layer's output before the final norm; token_ids
#                                         int64 [T] (= the row's input_ids). bf16: bfloat16. fp8: float8_e4m3fn
#                                         values + hidden_states_scales float32 [T, 4, 1], one scale per token and
#                                         state (hs_connectors' FP8 key and dequantisation, values * scales, which
#                                         broadcasts; `--hidden-states-backend fp8` dequantises on read).
#                                         safetensors metadata: layer_ids (the ids above, as captured), num_layers,
#                                         all_finite (hs_file_metadata; 02 and 04 check them per file)
#     manifest.json                       written last; its presence means the stage finished (HiddenStatesManifest,
#                                         format_version HS_FORMAT_VERSION: readers refuse an older one)
#     errors.jsonl                        samples not written, one DroppedRow each: content that is wrong for good
#                                         (non-finite states, a file that keeps not holding the row), and samples
#                                         left open within --max-error-share (reason "retryable: ..."; counted in
#                                         manifest.num_retryable, a rerun of 02 retries them)
#     work/shard_{w}/                     during a run: worker w's hs_{k}.safetensors + done.jsonl journal
#                                         (HsJournalEntry); finalize renames the files into hidden_states/. The
#                                         vLLM backend's requests write hs_{k}.attempt-{n}-{tag}.safetensors first
#                                         (hs_attempt_file), renamed to hs_{k} once checked; others are junk
#     work/finalize_plan.npy              the finalize plan: which shard file becomes which hs_{i}, written before the
#                                         first rename and kept with the output (an interrupted finalize, or a rerun
#                                         that retries samples left open, puts every file back by it first): int64
#                                         [N, 3] (input position, shard, local index of hs_0 .. hs_{N-1}), 24 bytes a
#                                         sample, numpy's .npy (no pickle; not .safetensors, which would read as a
#                                         sample file in work/). work/finalize.json: the same as JSON, before issue 27

HS_FORMAT_VERSION = 2  # of hidden_states/ (manifest.json's format_version). 2: every sample file carries
# hs_file_metadata (layer ids, verifier depth, finite flag), which 02 and 04 check; 1: written before that
# (eagle3pipe before 2026-12-01 22:32), its files may lack it: 04 refuses it, 02 upgrades it after checking each file

HS_KEY = "hidden_states"  # [T, num_states, H]
HS_TOKEN_IDS_KEY = "token_ids"  # int64 [T]
HS_SCALES_KEY = "hidden_states_scales"  # float32 [T, n, 1], fp8 storage only (same key as hs_connectors.fp8_utils)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# safetensors metadata of every sample file (both backends write it; stage 02 and stage 04 check it per file)
HS_META_FINITE = "all_finite"  # "1", or "0" when a state is NaN/Inf (the vLLM connector's; the client drops those)
HS_META_LAYER_IDS = "layer_ids"  # JSON list: the ids of the stored states as captured, e.g. "[2, 30, 58, 61]"
HS_META_NUM_LAYERS = "num_layers"  # decoder layers of the verifier that computed them, e.g. "61"
HS_STORAGE_DTYPES = ("bf16", "fp8")
HS_ROW_COLUMNS = ("input_ids", "loss_mask", "seq_len")


HS_ATTEMPT_INFIX = ".attempt-"  # in the name of a request attempt's file (and its lock): never a sample's own file


def hs_attempt_file(final: Path, attempt: int, tag: str) -> Path:
    """The file one request attempt for ``final`` asks the server to write: a name of its own (``tag``: unique to
    the attempt), so the late write of an attempt the client gave up on (vLLM's connector also saves aborted
    requests) never lands on another attempt's checked file, nor on ``final``; renamed to ``final`` once checked."""
    final = Path(final)
    return final.with_name(f"{final.stem}{HS_ATTEMPT_INFIX}{attempt}-{tag}{final.suffix}")


def is_hs_attempt_file(path: Path) -> bool:
    """A request attempt's file or lock (``hs_attempt_file``): never read as a sample, deleted when found."""
    return HS_ATTEMPT_INFIX in Path(path).name


HS_FILE_HEADER_BYTES = 320  # upper bound of one sample file's safetensors header (measured: 152-264 B)


def hs_bytes_per_token(num_states: int, hidden_size: int, storage_dtype: str) -> int:
    """Bytes one token costs on disk (states + token id, + scales for fp8), safetensors header excluded. Exact for
    what ``hidden_states_tensors`` writes: bf16 storage is bf16 whatever dtype the verifier ran in."""
    if storage_dtype == "fp8":
        return num_states * hidden_size + 4 * num_states + 8
    return num_states * hidden_size * 2 + 8


def hs_bytes_estimate(num_tokens: int, num_samples: int, num_states: int, hidden_size: int,
                      storage_dtype: str) -> int:
    """Upper bound of the bytes ``num_samples`` sample files of ``num_tokens`` tokens in all take on disk."""
    return num_tokens * hs_bytes_per_token(num_states, hidden_size, storage_dtype) + num_samples * HS_FILE_HEADER_BYTES


def quantize_hidden_states(hidden_states):
    """[..., n, H] float -> (float8_e4m3fn [..., n, H], float32 scales [..., n, 1]): one scale per token and state.

    hs_connectors' rule keeps one scale per token across all states; DeepSeek-family residual streams grow large
    outlier channels in late layers and the final state, and a scale shared with them pushes the early state's
    ordinary values towards e4m3's subnormal range. Per (token, state) costs 4 bytes per state and is never
    coarser (BENCHMARKS.md, "fp8 scales"). hs_connectors' reader dequantises it unchanged (values * scales
    broadcasts). Runs on any device (the GPU, before the copy out) and needs only torch (the vLLM connector too)."""
    import torch

    fp32 = hidden_states.float()
    scales = (fp32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (fp32 / scales).to(torch.float8_e4m3fn), scales


def hidden_states_tensors(hidden_states, token_ids, storage_dtype: str = "bf16", scales=None) -> dict:
    """The tensors of one sample file. ``hidden_states`` [T, n, H] in the model dtype (stored as bf16 for bf16
    storage, whatever the model dtype), or already fp8 with ``scales`` given (quantised on the GPU); ``token_ids``
    [T]. CPU bf16 tensors are used as they are (no copy)."""
    import torch

    if storage_dtype not in HS_STORAGE_DTYPES:
        raise ValueError(f"storage dtype must be one of {HS_STORAGE_DTYPES}, got {storage_dtype!r}")
    if hidden_states.ndim != 3 or hidden_states.shape[0] != token_ids.shape[0]:
        raise ValueError(f"hidden_states {tuple(hidden_states.shape)} must be [T, n, H] with T = {token_ids.shape[0]}")
    tensors = {HS_TOKEN_IDS_KEY: token_ids.to(torch.int64).contiguous().cpu()}
    if storage_dtype == "fp8":
        if hidden_states.dtype != torch.float8_e4m3fn:
            hidden_states, scales = quantize_hidden_states(hidden_states)
        elif scales is None:
            raise ValueError("fp8 hidden_states given without their scales")
        tensors[HS_SCALES_KEY] = scales.to(torch.float32).contiguous().cpu()
    else:
        hidden_states = hidden_states.to(torch.bfloat16)  # what the manifest and the disk preflight say
    tensors[HS_KEY] = hidden_states.contiguous().cpu()
    return tensors


def encode_hidden_states(hidden_states, token_ids, storage_dtype: str = "bf16", scales=None) -> bytes:
    """safetensors bytes of one sample (see ``hidden_states_tensors``)."""
    from safetensors.torch import save as st_save

    return st_save(hidden_states_tensors(hidden_states, token_ids, storage_dtype, scales))


# safetensors' dtype names, ranked as its serializer orders tensors in a file (dtype descending, then name), so that
# save_tensors_atomic writes exactly the bytes of safetensors.torch.save (tests/test_records.py pins this).
_SAFETENSORS_DTYPES = ("F8_E4M3", "F16", "BF16", "F32", "I64")  # ascending rank


def _safetensors_dtype(t) -> str:
    import torch

    names = {torch.float8_e4m3fn: "F8_E4M3", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
             torch.int64: "I64"}
    if t.dtype not in names:
        raise ValueError(f"save_tensors_atomic: dtype {t.dtype} not supported (add its safetensors rank)")
    return names[t.dtype]


def save_tensors_atomic(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> int:
    """Write ``tensors`` (contiguous CPU tensors) as a safetensors file: temporary name, fsync, rename. Returns bytes.

    The bytes equal ``safetensors.torch.save(tensors, metadata)``; they go to disk with ``os.write`` straight from
    the tensors' memory (pinned host buffers in stage 02), which releases the GIL for the whole write and makes no
    copy (``save`` + a bytes write copied every sample twice in Python: 0.64 GB/s per thread on the H200)."""
    import struct

    import torch

    items = sorted(tensors.items(), key=lambda kv: (-_SAFETENSORS_DTYPES.index(_safetensors_dtype(kv[1])), kv[0]))
    header: dict = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for name, t in items:
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"save_tensors_atomic: tensor {name!r} must be a contiguous CPU tensor")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _safetensors_dtype(t), "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads its header to 8 bytes
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        chunks = [struct.pack("<Q", len(head)) + head]
        chunks += [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for _, t in items if t.numel()]
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return 8 + len(head) + offset


def hs_layer_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    """The ids of a sample file's states, in file order: the states entering the aux layers (ascending, as vLLM
    captures them), then ``num_layers`` (the last decoder layer's output before the final norm)."""
    return sorted(set(aux_layer_ids)) + [num_layers]


def hs_file_metadata(layer_ids: list[int], num_layers: int, finite: bool = True) -> dict[str, str]:
    """The metadata of one sample file: what was captured, from how deep a verifier, and whether it is finite."""
    return {HS_META_LAYER_IDS: json.dumps([int(k) for k in layer_ids]), HS_META_NUM_LAYERS: str(int(num_layers)),
            HS_META_FINITE: "1" if finite else "0"}


def check_hs_file_metadata(path: Path, metadata: dict[str, str], aux_layer_ids: list[int], num_layers: int) -> bool:
    """Whether the file's states are all finite, after checking that its metadata names the layers the config
    stores (``hs_layer_ids``) from a ``num_layers``-layer verifier. FormatError naming both otherwise, or when a key
    is missing (a file not written by this pipeline's writers: vLLM's own connector writes none)."""
    missing = [k for k in (HS_META_LAYER_IDS, HS_META_NUM_LAYERS, HS_META_FINITE) if k not in metadata]
    if missing:
        raise FormatError(f"{path}: its metadata lacks {missing} (has {sorted(metadata)}): not written by "
                          "eagle3pipe's stage 02 (the vLLM server's connector must be eagle3pipe.vllm_connector)")
    want = hs_layer_ids(aux_layer_ids, num_layers)
    try:
        got, depth = json.loads(metadata[HS_META_LAYER_IDS]), int(metadata[HS_META_NUM_LAYERS])
    except ValueError:
        raise FormatError(f"{path}: unreadable layer metadata {metadata}") from None
    if got != want or depth != num_layers:
        raise FormatError(f"{path}: states of layer ids {got} from a {depth}-layer verifier, but the config stores "
                          f"{want} of a {num_layers}-layer one (aux_layer_ids {list(aux_layer_ids)} + the final "
                          "state): the server's eagle_aux_hidden_state_layer_ids are not the config's")
    return metadata[HS_META_FINITE] == "1"


def read_hidden_states_metadata(path: Path) -> dict[str, str]:
    """The safetensors metadata of one sample file (its header only)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return f.metadata() or {}
    except (OSError, ValueError, RuntimeError) as e:
        raise FormatError(f"{path}: not a readable safetensors file ({e})") from None


def save_hidden_states(path: Path, hidden_states, token_ids, storage_dtype: str = "bf16", scales=None,
                       metadata: dict[str, str] | None = None) -> int:
    """Write one sample atomically (temporary name, fsync, rename), with ``hs_file_metadata``. Returns the bytes."""
    return save_tensors_atomic(path, hidden_states_tensors(hidden_states, token_ids, storage_dtype, scales), metadata)


def load_hidden_states(path: Path, dtype=None) -> dict:
    """{"hidden_states": [T, n, H], "token_ids": [T]}; fp8 files are dequantised (to ``dtype``, default bf16) the
    way hs_connectors' FP8Transfer does it, so callers see the same values the trainer sees."""
    import torch
    from hs_connectors.fp8_utils import dequantize_fp8_tensor
    from safetensors.torch import load_file

    path = Path(path)
    try:
        data = load_file(str(path))
    except Exception as e:
        raise FormatError(f"{path}: not a readable safetensors file ({e})") from None
    for key in (HS_KEY, HS_TOKEN_IDS_KEY):
        if key not in data:
            raise FormatError(f"{path}: lacks tensor '{key}' (has {sorted(data)})")
    if HS_SCALES_KEY in data:
        scales = data.pop(HS_SCALES_KEY)
        data[HS_KEY] = dequantize_fp8_tensor(data[HS_KEY], scales, dtype=dtype or torch.bfloat16)
    elif dtype is not None:
        data[HS_KEY] = data[HS_KEY].to(dtype)
    return data


HS_FILE_DTYPES = {"bf16": "BF16", "fp8": "F8_E4M3"}  # storage dtype -> safetensors' name of hidden_states' dtype


def read_hidden_states_header(path: Path) -> tuple[list[int], tuple[int, ...], str, dict[str, str]]:
    """(token ids, hidden_states shape, its safetensors dtype name, file metadata) of one sample file, without
    reading its states."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
            if not {HS_KEY, HS_TOKEN_IDS_KEY} <= keys:
                raise FormatError(f"{path}: lacks tensor(s) {sorted({HS_KEY, HS_TOKEN_IDS_KEY} - keys)}")
            states = f.get_slice(HS_KEY)
            return (f.get_tensor(HS_TOKEN_IDS_KEY).tolist(), tuple(states.get_shape()), states.get_dtype(),
                    f.metadata() or {})
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # a truncated, foreign or junk file
        raise FormatError(f"{path}: not a readable safetensors file ({e})") from None


def check_hidden_states_file(path: Path, token_ids: list[int] | None = None, num_states: int | None = None,
                             hidden_size: int | None = None) -> dict:
    """Load and check one sample file (shape, token ids, finite values); returns it. Raises FormatError."""
    import torch

    data = load_hidden_states(path)
    hs, ids = data[HS_KEY], data[HS_TOKEN_IDS_KEY]
    if hs.ndim != 3 or hs.shape[0] != ids.shape[0]:
        raise FormatError(f"{path}: hidden_states {tuple(hs.shape)} does not match token_ids {tuple(ids.shape)}")
    if num_states is not None and hs.shape[1] != num_states:
        raise FormatError(f"{path}: {hs.shape[1]} states per token, expected {num_states}")
    if hidden_size is not None and hs.shape[2] != hidden_size:
        raise FormatError(f"{path}: hidden size {hs.shape[2]}, expected {hidden_size}")
    if token_ids is not None and ids.tolist() != list(token_ids):
        raise FormatError(f"{path}: token_ids differ from the row's input_ids")
    if not bool(torch.isfinite(hs).all()):
        raise FormatError(f"{path}: hidden_states hold NaN/Inf")
    return data


@dataclass
class HsJournalEntry:
    """One sample a worker finished: written under work/shard_{w}/hs_{local_index}.safetensors, or dropped."""

    position: int  # 0-based line number of the sample in the input data.jsonl
    id: str
    local_index: int  # file index inside the shard dir; -1 when dropped
    num_tokens: int
    bytes: int
    reason: str = ""  # why it was dropped (local_index -1), e.g. "non-finite hidden states"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "HsJournalEntry":
        return cls(**d)


def load_hs_journal(path: Path) -> list[HsJournalEntry]:
    path = Path(path)
    if not path.exists():
        return []
    repair_jsonl(path)
    return [HsJournalEntry.from_json(d) for d in read_jsonl(path)]


HS_JOURNAL_DTYPE = np.dtype([("position", "<i8"), ("shard", "<i4"), ("local_index", "<i4"), ("num_tokens", "<u4"),
                             ("bytes", "<i8")])  # packed: 28 bytes an entry


def load_hs_journal_arrays(path: Path, shard: int) -> tuple[np.ndarray, dict[int, tuple[str, str]]]:
    """A shard's journal as stage 02's resume and finalize keep it at 10^6 samples: an HS_JOURNAL_DTYPE array in
    journal order (28 bytes an entry, no HsJournalEntry per sample), and the (id, reason) of each dropped entry
    (local_index -1; few) by position, the first of a position kept. A torn last line is repaired first."""
    path = Path(path)
    if not path.exists():
        return np.empty(0, dtype=HS_JOURNAL_DTYPE), {}
    repair_jsonl(path)
    with open(path, "rb") as f:  # lines, counted first: the array is allocated once, at its size
        lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 16), b""))
    out = np.empty(lines, dtype=HS_JOURNAL_DTYPE)
    out["shard"] = shard
    dropped: dict[int, tuple[str, str]] = {}
    n = 0
    for i, d in enumerate(read_jsonl(path), 1):
        try:
            position, local_index = int(d["position"]), int(d["local_index"])
            out[n] = (position, shard, local_index, int(d["num_tokens"]), int(d["bytes"]))
            if local_index < 0:
                dropped.setdefault(position, (str(d["id"]), str(d.get("reason", ""))))
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise FormatError(f"{path}:{i}: not a journal entry (HsJournalEntry: {e})") from None
        n += 1
    return out[:n], dropped


def forget_hs_journal_entries(path: Path, positions: set[int]) -> None:
    """Rewrite a shard's journal (atomically) without the entries of ``positions``: the next run redoes them."""
    repair_jsonl(Path(path))
    kept = (d for d in read_jsonl(Path(path)) if d["position"] not in positions)  # streamed: 10^6 entries
    write_jsonl_atomic(Path(path), kept)


@dataclass
class HiddenStatesManifest:
    """manifest.json of hidden_states/: what was extracted, from what, how it is stored."""

    verifier: str
    num_layers: int  # decoder layers of the verifier; the final state is vLLM layer id num_layers
    aux_layer_ids: list[int]  # state entering decoder layer k (vLLM convention), in the order stored
    hidden_size: int
    model_dtype: str  # dtype the verifier ran in
    storage_dtype: str  # "bf16" or "fp8"
    num_samples: int  # rows in the dataset = files in hidden_states/
    num_tokens: int
    num_dropped: int  # samples listed in errors.jsonl
    bytes: int  # bytes of all sample files
    input: str  # the data.jsonl extracted
    config_hash: str  # hash of the shared + extract config sections that produced this
    states: list[str] = field(default_factory=list)  # what each of the n states is, e.g. "enter layer 2", "final"
    num_retryable: int = 0  # of num_dropped: samples a transient failure left open (a rerun of 02 retries them)
    format_version: int = HS_FORMAT_VERSION

    def to_json(self) -> dict:
        return asdict(self)


def save_hs_manifest(path: Path, manifest: HiddenStatesManifest) -> None:
    atomic_write_json(path, manifest.to_json())


def load_hs_manifest(path: Path, any_version: bool = False) -> HiddenStatesManifest | None:
    """The manifest of a finished hidden_states/ (None: not finished). One of an older format (HS_FORMAT_VERSION) is
    refused, naming stage 02 as the fix; stage 02 itself reads it with ``any_version`` (to upgrade it)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        manifest = HiddenStatesManifest(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise FormatError(f"{path}: not a hidden-states manifest ({e})") from None
    if manifest.format_version > HS_FORMAT_VERSION:
        raise FormatError(f"{path}: hidden states of format {manifest.format_version}, newer than this eagle3pipe "
                          f"reads ({HS_FORMAT_VERSION}): update eagle3pipe")
    if manifest.format_version < HS_FORMAT_VERSION and not any_version:
        raise FormatError(
            f"{path}: hidden states of format {manifest.format_version}, written before each sample file recorded "
            f"the layer ids it holds (format {HS_FORMAT_VERSION}), so nothing can check its files: rerun "
            "02_extract_hidden_states.py with the same settings (it checks every file and upgrades the manifest "
            "when each carries its layer ids), or with --overwrite to extract them again")
    return manifest


def save_hs_finalize_plan(path: Path, files) -> None:
    """Stage 02's finalize plan: ``files[i]`` = (input position, shard, local index) of the shard file that becomes
    hs_{i} (int64 [N, 3], or a list of triples). Written atomically before the first rename, so a rerun knows where
    each file went; 24 bytes a sample on disk and in memory (.npy, no pickle)."""
    files = np.ascontiguousarray(np.asarray(files, dtype=np.int64).reshape(-1, 3))
    tmp = tmp_path_for(path)
    try:
        with open(tmp, "wb") as f:
            np.save(f, files, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_hs_finalize_plan(path: Path) -> np.ndarray | None:
    """The plan ``save_hs_finalize_plan`` wrote, int64 [N, 3] (None: there is none). A ``.json`` path is read as
    the plan of an eagle3pipe before issue 27 (``DataDir.hs_finalize_plan_v1``)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        if path.suffix == ".json":
            files = np.asarray(json.loads(path.read_text())["files"], dtype=np.int64)
        else:
            files = np.load(path, allow_pickle=False)
        if files.size and (files.dtype != np.int64 or files.ndim != 2 or files.shape[1] != 3):
            raise ValueError(f"an array of {files.dtype} {list(files.shape)}, not int64 [N, 3]")
        return files.reshape(-1, 3)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, OSError, EOFError) as e:
        raise FormatError(f"{path}: not a finalize plan ({e}); rerun stage 02 with --overwrite") from None


def check_hs_manifest(manifest: HiddenStatesManifest, **expected) -> list[str]:
    """Fields of ``manifest`` that differ from ``expected`` (e.g. hidden_size=7168), as 'field: got X, want Y'."""
    return [f"{k}: got {getattr(manifest, k)!r}, want {v!r}" for k, v in expected.items() if getattr(manifest, k) != v]


HS_ROWS_WRITE_BATCH = 1024  # rows per Arrow record batch save_hs_rows writes (its memory whatever the row count)


HS_ROWS_IDENTITY_FILE = "rows_identity.json"  # beside a rows dataset 04 online wrote: what it was written from


def hs_rows_identity(src: Path, rows: "RowIndex") -> dict:
    """What a rows dataset is written from: the rows file (its path, size and modification time) and its row index
    (each row's place, length and id key, hashed), so that a dataset written from other rows is never reused."""
    st = Path(src).stat()
    return {"rows_file": str(Path(src).resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
            "rows": len(rows), "index_sha256": hashlib.sha256(np.ascontiguousarray(rows.records).tobytes()).hexdigest(),
            "format_version": FORMAT_VERSION}


def ensure_hs_rows(dataset_dir: Path, identity: dict, rows: Callable[[], Iterable]) -> bool:
    """The rows dataset of ``identity``'s rows in ``dataset_dir``: kept when the one there was written from them
    (its ``HS_ROWS_IDENTITY_FILE``, written last, says so), else written from ``rows()`` (``save_hs_rows``). Returns
    whether it was written. 04 online's start-up then reads no row at a --resume or a later run over the same
    rows (the rows dataset took ~0.9 s per 10^6 tokens to write, ~1.5 h at 6 x 10^9 tokens)."""
    dataset_dir = Path(dataset_dir)
    marker = dataset_dir / HS_ROWS_IDENTITY_FILE
    try:
        if json.loads(marker.read_text()) == identity and (dataset_dir / "state.json").is_file():
            return False
    except (OSError, ValueError):
        pass
    marker.unlink(missing_ok=True)  # a dataset being rewritten is no one's until its identity is written again
    dataset_dir.mkdir(parents=True, exist_ok=True)
    save_hs_rows(dataset_dir, rows())
    atomic_write_json(marker, identity)
    return True


def save_hs_rows(dataset_dir: Path, rows) -> None:
    """Write the speculators rows dataset (input_ids, loss_mask, seq_len; row i <-> hs_{i}) into ``dataset_dir``.
    ``rows``: (input_ids, loss_mask) pairs, any iterable: streamed into an Arrow file HS_ROWS_WRITE_BATCH rows at a
    time (a generator that reads each row when it is needed keeps the memory flat at 10^6 rows), each batch built
    as Arrow arrays of the schema ``Dataset.from_dict`` gives these columns (input_ids int32, as datasets stores a
    column of that name), from numpy: no per-token Python object, no type inferred.

    ``save_to_disk`` writes in place, so it goes to a temporary folder first and its files are renamed in, the
    Arrow shards before state.json: a crash leaves either the old dataset or the new one readable."""
    import shutil

    import pyarrow as pa
    from datasets import Dataset, Features, Sequence, Value
    from datasets.arrow_writer import ArrowWriter

    dataset_dir = Path(dataset_dir)
    features = Features({"input_ids": Sequence(Value("int32")), "loss_mask": Sequence(Value("int64")),
                         "seq_len": Value("int64")})
    schema = features.arrow_schema
    tmp = dataset_dir / f".rows.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    staging = tmp / "rows.arrow"  # streamed here, then saved as save_to_disk lays a dataset out (a copy)
    out = tmp / "dataset"

    def lists(parts: list[np.ndarray], offsets: np.ndarray, dtype) -> pa.ListArray:
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int64()), pa.array(np.concatenate(parts), dtype))

    writer = ArrowWriter(features=features, path=str(staging), writer_batch_size=HS_ROWS_WRITE_BATCH)
    try:
        ids_parts, mask_parts = [], []

        def flush() -> None:
            lengths = np.fromiter(map(len, ids_parts), dtype=np.int64, count=len(ids_parts))  # [b]
            offsets = np.zeros(len(ids_parts) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])  # [b + 1]
            # list<int32> with int64 offsets is large_list: cast to the schema's list (a batch holds < 2^31 tokens)
            table = pa.Table.from_arrays([lists(ids_parts, offsets, pa.int32()).cast(schema.field("input_ids").type),
                                          lists(mask_parts, offsets, pa.int64()).cast(schema.field("loss_mask").type),
                                          pa.array(lengths, pa.int64())], schema=schema)
            writer.write_table(table)
            ids_parts.clear()
            mask_parts.clear()

        for ids, mask in rows:
            ids_parts.append(np.asarray(ids, dtype=np.int32))
            mask_parts.append(np.asarray(mask, dtype=np.int64))
            if len(ids_parts) >= HS_ROWS_WRITE_BATCH:
                flush()
        if ids_parts:
            flush()
        writer.finalize()
    finally:
        writer.close()
    ds = Dataset.from_file(str(staging))
    ds.set_format(type="torch")  # what speculators' preprocessing leaves; its loader compares torch tensors
    ds.save_to_disk(str(out))
    del ds
    for old in dataset_dir.glob("data-*.arrow"):
        old.unlink()
    names = sorted(p.name for p in out.iterdir())
    for name in sorted(names, key=lambda n: n == "state.json"):
        os.replace(out / name, dataset_dir / name)
    shutil.rmtree(tmp, ignore_errors=True)


def load_hs_rows(dataset_dir: Path):
    """The rows dataset of ``dataset_dir`` (torch format), as speculators loads it."""
    from datasets import load_from_disk

    return load_from_disk(str(dataset_dir))
