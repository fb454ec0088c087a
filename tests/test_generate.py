"""Stage 01b without a vLLM server: reply parsing, /metrics parsing, resume repair, and the fault drills a real
server cannot stage on demand (timeouts, 5xx, no reasoning field, a long queue, the only server restarting on its
port), against a small local HTTP server that misbehaves on purpose. The real-server tests are in test_generate_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx2
import pytest

from conftest import run_script_here
from memory_bound import in_a_fresh_process
from eagle3pipe.cli import StageError, run_stage
from eagle3pipe.config import ConfigError, load_config
from eagle3pipe.extract import run_extract
from eagle3pipe.generate import run_generate
from eagle3pipe.generate_requests import BadResponse, EmptyReasoningError, parse_completion, training_row
from eagle3pipe.records import (
    DataDir,
    IndexedJsonlWriter,
    Question,
    Response,
    check_synthetic,
    id_key,
    open_row_index,
    load_request_errors,
    load_responses,
    load_training_rows,
    read_jsonl,
    read_provenance,
    write_jsonl_atomic,
)
from eagle3pipe.server import free_port
from eagle3pipe.vllm_client import (
    NoServerAnswers,
    RequestFailed,
    RequestFailure,
    ServerLostMidRequest,
    ServerPool,
    api_base,
    classify_request_error,
    parse_prometheus_text,
    status_failure,
)
from eagle3pipe.vocab import run_vocab

# ---------------------------------------------------------------------------------------------------------------
# helpers


def _completion(reasoning_field: str | None = "reasoning", reasoning: str = "let me think", content: str = "4",
                with_ids: bool = True, finish_reason: str = "stop") -> dict:
    message = {"role": "assistant", "content": content}
    if reasoning_field:
        message[reasoning_field] = reasoning
    choice = {"index": 0, "finish_reason": finish_reason, "message": message}
    body = {"id": "cmpl-1", "object": "chat.completion", "created": 0, "model": "stub", "choices": [choice],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    if with_ids:
        choice["token_ids"] = [5, 6, 7, 8]
        body["prompt_token_ids"] = [1, 2, 3]
    return body


def write_questions(data_dir, n: int) -> list[str]:
    qs = [Question(id=f"q{i:03d}", messages=[{"role": "user", "content": f"what is {i} + {i}?"}], source="drill")
          for i in range(n)]
    write_jsonl_atomic(DataDir(data_dir).questions, [q.to_json() for q in qs])
    return [q.id for q in qs]


def _config(data_dir, verifier, meta, urls, **generate):
    cfg = load_config(None, {
        "shared": {"data_dir": str(data_dir), "verifier": str(verifier), "vllm_url": urls,
                   "think_token_id": meta["think_token_id"], "response_token_id": meta["response_token_id"],
                   "progress_every_s": 0.5},
        "generate": {"served_model_name": "stub", "min_completion_tokens": 1, **generate},
    })
    cfg.validate("generate")
    return cfg


class StubHTTPServer(ThreadingHTTPServer):
    """The HTTP server of the tests' misbehaving stubs (this file's and stage 02's)."""

    # 01b opens up to 128 connections at once; socketserver's listen backlog of 5 turned some of them into
    # connection errors on a loaded machine (vLLM's server listens with a far longer one)
    request_queue_size = 256

    def handle_error(self, request, client_address):  # a client that timed out closed the socket: expected here
        pass


class DyingStub:
    """What the stubs of 01b and 02 share: ``die_after`` posts, then they die as a crashed node does (the request in
    hand gets no reply, the port then refuses), and an idempotent ``close``. Subclasses set ``httpd`` and ``lock``."""

    die_after: int | None = None
    posts: int = 0

    def dies_now(self, handler) -> bool:
        """Count one post (call with ``lock`` held); True when it must go unanswered, the connection dropped."""
        self.posts += 1
        if self.die_after is None or self.posts <= self.die_after:
            return False
        if self.posts == self.die_after + 1:
            threading.Thread(target=self.close).start()
        handler.close_connection = True
        return True

    def close(self) -> None:
        """Stop serving and close the port (idempotent): new connections are refused."""
        with self.lock:
            if self.httpd is None:
                return
            httpd, self.httpd = self.httpd, None
        httpd.shutdown()
        httpd.server_close()


REPO = Path(__file__).resolve().parents[1]

# A deadline guard, not a speed measurement, counted from the moment the dying server's port refuses: a retry that
# sleeps its whole backoff after its server came back (the code before ServerPool.wait_to_retry) is sent no sooner
# than 48 s after its request failed (backoffs are capped at 60 s, jittered -20 %), so a stage whose only server
# restarts cannot end within this; one that uses the server at once ends a few seconds after the pool's first
# /health probe (PROBE_FIRST_S).
RESTART_GUARD_S = 40.0
DEATH_WITHIN_S = 300.0  # the bound on the stage reaching its server's death (start-up, the first requests)


