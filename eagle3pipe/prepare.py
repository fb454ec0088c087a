"""Stage 01: chat datasets -> exact token ids, assistant-only loss masks, and the questions stage 01b will send.

Reads HF dataset ids or local .json/.jsonl/.parquet files through ``datasets`` (OpenAI ``messages`` role/content,
ShareGPT / open-perfectblend ``conversations`` from/value), renders each conversation with the verifier tokenizer's
own chat template, and writes under ``<data_dir>/prepared/``:

- ``data.jsonl``: TrainingRow per kept conversation (id, input_ids, loss_mask, source);
- ``questions.jsonl``: Question per conversation (messages cut at the last user turn), same id;
- ``errors.jsonl``: DroppedRow per row not kept (malformed, duplicate, too long), with row number and reason;
- ``provenance.json``: config, inputs, counts. A rerun with the same config skips; a different config refuses
  unless ``--overwrite``.

Ids are a hash of the source name and the normalised conversation, so reruns and later stages join on them.
Truncation policy for rows over ``max_seq_len`` tokens is explicit: ``drop`` (default, listed in errors.jsonl)
or ``truncate`` (keep the first max_seq_len tokens; a row left with no supervised token is dropped).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Iterator

from .chat import ChatError, load_tokenizer, normalize_messages, normalize_tools, question_messages
from .chat import resolve_special_ids, tokenize_with_loss_mask
from .cli import StageError
from .config import PipelineConfig
from .progress import Progress
from .records import DataDir, DroppedRow, Question, TrainingRow, read_provenance, write_jsonl_atomic
from .records import write_provenance

log = logging.getLogger(__name__)

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def conversation_id(source: str, messages: list[dict], tools: list[dict] | None = None) -> str:
    """Deterministic id: same source and conversation (and tools declared), same id, on every run and machine."""
    payload = json.dumps([source, messages] + ([tools] if tools else []), ensure_ascii=False, sort_keys=True)
    return hashlib.sha1(payload.encode()).hexdigest()[:16]


def source_name(spec: str) -> str:
    path = Path(spec)
    return path.stem if path.suffix in LOCAL_FORMATS else spec


def iter_dataset(spec: str, split: str) -> tuple[int | None, Iterator[tuple[int, dict | None, str]]]:
    """(row count if known, iterator of (row number, row or None, reason if unreadable)) for one dataset spec.

    Local JSON / JSON Lines files are read with ``json``, row by row, exactly as written: Arrow (``datasets``)
    would unify the rows' nested structures and fill keys a row lacks with nulls, which changes tool schemas and
    tool-call arguments, hence the rendered prompt. Parquet files, saved datasets and hub ids go through
    ``datasets``."""
    import datasets

    path = Path(spec)
    if path.suffix in LOCAL_FORMATS:
        if not path.is_file():
            raise FileNotFoundError(f"dataset file not found: {spec} (from --dataset)")
        if path.suffix == ".json":
            try:
                rows = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                return None, _iter_jsonl_lines(path)  # JSON Lines under a .json name
            if not isinstance(rows, list):
                raise StageError(f"{spec}: a .json dataset must hold a list of rows, got {type(rows).__name__}")
            return len(rows), ((i, row, "") if isinstance(row, dict) else (i, None, "row is not a JSON object")
                               for i, row in enumerate(rows))
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                total = sum(1 for line in f if line.strip())
            return total, _iter_jsonl_lines(path)
        try:
            ds = datasets.load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
        except Exception as e:
            raise StageError(f"{spec}: datasets could not read it: {e}") from e
    elif path.is_dir():
        ds = datasets.load_from_disk(str(path)) if (path / "dataset_info.json").exists() else \
            datasets.load_dataset(str(path), split=split)
    else:
        try:
            ds = datasets.load_dataset(spec, split=split)
        except Exception as e:
            raise StageError(f"dataset {spec!r} could not be loaded (not a local file; as an HF id: {e})") from e
    return len(ds), ((i, row, "") for i, row in enumerate(ds))


def _iter_jsonl_lines(path: Path) -> Iterator[tuple[int, dict | None, str]]:
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield i, None, f"not valid JSON ({e.msg})"
                continue
            yield (i, row, "") if isinstance(row, dict) else (i, None, "row is not a JSON object")


def run_prepare(cfg: PipelineConfig) -> dict:
    started = time.time()
    dd = DataDir(cfg.data_dir)
    config_hash = cfg.section_hash("prepare") + cfg.section_hash("shared")
    outputs = (dd.prepared_data, dd.questions, dd.prepared_errors)
    prev = read_provenance(dd.provenance(dd.prepared))
    if prev is not None and all(p.exists() for p in outputs):
        if prev.get("config_hash") == config_hash:
            log.info("prepared/ already made with this config (%s); skipping. Counts: %s", config_hash, prev["counts"])
            return prev["counts"]
        if not cfg.prepare.overwrite:
            raise StageError(
                f"{dd.prepared} was made with a different config (hash {prev.get('config_hash')} vs {config_hash}); "
                "pass --overwrite to rebuild it, or use another --data-dir"
            )

    tokenizer = load_tokenizer(cfg.tokenizer_path, cfg.shared.trust_remote_code)
    resolve_special_ids(tokenizer, cfg.shared.think_token_id, cfg.shared.response_token_id)
    thinking, max_len, cap = cfg.shared.thinking, cfg.shared.max_seq_len, cfg.prepare.max_samples

    rows: list[dict] = []
    questions: list[dict] = []
    dropped: list[dict] = []
    seen: set[str] = set()
    counts = {"rows_read": 0, "kept": 0, "questions": 0, "question_only": 0, "truncated": 0, "dropped": 0}
    for spec in cfg.prepare.dataset:
        source = source_name(spec)
        total, it = iter_dataset(spec, cfg.prepare.dataset_split)
        progress = Progress(total or 0, unit="rows", every_s=cfg.shared.progress_every_s, desc=f"Prepare {source}")
        for row_number, example, unreadable in it:
            if cap and counts["questions"] >= cap:
                break
            counts["rows_read"] += 1
            try:
                reason, row_id = _prepare_one(tokenizer, example, unreadable, source, seen, thinking, max_len,
                                              cfg.prepare.truncation, rows, questions, counts, cfg.shared.vocab_size)
            except _OutOfVocab as e:
                raise StageError(f"{spec} row {row_number} (id {e.row_id}): {e}; nothing was written") from None
            if reason:
                dropped.append(DroppedRow(source=source, row=row_number, reason=reason, id=row_id).to_json())
                counts["dropped"] += 1
            progress.update(1, errors=1 if reason else 0, kept=str(counts["kept"]))
        progress.close()

    write_jsonl_atomic(dd.prepared_data, rows)
    write_jsonl_atomic(dd.questions, questions)
    write_jsonl_atomic(dd.prepared_errors, dropped)
    write_provenance(dd.provenance(dd.prepared), stage="prepare", config_hash=config_hash, config=cfg.to_dict(),
                     inputs=list(cfg.prepare.dataset), counts=counts, started=started)
    by_reason: dict[str, int] = {}
    for d in dropped:
        key = d["reason"].split(" (")[0].split(":")[0]
        by_reason[key] = by_reason.get(key, 0) + 1
    log.info(
        "prepared %d training rows and %d questions from %d rows into %s; dropped %d (listed in %s)%s; "
        "truncated %d; elapsed %.1fs",
        counts["kept"], counts["questions"], counts["rows_read"], dd.prepared, counts["dropped"], dd.prepared_errors,
        f" by reason: {by_reason}" if by_reason else "", counts["truncated"], time.time() - started,
    )
    return counts


class _OutOfVocab(Exception):
    """A row holds an id the verifier has no embedding row for; stops the stage (see _prepare_one)."""

    def __init__(self, message: str, row_id: str):
        super().__init__(message)
        self.row_id = row_id


def _prepare_one(tokenizer, example, unreadable, source, seen, thinking, max_len, truncation, rows, questions,
                 counts, vocab_size) -> tuple[str, str]:
    """Process one dataset row; append its outputs. Returns (drop reason or "", row id or "").

    An id >= ``vocab_size`` stops the stage instead of dropping the row: it comes from the tokenizer and config
    pair (a tokenizer that appends specials past the model's rows, or a wrong shared.vocab_size), not from the row,
    so every row with that token would go (all tool rows, say) while the stage "succeeds"; nothing is written and a
    rerun after the fix loses nothing."""
    if example is None:
        return f"malformed: {unreadable}", ""
    try:
        messages = normalize_messages(example)
        tools = normalize_tools(example)
    except ChatError as e:
        return f"malformed: {e}", ""
    row_id = conversation_id(source, messages, tools)
    if row_id in seen:
        return "duplicate conversation", row_id
    has_answer = any(m["role"] == "assistant" for m in messages)
    if has_answer:
        try:
            input_ids, loss_mask = tokenize_with_loss_mask(tokenizer, messages, thinking=thinking, tools=tools)
        except ChatError as e:
            return f"unrenderable: {e}", row_id
        beyond = [t for t in input_ids if t >= vocab_size]
        if beyond:
            token = tokenizer.convert_ids_to_tokens(beyond[0])
            raise _OutOfVocab(f"token id {beyond[0]} ({token!r}) is >= shared.vocab_size {vocab_size}, the verifier's "
                              f"embedding rows ({len(beyond)} of the row's {len(input_ids)} ids are): the tokenizer "
                              "gives ids the model does not have; fix the tokenizer (name its specials in the reserved "
                              "block) or shared.vocab_size (--vocab-size)", row_id)
        if len(input_ids) > max_len:
            if truncation == "drop":
                return f"too long: {len(input_ids)} tokens > max_seq_len {max_len} (truncation: drop)", row_id
            input_ids, loss_mask = input_ids[:max_len], loss_mask[:max_len]
            if not any(loss_mask):
                return f"too long: no supervised token within the first {max_len} tokens", row_id
            counts["truncated"] += 1
        rows.append(TrainingRow(id=row_id, input_ids=input_ids, loss_mask=loss_mask, source=source).to_json())
        counts["kept"] += 1
    else:
        counts["question_only"] += 1
    seen.add(row_id)
    questions.append(Question(id=row_id, messages=question_messages(messages), source=source, tools=tools).to_json())
    counts["questions"] += 1
    return "", row_id
