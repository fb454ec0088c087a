"""Stage 02's vLLM client against a small server that misbehaves on purpose (what a real server cannot be made to do
on demand): files that do not hold the row are redone, then listed as dropped; rows longer than the server's
context are listed; a server set up with another storage dtype stops the stage at once. The real-server tests are
in test_extract_vllm.py."""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler

import pytest
import torch

from eagle3pipe.cli import StageError
from eagle3pipe.extract import run_extract
from eagle3pipe.records import DataDir, load_hidden_states, load_hs_manifest, read_jsonl, save_hidden_states

from test_extract import make_cfg, write_rows
from test_generate import StubHTTPServer

MAX_MODEL_LEN = 30


class StubExtractionServer:
    """/v1/models and /v1/completions like an extraction server: writes a random sample file where the request
    asks. ``bad(ids)`` says which prompts get a file with other token ids; ``dtype`` is what it stores;
    ``die_after``: after that many completions it dies as a crashed node does (no reply, then the port refuses)."""

    def __init__(self, bad=lambda ids: False, dtype: str = "bf16", die_after: int | None = None):
        self.requests: Counter = Counter()
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
                self._reply({"object": "list", "data": [{"id": "stub", "object": "model",
                                                         "max_model_len": MAX_MODEL_LEN}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.posts += 1
                    if stub.die_after is not None and stub.posts > stub.die_after:
                        if stub.posts == stub.die_after + 1:
                            threading.Thread(target=stub.close).start()
                        self.close_connection = True
                        return  # no reply: the client sees the connection drop
                ids, path = body["prompt"], body["kv_transfer_params"]["hidden_states_path"]
                stub.requests[tuple(ids)] += 1
                stored = [i + 1 for i in ids] if bad(ids) else ids
                save_hidden_states(path, torch.randn(len(ids), 4, 128), torch.tensor(stored), dtype)
                self._reply({"id": "c", "object": "text_completion", "model": "stub", "kv_transfer_params":
                             {"hidden_states_path": path}, "choices": [{"index": 0, "text": "x",
                                                                         "finish_reason": "length"}]})

        self.httpd = StubHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        with self.lock:
            if self.httpd is None:
                return
            httpd, self.httpd = self.httpd, None
        httpd.shutdown()
        httpd.server_close()


def _cfg(data_dir, verifier, url, **extract):
    extract = {"verify_tokens": 0, "max_retries": 2, "retry_backoff_s": 0.01, "concurrency": 3, **extract}
    cfg = make_cfg(data_dir, verifier, backend="vllm", extract_url=url if isinstance(url, list) else [url], **extract)
    cfg.validate("extract")
    return cfg


def test_bad_files_are_redone_then_listed_and_long_rows_listed(tmp_path, toy_llama):
    rows = write_rows(tmp_path, 12, seed=1, min_len=4, max_len=34)
    bad = {tuple(r["input_ids"]) for r in rows[::4]}
    long = [r for r in rows if len(r["input_ids"]) >= MAX_MODEL_LEN]
    stub = StubExtractionServer(bad=lambda ids: tuple(ids) in bad)
    try:
        manifest = run_extract(_cfg(tmp_path, toy_llama, stub.url))
    finally:
        stub.close()
    errors = {e["id"]: e["reason"] for e in read_jsonl(DataDir(tmp_path).hs_errors)}
    for r in rows:
        ids = tuple(r["input_ids"])
        if r in long:
            assert f"longer than the server's max_model_len {MAX_MODEL_LEN}" in errors[r["id"]]
            assert stub.requests[ids] == 0  # never sent
        elif ids in bad:
            assert errors[r["id"]].startswith("file check failed 3 times: ") and "token_ids differ" in errors[r["id"]]
            assert stub.requests[ids] == 3  # first try and both retries
        else:
            assert r["id"] not in errors and stub.requests[ids] == 1
    kept = [r for r in rows if r not in long and tuple(r["input_ids"]) not in bad]
    assert manifest.num_samples == len(kept) and manifest.num_dropped == len(rows) - len(kept) > len(long) > 0
    for i, r in enumerate(kept):
        assert load_hidden_states(DataDir(tmp_path).hs_file(i))["token_ids"].tolist() == r["input_ids"]


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
        with caplog.at_level(logging.WARNING, logger="eagle3pipe.server"):
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