def run_door_through_a_restart(argv: list[str], dying: DyingStub, revive) -> tuple[int, str, DyingStub]:
    """Run a stage's door (``argv``: the interpreter, the script, its flags; run in a thread of this process by
    conftest.run_script_here, issue 30) while ``dying``, its only server, dies mid-run (its ``die_after``) and
    ``revive()`` returns a healthy server listening on the same port, started as soon as the old one's port refuses.
    The test fails if the door has not ended RESTART_GUARD_S after that. Returns (exit status, stderr, the revived
    server: the caller closes it)."""
    port = int(dying.url.rsplit(":", 1)[1])
    revived = None
    result: list = []

    def run() -> None:
        try:
            result.append(run_script_here(argv[1], argv[2:]))
        except BaseException as e:  # raised here below, in the test's thread
            result.append(e)

    door = threading.Thread(target=run, daemon=True)
    door.start()
    try:
        start_deadline = time.monotonic() + DEATH_WITHIN_S
        while door.is_alive():  # until the old server's port refuses
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            except ConnectionRefusedError:
                break
            except OSError:  # reset: the port is closing
                pass
            if time.monotonic() > start_deadline:
                pytest.fail(f"{argv[1]}'s server did not die within {DEATH_WITHIN_S:g} s")
            time.sleep(0.05)
        revived = revive()
        door.join(timeout=RESTART_GUARD_S)
        if door.is_alive():
            pytest.fail(f"{argv[1]} did not end within {RESTART_GUARD_S:g} s of its server's restart although the "
                        "server was back at once (the retries slept out their backoff)")
    except BaseException:
        if revived is not None:
            revived.close()
        raise
    if isinstance(result[0], BaseException):
        revived.close()
        raise result[0]
    code, stderr = result[0]
    return code, stderr, revived


# vLLM 0.32's HTTP 400 body for a prompt over --max-model-len (vllm/renderers/params.py), as the server sends it
CONTEXT_TOO_LONG_BODY = {"error": {"message": "This model's maximum context length is 2048 tokens. However, your "
                                              "prompt contains 2100 input tokens, which exceeds this limit even "
                                              "without any output tokens. Please reduce the length of the input "
                                              "prompt.", "type": "BadRequestError", "param": "input_tokens",
                                   "code": 400}}


class StubServer(DyingStub):
    """A local OpenAI-compatible HTTP server with scripted faults. ``mode``: how /v1/chat/completions misbehaves;
    per user prompt: ``fail_for`` answer 500, ``too_long_for`` answer vLLM's context-length 400, ``empty_for``
    answer without reasoning (each a set the test may change between runs). ``die_after``: after that many chat
    requests it dies as a crashed node does (the request in hand gets no reply, the port then refuses)."""

    def __init__(self, mode: str, delay_s: float = 0.0, fail_first: int = 0, die_after: int | None = None,
                 port: int = 0):
        self.mode, self.delay_s, self.fail_first = mode, delay_s, fail_first
        self.die_after, self.posts = die_after, 0
        self.fail_for: set[str] = set()
        self.too_long_for: set[str] = set()
        self.empty_for: set[str] = set()
        self.requests: dict[str, int] = {}  # user prompt -> requests received
        self.scrapes = 0
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the test output clean
                pass

            def _send(self, code: int, body: str, ctype: str = "application/json") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/metrics":
                    with stub.lock:
                        stub.scrapes += 1
                        n = stub.scrapes
                    # every scrape, one more request left a queue it sat in for 100 s
                    self._send(200, "# HELP vllm:num_requests_running x\n"
                                    'vllm:num_requests_running{engine="0",model_name="stub"} 3.0\n'
                                    'vllm:num_requests_waiting{engine="0",model_name="stub"} 7.0\n'
                                    f'vllm:generation_tokens_total{{engine="0",model_name="stub"}} {40.0 * n}\n'
                                    f'vllm:request_queue_time_seconds_sum{{engine="0",model_name="stub"}} {100.0 * n}\n'
                                    f'vllm:request_queue_time_seconds_count{{engine="0",model_name="stub"}} {n}.0\n',
                               "text/plain")
                else:
                    self._send(200, json.dumps({"object": "list", "data": [{"id": "stub", "object": "model"}]}))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][-1]["content"]
                with stub.lock:
                    if stub.dies_now(self):
                        return  # no reply: the client sees the connection drop
                    stub.requests[prompt] = stub.requests.get(prompt, 0) + 1
                    seen = stub.requests[prompt]
                time.sleep(stub.delay_s)
                if (stub.mode == "fail_first" and seen <= stub.fail_first) or prompt in stub.fail_for:
                    self._send(500, json.dumps({"error": {"message": "engine hiccup", "code": 500}}))
                elif prompt in stub.too_long_for:
                    self._send(400, json.dumps(CONTEXT_TOO_LONG_BODY))
                elif stub.mode == "no_reasoning" or prompt in stub.empty_for:
                    self._send(200, json.dumps(_completion(reasoning_field=None)))
                else:
                    self._send(200, json.dumps(_completion()))

        self.httpd = StubHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.close()

# ---------------------------------------------------------------------------------------------------------------
# parsing


@pytest.mark.parametrize("field_name", ["reasoning", "reasoning_content", "thinking"])
def test_reasoning_read_from_new_old_and_unknown_fields(field_name):
    parsed = parse_completion(_completion(reasoning_field=field_name))
    assert parsed.reasoning == "let me think"
    assert parsed.reasoning_field == field_name
    assert parsed.content == "4"
    assert parsed.prompt_token_ids == [1, 2, 3] and parsed.completion_token_ids == [5, 6, 7, 8]


def test_reasoning_prefers_new_field_and_reports_what_came_back():
    body = _completion(reasoning_field="reasoning", reasoning="new")
    body["choices"][0]["message"]["reasoning_content"] = "old"
    parsed = parse_completion(body)
    assert parsed.reasoning == "new" and parsed.reasoning_field == "reasoning"
    missing = parse_completion(_completion(reasoning_field=None, with_ids=False))
    assert missing.reasoning is None and missing.reasoning_field == ""
    assert missing.prompt_token_ids is None and missing.completion_token_ids is None
    assert missing.message_fields == {"role": "str(9 chars)", "content": "str(1 chars)"}
    with pytest.raises(BadResponse, match="no choices"):
        parse_completion({"object": "error", "message": "?"})


