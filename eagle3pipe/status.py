"""Where a run stands, read from its data dir alone: ``run_all.sh --status`` (``python -m eagle3pipe.status``).

Read-only and safe while stages run (it takes no lock and writes nothing). Per stage:

- **state**: ``running`` (its lock is held by a live process: ``locks.py``), ``crashed`` (a lock whose holder is gone:
  ``kill -9``, a lost node, an OOM kill), ``done`` (its finished output: prepared/ and synthetic/ provenance,
  hidden_states/manifest.json, vocab/summary.json, checkpoints/final/, eval/report.json), ``failed`` or ``stopped``
  (output started, no lock: its log's last run ended with an error line, or with SIGTERM / Ctrl-C), or
  ``not started``;
- **progress** from its files where they say it (01b: ids answered or errored of the ids asked; 02: samples journalled
  of the input rows; 04: the last logged step), else from the last progress line of its current run in its log
  (``progress.parse_line``), which also gives the **rate** and **ETA**;
- **dropped**: one list of every sample any stage left out, in one format (``Drop``: stage, id, reason, detail, the
  file that lists it), read from the files each stage writes through ``records.py``: prepared/errors.jsonl (01),
  synthetic/errors.jsonl (01b: errored requests; a rerun retries them) and the responses 01b kept out of data.jsonl
  (their flags: length, short, empty_reasoning, ...), hidden_states/errors.jsonl (02; during a run its shards'
  journals), checkpoints/online_errors.jsonl (04 online: rows never extracted) and checkpoints/skipped.jsonl (04: the
  samples its read checks skipped, once per epoch that read them).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from json.decoder import scanstring
from pathlib import Path
from typing import Iterator

from .config import ConfigError, PipelineConfig, load_config
from .locks import LockHolder, holder_alive
from .progress import format_duration, parse_line
from .records import DataDir, load_hs_manifest, read_jsonl, read_provenance
from .records_checkpoints import SkippedSample
from .run_all import STAGES, left_out

STATES = ("not started", "running", "crashed", "failed", "stopped", "done")
LOG_TAIL_BYTES = 4 << 20  # the end of a stage's log read for its current run (progress lines every 30 s are short)


@dataclass
class Drop:
    """One sample a stage left out, whichever stage and file: the unified view of every drop list."""

    stage: str
    id: str
    reason: str  # the short kind, e.g. "too long", "timeout", "length", "non-finite hidden states"
    detail: str  # the full message as the stage wrote it
    listed_in: str  # the file (relative to the data dir) or log that lists it


@dataclass
class StageStatus:
    name: str
    state: str  # one of STATES
    detail: str = ""  # the lock's holder, the log's error line, the finished counts
    done: int | None = None
    total: int | None = None
    unit: str = ""
    rate: str = ""  # e.g. "0.5 req/s" (the current run's, from its progress line)
    eta: str = ""
    drops: dict[str, int] = field(default_factory=dict)  # reason -> count

    def to_json(self) -> dict:
        return asdict(self)


def reason_key(reason: str) -> str:
    """The kind of a drop reason: the text before its first ':' or ' (' ("too long: 40000 tokens > ..." -> "too long");
    "retryable: <reason>" keeps its prefix."""
    if reason.startswith("retryable: "):
        return "retryable: " + reason_key(reason.removeprefix("retryable: "))
    return re.split(r":| \(", reason, maxsplit=1)[0].strip() or reason


def skip_kind(reason: str) -> str:
    """The kind of a reason 04's read checks skipped a sample for, its numbers left out ("hidden states for N tokens,
    token_ids hold N")."""
    return reason_key(re.sub(r"\d+", "N", reason))


def _leading_id(line: str) -> str | None:
    """The id of a JSONL record written with ``id`` as its first key (TrainingRow, Response, RequestError), without
    parsing the rest of a line that may hold 30 k token ids."""
    if not line.startswith('{"id": "'):
        return None
    try:
        return scanstring(line, 8)[0]
    except ValueError:
        return None


