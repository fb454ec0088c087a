"""Stage 01: chat datasets -> exact token ids, assistant-only loss masks, and the questions stage 01b will send.

Reads HF dataset ids or local .json/.jsonl/.parquet files (OpenAI ``messages`` role/content, ShareGPT /
open-perfectblend ``conversations`` from/value), renders each conversation with the verifier tokenizer's own chat
template, and writes under ``<data_dir>/prepared/``:

- ``data.jsonl``: TrainingRow per kept conversation (id, input_ids, loss_mask, source), and its row index;
- ``questions.jsonl``: Question per conversation (messages cut at the last user turn), same id, and its row index;
- ``errors.jsonl``: DroppedRow per row not kept (malformed, duplicate, too long), with row number and reason;
- ``provenance.json``: config, inputs, counts. A rerun with the same config skips; a different config refuses
  unless ``--overwrite``.

Ids are a hash of the source name and the normalised conversation, so reruns and later stages join on them.
Truncation policy for rows over ``max_seq_len`` tokens is explicit: ``drop`` (default, listed in errors.jsonl)
or ``truncate`` (keep the first max_seq_len tokens; a row left with no supervised token is dropped).

At scale (10^6 conversations): datasets are read as a stream (JSON Lines line by line, JSON arrays element by
element, Arrow tables memory-mapped), rows are rendered and tokenized by ``prepare.num_proc`` worker processes in
batches and written as they come (under temporary names, put in place when the stage ends: a stopped run leaves
nothing half-written), and what the stage keeps per conversation is the 8-byte key of its id (duplicates). The
output is the same whatever the number of processes: results are written in the order the rows were read.
``--max-samples N`` keeps N questions per dataset: when a dataset has more rows, a sample of them drawn with
``shared.seed`` (rows dropped from the sample are replaced by further rows of the same draw), in file order.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from .chat import ChatError, load_tokenizer, normalize_messages, normalize_tools, question_messages
from .chat import resolve_special_ids, tokenize_with_loss_mask
from .cli import StageError
from .config import ConfigError, PipelineConfig
from .progress import Progress
from .records import DataDir, DroppedRow, IndexedJsonlWriter, Question, TrainingRow, id_key, read_provenance
from .records import row_index_path, tmp_path_for, write_provenance

log = logging.getLogger(__name__)

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
BATCH_ROWS = 64  # rows a worker renders per task: big enough that the hand-over costs little, small to stay in step
TASKS_AHEAD = 3  # tasks in flight per worker process (bounds the rows held between reading and writing)
JSON_CHUNK_CHARS = 1 << 20  # JSON arrays are decoded through a buffer of this many characters, grown for big rows


def conversation_id(source: str, messages: list[dict], tools: list[dict] | None = None) -> str:
    """Deterministic id: same source and conversation (and tools declared), same id, on every run and machine."""
    payload = json.dumps([source, messages] + ([tools] if tools else []), ensure_ascii=False, sort_keys=True)
    return hashlib.sha1(payload.encode()).hexdigest()[:16]


def source_name(spec: str) -> str:
    path = Path(spec)
    return path.stem if path.suffix in LOCAL_FORMATS else spec


def available_cores() -> int:
    """CPU cores this process may run on (its affinity: a container's or taskset's share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------------------------------------------
# Reading a dataset as a stream: (row number, payload, reason if unreadable); payload is a JSON line (bytes, parsed
# by the worker), a row (dict) or None


class Source:
    """One dataset spec: its row count and its rows, all in order or only some (``entries(chosen)``)."""

    total: int

    def entries(self, chosen: np.ndarray | None = None) -> Iterator[tuple[int, bytes | dict | None, str]]:
        raise NotImplementedError


class JsonLinesSource(Source):
    """A local JSON Lines file, read line by line as bytes (a worker parses each); blank lines are not rows but
    keep their number, so a row number is the line number (0-based)."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            self.total = sum(1 for line in f if line.strip())

    def entries(self, chosen=None):
        want = iter(chosen.tolist()) if chosen is not None else None
        next_wanted = next(want, None) if want is not None else None
        entry = 0
        with open(self.path, "rb") as f:
            for lineno, line in enumerate(f):
                if not line.strip():
                    continue
                if want is None or entry == next_wanted:
                    yield lineno, line, ""
                    if want is not None:
                        next_wanted = next(want, None)
                        if next_wanted is None:
                            return
                entry += 1


class JsonArraySource(Source):
    """A local .json file holding one array of rows, decoded element by element through a bounded buffer (not
    loaded whole); row number = position in the array."""

    def __init__(self, path: Path):
        self.path = path
        self.total = sum(1 for _ in self._elements())

    def _elements(self) -> Iterator[object]:
        decoder = json.JSONDecoder()
        with open(self.path, encoding="utf-8") as f:
            buf, pos, eof = "", 0, False

            def fill(need_more: bool) -> None:
                nonlocal buf, pos, eof
                chunk = f.read(max(JSON_CHUNK_CHARS, len(buf) - pos) if need_more else JSON_CHUNK_CHARS)
                eof = not chunk
                buf, pos = buf[pos:] + chunk, 0

            def next_char() -> str:
                nonlocal pos
                while True:
                    while pos < len(buf) and buf[pos] in " \t\n\r":
                        pos += 1
                    if pos < len(buf) or eof:
                        return buf[pos] if pos < len(buf) else ""
                    fill(False)

            fill(False)
            if next_char() != "[":
                raise json.JSONDecodeError("not a JSON array", buf, pos)
            pos += 1
            if next_char() == "]":
                return
            while True:
                next_char()
                try:
                    value, end = decoder.raw_decode(buf, pos)
                    cut = end >= len(buf) and not eof  # a number or literal may go on past the buffer
                except json.JSONDecodeError:
                    if eof:
                        raise
                    cut = True
                if cut:
                    fill(True)
                    continue
                pos = end
                yield value
                c = next_char()
                if c == "]":
                    return
                if c != ",":
                    raise json.JSONDecodeError("expected ',' or ']' between rows", buf, pos)
                pos += 1

    def entries(self, chosen=None):
        wanted = None if chosen is None else set(chosen.tolist())
        for i, row in enumerate(self._elements()):
            if wanted is None or i in wanted:
                yield (i, row, "") if isinstance(row, dict) else (i, None, "row is not a JSON object")


class ArrowSource(Source):
    """A ``datasets`` table (parquet, a saved dataset, a hub id): memory-mapped Arrow, read in batches."""

    def __init__(self, ds):
        self.ds, self.total = ds, len(ds)

    def entries(self, chosen=None):
        ds = self.ds if chosen is None else self.ds.select(chosen)
        numbers = iter(range(self.total)) if chosen is None else iter(chosen.tolist())
        for batch in ds.iter(batch_size=256):
            columns = list(batch)
            for values in zip(*(batch[c] for c in columns)):
                yield next(numbers), dict(zip(columns, values)), ""


def check_local_file(spec: str) -> None:
    """A local dataset file (JSON, JSON Lines, Parquet) that is not there, named as --dataset gave it."""
    if Path(spec).suffix in LOCAL_FORMATS and not Path(spec).is_file():
        raise FileNotFoundError(f"dataset file not found: {spec} (from --dataset)")


def open_source(spec: str, split: str) -> Source:
    """The Source of one dataset spec.

    Local JSON / JSON Lines files are read with ``json``, row by row, exactly as written: Arrow (``datasets``)
    would unify the rows' nested structures and fill keys a row lacks with nulls, which changes tool schemas and
    tool-call arguments, hence the rendered prompt. Parquet files, saved datasets and hub ids go through
    ``datasets``."""
    check_local_file(spec)
    path = Path(spec)
    if path.suffix in LOCAL_FORMATS:
        if path.suffix == ".json":
            return _json_file_source(path, spec)
        if path.suffix == ".jsonl":
            return JsonLinesSource(path)
    import datasets  # here: JSON files need none of it (its import takes seconds)

    if path.suffix in LOCAL_FORMATS:
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
    return ArrowSource(ds)


def _json_file_source(path: Path, spec: str) -> Source:
    """A .json file: an array of rows (streamed), JSON Lines under a .json name, or an error for another value."""
    with open(path, encoding="utf-8") as f:
        head = f.read(JSON_CHUNK_CHARS).lstrip()
    if head.startswith("["):
        try:
            return JsonArraySource(path)
        except json.JSONDecodeError:
            return JsonLinesSource(path)  # not one valid array: read line by line, bad lines listed
    try:
        _, end = json.JSONDecoder().raw_decode(head)
        if head[end:].strip():
            return JsonLinesSource(path)  # a second value follows the first: JSON Lines under a .json name
    except json.JSONDecodeError:
        pass  # not one value within the first chunk: the whole file decides
    with open(path, encoding="utf-8") as f:
        try:
            value = json.load(f)
        except json.JSONDecodeError:
            return JsonLinesSource(path)
    raise StageError(f"{spec}: a .json dataset must hold a list of rows, got {type(value).__name__}")


# ---------------------------------------------------------------------------------------------------------------
# Rendering: one function for a batch of rows, run in worker processes (or in this one); plain-data results


@dataclasses.dataclass(frozen=True)
class RenderSettings:
    tokenizer: str
    trust_remote_code: bool
    thinking: bool
    max_seq_len: int
    truncation: str
    vocab_size: int


_worker: dict = {}  # this process's tokenizer and settings (set by _init_worker, or in-process by Renderer)


def _init_worker(settings: RenderSettings) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker.update(settings=settings, tokenizer=load_tokenizer(settings.tokenizer, settings.trust_remote_code))


# result kinds: ("drop", row, reason, id) ("oov", row, message, id) ("keep", row, id, question line, row line or
# None, tokens, truncated)
def render_batch(source: str, batch: list[tuple[int, bytes | dict | None, str]]) -> list[tuple]:
    """Render one batch of rows of ``source``; the results in the batch's order, rows serialised as JSONL lines."""
    return [_render_one(_worker["tokenizer"], _worker["settings"], source, *entry) for entry in batch]


def _parse_line(line: bytes) -> tuple[dict | None, str]:
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        return None, f"not valid UTF-8 ({e.reason} at byte {e.start})"
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg})"
    return (row, "") if isinstance(row, dict) else (None, "row is not a JSON object")


