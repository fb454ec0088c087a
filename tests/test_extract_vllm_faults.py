"""Stage 02's vLLM client against a small server that misbehaves on purpose (what a real server cannot be made to do
on demand), through the stage's door: files that do not hold the row are redone, then listed as dropped for good;
transient failures (no file written, its lock still held) are redone, then left open and retried by a rerun, and
stop the stage while more than --max-error-share remain; a journalled file that went missing is re-extracted alone;
rows longer than the server's context are refused before anything is sent; a server set up with another storage
dtype or other layer ids (the file's metadata), or a connector that writes no finite flag, stops the stage at once;
the only server restarting on its port is used again at once by the samples waiting for it.
The real-server tests are in test_extract_vllm.py."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import threading
import time
import zlib
from collections import Counter
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import torch

from memory_bound import in_a_fresh_process
from eagle3pipe.cli import StageError, StageInterrupted, run_stage
from eagle3pipe.extract import STAGE, run_extract
from eagle3pipe.records import (
    HS_META_FINITE,
    DataDir,
    hs_file_metadata,
    load_hidden_states,
    load_hs_journal,
    load_hs_manifest,
    read_jsonl,
    save_hidden_states,
)

from test_extract import AUX, make_cfg, write_rows
from test_generate import REPO, DyingStub, StubHTTPServer, run_door_through_a_restart

MAX_MODEL_LEN = 30
LATE_HOLD_S = 1.5  # how long the stub keeps a request it will write late: past the doors' --request-timeout-s 1
NUM_LAYERS = 8
RIGHT_IDS = AUX + [NUM_LAYERS]


def stub_states(ids) -> torch.Tensor:
    """The states the stub computes for a prompt: a function of its token ids alone, so a test has each row's own
    states to compare a file with (random-looking: they never agree with a verifier's top-1)."""
    g = torch.Generator().manual_seed(zlib.crc32(json.dumps(list(ids)).encode()))
    return torch.randn(len(ids), 4, 128, generator=g)


class StubExtractionServer(DyingStub):
    """/v1/models and /v1/completions like an extraction server: writes a random sample file where the request
    asks, with our connector's metadata (``layer_ids`` captured from a ``NUM_LAYERS``-layer verifier, or ``meta``).
    ``bad(ids)`` says which prompts get a file with other token ids; ``dtype`` is what it stores. Faults a rerun
    must survive, switched per prompt through the sets: ``no_file`` (the writer failed: vLLM only logs it) and
    ``hold_lock`` (a lock held past the client's wait: a slow disk); ``late``: the prompt's first request gets no
    reply before the client gives up, and its file (other states: ``-stub_states``) is written late, as vLLM's
    connector writes an aborted request's, when the next request after its retry's reply arrives
    (``late_written``: where). ``prompt_logprobs`` are answered claiming the
    row's next token as top-1 (random states never agree with that: a wrong capture). ``die_after``: after that
    many completions it dies as a crashed node does (no reply, then the port refuses); ``port``: where it listens
    (0: a free one)."""

    def __init__(self, bad=lambda ids: False, dtype: str = "bf16", layer_ids: list[int] = RIGHT_IDS,
                 meta: dict | None = None, model: str = "stub", max_model_len: int = MAX_MODEL_LEN,
                 die_after: int | None = None, port: int = 0):
        self.requests: Counter = Counter()
        self.no_file: set[tuple] = set()
        self.hold_lock: set[tuple] = set()
        self.held: list[int] = []  # fds of the locks held
        self.late: set[tuple] = set()
        self.late_paths: dict[tuple, str] = {}  # prompt: the path its first (given up) request named
        self.late_due: tuple | None = None  # (path, ids) of the late write the next request triggers
        self.late_written: str | None = None
        self.die_after, self.posts, self.lock = die_after, 0, threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._reply({"object": "list", "data": [{"id": model, "object": "model",
                                                         "max_model_len": max_model_len}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    if stub.dies_now(self):
                        return  # no reply: the client sees the connection drop
                ids, path = body["prompt"], body["kv_transfer_params"]["hidden_states_path"]
                with stub.lock:
                    stub.requests[tuple(ids)] += 1
                    first = stub.requests[tuple(ids)] == 1
                    late_due, stub.late_due = stub.late_due, None
                if late_due is not None:  # the aborted request's write, after its retry's file was checked
                    late_path, late_ids = late_due
                    save_hidden_states(late_path, -stub_states(late_ids), torch.tensor(late_ids), dtype,
                                       metadata=hs_file_metadata(layer_ids, NUM_LAYERS))
                    stub.late_written = late_path
                if tuple(ids) in stub.late and first:
                    stub.late_paths[tuple(ids)] = path
                    time.sleep(LATE_HOLD_S)  # past the client's timeout: it gives up, vLLM would abort the request
                    self.close_connection = True
                    return
                if tuple(ids) in stub.hold_lock:
                    fd = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    stub.held.append(fd)
                elif tuple(ids) not in stub.no_file:
                    stored = [i + 1 for i in ids] if bad(ids) else ids
                    save_hidden_states(path, stub_states(ids), torch.tensor(stored), dtype,
                                       metadata=meta if meta is not None else hs_file_metadata(layer_ids, NUM_LAYERS))
                choice = {"index": 0, "text": "x", "finish_reason": "length"}
                if body.get("prompt_logprobs"):
                    choice["prompt_logprobs"] = [None] + [{str(t): {"logprob": -0.1, "rank": 1}} for t in ids[1:]]
                self._reply({"id": "c", "object": "text_completion", "model": model, "kv_transfer_params":
                             {"hidden_states_path": path}, "choices": [choice]})
                if tuple(ids) in stub.late_paths:  # the retry is answered: the given-up request's write comes next
                    with stub.lock:
                        stub.late_due = (stub.late_paths.pop(tuple(ids)), ids)

        self.httpd = StubHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def heal(self) -> None:
        """The disk is back: every prompt gets its file again, every lock is released."""
        self.no_file.clear()
        self.hold_lock.clear()
        for fd in self.held:
            os.close(fd)
        self.held.clear()

    def close(self) -> None:
        self.heal()
        super().close()


def _cfg(data_dir, verifier, url, **extract):
    extract = {"verify_tokens": 0, "max_retries": 2, "retry_backoff_s": 0.01, "concurrency": 3, **extract}
    cfg = make_cfg(data_dir, verifier, backend="vllm", extract_url=url if isinstance(url, list) else [url], **extract)
    cfg.validate("extract")
    return cfg


def _door(data_dir, verifier, url, capsys, *flags: str) -> tuple[int, str]:
    """Stage 02 through cli.run_stage (what 02_extract_hidden_states.py calls): (exit status, stderr)."""
    argv = ["--data-dir", str(data_dir), "--verifier", str(verifier), "--input", "prepared", "--aux-layer-ids",
            *map(str, AUX), "--hidden-size", "128", "--backend", "vllm", "--extract-url", url, "--verify-tokens", "0",
            "--max-retries", "2", "--retry-backoff-s", "0.01", "--concurrency", "3", "--request-timeout-s", "1",
            *flags]
    code = run_stage("extract", STAGE, run_extract, None, argv)
    return code, capsys.readouterr().err


def _ids(row) -> tuple:
    return tuple(row["input_ids"])


def _assert_complete(data_dir, rows) -> None:
    """hidden_states/ finished with every row, in input order, nothing listed."""
    dd = DataDir(data_dir)
    manifest = load_hs_manifest(dd.hs_manifest)
    assert manifest.num_samples == len(rows) and manifest.num_dropped == 0 and manifest.num_retryable == 0
    assert list(read_jsonl(dd.hs_errors)) == []
    for i, r in enumerate(rows):
        assert load_hidden_states(dd.hs_file(i))["token_ids"].tolist() == r["input_ids"]


def test_bad_files_are_redone_then_listed(tmp_path, toy_llama):
    rows = write_rows(tmp_path, 12, seed=1, min_len=4, max_len=MAX_MODEL_LEN - 1)
    bad = {_ids(r) for r in rows[::4]}
    stub = StubExtractionServer(bad=lambda ids: tuple(ids) in bad)
    try:
        manifest = run_extract(_cfg(tmp_path, toy_llama, stub.url))
    finally:
        stub.close()
    errors = {e["id"]: e["reason"] for e in read_jsonl(DataDir(tmp_path).hs_errors)}
    for r in rows:
        if _ids(r) in bad:  # the content is wrong: a permanent drop, listed
            assert errors[r["id"]].startswith("file check failed 3 times: ") and "token_ids differ" in errors[r["id"]]
            assert stub.requests[_ids(r)] == 3  # first try and both retries
        else:
            assert r["id"] not in errors and stub.requests[_ids(r)] == 1
    kept = [r for r in rows if _ids(r) not in bad]
    assert manifest.num_samples == len(kept) and manifest.num_dropped == len(bad) and manifest.num_retryable == 0
    for i, r in enumerate(kept):
        assert load_hidden_states(DataDir(tmp_path).hs_file(i))["token_ids"].tolist() == r["input_ids"]


# -- issue 19 item 1: transient failures are never dropped for good --------------------------------------------------


def test_transient_failures_stay_open_and_a_rerun_retries_exactly_them(tmp_path, toy_llama, capsys):
    """The server wrote no file (its writer hit ENOSPC: vLLM only logs it) for two rows, and holds a third's lock past
    the client's wait (a slow disk): 02 exits 2 without a manifest, journals none of them, lists none as dropped;
    once the disk is back, the same command sends exactly those three again and finishes with every row."""
    rows = write_rows(tmp_path, 10, seed=4, min_len=4, max_len=20)
    flaky = {1, 3, 6}
    stub = StubExtractionServer()
    stub.no_file = {_ids(rows[1]), _ids(rows[6])}
    stub.hold_lock = {_ids(rows[3])}
    dd = DataDir(tmp_path)
    try:
        code, err = _door(tmp_path, toy_llama, stub.url, capsys)
        last = err.strip().splitlines()[-1]
        assert code == 2 and last.startswith("error: 3 of 10 samples are not extracted after 3 attempts ("), err
        assert "no_file 2" in last and "lock_held 1" in last and "allowed: 0 (--max-error-share 0)" in last
        assert "retry exactly these 3 samples" in last
        assert load_hs_manifest(dd.hs_manifest) is None and not dd.hs_errors.exists()
        journal = load_hs_journal(dd.hs_shard_journal(0))
        assert sorted(e.position for e in journal) == sorted(set(range(10)) - flaky)
        assert all(e.local_index >= 0 for e in journal)  # nothing journalled as dropped
        assert all(stub.requests[_ids(rows[i])] == 3 for i in flaky)
        stub.heal()
        code, err = _door(tmp_path, toy_llama, stub.url, capsys)
        assert code == 0, err
    finally:
        stub.close()
    _assert_complete(tmp_path, rows)
    assert [stub.requests[_ids(r)] for r in rows] == [4 if i in flaky else 1 for i in range(10)]


def test_open_samples_within_the_error_share_are_listed_and_a_rerun_retries_them(tmp_path, toy_llama, capsys):
    """--max-error-share 0.1 lets 02 finish with 1 of 10 rows left open: listed in errors.jsonl as retryable and
    counted in the manifest; the rerun reopens hidden_states/, sends only that row and renumbers the files."""
    rows = write_rows(tmp_path, 10, seed=5, min_len=4, max_len=20)
    stub = StubExtractionServer()
    stub.no_file = {_ids(rows[2])}
    dd = DataDir(tmp_path)
    try:
        code, err = _door(tmp_path, toy_llama, stub.url, capsys, "--max-error-share", "0.1")
        assert code == 0, err
        manifest = load_hs_manifest(dd.hs_manifest)
        assert (manifest.num_samples, manifest.num_dropped, manifest.num_retryable) == (9, 1, 1)
        (listed,) = read_jsonl(dd.hs_errors)
        assert listed["id"] == rows[2]["id"] and listed["reason"].startswith("retryable: no_file: ")
        kept = [r for i, r in enumerate(rows) if i != 2]
        assert [load_hidden_states(dd.hs_file(i))["token_ids"].tolist() for i in range(9)] == \
            [r["input_ids"] for r in kept]
        stub.heal()
        code, err = _door(tmp_path, toy_llama, stub.url, capsys, "--max-error-share", "0.1")
        assert code == 0, err
    finally:
        stub.close()
    _assert_complete(tmp_path, rows)
    assert [stub.requests[_ids(r)] for r in rows] == [4 if i == 2 else 1 for i in range(10)]


def _assert_each_file_holds_its_row(data_dir, rows) -> None:
    """hidden_states/ finished with every row, and hs_i holds row i's own token ids and states (the stub's states are
    a function of the row's ids: stub_states is the per-row reference)."""
    dd = DataDir(data_dir)
    manifest = load_hs_manifest(dd.hs_manifest)
    assert (manifest.num_samples, manifest.num_dropped, manifest.num_retryable) == (len(rows), 0, 0)
    for i, r in enumerate(rows):
        data = load_hidden_states(dd.hs_file(i))
        assert data["token_ids"].tolist() == r["input_ids"], f"hs_{i} holds another row's token ids"
        assert torch.equal(data["hidden_states"], stub_states(r["input_ids"]).to(torch.bfloat16)), \
            f"hs_{i} does not hold row {i}'s own states"


def _interrupt_finalize_after(monkeypatch, dd, renames: int) -> list:
    """SIGTERM's effect (cli's StageInterrupted) after ``renames`` of finalize's renames into hidden_states/: the
    os.replace of every other write goes through."""
    real_replace, done = os.replace, []

    def replace(src, dst, **kw):
        into_output = Path(dst).parent == dd.hs_files
        if into_output and len(done) >= renames:
            raise StageInterrupted(128 + signal.SIGTERM)
        real_replace(src, dst, **kw)
        if into_output:
            done.append(Path(dst).name)

    monkeypatch.setattr(os, "replace", replace)
    return done


def test_an_interrupted_finalize_with_a_sample_left_open_pairs_every_file_with_its_row(tmp_path, toy_llama, capsys,
                                                                                      monkeypatch):
    """Issue 26 item 1. --max-error-share 0.1 leaves row 2 open, so finalize numbers the files without it (row 3 ->
    hs_2, ...); SIGTERM lands after 5 of its 9 renames. The rerun extracts row 2 and finishes: every hs_i must hold
    row i's token ids and states. Before the finalize plan, the rerun renumbered from its own journals: row 2's file
    overwrote hs_2 (row 3's states), hs_3 and hs_4 kept rows 4 and 5, and a third run finished with them."""
    rows = write_rows(tmp_path, 10, seed=5, min_len=4, max_len=20)
    stub = StubExtractionServer()
    stub.no_file = {_ids(rows[2])}
    dd = DataDir(tmp_path)
    try:
        renamed = _interrupt_finalize_after(monkeypatch, dd, 5)
        code, err = _door(tmp_path, toy_llama, stub.url, capsys, "--max-error-share", "0.1")
        monkeypatch.undo()
        assert code == 128 + signal.SIGTERM and len(renamed) == 5, err
        assert load_hs_manifest(dd.hs_manifest) is None
        stub.heal()
        runs = []
        while len(runs) < 3 and (not runs or runs[-1][0] == 2):  # as a user would: rerun while told to
            runs.append(_door(tmp_path, toy_llama, stub.url, capsys, "--max-error-share", "0.1"))
    finally:
        stub.close()
    assert runs[-1][0] == 0, runs[-1][1]
    _assert_each_file_holds_its_row(tmp_path, rows)
    assert len(runs) == 1, [err.strip().splitlines()[-1] for _, err in runs]  # one rerun, nothing lost on the way
    assert not list(dd.hs_shard(0).glob("*.safetensors")) and not list(dd.hs_shard(1).glob("*.safetensors"))


def test_a_finalize_plan_left_as_json_by_the_code_before_issue_27_is_followed(tmp_path, toy_llama, capsys,
                                                                              monkeypatch):
    """Issue 27 moved the finalize plan from work/finalize.json (a JSON list) to an int64 array (finalize_plan.npy).
    A finalize of the code before, interrupted after 5 renames with row 2 left open, left its plan as JSON: the rerun
    reads it, puts the 5 files back by it and renumbers, so every hs_i holds row i (renumbering without it would
    mis-pair them, as in the issue 26 test above); the JSON plan is replaced by the array."""
    import numpy as np

    rows = write_rows(tmp_path, 10, seed=5, min_len=4, max_len=20)
    stub = StubExtractionServer()
    stub.no_file = {_ids(rows[2])}
    dd = DataDir(tmp_path)
    try:
        renamed = _interrupt_finalize_after(monkeypatch, dd, 5)
        code, err = _door(tmp_path, toy_llama, stub.url, capsys, "--max-error-share", "0.1")
        monkeypatch.undo()
        assert code == 128 + signal.SIGTERM and len(renamed) == 5, err
        plan = np.load(dd.hs_finalize_plan).tolist()
        dd.hs_finalize_plan.unlink()
        dd.hs_finalize_plan_v1.write_text(json.dumps({"format_version": 2, "files": plan}))  # as the code before
        stub.heal()
        code, err = _door(tmp_path, toy_llama, stub.url, capsys, "--max-error-share", "0.1")
    finally:
        stub.close()
    assert code == 0, err
    _assert_each_file_holds_its_row(tmp_path, rows)
    assert dd.hs_finalize_plan.exists() and not dd.hs_finalize_plan_v1.exists()


@pytest.mark.parametrize("left", ["interrupted", "finished"])
def test_an_output_of_the_code_before_the_finalize_plan(tmp_path, toy_llama, capsys, monkeypatch, left):
    """An output with no finalize plan (work/finalize.json), as the code before issue 26 left one, row 2 open: when
    its finalize was interrupted (files already renumbered without row 2), the rerun refuses, naming the first file
    that holds another row and --overwrite, and renames nothing; when it finished, the rerun's reopen takes the plan
    from the journals (the ones that finalize renamed from) and every file ends with its row."""
    rows = write_rows(tmp_path, 10, seed=5, min_len=4, max_len=20)
    stub = StubExtractionServer()
    stub.no_file = {_ids(rows[2])}
    dd = DataDir(tmp_path)
    try:
        if left == "interrupted":
            _interrupt_finalize_after(monkeypatch, dd, 5)
        code, err = _door(tmp_path, toy_llama, stub.url, capsys, "--max-error-share", "0.1")
        monkeypatch.undo()
        assert code == (128 + signal.SIGTERM if left == "interrupted" else 0), err
        dd.hs_finalize_plan.unlink()
        before = {p.name: p.read_bytes() for p in dd.hs_files.glob("*.safetensors")}
        stub.heal()
        code, err = _door(tmp_path, toy_llama, stub.url, capsys, "--max-error-share", "0.1")
    finally:
        stub.close()
    if left == "finished":
        assert code == 0, err
        _assert_each_file_holds_its_row(tmp_path, rows)
        return
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"error: {dd.hs_file(3)} holds other token ids than row row3 (line 4)"), err
    assert last.endswith("Rerun with --overwrite to extract them again")
    assert {p.name: p.read_bytes() for p in dd.hs_files.glob("*.safetensors")} == before  # nothing renamed
    assert load_hs_manifest(dd.hs_manifest) is None


def test_a_late_write_of_an_aborted_attempt_never_replaces_the_checked_file(tmp_path, toy_llama, capsys):
    """Issue 26 item 2. The longest row's first request gets no reply within --request-timeout-s (the client gives
    up; vLLM aborts the request and its connector still writes the file): the retry's file is checked and kept,
    then the aborted attempt's file lands, with other states, before the next sample is sent. Every hs_i must hold
    its row's own states (before: both attempts named the same path, and the late write replaced the checked file),
    and no attempt's file is left anywhere in hidden_states/."""
    rows = write_rows(tmp_path, 6, seed=8, min_len=4, max_len=20)
    longest = max(rows, key=lambda r: len(r["input_ids"]))  # sent first (longest first), with more to follow
    stub = StubExtractionServer()
    stub.late = {_ids(longest)}
    dd = DataDir(tmp_path)
    try:
        code, err = _door(tmp_path, toy_llama, stub.url, capsys, "--concurrency", "1")
    finally:
        stub.close()
    assert code == 0, err
    assert stub.requests[_ids(longest)] == 2 and stub.late_written is not None  # the late write happened
    _assert_each_file_holds_its_row(tmp_path, rows)
    assert sorted(p.name for p in dd.hs_files.iterdir()) == sorted(f"hs_{i}.safetensors" for i in range(len(rows)))
    left = [p for p in dd.hs_work.rglob("*") if p.is_file() and p.name not in ("done.jsonl", "run.json",
                                                                                dd.hs_finalize_plan.name)]
    assert left == [], left


def test_check_file_refuses_states_shorter_than_the_token_ids(tmp_path):
    """Issue 26 item 2 (stage 02's side): a file with the row's token ids and metadata but 16 fewer state rows."""
    from eagle3pipe.extract_vllm import BadSample, check_file
    from eagle3pipe.records import save_tensors_atomic

    ids = list(range(40))
    path = tmp_path / "hs_0.safetensors"
    save_tensors_atomic(path, {"hidden_states": stub_states(ids)[:-16].to(torch.bfloat16).contiguous(),
                               "token_ids": torch.tensor(ids)}, hs_file_metadata(RIGHT_IDS, NUM_LAYERS))
    with pytest.raises(BadSample, match=r"hidden_states \(24, 4, 128\), expected \(40, 4, 128\)") as e:
        check_file(path, ids, AUX, NUM_LAYERS, 128, "bf16")
    assert e.value.kind == BadSample.PERMANENT


def test_a_journalled_file_gone_missing_is_re_extracted_alone(tmp_path, toy_llama, capsys):
    """A file journalled as written but gone before finalize (deleted, a lost disk): 02 removes its journal line and
    says so (no --overwrite, which would redo every row); the next run extracts that row only."""
    rows = write_rows(tmp_path, 8, seed=6, min_len=4, max_len=20)
    stub = StubExtractionServer()
    stub.hold_lock = {_ids(rows[5])}  # the first run stops before finalize: exit 2
    dd = DataDir(tmp_path)
    try:
        assert _door(tmp_path, toy_llama, stub.url, capsys)[0] == 2
        (lost,) = [e for e in load_hs_journal(dd.hs_shard_journal(0)) if e.position == 2]
        dd.hs_shard_file(0, lost.local_index).unlink()
        stub.heal()
        code, err = _door(tmp_path, toy_llama, stub.url, capsys)
        last = err.strip().splitlines()[-1]
        assert code == 2 and last.startswith("error: 1 samples journalled as written have no file (first: row row2, "
                                             "line 3: "), err
        assert "rerun the stage to re-extract exactly them" in last and "--overwrite" not in last
        code, err = _door(tmp_path, toy_llama, stub.url, capsys)
        assert code == 0, err
    finally:
        stub.close()
    _assert_complete(tmp_path, rows)
    assert [stub.requests[_ids(r)] for r in rows] == [2 if i == 2 else 4 if i == 5 else 1 for i in range(8)]


def test_rows_longer_than_the_servers_context_are_refused_before_anything_is_sent(tmp_path, toy_llama, capsys):
    """vLLM needs room for the prompt and the 1 generated token: rows of max_model_len tokens or more (here 30 and
    33 tokens; the 29-token row fits) are refused, counted, with the flag that fixes it."""
    rows = write_rows(tmp_path, 12, seed=6, min_len=4, max_len=34)
    assert sorted(len(r["input_ids"]) for r in rows)[-3:] == [29, 30, 33]
    stub = StubExtractionServer()
    try:
        code, err = _door(tmp_path, toy_llama, stub.url, capsys)
    finally:
        stub.close()
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"error: 2 of 12 rows have {MAX_MODEL_LEN} tokens or more (the longest: "
                                         "row row3, line 4, 33 tokens)"), err
    assert "--max-model-len 34 or more" in last and "Nothing was sent" in last
    assert sum(stub.requests.values()) == 0
    assert load_hs_manifest(DataDir(tmp_path).hs_manifest) is None


# -- a server set up otherwise than the config: the stage stops at once ---------------------------------------------


def test_a_server_storing_another_dtype_stops_the_stage_at_once(tmp_path, toy_llama):
    write_rows(tmp_path, 6, seed=2, min_len=4, max_len=20)
    stub = StubExtractionServer(dtype="bf16")
    try:
        with pytest.raises(StageError, match="stored as BF16, extract.storage_dtype is fp8"):
            run_extract(_cfg(tmp_path, toy_llama, stub.url, storage_dtype="fp8"))
    finally:
        stub.close()
    assert sum(stub.requests.values()) <= 3  # the requests already in flight, no retries, nothing more
    assert load_hs_manifest(DataDir(tmp_path).hs_manifest) is None


def test_a_closed_first_url_and_a_server_dying_mid_run_leave_the_run_to_the_servers_that_answer(tmp_path, toy_llama,
                                                                                               caplog):
    """Three --extract-urls: a closed port first (today's code exited 2 at start: "cannot list models"), a server
    that dies after 4 samples, and a healthy one: every row is extracted, nothing dropped, both dead ones named."""
    import logging

    from eagle3pipe.server import free_port

    rows = write_rows(tmp_path, 30, seed=4, min_len=4, max_len=MAX_MODEL_LEN - 2)
    closed = f"http://127.0.0.1:{free_port()}"
    dying, healthy = StubExtractionServer(die_after=4), StubExtractionServer()
    try:
        with caplog.at_level(logging.WARNING, logger="eagle3pipe.vllm_client"):
            manifest = run_extract(_cfg(tmp_path, toy_llama, [closed, dying.url, healthy.url], max_retries=1))
    finally:
        dying.close()
        healthy.close()
    assert manifest.num_samples == len(rows) and manifest.num_dropped == 0
    for i, r in enumerate(rows):
        assert load_hidden_states(DataDir(tmp_path).hs_file(i))["token_ids"].tolist() == r["input_ids"]
    assert dying.posts > 4 and sum(healthy.requests.values()) >= len(rows) - 4
    aside = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
    assert any(closed in m for m in aside) and any(dying.url in m for m in aside)


def test_a_server_restarting_on_its_port_is_used_at_once_by_the_samples_waiting_for_it(tmp_path, toy_llama):
    """Stage 02's only server dies after 4 of 16 samples (the request in hand unanswered, the port then refused) and a
    new one listens on its port as soon as it is gone; retries back off 300 s (capped at 60 s). The stage (its door,
    in a thread of the test) ends with every row extracted and nothing listed, the rest by the new server: the
    samples waiting for a server (Extractor.one, also 04 online's) woke when the pool took it back. A deadline
    guard, not a speed measurement (RESTART_GUARD_S): before ServerPool.wait_to_retry each retry slept out its
    backoff (>= 48 s) and the test failed at the guard."""
    rows = write_rows(tmp_path, 16, seed=5, min_len=4, max_len=MAX_MODEL_LEN - 2)
    dying = StubExtractionServer(die_after=4)
    port = dying.httpd.server_address[1]
    argv = [sys.executable, str(REPO / "02_extract_hidden_states.py"), "--data-dir", str(tmp_path), "--verifier",
            str(toy_llama), "--input", "prepared", "--aux-layer-ids", *map(str, AUX), "--hidden-size", "128",
            "--backend", "vllm", "--extract-url", dying.url, "--verify-tokens", "0", "--max-retries", "2",
            "--retry-backoff-s", "300", "--concurrency", "3"]
    try:
        code, err, revived = run_door_through_a_restart(argv, dying,
                                                        lambda: StubExtractionServer(port=port))
    finally:
        dying.close()
    revived.close()
    assert code == 0, err
    _assert_complete(tmp_path, rows)
    assert dying.posts > 4 and sum(revived.requests.values()) >= len(rows) - 4  # the old one wrote 4, the new the rest
    assert "set aside" in err and "answers again: taken back" in err


@pytest.mark.parametrize("case", ["other_layer_ids", "no_finite_flag"])
def test_a_server_capturing_other_layers_or_without_the_finite_flag_stops_the_stage(tmp_path, toy_llama, capsys,
                                                                                    case):
    """The file's metadata names the layers the server captured: [1, 3, 4, 8] (the other convention: the output of
    layer k - 1, same final state, so the top-1 check passes it) is refused at once, naming the server and both id
    lists; so is a file without the finite flag (vLLM's own connector writes none: NaN would pass unseen)."""
    write_rows(tmp_path, 6, seed=2, min_len=4, max_len=20)
    if case == "other_layer_ids":
        stub = StubExtractionServer(layer_ids=[1, 3, 4, 8])
    else:
        stub = StubExtractionServer(meta={k: v for k, v in hs_file_metadata(RIGHT_IDS, NUM_LAYERS).items()
                                          if k != HS_META_FINITE})
    try:
        code, err = _door(tmp_path, toy_llama, stub.url, capsys)
    finally:
        stub.close()
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"error: {stub.url}: "), err
    if case == "other_layer_ids":
        assert "states of layer ids [1, 3, 4, 8] from a 8-layer verifier" in last and f"stores {RIGHT_IDS}" in last
    else:
        assert "its metadata lacks ['all_finite']" in last
    assert sum(stub.requests.values()) <= 3  # the requests already in flight, no retries, nothing more
    assert load_hs_manifest(DataDir(tmp_path).hs_manifest) is None


# -- issue 26 item 6: a server taken back must serve what the run started with ---------------------------------------


@pytest.mark.parametrize("back_as", ["another_model", "a_shorter_context"])
def test_a_server_back_with_another_model_or_a_shorter_context_gets_no_sample(tmp_path, toy_llama, back_as):
    """Stage 02's only server dies after 4 samples and a server listens on its port at once, serving another model,
    or the same one with a max_model_len below the one the rows were checked against. Before, the pool took it back
    without reading /v1/models again (it had answered before) and sent it every other sample; now it names the
    server and what it serves, leaves it aside, and the stage stops with the rest open (exit 2)."""
    rows = write_rows(tmp_path, 16, seed=5, min_len=4, max_len=MAX_MODEL_LEN - 2)
    dying = StubExtractionServer(die_after=4)
    port = dying.httpd.server_address[1]
    argv = [sys.executable, str(REPO / "02_extract_hidden_states.py"), "--data-dir", str(tmp_path), "--verifier",
            str(toy_llama), "--input", "prepared", "--aux-layer-ids", *map(str, AUX), "--hidden-size", "128",
            "--backend", "vllm", "--extract-url", dying.url, "--verify-tokens", "0", "--max-retries", "2",
            "--retry-backoff-s", "1", "--concurrency", "4"]  # each sample's last attempt after the first probe (1 s)
    back = {"model": "other"} if back_as == "another_model" else {"max_model_len": MAX_MODEL_LEN - 10}
    try:
        code, err, revived = run_door_through_a_restart(argv, dying,
                                                        lambda: StubExtractionServer(port=port, **back))
    finally:
        dying.close()
    revived.close()
    why = ("serves other, not stub" if back_as == "another_model"
           else f"max_model_len {MAX_MODEL_LEN - 10}, less than the {MAX_MODEL_LEN} the run started with")
    assert sum(revived.requests.values()) == 0, err[-3000:]
    assert f"{dying.url} answers again but {why}: left aside" in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert code == 2 and "samples are not extracted after 3 attempts" in last and why in last, last
    assert load_hs_manifest(DataDir(tmp_path).hs_manifest) is None and len(rows) == 16


# -- issue 27: stage 02 at 10^6 rows keeps an index, not the rows ----------------------------------------------------


class FirstRequest(Exception):
    """Raised where stage 02 would send its first request (what the memory test measures up to)."""


def _journalled(data_dir: Path, rows: list[dict], done: int) -> None:
    """A shard as a run killed after ``done`` samples leaves it: their journal lines and (empty) files; the row index
    built (as stage 01 leaves it)."""
    from eagle3pipe.records import HsJournalEntry, open_row_index, write_jsonl_atomic

    dd = DataDir(data_dir)
    open_row_index(dd.prepared_data, "rows").close()
    dd.hs_shard(0).mkdir(parents=True)
    write_jsonl_atomic(dd.hs_shard_journal(0), [HsJournalEntry(i, r["id"], i, len(r["input_ids"]), 0).to_json()
                                                for i, r in enumerate(rows[:done])])
    for i in range(done):
        dd.hs_shard_file(0, i).touch()


@in_a_fresh_process
def test_stage_02_holds_tens_of_bytes_a_row_to_its_first_request_and_through_finalize(tmp_path, toy_llama,
                                                                                       monkeypatch):
    """Issue 27: stage 02 reads the rows through their index (positions and lengths; a row's ids read as it is
    sent) and keeps the journals and the finalize plan as arrays. Measured with tracemalloc at two row counts (rows of
    4-8 tokens): the resume of a run killed at 90 % up to its first request, and the finalize of a finished one
    (every file renamed, the rows dataset written, the manifest), each under 80 bytes a row. The code before held
    every row as a TrainingRow, every journal entry as an HsJournalEntry and the plan as tuples."""
    from memory_bound import bytes_per_row

    from eagle3pipe.extract_vllm import Extractor

    async def first_request(self, idx, ids, path, prompt_logprobs):
        raise FirstRequest

    monkeypatch.setattr(Extractor, "_request", first_request)
    stub = StubExtractionServer()
    made = iter(range(10**6))

    def setup(n: int, share: float):
        folder = tmp_path / f"run{next(made)}"
        rows = write_rows(folder, n, seed=3, min_len=4, max_len=8)
        _journalled(folder, rows, int(n * share))
        cfg = _cfg(folder, toy_llama, stub.url)

        def resume():
            with pytest.raises(FirstRequest):
                run_extract(cfg)

        return resume if share < 1 else (lambda: run_extract(cfg))

    try:
        to_first_request = bytes_per_row(lambda n: setup(n, 0.9), 4000, 16000)
        through_finalize = bytes_per_row(lambda n: setup(n, 1.0), 4000, 16000)
    finally:
        stub.close()
    print(f"\nstage 02 allocates {to_first_request:.1f} bytes a row up to its first request (resumed at 90 %), "
          f"{through_finalize:.1f} through finalize")
    assert to_first_request < 80 and through_finalize < 80
    dd = DataDir(tmp_path / "run5")  # the last finalize (runs 0-2: warm-up, small, large resumes; 3-5 finalizes): every file in place, the rows dataset pairs them
    rows = list(read_jsonl(dd.prepared_data))
    assert load_hs_manifest(dd.hs_manifest).num_samples == len(rows) == 16000
    from eagle3pipe.records import load_hs_rows

    ds = load_hs_rows(dd.hidden_states)
    assert [ds[i]["input_ids"].tolist() for i in (0, 7777, 15999)] == [rows[i]["input_ids"] for i in (0, 7777, 15999)]
    assert all(dd.hs_file(i).exists() for i in (0, 15999)) and not dd.hs_file(16000).exists()