def _flags(line: str) -> list[str]:
    """A Response line's ``flags``. Inside JSON strings every quote is escaped, so the key's unescaped spelling
    occurs once, as the key."""
    at = line.rfind('"flags": ')
    if at < 0:
        return []
    return json.JSONDecoder().raw_decode(line, at + len('"flags": '))[0]


def _lines(path: Path) -> Iterator[str]:
    if not path.is_file():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n"):  # a torn last line is a record still being written (or redone on resume)
                yield line


def collect_drops(dd: DataDir) -> list[Drop]:
    """Every sample the stages left out so far, in stage order (see the module docstring for the sources)."""
    rel = lambda p: str(Path(p).relative_to(dd.root))  # noqa: E731
    out: list[Drop] = []
    if dd.prepared_errors.is_file():
        for d in read_jsonl(dd.prepared_errors):
            out.append(Drop("01_prepare", d.get("id") or f"{d['source']} row {d['row']}", reason_key(d["reason"]),
                            d["reason"], rel(dd.prepared_errors)))
    for line in _lines(dd.synthetic_errors):
        d = json.loads(line)
        out.append(Drop("01b_generate", d["id"], d["kind"], f"{d['message']} ({d['attempts']} attempts, {d['server']})",
                        rel(dd.synthetic_errors)))
    trained = {i for i in map(_leading_id, _lines(dd.synthetic_data)) if i is not None}
    for line in _lines(dd.responses):
        rid = _leading_id(line)
        if rid is not None and rid not in trained:
            flags = _flags(line)
            out.append(Drop("01b_generate", rid, "+".join(flags) or "not in data.jsonl",
                            "response kept in responses.jsonl, left out of data.jsonl" + (
                                f" (flags {flags})" if flags else ""), rel(dd.responses)))
    if dd.hs_manifest.is_file():
        for d in read_jsonl(dd.hs_errors) if dd.hs_errors.is_file() else ():
            out.append(Drop("02_extract", d.get("id") or f"line {d['row'] + 1}", reason_key(d["reason"]), d["reason"],
                            rel(dd.hs_errors)))
    else:
        for journal in sorted(dd.hs_work.glob("shard_*/done.jsonl")):
            for e in _journal_entries(journal):
                if e["local_index"] < 0:
                    out.append(Drop("02_extract", e["id"], reason_key(e["reason"]), e["reason"], rel(journal)))
    for line in _lines(dd.train_online_errors):
        d = json.loads(line)
        where = f"epoch {d['epoch'] + 1}" + (", held out" if d.get("held_out") else "")
        out.append(Drop("04_train", d.get("id") or f"line {d['row'] + 1}", reason_key(d["reason"]),
                        f"{d['reason']} ({where})", rel(dd.train_online_errors)))
    for line in _lines(dd.train_skipped):
        skip = SkippedSample.from_json(json.loads(line), str(dd.train_skipped))
        where = f"epoch {skip.epoch + 1}, step {skip.step}" + (", held out" if skip.held_out else "")
        out.append(Drop("04_train", f"row {skip.index}", skip_kind(skip.reason),
                        f"{skip.reason} ({where}; {skip.file})", rel(dd.train_skipped)))
    return out


def _journal_entries(path: Path) -> Iterator[dict]:
    for line in _lines(path):
        yield json.loads(line)


# ---------------------------------------------------------------------------------------------------------------
# Per-stage state and progress


def _finished(dd: DataDir, name: str) -> bool:
    return {
        "01_prepare": dd.provenance(dd.prepared).is_file(),
        "01b_generate": dd.provenance(dd.synthetic).is_file(),
        "02_extract": dd.hs_manifest.is_file(),
        "03_vocab": dd.vocab_summary.is_file(),
        "04_train": dd.final_checkpoint.is_dir(),
        "05_evaluate": dd.eval_report.is_file(),
    }[name]


def _started(dd: DataDir, name: str) -> bool:
    folder = {"01_prepare": dd.prepared, "01b_generate": dd.synthetic, "02_extract": dd.hidden_states,
              "03_vocab": dd.vocab, "04_train": dd.checkpoints, "05_evaluate": dd.eval}[name]
    return folder.is_dir() and any(folder.iterdir())