def test_prometheus_text_parsed_into_labelled_samples():
    text = ('# HELP vllm:x y\n# TYPE vllm:x counter\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 7.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 11.0\n'
            'vllm:num_requests_running{model_name="a b"} 3\n')
    samples = parse_prometheus_text(text)
    assert ("vllm:num_requests_running", {"model_name": "a b"}, 3.0) in samples
    assert len(samples) == 3


def test_api_base_is_appended_in_one_place_and_v1_refused():
    assert api_base("http://h:8000/") == "http://h:8000/v1"
    with pytest.raises(ValueError, match="without|ends with /v1"):
        api_base("http://h:8000/v1")
    with pytest.raises(ConfigError, match="without /v1"):
        load_config(None, {"shared": {"verifier": "x", "vllm_url": ["http://h:8000/v1"]}}).validate("generate")


# ---------------------------------------------------------------------------------------------------------------
# drills against a misbehaving local server


def test_timeouts_are_retried_then_recorded_as_errors(tmp_path, toy_llama, toy_meta):
    ids = write_questions(tmp_path, 3)
    # every answer comes after the client gave up; a timeout long enough for each try to reach the server on a
    # loaded machine (0.3 s once lost one there)
    with StubServer("ok", delay_s=6.0) as stub:
        cfg = _config(tmp_path, toy_llama, toy_meta, [stub.url], request_timeout_s=1.5, max_retries=2,
                      retry_backoff_s=0.05)
        with pytest.raises(StageError, match=r"3 of 3 ids errored \(timeout 3"):  # errored ids fail the stage
            run_generate(cfg)
        received = dict(stub.requests)
    errors = list(load_request_errors(DataDir(tmp_path).synthetic_errors))
    assert sorted(e.id for e in errors) == ids
    assert all(e.kind == "timeout" and e.attempts == 3 for e in errors)
    assert sorted(received.values()) == [3, 3, 3]  # the server saw 1 try + 2 retries per question
    check = check_synthetic(DataDir(tmp_path), ids)
    assert check.ok() and check.errored == 3 and check.finished == 0


def test_5xx_is_retried_and_then_succeeds_and_errors_are_retried_on_resume(tmp_path, toy_llama, toy_meta):
    ids = write_questions(tmp_path, 4)
    dd = DataDir(tmp_path)
    with StubServer("fail_first", fail_first=2) as stub:
        # run 1: one retry is not enough (2 failures per question): everything errors with kind http_5xx
        with pytest.raises(StageError, match="4 of 4 ids errored"):
            run_generate(_config(tmp_path, toy_llama, toy_meta, [stub.url], max_retries=1, retry_backoff_s=0.05))
        first = list(load_request_errors(dd.synthetic_errors))
        assert [e.kind for e in first] == ["http_5xx"] * 4 and all(e.attempts == 2 for e in first)
        # run 2, same command: the errored ids are retried; the third try of each succeeds
        summary = run_generate(_config(tmp_path, toy_llama, toy_meta, [stub.url], max_retries=1,
                                       retry_backoff_s=0.05))
    assert summary["finished"] == 4 and summary["errors"] == 0
    assert list(read_jsonl(dd.synthetic_errors)) == []  # stale errors dropped, never an id in both files
    responses = list(load_responses(dd.responses))
    assert sorted(r.id for r in responses) == ids
    rows = {r.id: r for r in load_training_rows(dd.synthetic_data)}
    for r in responses:  # the server's ids, mask on the completion only
        assert rows[r.id].input_ids == [1, 2, 3, 5, 6, 7, 8]
        assert rows[r.id].loss_mask == [0, 0, 0, 1, 1, 1, 1]
    assert check_synthetic(dd, ids).ok()


def test_server_without_reasoning_field_trips_the_guard(tmp_path, toy_llama, toy_meta):
    write_questions(tmp_path, 30)
    with StubServer("no_reasoning") as stub:
        cfg = _config(tmp_path, toy_llama, toy_meta, [stub.url], concurrency=2)
        with pytest.raises(EmptyReasoningError) as err:
            run_generate(cfg)
    message = str(err.value)
    # names the fields it read and what the server sent instead
    assert "reasoning_content" in message and "content=str(1 chars)" in message
    assert "--reasoning-parser kimi_k2" in message
    # tripped once the minimum sample (20) is judged, not after all 30
    assert len(list(read_jsonl(DataDir(tmp_path).responses))) < 30


def test_queue_warning_suggests_the_concurrency_the_server_sustains(tmp_path, toy_llama, toy_meta, caplog):
    write_questions(tmp_path, 4)
    with StubServer("ok", delay_s=1.2) as stub:
        cfg = _config(tmp_path, toy_llama, toy_meta, [stub.url], request_timeout_s=100.0, concurrency=4)
        cfg.shared.progress_every_s = 0.2
        with caplog.at_level(logging.INFO):
            run_generate(cfg)
    assert stub.scrapes >= 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "queue" in r.getMessage()]
    assert warnings and "lower --concurrency to about 3" in warnings[0] and "100 s" in warnings[0]
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Progress:")]
    assert any("3 running / 7 waiting" in line for line in progress)