def _line(record: dict) -> bytes:
    return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")


def _render_one(tokenizer, s: RenderSettings, source: str, row_number: int, payload, unreadable: str) -> tuple:
    """One dataset row -> its result (see render_batch).

    An id >= ``vocab_size`` stops the stage instead of dropping the row: it comes from the tokenizer and config
    pair (a tokenizer that appends specials past the model's rows, or a wrong shared.vocab_size), not from the row,
    so every row with that token would go (all tool rows, say) while the stage "succeeds"; nothing is written and a
    rerun after the fix loses nothing."""
    example = payload
    if isinstance(payload, bytes):
        example, unreadable = _parse_line(payload)
    if example is None:
        return "drop", row_number, f"malformed: {unreadable}", ""
    try:
        messages = normalize_messages(example)
        tools = normalize_tools(example)
    except ChatError as e:
        return "drop", row_number, f"malformed: {e}", ""
    row_id = conversation_id(source, messages, tools)
    question = _line(Question(id=row_id, messages=question_messages(messages), source=source, tools=tools).to_json())
    if not any(m["role"] == "assistant" for m in messages):
        return "keep", row_number, row_id, question, None, 0, False
    try:
        input_ids, loss_mask = tokenize_with_loss_mask(tokenizer, messages, thinking=s.thinking, tools=tools)
    except ChatError as e:
        return "drop", row_number, f"unrenderable: {e}", row_id
    beyond = [t for t in input_ids if t >= s.vocab_size]
    if beyond:
        token = tokenizer.convert_ids_to_tokens(beyond[0])
        return "oov", row_number, (
            f"token id {beyond[0]} ({token!r}) is >= shared.vocab_size {s.vocab_size}, the verifier's embedding rows "
            f"({len(beyond)} of the row's {len(input_ids)} ids are): the tokenizer gives ids the model does not "
            "have; fix the tokenizer (name its specials in the reserved block) or shared.vocab_size (--vocab-size)"
        ), row_id
    truncated = False
    if len(input_ids) > s.max_seq_len:
        if s.truncation == "drop":
            return ("drop", row_number,
                    f"too long: {len(input_ids)} tokens > max_seq_len {s.max_seq_len} (truncation: drop)", row_id)
        input_ids, loss_mask = input_ids[: s.max_seq_len], loss_mask[: s.max_seq_len]
        if not any(loss_mask):
            return "drop", row_number, f"too long: no supervised token within the first {s.max_seq_len} tokens", row_id
        truncated = True
    row = _line(TrainingRow(id=row_id, input_ids=input_ids, loss_mask=loss_mask, source=source).to_json())
    return "keep", row_number, row_id, question, row, len(input_ids), truncated