def _current_run(log: Path, name: str) -> list[str]:
    """The lines of the stage's last run in its log (from its last "<name>: config from" line, which cli.run_stage
    writes first)."""
    if not log.is_file():
        return []
    with open(log, "rb") as f:
        f.seek(max(0, log.stat().st_size - LOG_TAIL_BYTES))
        lines = f.read().decode("utf-8", "replace").splitlines()
    starts = [i for i, line in enumerate(lines) if f" {name}: config from " in line]
    return lines[starts[-1]:] if starts else lines


def _outcome(lines: list[str], name: str) -> tuple[str, str]:
    """("failed", its error) / ("stopped", how) / ("stopped", "") from the end of a run's log lines."""
    for line in reversed(lines):
        m = re.search(rf" {re.escape(name)} (failed|refused): (.*)$", line)
        if m:
            return "failed", m.group(2)
        m = re.search(rf" {re.escape(name)} (stopped by \S+)", line)
        if m:
            return "stopped", m.group(1)
    return "stopped", "its log names no end (killed with its lock released?)"


def _progress_lines(lines: list[str], name: str) -> list[dict]:
    """The last progress line of each progress bar of the run (02 has one per shard; 04 also counts online states:
    its training steps are what count)."""
    last: dict[str, dict] = {}
    for line in lines:
        parsed = parse_line(line)
        if parsed is not None and (name != "04_train" or parsed["desc"] == "Training"):
            last[parsed["desc"]] = parsed
    return list(last.values())


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def _files_progress(dd: DataDir, cfg: PipelineConfig, name: str) -> tuple[int | None, int | None, str]:
    """(done, total, unit) where the stage's files say it; (None, None, "") otherwise."""
    if name == "01b_generate" and dd.questions.is_file():
        asked = _count_lines(dd.questions)
        asked = min(asked, cfg.generate.max_samples) if cfg.generate.max_samples else asked
        answered = {i for path in (dd.responses, dd.synthetic_errors) for i in map(_leading_id, _lines(path)) if i}
        return len(answered), asked, "requests"
    if name == "02_extract":
        manifest = load_hs_manifest(dd.hs_manifest)
        if manifest is not None:
            return manifest.num_samples + manifest.num_dropped, manifest.num_samples + manifest.num_dropped, "samples"
        source = dd.synthetic_data if cfg.extract.input == "synthetic" else dd.prepared_data
        journals = list(dd.hs_work.glob("shard_*/done.jsonl"))
        if journals and source.is_file():
            return sum(1 for j in journals for _ in _lines(j)), _count_lines(source), "samples"
    if name == "04_train" and dd.train_metrics.is_file():
        steps = [d["step"] for d in map(json.loads, _lines(dd.train_metrics)) if d.get("kind") == "train"]
        if steps:
            return steps[-1], None, "steps"
    return None, None, ""


def stage_status(dd: DataDir, cfg: PipelineConfig, name: str, drops: list[Drop]) -> StageStatus:
    st = StageStatus(name, "not started")
    st.drops = dict(collections.Counter(d.reason for d in drops if d.stage == name).most_common())
    lock_path = dd.stage_lock(name)
    holder = None
    if lock_path.is_file():
        try:
            holder = LockHolder(**json.loads(lock_path.read_text()))
        except (ValueError, TypeError):
            st.state, st.detail = "crashed", f"unreadable lock {lock_path}"
    if holder is not None:
        if holder.host != socket.gethostname():
            st.state, st.detail = "running", f"pid {holder.pid} on {holder.host} (another host: not checked), since " \
                                             f"{holder.started}"
        elif holder_alive(holder):
            st.state, st.detail = "running", f"pid {holder.pid} since {holder.started}"
        else:
            st.state, st.detail = "crashed", (f"pid {holder.pid} (started {holder.started}) is gone and left its lock; "
                                              "rerun the stage (or run_all) to resume")
    elif _finished(dd, name):
        st.state = "done"
        prov_dir = {"01_prepare": dd.prepared, "01b_generate": dd.synthetic, "02_extract": dd.hidden_states,
                    "03_vocab": dd.vocab, "04_train": dd.checkpoints, "05_evaluate": dd.eval}[name]
        prov = read_provenance(dd.provenance(prov_dir)) or {}
        if "elapsed_s" in prov:
            st.detail = f"took {format_duration(prov['elapsed_s'])}, finished {prov.get('finished', '?')}"
    elif _started(dd, name):
        st.state, st.detail = _outcome(_current_run(dd.log_file(name), name), name)
    if st.state == "not started":
        if left_out(cfg, name):
            st.detail = f"run_all does not run it: {left_out(cfg, name)}"
        return st
    st.done, st.total, st.unit = _files_progress(dd, cfg, name)
    lines = _progress_lines(_current_run(dd.log_file(name), name), name)
    if lines:
        if st.done is None:
            st.done, st.unit = sum(p["done"] for p in lines), lines[0]["unit"]
        if st.total is None:
            st.total = sum(p["total"] for p in lines)
        if st.state in ("running", "crashed", "stopped", "failed"):
            st.rate = f"{sum(p['rate'] for p in lines):.1f} {lines[0]['unit']}/s"
            st.eta = "?" if any(p["eta"] == "?" for p in lines) else max((p["eta"] for p in lines), key=_seconds)
            if st.state != "running":
                st.eta = f"({st.eta} when it stopped)"
    if st.state == "done" and st.total is None and st.done is not None:
        st.total = st.done
    return st