def test_resume_repairs_torn_line_and_restores_missing_data_row(tmp_path, toy_llama, toy_meta):
    ids = write_questions(tmp_path, 3)
    dd = DataDir(tmp_path)
    done = Response(id=ids[0], messages=[], reasoning="r", content="c", finish_reason="stop", usage={},
                    prompt_token_ids=[1, 2], completion_token_ids=[3, 4], server="x", latency_s=0.1)
    dd.synthetic.mkdir(parents=True)
    # a crash after the response line, before its data line, in the middle of the next response line
    dd.responses.write_text(json.dumps(done.to_json()) + "\n" + '{"id": "q001", "messa')
    with StubServer("ok") as stub:
        summary = run_generate(_config(tmp_path, toy_llama, toy_meta, [stub.url]))
        assert sum(stub.requests.values()) == 2  # q000 was not asked again
    assert summary["skipped_finished"] == 1 and summary["finished"] == 2
    rows = {r.id: r for r in load_training_rows(dd.synthetic_data)}
    assert rows[ids[0]].input_ids == [1, 2, 3, 4] and rows[ids[0]].loss_mask == [0, 0, 1, 1]
    assert sorted(r.id for r in load_responses(dd.responses)) == ids
    assert check_synthetic(dd, ids).ok()


# ---------------------------------------------------------------------------------------------------------------
# Long unattended runs (issue 12): through the stage door, flags parsed as on the command line


def door_argv(data_dir, verifier, meta, url, *flags: str) -> list[str]:
    """01b's command-line flags for the toy verifier and a stub server."""
    return ["--data-dir", str(data_dir), "--verifier", str(verifier), "--vllm-url", url,
            "--think-token-id", str(meta["think_token_id"]), "--response-token-id", str(meta["response_token_id"]),
            "--served-model-name", "stub", "--min-completion-tokens", "1", "--progress-every-s", "0.5",
            "--max-retries", "1", "--retry-backoff-s", "0.05", *flags]


def _door(data_dir, verifier, meta, url, *flags: str) -> int:
    """Stage 01b through cli.run_stage (what 01b_generate_synthetic.py calls); returns its exit status."""
    return run_stage("generate", "01b_generate", run_generate, None, door_argv(data_dir, verifier, meta, url, *flags))


def _vocab_door(data_dir, verifier) -> int:
    argv = ["--data-dir", str(data_dir), "--verifier", str(verifier), "--vocab-size", "1088", "--draft-vocab-size",
            "16", "--hidden-size", "128", "--aux-layer-ids", "2", "4", "5"]
    return run_stage("vocab", "03_vocab", run_vocab, None, argv)


def _extract_door(data_dir, verifier) -> int:
    argv = ["--data-dir", str(data_dir), "--verifier", str(verifier), "--input", "synthetic", "--hidden-size", "128",
            "--aux-layer-ids", "2", "4", "5", "--device", "cpu", "--model-dtype", "float32"]
    return run_stage("extract", "02_extract", run_extract, None, argv)


def test_errored_ids_fail_01b_later_stages_refuse_and_a_rerun_retries_exactly_them(tmp_path, toy_llama, toy_meta,
                                                                                     capsys):
    ids = write_questions(tmp_path, 6)
    dd = DataDir(tmp_path)
    failing = {"what is 1 + 1?", "what is 4 + 4?"}
    with StubServer("ok") as stub:
        stub.fail_for = set(failing)
        assert _door(tmp_path, toy_llama, toy_meta, stub.url) == 2
        err = capsys.readouterr().err
        assert "2 of 6 ids errored (http_5xx 2" in err
        assert "Rerun the same command to retry exactly these 2 ids" in err
        assert not dd.provenance(dd.synthetic).exists()
        # 03 and 02 refuse the partial synthetic/ (4 rows), naming stage 01b
        assert _vocab_door(tmp_path, toy_llama) == 2
        assert _extract_door(tmp_path, toy_llama) == 2
        err = capsys.readouterr().err
        refusals = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(refusals) == 2 and all("is not a finished stage 01b output" in line for line in refusals)
        assert not dd.vocab_mapping.exists()
        before = dict(stub.requests)
        stub.fail_for.clear()
        assert _door(tmp_path, toy_llama, toy_meta, stub.url) == 0
        sent_again = {p: n - before.get(p, 0) for p, n in stub.requests.items() if n != before.get(p, 0)}
    assert sent_again == {p: 1 for p in failing}  # exactly the errored ids, once each
    check = check_synthetic(dd, ids)
    assert check.ok() and check.finished == 6 and check.errored == 0 and check.trained == 6
    assert dd.provenance(dd.synthetic).exists()
    assert _vocab_door(tmp_path, toy_llama) == 0


def test_context_too_long_is_named_and_can_be_accepted_as_permanent(tmp_path, toy_llama, toy_meta, capsys):
    write_questions(tmp_path / "a", 5)
    write_questions(tmp_path / "b", 5)
    dd = DataDir(tmp_path / "a")
    with StubServer("ok") as stub:
        stub.too_long_for = {"what is 2 + 2?"}
        assert _door(tmp_path / "a", toy_llama, toy_meta, stub.url) == 2
        err = capsys.readouterr().err
        assert "1 of 5 ids errored (context_too_long 1" in err and "--permanent-error-kinds context_too_long" in err
        sent = sum(stub.requests.values())
        assert _door(tmp_path / "a", toy_llama, toy_meta, stub.url, "--permanent-error-kinds", "context_too_long") == 0
        assert sum(stub.requests.values()) == sent  # the accepted id is not asked again
        # another data dir: one 5xx id among 5 is within --max-error-share 0.2
        stub.too_long_for, stub.fail_for = set(), {"what is 2 + 2?"}
        assert _door(tmp_path / "b", toy_llama, toy_meta, stub.url, "--max-error-share", "0.2") == 0
    assert [(e.id, e.kind) for e in load_request_errors(dd.synthetic_errors)] == [("q002", "context_too_long")]
    prov = read_provenance(dd.provenance(dd.synthetic))
    assert prov["counts"]["accepted_permanent"] == {"context_too_long": 1} and prov["counts"]["errored"] == 0
    prov_b = read_provenance(DataDir(tmp_path / "b").provenance(DataDir(tmp_path / "b").synthetic))
    assert prov_b["counts"]["errored_kinds"] == {"http_5xx": 1}