def _batches(entries: Iterator, size: int) -> Iterator[list]:
    batch = []
    for entry in entries:
        batch.append(entry)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class Renderer:
    """Renders batches of rows with ``num_proc`` worker processes (started when a dataset first needs more than one
    batch), or in this process for one; results come back in the order the rows went in."""

    def __init__(self, settings: RenderSettings, num_proc: int, tokenizer):
        self.settings, self.num_proc = settings, num_proc
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        _worker.update(settings=settings, tokenizer=tokenizer)  # the in-process path

    def map(self, source: str, entries: Iterator, rows_hint: int) -> Iterator[tuple]:
        if self.num_proc <= 1 or rows_hint <= BATCH_ROWS:
            for batch in _batches(entries, BATCH_ROWS):
                yield from render_batch(source, batch)
            return
        if self._pool is None:
            # spawn, not fork: this process already holds threads (datasets, tokenizers) a fork would copy mid-use
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.num_proc, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
                initargs=(self.settings,))
            log.info("rendering with %d worker processes (prepare.num_proc)", self.num_proc)
        pending: collections.deque = collections.deque()
        try:
            for batch in _batches(entries, BATCH_ROWS):
                pending.append(self._pool.submit(render_batch, source, batch))
                if len(pending) >= TASKS_AHEAD * self.num_proc:
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()
        except concurrent.futures.BrokenExecutor:
            raise StageError(
                "a worker process of prepare.num_proc stopped (killed, out of memory, or it could not start: a "
                "script that calls run_prepare itself must start from an `if __name__ == \"__main__\":` block, as "
                "01_prepare_data.py does); nothing was written. Rerun, or pass --num-proc 1 to render in this "
                "process") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "Renderer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SeenKeys:
    """The id keys of the conversations kept so far (a later copy is a duplicate): sorted uint64 runs, merged as
    they grow (8 bytes a key), plus a set of the newest keys."""

    RECENT = 1 << 12  # keys held in the set before they become a sorted run (a set costs ~70 bytes a key)

    def __init__(self):
        self.runs: list[np.ndarray] = []
        self.recent: set[int] = set()

    def __contains__(self, key: int) -> bool:
        if key in self.recent:
            return True
        k = np.uint64(key)
        for run in self.runs:
            at = int(run.searchsorted(k))
            if at < run.size and run[at] == k:
                return True
        return False

    def add(self, key: int) -> None:
        self.recent.add(key)
        if len(self.recent) >= self.RECENT:
            self.runs.append(np.sort(np.fromiter(self.recent, dtype=np.uint64, count=len(self.recent))))
            self.recent = set()
            while len(self.runs) > 1 and self.runs[-2].size <= self.runs[-1].size:
                last = self.runs.pop()
                self.runs[-1] = np.sort(np.concatenate([self.runs[-1], last]))


