"""Scale benchmark (issue 27): each stage's memory and start-up against the number of rows, on synthetic rows for the
tiny toy verifier.

For every stage and size, the stage runs in a fresh process (so that its peak RSS is the stage's own), on inputs
made beforehand (not timed), and the bench reports: the process's RSS before the stage and its peak, the growth
(peak - before) and that growth per row, the peak RSS of its worker processes, the time to its first unit of work,
and its steady state in seconds per 10^5 units (rows, requests or steps; for 04 and 04on also per step). From
those it projects RAM and start-up to a dataset of 10^9 and 6 * 10^9 tokens (``--tokens-per-row``, 10^4 by
default: lightseekorg's K2.5 draft data, 6 * 10^9 tokens in 600 k samples).

Stages (``STAGES``):

- ``01``: N two-turn conversations in a JSON Lines file -> run_prepare (every row, ``prepare.num_proc`` default;
  ``--answer-words W``: answers of W more words, for the per-token costs of long rows).
  First unit: the first row rendered and written; steady: the rows after it.
- ``01b``: N questions of which all but W were answered by an earlier run that stopped (a resume at >= 90 %; W =
  N / 10, at least 1000, at most 20000), a fast local stub (an aiohttp server in its own process) stands in for vLLM
  and answers the W at once. First unit: the first request the stub receives; steady: the W requests.
- ``03``: N rows of 8-16 tokens -> run_vocab. First unit: the first row counted; steady: the rows after it.
- ``02``: N rows of 8-16 tokens, of which 90 % are journalled as extracted by a run that stopped (a resume at 90 %;
  journal lines only, no files: nothing before the first request opens one) -> run_extract, vLLM backend, the stub
  answering as our vLLM connector does (``stub_server``: each request's states written to the path it names, with
  records.py's writer; random values, so ``extract.verify_min_agreement`` is 0: the capture check runs, its
  agreement is not asked for). First unit: the first request (``Extractor._request``: the capture check's, as the
  stage sends it first). Steady: the bulk requests' replies, from the first to the last of ``steady_02(n)`` (N / 20,
  at most 20000) sent after the first, then the stage is stopped (before its finalize: the journalled rows have no
  files); the few still in flight then are cancelled and not counted.
- ``04``: N rows of 8-16 tokens and their hidden states (stage 02's output: the rows dataset, the manifest, a sample
  file per row, hard links of one random file per length; made beforehand, read only) -> run_vocab (03's output, in
  the child, as 04on), then run_train offline (2 epochs, no held-out rows, the DataLoader in the process). First
  unit: the first optimizer step done (the data, the model, every epoch's packing and plan, the loader, the step's
  rows read and trained). Steady: the ``--steady-steps`` steps after it (30; all when the run has fewer), then the
  stage is stopped; the peak RSS covers them too (the question: does a step's cost or memory grow with N? it
  should not).
- ``04on``: N rows of 8-16 tokens -> run_vocab (stage 03's output, in the child: its growth is 03's, flat), then
  run_train with train.data_source online (2 epochs, the stub writing each request's states as for 02,
  ``extract.verify_tokens`` 0, a spool of 4 full rows). First unit: the first request, the first packed row's
  (sent by the online source's prefetcher once the data, the model, every epoch's packing and plan and the source's
  ``plan`` are set up). Steady: the ``--steady-steps`` steps after the first, and the requests the prefetcher sent
  meanwhile (the steady units; it runs 4 rows ahead of the loop). (Before 2026-12-03's i27-slots the capture check
  was on and its request, sent before ``plan``, was the first: the plan was not measured.)

04 and 04on also report seconds a step (and of those, the loop's wait for its data); both train with
``train.cpu_threads`` 1, as the CPU demo does. ``BENCH_LOG=INFO`` in the environment shows the stages' own log lines.

Usage:
    .venv/bin/python bench/bench_scale.py --sizes 10000 100000 1000000 --stages 01 01b 03 02 04 04on --json out.json
    .venv/bin/python bench/bench_scale.py --sizes 10000 --stages 04 --steady-steps 100   # a longer steady state
    .venv/bin/python bench/bench_scale.py --repo /path/to/another/checkout ...   # another version, same inputs
    .venv/bin/python bench/bench_scale.py --stages 04on --sizes 2500 10000 --row-tokens 2048 --again   # long rows,
                                                          # and a second run over the same rows (the rows dataset kept)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------------------------
# Inputs (made in the parent with this checkout's writers, so the row indexes a stage would have written are there;
# an older version reads the same JSONL files and ignores them)


def make_conversations(folder: Path, n: int, answer_words: int = 0) -> None:
    """``answer_words``: that many more words in each answer (a long reasoning-model answer: the per-token costs)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "chats.jsonl", "w") as f:
        for i in range(n):
            answer = " ".join([str(i + i % 7)] + [f"w{(i * 31 + k) % 997}" for k in range(answer_words)])
            f.write(json.dumps({"messages": [{"role": "user", "content": f"what is {i} + {i % 7}?"},
                                             {"role": "assistant", "content": answer}]}) + "\n")