def test_resume_with_other_sampling_settings_is_refused_by_name(tmp_path, toy_llama, toy_meta, capsys):
    ids = write_questions(tmp_path, 4)
    with StubServer("ok") as stub:
        stub.fail_for = {"what is 3 + 3?"}  # the first run stops unfinished (no provenance.json), like a crash
        assert _door(tmp_path, toy_llama, toy_meta, stub.url, "--temperature", "0.6") == 2
        stub.fail_for.clear()
        capsys.readouterr()
        sent = sum(stub.requests.values())
        assert _door(tmp_path, toy_llama, toy_meta, stub.url, "--temperature", "0.9",
                     "--max-completion-tokens", "100") == 2
        err = capsys.readouterr().err
        assert "generate.temperature (0.6 then, 0.9 now)" in err
        assert "generate.max_completion_tokens (8192 then, 100 now)" in err and "--overwrite" in err
        assert sum(stub.requests.values()) == sent  # refused before any request
        assert _door(tmp_path, toy_llama, toy_meta, stub.url, "--temperature", "0.6") == 0  # the original resumes
    assert check_synthetic(DataDir(tmp_path), ids).finished == 4


def test_guard_judges_the_whole_run_so_one_empty_answer_does_not_stop_a_resume(tmp_path, toy_llama, toy_meta,
                                                                               capsys):
    ids = write_questions(tmp_path, 40)
    dd = DataDir(tmp_path)
    with StubServer("ok") as stub:
        assert _door(tmp_path, toy_llama, toy_meta, stub.url, "--max-samples", "38") == 0
        stub.empty_for = {"what is 39 + 39?"}  # of the 2 left, one comes back without reasoning
        assert _door(tmp_path, toy_llama, toy_meta, stub.url) == 0
    assert "1 of the 40 responses of this run have empty reasoning" in capsys.readouterr().err
    flags = {r.id: r.flags for r in load_responses(dd.responses)}
    assert flags["q039"] == ["empty_reasoning"] and not any(flags[i] for i in ids[:39])
    assert sorted(r.id for r in load_training_rows(dd.synthetic_data)) == ids[:39]  # never trained on
    assert dd.provenance(dd.synthetic).exists()


def test_server_dropping_reasoning_trains_nothing_and_stays_stopped_until_retried(tmp_path, toy_llama, toy_meta,
                                                                                  capsys):
    ids = write_questions(tmp_path, 30)
    dd = DataDir(tmp_path)
    with StubServer("no_reasoning") as stub:
        assert _door(tmp_path, toy_llama, toy_meta, stub.url, "--concurrency", "2") == 2
        err = capsys.readouterr().err
        assert "--retry-empty-reasoning" in err and "--overwrite" not in err  # never: it deletes finished work
        first = len(list(load_responses(dd.responses)))
        assert 20 <= first < 30
        assert not dd.synthetic_data.exists() or not list(read_jsonl(dd.synthetic_data))  # nothing trainable
        sent = sum(stub.requests.values())
        # the same command again: the finished responses alone trip the guard, before any request
        assert _door(tmp_path, toy_llama, toy_meta, stub.url, "--concurrency", "2") == 2
        assert sum(stub.requests.values()) == sent and "--retry-empty-reasoning" in capsys.readouterr().err
        stub.mode = "ok"  # the server fixed; ask the empty ones again, keep the rest
        assert _door(tmp_path, toy_llama, toy_meta, stub.url, "--concurrency", "2", "--retry-empty-reasoning") == 0
    responses = list(load_responses(dd.responses))
    assert sorted(r.id for r in responses) == ids and all(r.reasoning and not r.flags for r in responses)
    assert sorted(r.id for r in load_training_rows(dd.synthetic_data)) == ids
    assert check_synthetic(dd, ids).ok()


# ---------------------------------------------------------------------------------------------------------------
# a server that does not answer (issue 19, item 3)


def test_a_closed_first_url_and_a_server_dying_mid_run_leave_the_run_to_the_servers_that_answer(tmp_path, toy_llama,
                                                                                               toy_meta, caplog):
    """Three URLs: a closed port (first, so the model is asked elsewhere), a server that dies after 5 requests, and
    a healthy one. Everything finishes through the servers that answer; both dead ones are named as set aside."""
    ids = write_questions(tmp_path, 40)
    closed = f"http://127.0.0.1:{free_port()}"
    with StubServer("ok", die_after=5) as dying, StubServer("ok") as healthy:
        cfg = _config(tmp_path, toy_llama, toy_meta, [closed, dying.url, healthy.url], served_model_name="",
                      concurrency=4, max_retries=1, retry_backoff_s=0.05)
        with caplog.at_level(logging.WARNING, logger="eagle3pipe.vllm_client"):
            summary = run_generate(cfg)
        healthy_requests = sum(healthy.requests.values())
    assert summary["finished"] == 40 and summary["errors"] == 0
    check = check_synthetic(DataDir(tmp_path), ids)
    assert check.ok() and check.finished == 40 and check.errored == 0
    assert dying.posts > 5 and healthy_requests >= 35  # the dying one served its 5, the rest went to the other
    aside = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
    assert any(closed in m for m in aside) and any(dying.url in m for m in aside)
    assert {r.server for r in load_responses(DataDir(tmp_path).responses)} <= {dying.url, healthy.url}