# ---------------------------------------------------------------------------------------------------------------
# The stage


def config_hash(cfg: PipelineConfig) -> str:
    """What decides prepared/: the prepare and shared sections, less prepare.num_proc (the output is the same for
    any number of processes; a hash with it would refuse a rerun on another machine)."""
    prepare = {k: v for k, v in dataclasses.asdict(cfg.prepare).items() if k != "num_proc"}
    payload = json.dumps({"prepare": prepare}, sort_keys=True).encode()
    return hashlib.sha256(payload).hexdigest()[:16] + cfg.section_hash("shared")


def sample_order(total: int, seed: int, source: str) -> np.ndarray:
    """The seeded draw of a dataset's rows (a permutation of its row positions) that --max-samples takes from."""
    stream = int.from_bytes(hashlib.sha256(source.encode()).digest()[:8], "little")
    return np.random.default_rng([seed, stream]).permutation(total)


def run_prepare(cfg: PipelineConfig) -> dict:
    started = time.time()
    dd = DataDir(cfg.data_dir)
    chash = config_hash(cfg)
    outputs = (dd.prepared_data, dd.questions, dd.prepared_errors)
    prev = read_provenance(dd.provenance(dd.prepared))
    if prev is not None and all(p.exists() for p in outputs):
        if prev.get("config_hash") == chash:
            log.info("prepared/ already made with this config (%s); skipping. Counts: %s", chash, prev["counts"])
            return prev["counts"]
        if not cfg.prepare.overwrite:
            raise StageError(
                f"{dd.prepared} was made with a different config (hash {prev.get('config_hash')} vs {chash}); "
                "pass --overwrite to rebuild it, or use another --data-dir"
            )
    if cfg.prepare.num_proc < 0:
        raise ConfigError(f"prepare.num_proc must be >= 0 (0 = the cores), got {cfg.prepare.num_proc}")

    for spec in cfg.prepare.dataset:  # a missing file is named at once, not after the tokenizer's seconds
        check_local_file(spec)
    tokenizer = load_tokenizer(cfg.tokenizer_path, cfg.shared.trust_remote_code)
    resolve_special_ids(tokenizer, cfg.shared.think_token_id, cfg.shared.response_token_id)
    s = cfg.shared
    settings = RenderSettings(tokenizer=str(cfg.tokenizer_path), trust_remote_code=s.trust_remote_code,
                              thinking=s.thinking, max_seq_len=s.max_seq_len, truncation=cfg.prepare.truncation,
                              vocab_size=s.vocab_size)
    num_proc = cfg.prepare.num_proc or available_cores()
    _remove_stale_temporaries(dd)
    counts = {"rows_read": 0, "kept": 0, "questions": 0, "question_only": 0, "truncated": 0, "dropped": 0}
    by_reason: collections.Counter = collections.Counter()
    seen = SeenKeys()
    dd.prepared.mkdir(parents=True, exist_ok=True)
    errors_tmp = tmp_path_for(dd.prepared_errors)
    with IndexedJsonlWriter(dd.prepared_data, "rows", new=True) as rows_out, \
            IndexedJsonlWriter(dd.questions, "questions", new=True) as questions_out, \
            open(errors_tmp, "wb") as errors_out, Renderer(settings, num_proc, tokenizer) as renderer:
        try:
            for spec in cfg.prepare.dataset:
                _prepare_dataset(spec, cfg, renderer, seen, counts, by_reason, rows_out, questions_out, errors_out)
            errors_out.flush()
            os.fsync(errors_out.fileno())
        except BaseException:
            errors_tmp.unlink(missing_ok=True)
            raise
        rows_out.commit()
        questions_out.commit()
        os.replace(errors_tmp, dd.prepared_errors)
    write_provenance(dd.provenance(dd.prepared), stage="prepare", config_hash=chash, config=cfg.to_dict(),
                     inputs=list(cfg.prepare.dataset), counts=counts, started=started)
    log.info(
        "prepared %d training rows and %d questions from %d rows into %s; dropped %d (listed in %s)%s; "
        "truncated %d; elapsed %.1fs",
        counts["kept"], counts["questions"], counts["rows_read"], dd.prepared, counts["dropped"], dd.prepared_errors,
        f" by reason: {dict(by_reason)}" if by_reason else "", counts["truncated"], time.time() - started,
    )
    return counts