def unfinished_01b(n: int) -> int:
    return min(max(n // 10, 1000), 20000, n)


def make_01b_resume(folder: Path, n: int) -> None:
    """questions.jsonl of n questions (as 01 writes it) and a 01b run stopped with all but unfinished_01b(n)
    answered (responses and data rows with their indexes, as 01b writes them)."""
    sys.path.insert(0, str(REPO))
    from eagle3pipe.records import DataDir, IndexedJsonlWriter

    dd = DataDir(folder)
    with IndexedJsonlWriter(dd.questions, "questions", new=True) as out:
        for i in range(n):
            out.write({"id": f"{i:016x}", "messages": [{"role": "user", "content": f"what is {i} + {i}?"}],
                       "source": "bench"})
        out.commit()
    with IndexedJsonlWriter(dd.responses, "responses") as responses, \
            IndexedJsonlWriter(dd.synthetic_data, "rows") as data:
        for i in range(n - unfinished_01b(n)):
            qid = f"{i:016x}"
            responses.write({"id": qid, "messages": [], "reasoning": "r", "content": "c", "finish_reason": "stop",
                             "usage": {}, "prompt_token_ids": [1, 2, 3], "completion_token_ids": [5, 6, 7, 8],
                             "server": "stub", "latency_s": 0.1, "token_ids_source": "server", "flags": [],
                             "reasoning_field": "reasoning"})
            data.write({"id": qid, "input_ids": [1, 2, 3, 5, 6, 7, 8], "loss_mask": [0, 0, 0, 1, 1, 1, 1],
                        "source": "bench"})


def make_rows(folder: Path, n: int, row_tokens: int = 0) -> None:
    """``row_tokens``: rows of that many tokens and up to 96 more (04on's --row-tokens), else 8-16."""
    sys.path.insert(0, str(REPO))
    from eagle3pipe.records import DataDir, IndexedJsonlWriter

    with IndexedJsonlWriter(DataDir(folder).prepared_data, "rows", new=True) as out:
        for i in range(n):
            length = row_tokens + i % 97 if row_tokens else 8 + i % 9
            out.write({"id": f"{i:016x}", "input_ids": [(i * 7 + k * 13) % 1000 for k in range(length)],
                       "loss_mask": [0] * 3 + [1] * (length - 3), "source": "bench"})
        out.commit()


def make_02_resume(folder: Path, n: int) -> None:
    """make_rows, and a stage-02 run stopped with 90 % of them journalled (run.json of this config, the journal of
    shard 0; no files: a resume opens none before its first request)."""
    make_rows(folder, n)
    from eagle3pipe.records import DataDir, HsJournalEntry, JsonlAppender

    dd = DataDir(folder)
    dd.hs_shard(0).mkdir(parents=True)
    with JsonlAppender(dd.hs_shard_journal(0)) as journal:
        for i in range(int(n * 0.9)):
            journal.write(HsJournalEntry(i, f"{i:016x}", i, 8 + i % 9, 1000).to_json())


def _same_length_ids(length: int) -> list[int]:
    """04's rows: a row's token ids depend on its length alone, so 9 sample files (8-16 tokens) serve N rows."""
    return [(7 + k * 13) % 1000 for k in range(length)]


def make_04_states(folder: Path, n: int, *, toy: Path) -> None:
    """Stage 02's output for N rows of 8-16 tokens, as 04 offline reads it: the rows (prepared data, for 03, and the
    speculators rows dataset of hidden_states/), the manifest, and a sample file per row: one random file per length
    written with records.py's writer, hard-linked for each row of that length (a copy every 60 000 links: 10^6 rows
    take ~18 files, not 12 GB)."""
    sys.path.insert(0, str(REPO))
    import torch

    from eagle3pipe.records import (DataDir, HiddenStatesManifest, IndexedJsonlWriter, hs_file_metadata,
                                    hs_layer_ids, save_hidden_states, save_hs_manifest, save_hs_rows)

    meta = json.loads((toy / "toy_verifier.json").read_text())
    num_layers = json.loads((toy / "config.json").read_text())["num_hidden_layers"]
    aux, hidden = meta["aux_layer_ids"], meta["hidden_size"]
    dd = DataDir(folder)
    lengths = [8 + i % 9 for i in range(n)]
    with IndexedJsonlWriter(dd.prepared_data, "rows", new=True) as out:
        for i, length in enumerate(lengths):
            out.write({"id": f"{i:016x}", "input_ids": _same_length_ids(length),
                       "loss_mask": [0] * 3 + [1] * (length - 3), "source": "bench"})
        out.commit()
    dd.hs_files.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    by_length = {}
    for length in range(8, 17):
        by_length[length] = folder / f"hs_length_{length}.safetensors"
        states = torch.randn(length, len(aux) + 1, hidden, generator=g).to(torch.bfloat16)  # [T, n, H]
        save_hidden_states(by_length[length], states, torch.tensor(_same_length_ids(length)), "bf16",
                           metadata=hs_file_metadata(hs_layer_ids(aux, num_layers), num_layers))
    links = dict.fromkeys(by_length, 0)
    for i, length in enumerate(lengths):
        if links[length] and links[length] % 60000 == 0:  # ext4 allows 65000 links to a file: a fresh copy
            shutil.copyfile(by_length[length], by_length[length].with_suffix(f".{links[length]}"))
            by_length[length] = by_length[length].with_suffix(f".{links[length]}")
        os.link(by_length[length], dd.hs_file(i))
        links[length] += 1
    save_hs_rows(dd.hidden_states, ((_same_length_ids(length), [0] * 3 + [1] * (length - 3)) for length in lengths))
    save_hs_manifest(dd.hs_manifest, HiddenStatesManifest(
        verifier=str(toy), num_layers=num_layers, aux_layer_ids=list(aux), hidden_size=hidden,
        model_dtype="bfloat16", storage_dtype="bf16", num_samples=n, num_tokens=sum(lengths), num_dropped=0,
        bytes=0, input=str(dd.prepared_data), config_hash="bench"))


class StopBench(Exception):
    """Raised once a stage has done the units the bench measures (its first and a bounded steady state): the bench
    stops the stage there."""


def steady_02(n: int) -> int:
    """02's bulk requests sent past the first: half the unfinished 10 %, at most 20 000 (as 01b's), so the stage
    is always stopped before its finalize (the rows journalled beforehand have no files). From 10^4 rows: below,
    the capture check's ~170 samples leave fewer bulk requests than that."""
    if n < 10000:
        raise SystemExit(f"stage 02 needs --sizes of 10000 or more (got {n}): its steady state is {n // 20} of the "
                         f"{n // 10} unfinished rows, of which the capture check takes ~170 first")
    return min(n // 20, 20000)


def _request_clock(limit: int | None) -> dict:
    """Time the requests stage 02's client sends (Extractor._request): when the first was sent (the capture
    check's, where there is one), when each bulk request's reply came (the check's, sent with prompt_logprobs,
    are not the steady state); with ``limit``, the stage is stopped at the bulk request after the first
    ``limit + 1``."""
    from eagle3pipe import extract_vllm

    clock: dict = {"sent": 0, "bulk_sent": 0, "replies": 0}
    request = extract_vllm.Extractor._request

    async def timed(self, idx, ids, path, prompt_logprobs):
        bulk = not prompt_logprobs
        if bulk and limit is not None and clock["bulk_sent"] > limit:
            raise StopBench
        clock["sent"] += 1
        clock["bulk_sent"] += bulk
        clock.setdefault("first", time.monotonic())
        reply = await request(self, idx, ids, path, prompt_logprobs)
        if bulk:
            now = time.monotonic()
            clock.setdefault("first_reply", now)
            clock["last_reply"] = now
            clock["replies"] += 1
        return reply

    extract_vllm.Extractor._request = timed
    return clock


def _step_clock(limit: int, requests: dict | None = None) -> dict:
    """Time 04's optimizer steps (TrainingLoop.train_step): the first done, then ``limit`` more (or every step
    when the run has fewer), then stop the stage; ``requests`` (a _request_clock): the requests sent by the
    first step's end and by the last's."""
    from eagle3pipe import train

    clock: dict = {"steps": 0}
    step = train.TrainingLoop.train_step

    def timed(self, *a, **kw):
        out = step(self, *a, **kw)
        now = time.monotonic()
        clock["steps"] += 1
        clock.setdefault("first", now)
        clock["last"] = now
        waited = self.waited.get("loader_wait_s", 0.0)  # the loop's wait for its data (the loader, or the spool)
        clock.setdefault("first_wait", waited)
        clock["last_wait"] = waited
        if requests is not None:
            clock.setdefault("first_sent", requests["sent"])
            clock["last_sent"] = requests["sent"]
        if clock["steps"] > limit:
            raise StopBench
        return out

    train.TrainingLoop.train_step = timed
    return clock


def _steps_timings(start: float, first: float, steps: dict) -> dict:
    return {"first_s": first - start, "steady_units": steps["steps"] - 1,
            "steady_s": steps["last"] - steps["first"], "steady_steps": steps["steps"] - 1,
            "steady_step_s": steps["last"] - steps["first"], "steady_wait_s": steps["last_wait"] - steps["first_wait"]}


# ---------------------------------------------------------------------------------------------------------------
# Stages: what the child runs. Each returns {"first_s": seconds from the stage call to its first unit of work,
# "steady_units": units after the first, "steady_s": their seconds}


def _config(toy: Path, data_dir: Path, **sections):
    from eagle3pipe.config import load_config

    meta = json.loads((toy / "toy_verifier.json").read_text())
    shared = {"data_dir": str(data_dir), "verifier": str(toy), "think_token_id": meta["think_token_id"],
              "response_token_id": meta["response_token_id"], "max_seq_len": 256, "progress_every_s": 3600.0,
              "vocab_size": meta["vocab_size"], "hidden_size": meta["hidden_size"],
              "aux_layer_ids": meta["aux_layer_ids"], "draft_vocab_size": 64}
    shared.update(sections.pop("shared", {}))
    return load_config(overrides={"shared": shared, **sections})


def _progress_clock(desc_prefix: str) -> dict:
    """Time the first and last Progress.update of the progress named ``desc_prefix``: the stage's row loop."""
    from eagle3pipe import progress

    clock: dict = {}
    update = progress.Progress.update

    def timed(self, *args, **kwargs):
        if self.desc.startswith(desc_prefix):
            now = time.monotonic()
            clock.setdefault("first", now)
            clock["last"] = now
            clock["calls"] = clock.get("calls", 0) + 1
        return update(self, *args, **kwargs)

    progress.Progress.update = timed
    return clock


def run_01(toy: Path, work: Path, n: int, args) -> dict:
    import dataclasses as dc

    from eagle3pipe.config import PrepareConfig
    from eagle3pipe.prepare import run_prepare

    prepare = {"dataset": [str(work / "input" / "chats.jsonl")], "max_samples": 0}
    if args.num_proc and "num_proc" in {f.name for f in dc.fields(PrepareConfig)}:
        prepare["num_proc"] = args.num_proc
    cfg = _config(toy, work / "run", prepare=prepare, shared={"max_seq_len": 65536})  # --answer-words rows kept whole
    clock = _progress_clock("Prepare")
    start = time.monotonic()
    run_prepare(cfg)
    return {"first_s": clock["first"] - start, "steady_units": clock["calls"] - 1,
            "steady_s": clock["last"] - clock["first"]}


def run_01b(toy: Path, work: Path, n: int, args) -> dict:
    import urllib.request

    from eagle3pipe.generate import run_generate

    cfg = _config(toy, work / "run", shared={"vllm_url": [args.stub_url]},
                  generate={"served_model_name": "stub", "min_completion_tokens": 1, "max_samples": 0,
                            "concurrency": 64, "max_retries": 0})
    urllib.request.urlopen(urllib.request.Request(args.stub_url + "/reset", method="POST")).read()
    start = time.time()
    summary = run_generate(cfg)
    stats = json.loads(urllib.request.urlopen(args.stub_url + "/stats").read())
    assert summary["finished"] == unfinished_01b(n) == stats["count"], (summary, stats)
    return {"first_s": stats["first"] - start, "steady_units": stats["count"] - 1,
            "steady_s": stats["last"] - stats["first"]}


def run_03(toy: Path, work: Path, n: int, args) -> dict:
    from eagle3pipe.vocab import run_vocab

    cfg = _config(toy, work / "run", extract={"input": "prepared"})
    clock = _progress_clock("Counting")
    start = time.monotonic()
    run_vocab(cfg)
    return {"first_s": clock["first"] - start, "steady_units": clock["calls"] - 1,
            "steady_s": clock["last"] - clock["first"]}


def run_02(toy: Path, work: Path, n: int, args) -> dict:
    from eagle3pipe.extract import run_extract

    # verify_min_agreement 0: the stub's states are random, so their top-1 is not the one it answers; the check's
    # work (its requests, the head loaded, the files read and compared) is done all the same, first, as on vLLM
    cfg = _config(toy, work / "run", extract={"input": "prepared", "backend": "vllm", "extract_url": [args.stub_url],
                                              "model_dtype": "bfloat16", "verify_min_agreement": 0.0})
    clock = _request_clock(steady_02(n))
    start = time.monotonic()
    try:
        run_extract(cfg)
    except StopBench:
        pass
    # the bulk requests still in flight when the stage stops are cancelled: a few fewer replies than sent
    assert clock["replies"] > steady_02(n) // 2, clock
    return {"first_s": clock["first"] - start, "steady_units": clock["replies"] - 1,
            "steady_s": clock["last_reply"] - clock["first_reply"]}


def run_04on(toy: Path, work: Path, n: int, args) -> dict:
    from eagle3pipe.train import run_train
    from eagle3pipe.vocab import run_vocab

    # no capture check: its request comes before the run's plan is made, the first row's after
    row_len = 1 << (args.row_tokens + 96).bit_length() if args.row_tokens else 256  # a packed row holds the longest
    sections = {"shared": {"max_seq_len": row_len},
                "extract": {"input": "prepared", "backend": "vllm", "extract_url": [args.stub_url],
                            "model_dtype": "bfloat16", "verify_tokens": 0},
                "train": {"data_source": "online", "epochs": 2, "device": "cpu", "total_seq_len": row_len,
                          "num_workers": 0, "eval_fraction": 0.0, "cpu_threads": 1}}
    run_vocab(_config(toy, work / "run", **json.loads(json.dumps(sections))))  # 03's output (flat), not timed
    cfg = _config(toy, work / "run", **sections)
    # a spool of 4 full rows: what the prefetcher admits ahead of the loop (each row a slot and its requests'
    # tasks) is bounded by spool_gb whatever N; 0.5 GB held ~3800 of these rows, which would count in the peak
    from eagle3pipe.records import hs_bytes_estimate

    cfg.train.spool_gb = 4 * hs_bytes_estimate(cfg.train.total_seq_len, 1, len(cfg.shared.aux_layer_ids) + 1,
                                               cfg.shared.hidden_size, cfg.extract.storage_dtype) / 1e9
    requests = _request_clock(None)
    steps = _step_clock(args.steady_steps, requests)
    start = time.monotonic()
    try:
        run_train(cfg)
    except StopBench:
        pass
    # steady: the steps after the first, and the requests the prefetcher sent meanwhile (it runs ahead of the
    # loop by the spool, 4 rows, at both ends)
    return {**_steps_timings(start, requests["first"], steps),
            "steady_units": steps["last_sent"] - steps["first_sent"]}


def run_04(toy: Path, work: Path, n: int, args) -> dict:
    from eagle3pipe import train
    from eagle3pipe.vocab import run_vocab

    # hidden_states/ is the input's (read only, N hard links); vocab/ and train/ are written in the run folder
    from eagle3pipe.records import DataDir

    given, run = DataDir(work / "input"), DataDir(work / "run")
    run.root.mkdir(parents=True, exist_ok=True)
    for folder in ("prepared", "hidden_states"):
        getattr(run, folder).symlink_to(getattr(given, folder).resolve())
    run = run.root
    sections = {"extract": {"input": "prepared", "model_dtype": "bfloat16"},
                "train": {"data_source": "offline", "epochs": 2, "device": "cpu", "total_seq_len": 256,
                          "num_workers": 0, "eval_fraction": 0.0, "cpu_threads": 1}}
    # cpu_threads 1 (04on too): with torch's 2 threads on the 2 shared cores a toy step took 4-5x longer and
    # followed the other sessions' load (0.06-1.8 s a step at 10^4-10^6 rows); configs/demo.yaml does the same
    run_vocab(_config(toy, run, **json.loads(json.dumps(sections))))  # 03's output (flat), not timed
    cfg = _config(toy, run, **sections)
    steps = _step_clock(args.steady_steps)
    start = time.monotonic()
    try:
        train.run_train(cfg)
    except StopBench:
        pass
    return _steps_timings(start, steps["first"], steps)


@dataclasses.dataclass
class Stage:
    make: Callable[[Path, int], None]  # inputs for n rows into a folder (parent, once per size)
    inputs: str  # "input": the folder is read only; "run": the stage writes into it (copied afresh per run)
    run: Callable  # in the child: (toy, work, n, args) -> timings
    unit: str
    modules: tuple  # the stage's modules and what it imports on its way (imported before the baseline RSS)


STAGES = {
    # transformers' AutoTokenizer: eagle3pipe.chat imports it when a tokenizer is loaded (112c2ff), inside the stage
    "01": Stage(make_conversations, "input", run_01, "rows", ("eagle3pipe.prepare",
                                                              "transformers.models.auto.tokenization_auto")),
    "01b": Stage(make_01b_resume, "run", run_01b, "requests", ("eagle3pipe.generate",
                                                               "transformers.models.auto.tokenization_auto")),
    "03": Stage(make_rows, "run", run_03, "rows", ("eagle3pipe.vocab", "speculators.train.vocab_mapping")),
    "02": Stage(make_02_resume, "run", run_02, "requests", ("eagle3pipe.extract", "eagle3pipe.extract_vllm",
                                                             "datasets")),
    "04": Stage(make_04_states, "input", run_04, "steps", ("eagle3pipe.train", "eagle3pipe.vocab", "datasets",
                                                           "speculators.train.vocab_mapping",
                                                           "speculators.train.data")),
    "04on": Stage(make_rows, "run", run_04on, "requests", ("eagle3pipe.train", "eagle3pipe.train_online",
                                                                "eagle3pipe.vocab", "eagle3pipe.extract_vllm",
                                                                "speculators.train.vocab_mapping", "datasets")),
}


def child(args) -> None:
    """Run one stage once and print its figures as one JSON line."""
    import logging

    import psutil

    sys.path.insert(0, str(args.repo))
    os.chdir(args.repo)  # the package (and, for spawned workers, the stage module) from the checkout measured
    logging.basicConfig(level=getattr(logging, os.environ.get("BENCH_LOG", "WARNING")))  # INFO: the stages' lines
    work = Path(args.work)
    stage = STAGES[args.child]
    # the stage's module imported before the baseline: what the stage allocates is measured, not the libraries
    import importlib

    for module in stage.modules:
        importlib.import_module(module)

    me = psutil.Process()
    before = me.memory_info().rss
    anon_before, file_before = _rss_split()
    workers = {"peak": 0, "anon": anon_before, "file": file_before}
    stop = threading.Event()

    def sample() -> None:  # every 50 ms: this process's anonymous and file-backed RSS (the row indexes are memory
        while not stop.wait(0.05):  # maps: page cache, counted in RSS), and the worker processes' RSS summed
            total = 0  # (ru_maxrss of children would count the parent's pages each fork+exec copies for an instant)
            for c in me.children(recursive=True):
                try:
                    total += c.memory_info().rss
                except psutil.Error:
                    pass
            anon, file = _rss_split()
            workers.update(peak=max(workers["peak"], total), anon=max(workers["anon"], anon),
                           file=max(workers["file"], file))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cpu = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    wall = time.monotonic()
    timings = stage.run(Path(args.toy), work, args.size, args)
    wall = time.monotonic() - wall
    cpu = [(after.ru_utime + after.ru_stime) - (b.ru_utime + b.ru_stime)
           for b, after in zip(cpu, (resource.getrusage(resource.RUSAGE_SELF),
                                     resource.getrusage(resource.RUSAGE_CHILDREN)))]
    stop.set()
    sampler.join()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps({"stage": args.child, "rows": args.size, "rss_before": before, "rss_peak": peak,
                                  "anon_growth": workers["anon"] - anon_before,
                                  "file_growth": workers["file"] - file_before, "workers_peak": workers["peak"],
                                  "cpu_s": cpu[0], "workers_cpu_s": cpu[1], "wall_s": wall,
                                  "load": os.getloadavg()[0], **timings}), flush=True)


def _rss_split() -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes of this process, from /proc/self/status."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssFile:")):
            name, value = line.split(":")
            fields[name] = int(value.split()[0]) * 1024
    return fields.get("RssAnon", 0), fields.get("RssFile", 0)