def test_no_server_answering_at_start_stops_01b_naming_them(tmp_path, toy_llama, toy_meta):
    write_questions(tmp_path, 3)
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    with pytest.raises(StageError, match="no server answers: .*" + urls[0].replace(".", r"\.") + ".*--vllm-url"):
        run_generate(_config(tmp_path, toy_llama, toy_meta, urls, served_model_name=""))


def test_the_pool_takes_a_server_back_once_it_answers_on_its_port():
    """Set aside at start (its port refused), probed on /health, then routed to again once a server listens there:
    with more in flight on the other server, the next pick is the one taken back."""
    port = free_port()

    async def drill() -> None:
        with StubServer("ok") as live:
            async with ServerPool([f"http://127.0.0.1:{port}", live.url], 5.0, 8, flag="--vllm-url") as pool:
                served = await pool.open()
                assert list(served) == [1] and list(pool.aside) == [0]
                assert [pool.acquire() for _ in range(3)] == [1, 1, 1]  # never the one set aside
                with StubServer("ok", port=port):
                    for _ in range(600):  # probes back off from 1 s; bounded so a bug fails instead of hanging
                        if not pool.aside:
                            break
                        await asyncio.sleep(0.1)
                    assert not pool.aside and pool.served[0].name == "stub"
                    assert pool.acquire() == 0  # fewest in flight: 0 against 3

    asyncio.run(drill())


def test_a_reply_to_a_request_in_flight_when_its_server_was_set_aside_is_not_used():
    """A server that dies mid-run with requests in flight may be back on its port before one of them connects (the
    extraction drill's instant restart, test_extract_vllm_faults.py): that request reaches a server no /v1/models
    read and no check has seen. check_reply refuses its reply once the server was set aside after the request was
    sent (a connection failure, retried when a server is taken back), and trusts a request sent afterwards."""
    port = free_port()

    async def drill() -> None:
        async with ServerPool([f"http://127.0.0.1:{port}"], 5.0, 4, flag="--extract-url") as pool:
            first, second = pool.acquire(), pool.acquire()
            sent = pool.times_aside[first]
            pool.check_reply(first, sent)  # nothing happened meanwhile: used
            pool.set_aside(second, "ConnectError: the other request's connection was refused")
            with pytest.raises(ServerLostMidRequest, match=f"127.0.0.1:{port} stopped answering") as lost:
                pool.check_reply(first, sent)
            failure = classify_request_error(lost.value, 5.0)
            assert (failure.kind, failure.retryable) == ("connection", True)
            pool.check_reply(first, pool.times_aside[first])  # a request sent after it was set aside (taken back)

    asyncio.run(drill())


def test_a_retry_waiting_for_a_server_wakes_when_the_pool_takes_one_back_and_others_wait_their_backoff():
    """ServerPool.wait_to_retry with 300 s delays: after no server answered (NoServerAnswers, a refused connection)
    it returns once the set-aside server is taken back (awaited under a bound, so a bug fails instead of hanging);
    after a 5xx or a bad file (error None) it is still asleep then; and the next outage waits for the next return."""
    port = free_port()
    refused = RequestFailed(RequestFailure("connection", "ClientConnectorError: refused", True), unreachable=True)

    async def drill() -> None:
        with StubServer("ok") as live:
            async with ServerPool([f"http://127.0.0.1:{port}", live.url], 5.0, 8, flag="--vllm-url") as pool:
                await pool.open()
                assert list(pool.aside) == [0]
                wake = [asyncio.create_task(pool.wait_to_retry(300.0, e)) for e in (NoServerAnswers("x"), refused)]
                full = [asyncio.create_task(pool.wait_to_retry(300.0, e))
                        for e in (RequestFailed(status_failure(500, "engine hiccup")), None)]
                await asyncio.sleep(0.2)
                assert not any(t.done() for t in wake + full)  # nothing taken back yet: all asleep
                with StubServer("ok", port=port):
                    await asyncio.wait_for(asyncio.gather(*wake), 60.0)  # probes back off from 1 s
                    assert not pool.aside
                    assert not any(t.done() for t in full)  # a busy or broken server is not hammered
                    again = asyncio.create_task(pool.wait_to_retry(300.0, NoServerAnswers("x")))
                    await asyncio.sleep(0.2)
                    assert not again.done()  # the return it woke for is spent: the next one wakes it
                for t in full + [again]:
                    t.cancel()

    asyncio.run(drill())


def test_01b_whose_only_server_restarts_on_its_port_uses_it_at_once(tmp_path, toy_llama, toy_meta):
    """01b's only server dies after 5 of 20 requests (the request in hand unanswered, the port then refused) and a new
    one listens on its port as soon as it is gone; retries back off 300 s (capped at 60 s). The stage ends with
    every question answered, none errored, the rest by the new server: the retries waiting for a server woke when
    the pool took it back. A deadline guard, not a speed measurement (RESTART_GUARD_S): before
    ServerPool.wait_to_retry each retry slept out its backoff (>= 48 s) and the test failed at the guard."""
    ids = write_questions(tmp_path, 20)
    with StubServer("ok", die_after=5) as dying:
        port = dying.httpd.server_address[1]
        argv = [sys.executable, str(REPO / "01b_generate_synthetic.py"),
                *door_argv(tmp_path, toy_llama, toy_meta, dying.url, "--max-retries", "2", "--retry-backoff-s", "300",
                           "--concurrency", "4")]
        code, err, revived = run_door_through_a_restart(argv, dying, lambda: StubServer("ok", port=port).__enter__())
    revived.close()
    assert code == 0, err
    check = check_synthetic(DataDir(tmp_path), ids)
    assert check.ok() and check.finished == 20 and check.errored == 0
    assert dying.posts > 5 and sum(revived.requests.values()) >= 15  # the old one served 5, the new one the rest
    assert "set aside" in err and "answers again: taken back" in err