def _seconds(duration: str) -> int:
    """format_duration's text back to seconds (3h10m, 12m05s, 42s)."""
    total = 0
    for value, unit in re.findall(r"(\d+)([hms])", duration):
        total += int(value) * {"h": 3600, "m": 60, "s": 1}[unit]
    return total


def run_status(cfg: PipelineConfig) -> tuple[list[StageStatus], list[Drop]]:
    dd = DataDir(cfg.data_dir)
    drops = collect_drops(dd)
    return [stage_status(dd, cfg, name, drops) for name, _, _ in STAGES], drops


def format_status(cfg: PipelineConfig, stages: list[StageStatus], drops: list[Drop]) -> str:
    now = time.strftime("%Y-%m-%d %H:%M:%S")
    lines = [f"status of {cfg.data_dir} at {now}",
             f"{'stage':<13} {'state':<11} {'progress':<24} {'rate':<14} {'eta':<22} dropped"]
    for st in stages:
        progress = ""
        if st.done is not None:
            progress = f"{st.done}/{st.total if st.total is not None else '?'} {st.unit}"
        dropped = f"{sum(st.drops.values())}" + (f" ({', '.join(f'{k} {v}' for k, v in st.drops.items())})"
                                                 if st.drops else "")
        lines.append(f"{st.name:<13} {st.state:<11} {progress:<24} {st.rate:<14} {st.eta:<22} {dropped}")
        if st.detail:
            lines.append(f"{'':<13} {st.detail}")
    lines.append(f"dropped: {len(drops)} samples in all" + (":" if drops else ""))
    by = collections.Counter((d.stage, d.reason, d.listed_in) for d in drops)
    for (stage, reason, listed_in), n in sorted(by.items()):
        first = next(d for d in drops if (d.stage, d.reason, d.listed_in) == (stage, reason, listed_in))
        lines.append(f"  {stage:<13} {reason:<30} {n:>7}  in {listed_in} (first: {first.id})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Show each stage's state, progress, rate, ETA and drops, from the data "
                                             "dir alone (safe while the run goes on).")
    ap.add_argument("--config", required=True, help="the run's YAML config (its shared.data_dir is read)")
    ap.add_argument("--json", action="store_true", help="print {stages: [...], drops: [...]} as JSON instead")
    ap.add_argument("--drops", action="store_true", help="also list every dropped sample, one line each")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stages, drops = run_status(cfg)
    if args.json:
        print(json.dumps({"data_dir": str(cfg.data_dir), "stages": [s.to_json() for s in stages],
                          "drops": [asdict(d) for d in drops]}, indent=1))
        return 0
    print(format_status(cfg, stages, drops))
    if args.drops:
        for d in drops:
            print(f"{d.stage}\t{d.id}\t{d.reason}\t{d.detail}\t{d.listed_in}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