# ---------------------------------------------------------------------------------------------------------------
# The stub that stands in for vLLM (01b, 02, 04on): answers every chat request at once with token ids; /stats says
# when the first and the last request came. Extraction requests (/v1/completions) are answered as our vLLM
# connector (eagle3pipe.vllm_connector) does: the prompt's states written with records.py's writer, atomically, to
# the path the request names, its metadata the toy verifier's layers; the states are random bf16 (one tensor per
# length, made once: the client checks their shape, dtype and finiteness, not their values)


def stub_server(port_file: str, toy: str | None = None) -> None:
    from aiohttp import web

    stats = {"first": None, "last": None, "count": 0}
    body = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "stub",
                       "choices": [{"index": 0, "finish_reason": "stop", "token_ids": [5, 6, 7, 8],
                                    "message": {"role": "assistant", "content": "4", "reasoning": "let me think"}}],
                       "prompt_token_ids": [1, 2, 3],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})

    async def chat(request):
        await request.read()
        now = time.time()
        if stats["first"] is None:
            stats["first"] = now
        stats["last"] = now
        stats["count"] += 1
        return web.Response(text=body, content_type="application/json")

    states_by_length: dict = {}
    if toy is not None:
        meta = json.loads((Path(toy) / "toy_verifier.json").read_text())
        num_layers = json.loads((Path(toy) / "config.json").read_text())["num_hidden_layers"]
        aux, hidden = meta["aux_layer_ids"], meta["hidden_size"]

    def write_states(path: str, ids: list[int], storage_dtype: str) -> None:
        import torch

        from eagle3pipe.records import hs_file_metadata, hs_layer_ids, save_hidden_states

        if len(ids) not in states_by_length:
            g = torch.Generator().manual_seed(len(ids))
            states_by_length[len(ids)] = torch.randn(len(ids), len(aux) + 1, hidden,
                                                     generator=g).to(torch.bfloat16)  # [T, n, H]
        save_hidden_states(Path(path), states_by_length[len(ids)], torch.tensor(ids), storage_dtype,
                           metadata=hs_file_metadata(hs_layer_ids(aux, num_layers), num_layers))

    async def completions(request):
        body = json.loads(await request.read())
        params = body["kv_transfer_params"]
        ids = body["prompt"]
        # in a thread, as the connector's writer: the file's fsync does not hold up the other requests
        await asyncio.get_running_loop().run_in_executor(None, write_states, params["hidden_states_path"], ids,
                                                         params.get("storage_dtype", "bf16"))
        choice = {"index": 0, "text": "x", "finish_reason": "length"}
        if body.get("prompt_logprobs"):  # vLLM's shape: None for the first token, then each prompt token's
            choice["prompt_logprobs"] = [None] + [{str(t): {"logprob": 0.0, "rank": 1, "decoded_token": "x"}}
                                                  for t in ids[1:]]
        return web.json_response({"id": "c", "object": "text_completion", "created": 0, "model": "stub",
                                  "choices": [choice], "kv_transfer_params": {"hidden_states_path":
                                                                              params["hidden_states_path"]},
                                  "usage": {"prompt_tokens": len(ids), "completion_tokens": 1}})

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model",
                                                              "max_model_len": 1 << 20}]})

    async def get_stats(request):
        return web.json_response(stats)

    async def reset(request):
        stats.update(first=None, last=None, count=0)
        return web.json_response(stats)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", models)
    app.router.add_get("/stats", get_stats)
    app.router.add_post("/reset", reset)

    async def main():
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        Path(port_file).write_text(str(port))
        while True:
            await asyncio.sleep(3600)

    import asyncio

    asyncio.run(main())