# ---------------------------------------------------------------------------------------------------------------
# 01b's transport (vllm_client.post_json, aiohttp): each failure mapped onto the openai client's kinds and decisions

# fault -> (kind, retryable, unreachable: ServerPool sets the server aside); the openai client's column is what
# classify_request_error and is_connection_failure said for the same reply before 01b left that client
TRANSPORT_FAULTS = {
    "http_500": ("http_5xx", True, False),
    "http_503": ("http_5xx", True, False),
    "http_408": ("http_408", True, False),
    "http_429": ("http_429", True, False),
    "http_404": ("http_404", False, False),
    "http_401": ("http_401", False, False),
    "too_long": ("context_too_long", False, False),
    "slow": ("timeout", True, False),
    "drop": ("connection", True, True),
    "refused": ("connection", True, True),
    "not_json": ("bad_response", False, False),
}


class FaultStub(DyingStub):
    """Answers POST /v1/chat/completions as the body's ``fault`` says (``http_NNN``, ``too_long``: vLLM's 400,
    ``slow``: after ``slow_s``, ``drop``: closes the connection unanswered, ``not_json``: a 200 that is not JSON,
    else a completion); records each request's Authorization header."""

    def __init__(self, slow_s: float = 6.0):
        self.lock = threading.Lock()
        self.auth: list[str | None] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                fault = json.loads(self.rfile.read(int(self.headers["Content-Length"]))).get("fault", "")
                with stub.lock:
                    stub.auth.append(self.headers.get("Authorization"))
                if fault.startswith("http_"):
                    self._send(int(fault[5:]), json.dumps({"error": {"message": f"scripted {fault}"}}))
                elif fault == "too_long":
                    self._send(400, json.dumps(CONTEXT_TOO_LONG_BODY))
                elif fault == "slow":
                    time.sleep(slow_s)
                    self._send(200, json.dumps(_completion()))
                elif fault == "drop":
                    self.close_connection = True  # no reply at all: the client sees the connection close
                elif fault == "not_json":
                    self._send(200, "<html>proxy error</html>")
                else:
                    self._send(200, json.dumps(_completion()))

        self.httpd = StubHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


async def _post_json_outcome(url: str, fault: str, timeout_s: float):
    """What post_json makes of one fault: the reply, or (kind, retryable, unreachable) of its RequestFailed, with
    what ServerPool does with it (set aside or not) and classify_request_error's reading of it."""
    from eagle3pipe.vllm_client import RequestFailed, classify_request_error, make_session, post_json

    async with make_session(timeout_s, 4) as session:
        try:
            return await post_json(session, api_base(url) + "/chat/completions", {"fault": fault}, timeout_s)
        except RequestFailed as e:
            async with ServerPool([url], timeout_s, 4, flag="--vllm-url") as pool:
                pool.report_failure(0, e)
                set_aside = 0 in pool.aside
            assert classify_request_error(e, timeout_s) is e.failure  # run_one reads it through here
            return e.failure.kind, e.failure.retryable, e.unreachable, set_aside, e.failure.message


async def _openai_outcome(url: str, fault: str, timeout_s: float):
    """The same fault through the openai client 01b used before (its low-level post), as classify_request_error and
    is_connection_failure read it."""
    import openai

    from eagle3pipe.vllm_client import classify_request_error, is_connection_failure, make_async_client

    client = make_async_client(url, timeout_s, max_connections=4)
    try:
        await client.post("/chat/completions", cast_to=httpx2.Response, body={"fault": fault},
                          options={"timeout": timeout_s})
        return None
    except openai.OpenAIError as e:
        failure = classify_request_error(e, timeout_s)
        return failure.kind, failure.retryable, is_connection_failure(e)
    finally:
        await client.close()


@pytest.mark.parametrize("fault", sorted(TRANSPORT_FAULTS))
def test_post_json_classifies_each_failure_as_the_openai_client_did(fault):
    stub = FaultStub()
    url = f"http://127.0.0.1:{free_port()}" if fault == "refused" else stub.url
    try:
        # a timeout that every other reply beats on a loaded machine (0.3 s did not), the slow one cannot
        kind, retryable, unreachable, set_aside, message = asyncio.run(_post_json_outcome(url, fault, 2.0))
        assert (kind, retryable, unreachable) == TRANSPORT_FAULTS[fault]
        assert set_aside == unreachable  # the pool sets aside exactly the servers that did not answer
        if fault.startswith("http_"):
            assert message.startswith(f"HTTP {fault[5:]}: ") and f"scripted {fault}" in message
        if fault != "not_json":  # the openai client has no such error: 01b parsed its raw reply itself
            assert asyncio.run(_openai_outcome(url, fault, 2.0)) == TRANSPORT_FAULTS[fault]
    finally:
        stub.close()


def test_post_json_returns_the_reply_and_sends_the_api_key(monkeypatch):
    stub = FaultStub()
    try:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
        assert asyncio.run(_post_json_outcome(stub.url, "", 5.0)) == _completion()
        monkeypatch.setenv("VLLM_API_KEY", "k-123")
        assert asyncio.run(_post_json_outcome(stub.url, "", 5.0)) == _completion()
    finally:
        stub.close()
    assert stub.auth == [None, "Bearer k-123"]