def _remove_stale_temporaries(dd: DataDir) -> None:
    """Temporary outputs of an earlier run that stopped (this stage's lock is held: no other run writes them)."""
    names = {p.name for p in (dd.prepared_data, dd.questions, dd.prepared_errors, row_index_path(dd.prepared_data),
                              row_index_path(dd.questions))}
    for p in dd.prepared.glob(".*.tmp-*") if dd.prepared.is_dir() else ():
        if p.name[1:].rsplit(".tmp-", 1)[0] in names:
            log.info("removing %s, left by a run that stopped", p)
            p.unlink()


def _prepare_dataset(spec, cfg, renderer, seen, counts, by_reason, rows_out, questions_out, errors_out) -> None:
    """Read, render and write one dataset; its rows in file order, the seeded sample when --max-samples asks."""
    source = source_name(spec)
    src = open_source(spec, cfg.prepare.dataset_split)
    cap = cfg.prepare.max_samples
    sampled = bool(cap) and src.total > cap
    progress = Progress(min(src.total, cap) if cap else src.total, unit="rows", every_s=cfg.shared.progress_every_s,
                        desc=f"Prepare {source}")
    if sampled:
        order = sample_order(src.total, cfg.shared.seed, source)
        log.info("%s: %d rows; --max-samples %d: a sample drawn with shared.seed %d", spec, src.total, cap,
                 cfg.shared.seed)
    kept_here, taken = 0, 0
    while True:
        if sampled:  # the next rows of the draw, as many as questions are still wanted, read in file order
            chosen = np.sort(order[taken: taken + cap - kept_here])
            taken += chosen.size
            entries, hint = src.entries(chosen), chosen.size
        else:
            entries, hint = src.entries(), src.total
        for result in renderer.map(source, entries, hint):
            kept_here += _take(result, spec, source, seen, counts, by_reason, rows_out, questions_out, errors_out)
            progress.update(1, errors=int(result[0] != "keep"), kept=str(counts["kept"]))
        if not sampled or kept_here >= cap or taken >= src.total:
            break
    progress.close()