def measure_row_reads(folder: Path) -> dict:
    """Seconds to read one row by its index (RowIndex.row: a pread and a json.loads of its line), for rows of 10^3
    and 10^4 tokens: what a stage pays per row when it reads rows on demand instead of holding them."""
    import random

    sys.path.insert(0, str(REPO))
    from eagle3pipe.records import IndexedJsonlWriter, open_row_index

    out = {}
    rng = random.Random(0)
    for tokens in (1000, 10000):
        path = folder / f"rows_{tokens}.jsonl"
        with IndexedJsonlWriter(path, "rows", new=True) as w:
            for i in range(200):
                w.write({"id": f"{i:016x}", "input_ids": [rng.randrange(163840) for _ in range(tokens)],
                         "loss_mask": [0] * (tokens // 4) + [1] * (tokens - tokens // 4), "source": "bench"})
            w.commit()
        index = open_row_index(path, "rows")
        start = time.perf_counter()
        for _ in range(3):
            for i in range(len(index)):
                index.row(i)
        out[tokens] = (time.perf_counter() - start) / (3 * len(index))
    return out


# ---------------------------------------------------------------------------------------------------------------
# The parent


def fmt_bytes(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(b) < 1024 or unit == "TB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    ap.add_argument("--work", default="/tmp/bench_scale", help="inputs and outputs (kept between runs: inputs are "
                                                               "made once per size)")
    ap.add_argument("--repo", default=str(REPO), help="checkout whose eagle3pipe is measured (inputs: this one's)")
    ap.add_argument("--num-proc", type=int, default=0, help="stage 01's prepare.num_proc (0: its default)")
    ap.add_argument("--answer-words", type=int, default=0, help="stage 01: words added to each answer (long rows)")
    ap.add_argument("--steady-steps", type=int, default=30, help="04 / 04on: optimizer steps measured after the "
                                                                 "first (all when the run has fewer)")
    ap.add_argument("--tokens-per-row", type=float, default=1e4, help="for the projection to 1e9 / 6e9 tokens")
    ap.add_argument("--row-tokens", type=int, default=0, help="04on: rows of this many tokens (+0-96) instead of "
                                                              "8-16 (the rows dataset's cost grows with the tokens)")
    ap.add_argument("--again", action="store_true", help="04on: run it a second time on the first run's data dir "
                                                         "(a --resume or later run over the same rows) and report "
                                                         "its first request too")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--stub", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--toy", help=argparse.SUPPRESS)
    ap.add_argument("--stub-url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stub:
        return stub_server(args.stub, args.toy)
    if args.child:
        return child(args)

    sys.path.insert(0, str(REPO))
    from eagle3pipe.toy import build_toy_verifier

    work = Path(args.work)
    toy = work / "toy_llama"
    if not (toy / "toy_verifier.json").exists():
        build_toy_verifier(toy, "llama", seed=0, dtype="bfloat16")
    stub = None
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if {"01b", "02", "04on"} & set(args.stages):
        port_file = work / "stub.port"
        port_file.unlink(missing_ok=True)
        stub = subprocess.Popen([sys.executable, __file__, "--stub", str(port_file), "--toy", str(toy)],
                                env={**env, "PYTHONPATH": str(REPO)})  # the stub writes with this checkout's writer
        while not port_file.exists():
            time.sleep(0.1)
        args.stub_url = f"http://127.0.0.1:{port_file.read_text()}"
    results = []
    try:
        for n in args.sizes:
            for name in args.stages:
                stage = STAGES[name]
                long_rows = f"_w{args.answer_words}" if name == "01" and args.answer_words else ""
                long_rows += f"_t{args.row_tokens}" if name == "04on" and args.row_tokens else ""
                folder = work / f"{name}_{n}{long_rows}"
                template = folder / "template"
                if not (folder / "template.done").exists():
                    shutil.rmtree(folder, ignore_errors=True)
                    stage.make(template, n, **({"toy": toy} if name == "04" else {}),
                               **({"answer_words": args.answer_words} if name == "01" else {}),
                               **({"row_tokens": args.row_tokens} if name == "04on" else {}))
                    (folder / "template.done").write_text("")
                run_dir = folder / "run"
                shutil.rmtree(run_dir, ignore_errors=True)
                if stage.inputs == "run":
                    shutil.copytree(template, run_dir)
                else:
                    if not (folder / "input").is_symlink():
                        (folder / "input").symlink_to(template)
                argv = [sys.executable, __file__, "--child", name, "--size", str(n), "--work", str(folder),
                        "--toy", str(toy), "--repo", args.repo, "--num-proc", str(args.num_proc),
                        "--steady-steps", str(args.steady_steps), "--row-tokens", str(args.row_tokens)]
                if args.stub_url:
                    argv += ["--stub-url", args.stub_url]
                out = subprocess.run(argv, env=env, capture_output=True, text=True)
                line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
                if out.returncode or line is None:
                    print(out.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"stage {name} at {n} rows failed (exit {out.returncode})")
                r = json.loads(line[len("RESULT "):])
                if name == "04on" and args.again:  # the same data dir again: the rows dataset written before
                    again = subprocess.run(argv, env=env, capture_output=True, text=True)
                    line2 = next((x for x in again.stdout.splitlines() if x.startswith("RESULT ")), None)
                    if again.returncode or line2 is None:
                        print(again.stderr[-3000:], file=sys.stderr)
                        raise SystemExit(f"stage {name} again at {n} rows failed (exit {again.returncode})")
                    r["first_s_again"] = json.loads(line2[len("RESULT "):])["first_s"]
                r["growth"] = max(0, r["rss_peak"] - r["rss_before"])
                r["bytes_per_row"] = r["growth"] / n
                r["first_s_per_1e6_rows"] = r["first_s"] / n * 1e6
                r["steady_s_per_1e5"] = r["steady_s"] / max(1, r["steady_units"]) * 1e5
                per_step = ""
                if "steady_steps" in r:
                    r["steady_s_per_step"] = r["steady_step_s"] / max(1, r["steady_steps"])
                    per_step = (f" ({r['steady_steps']} steps, {r['steady_s_per_step']:.3f} s a step, of which "
                                f"{r['steady_wait_s'] / max(1, r['steady_steps']):.3f} s waiting for data)")
                results.append(r)
                print(f"{name:>4} {n:>9} rows: RSS {fmt_bytes(r['rss_before'])} -> peak {fmt_bytes(r['rss_peak'])} "
                      f"(+{fmt_bytes(r['growth'])}; sampled peaks: anonymous +{fmt_bytes(r['anon_growth'])}, "
                      f"file-backed +{fmt_bytes(r['file_growth'])}; workers {fmt_bytes(r['workers_peak'])}); first "
                      f"{stage.unit[:-1]} after {r['first_s']:.2f} s; steady {r['steady_s_per_1e5']:.1f} s per 1e5 "
                      f"{stage.unit}{per_step}; wall {r['wall_s']:.1f} s, CPU {r.get('cpu_s', 0):.1f} s (+ workers "
                      f"{r.get('workers_cpu_s', 0):.1f} s); load {r['load']:.1f}"
                      + (f"; run again on its data dir: first request after {r['first_s_again']:.2f} s"
                         if "first_s_again" in r else ""), flush=True)
                shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        if stub is not None:
            stub.terminate()
            stub.wait()
    print(f"\nper row, between the two largest sizes (constants cancel); projected to rows of "
          f"{args.tokens_per_row:.0f} tokens from the largest size:")
    slopes = {}
    for name in args.stages:
        runs = sorted((x for x in results if x["stage"] == name), key=lambda x: x["rows"])
        big = runs[-1]
        small = runs[-2] if len(runs) > 1 else {"rows": 0, "growth": 0, "first_s": 0.0}
        per_row = (big["growth"] - small["growth"]) / (big["rows"] - small["rows"])
        first_per_row = (big["first_s"] - small["first_s"]) / (big["rows"] - small["rows"])
        slopes[name] = {"bytes_per_row": per_row, "first_s_per_1e6_rows": first_per_row * 1e6,
                        "from_rows": small["rows"], "to_rows": big["rows"]}
        print(f"  {name:>4}: {per_row:.1f} B/row of RSS growth, first unit +{first_per_row * 1e6:.2f} s per 1e6 rows "
              f"({small['rows']} -> {big['rows']} rows)")
        for tokens in (1e9, 6e9):
            rows = tokens / args.tokens_per_row
            ram = big["growth"] + per_row * (rows - big["rows"])
            first = big["first_s"] + first_per_row * (rows - big["rows"])
            print(f"        at {tokens:.0e} tokens ({rows:,.0f} rows): RAM growth {fmt_bytes(ram)}, first unit after "
                  f"{first:.1f} s")
    reads = measure_row_reads(work)
    print("one row read by its index (RowIndex.row: pread + json.loads + checks): " +
          ", ".join(f"{reads[t] * 1e6:.0f} us at {t} tokens" for t in sorted(reads)))
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv, "results": results, "slopes": slopes,
                                               "row_read_s": reads}, indent=2))


if __name__ == "__main__":
    main()