# ---------------------------------------------------------------------------------------------------------------
# Scale (issue 27): the resume bookkeeping on arrays, the row indexes in step with the files


def _finished_run(data_dir, n: int, unfinished: int) -> list[str]:
    """questions.jsonl of n questions (as stage 01 writes it, with its index) and a 01b run stopped with all but
    ``unfinished`` of them answered (responses and data rows, as 01b writes them)."""
    dd = DataDir(data_dir)
    ids = [f"q{i:06d}" for i in range(n)]
    with IndexedJsonlWriter(dd.questions, "questions", new=True) as out:
        for i, qid in enumerate(ids):
            out.write(Question(id=qid, messages=[{"role": "user", "content": f"what is {i} + {i}?"}],
                               source="drill").to_json())
        out.commit()
    with IndexedJsonlWriter(dd.responses, "responses") as responses, \
            IndexedJsonlWriter(dd.synthetic_data, "rows") as data:
        for qid in ids[: n - unfinished]:
            responses.write(Response(id=qid, messages=[], reasoning="r", content="c", finish_reason="stop", usage={},
                                     prompt_token_ids=[1, 2, 3], completion_token_ids=[5, 6, 7, 8], server="x",
                                     latency_s=0.1).to_json())
            data.write(training_row(qid, [1, 2, 3], [5, 6, 7, 8], "drill").to_json())
    return ids


@in_a_fresh_process
def test_resume_of_many_finished_questions_keeps_tens_of_bytes_a_question(tmp_path, toy_llama, toy_meta):
    """01b's start and resume hold the questions and the finished ids as arrays of 8-byte keys (and the row
    indexes' memory maps), not a Python object per question: what it allocates grows by tens of bytes a question."""
    from memory_bound import bytes_per_row

    with StubServer("ok") as stub:
        def setup(n: int):
            folder = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
            _finished_run(folder, n, unfinished=8)
            cfg = _config(folder, toy_llama, toy_meta, [stub.url], concurrency=4, max_samples=0)

            def run():
                summary = run_generate(cfg)
                assert summary["finished"] == 8 and summary["skipped_finished"] == n - 8
            return run

        per_question = bytes_per_row(setup, 4000, 16000)
    print(f"\nstage 01b allocates {per_question:.1f} bytes a question")
    assert per_question < 64


def test_row_indexes_stay_in_step_through_a_crash_and_a_resume(tmp_path, toy_llama, toy_meta):
    """After a crash that left lines without their index records and a torn line, and a resume that rewrites
    data.jsonl, every index equals an independent parse of its file."""
    ids = _finished_run(tmp_path, 12, unfinished=6)
    dd = DataDir(tmp_path)
    late = Response(id=ids[6], messages=[], reasoning="", content="c", finish_reason="stop", usage={},
                    prompt_token_ids=[1], completion_token_ids=[2], server="x", latency_s=0.1,
                    flags=["empty_reasoning"])
    with open(dd.responses, "a") as f:  # written by the crashed run, its index record not
        f.write(json.dumps(late.to_json()) + "\n" + '{"id": "q000007", "mess')
    with StubServer("ok") as stub:
        summary = run_generate(_config(tmp_path, toy_llama, toy_meta, [stub.url], allow_empty_reasoning=True))
        assert sum(stub.requests.values()) == 5  # q000006 finished before the crash
    assert summary["finished"] == 5 and check_synthetic(dd, ids).ok()
    assert ids[6] in {r.id for r in load_training_rows(dd.synthetic_data)}  # its data row restored
    with StubServer("ok") as stub:  # the same folder without --allow-empty-reasoning: q000006's data row goes
        run_generate(_config(tmp_path, toy_llama, toy_meta, [stub.url]))
    assert sorted(r.id for r in load_training_rows(dd.synthetic_data)) == [i for i in ids if i != ids[6]]
    for path, kind in ((dd.responses, "responses"), (dd.synthetic_data, "rows"), (dd.questions, "questions")):
        index = open_row_index(path, kind)
        lines = path.read_bytes().splitlines(keepends=True)
        assert index.offsets.tolist() == [sum(map(len, lines[:i])) for i in range(len(lines))]
        assert index.keys.tolist() == [id_key(json.loads(line)["id"]) for line in lines]
        if kind != "questions":
            tokens = [len(d["input_ids"]) if kind == "rows" else len(d["prompt_token_ids"]) +
                      len(d["completion_token_ids"]) for d in map(json.loads, lines)]
            assert index.lengths.tolist() == tokens


def test_trainable_mask_on_index_bits_agrees_with_trainable_on_records():
    """The resume decides trainability from the responses index's flag bits; every combination of flags (and an
    unknown one), with and without a completion, under each setting, agrees with trainable() on the record."""
    import itertools

    from eagle3pipe.generate_requests import trainable, trainable_mask
    from eagle3pipe.records import RESPONSE_FLAGS, response_bits

    names = list(RESPONSE_FLAGS) + ["flag_of_a_later_version"]
    records = [{"flags": [n for n, on in zip(names, bits) if on], "completion_token_ids": ids, "reasoning": "r"}
               for bits in itertools.product([0, 1], repeat=len(names)) for ids in ([], [5])]
    bits = [response_bits(d) for d in records]
    for include_truncated, allow_empty in itertools.product([False, True], repeat=2):
        expected = [bool(d["completion_token_ids"]) and trainable(d["flags"], include_truncated, allow_empty)
                    for d in records]
        assert trainable_mask(bits, include_truncated, allow_empty).tolist() == expected