def _take(result, spec, source, seen, counts, by_reason, rows_out, questions_out, errors_out) -> int:
    """Write one rendered row's outputs in order (duplicates decided here, in the order rows were read); 1 if it
    gave a question."""
    counts["rows_read"] += 1
    kind, row_number = result[0], result[1]
    row_id = result[3] if kind in ("drop", "oov") else result[2]
    reason = ""
    if kind == "drop" and not row_id:
        reason = result[2]
    elif id_key(row_id) in seen:
        reason = "duplicate conversation"
    elif kind == "drop":
        reason = result[2]
    elif kind == "oov":
        raise StageError(f"{spec} row {row_number} (id {row_id}): {result[2]}; nothing was written")
    if reason:
        errors_out.write(_line(DroppedRow(source=source, row=row_number, reason=reason, id=row_id).to_json()))
        counts["dropped"] += 1
        by_reason[reason.split(" (")[0].split(":")[0]] += 1
        return 0
    _, _, _, question, row, num_tokens, truncated = result
    key = id_key(row_id)
    if row is not None:
        rows_out.write_line(row, key, num_tokens)
        counts["kept"] += 1
        counts["truncated"] += truncated
    else:
        counts["question_only"] += 1
    questions_out.write_line(question, key, 0)
    seen.add(key)
    counts["questions"] += 1
    return 1
