"""ServerPool with real vLLM CPU servers behind a relay that stands for one node: a node restarted with another model
(stage 01b, here) or other weights under the same name (stage 02, test_extract_vllm.py) is not taken back as it was
(issue 26 item 6). ``NodeRelay`` only forwards and drops connections; every answer comes from a real server."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx2
import pytest

from eagle3pipe.records import DataDir, load_request_errors, load_responses

from test_generate import StubHTTPServer

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]
DOWN_S = 1.5  # how long a restarting node drops every connection: past the pool's first /health probe (1 s)
HOLD_MAX_S, HOLD_GRACE_S = 30.0, 1.0  # NodeRelay.hold_bulk_until: the longest wait, and the time to judge a check


class NodeRelay:
    """A loopback HTTP relay standing for one node: every request goes to the real server ``backend`` (its URL)
    until ``switch_after`` completions were answered; then the node goes down (each connection dropped unanswered)
    for DOWN_S, and comes back as ``then``: another real server, as a node restarted with another model or other
    weights. ``down_at_start``: the first request (the pool's /v1/models at open) is dropped: a node that joins
    late, ``backend`` afterwards. ``posts``: completions forwarded, by (backend, with prompt_logprobs: the capture
    check's); ``checked`` is set once one with prompt_logprobs was answered. ``hold_bulk_until``: completions
    without prompt_logprobs wait for that event (at most HOLD_MAX_S), then HOLD_GRACE_S more: a run kept going
    until another node's check was answered and judged."""

    def __init__(self, backend: str, then: str | None = None, switch_after: int | None = None,
                 down_at_start: bool = False, hold_bulk_until: threading.Event | None = None):
        self.backend, self.then, self.switch_after = backend, then, switch_after
        self.down_until = float("inf") if down_at_start else 0.0
        self.hold = hold_bulk_until
        self.checked = threading.Event()
        self.answered = 0
        self.posts: Counter = Counter()
        self.lock = threading.Lock()
        self.client = httpx2.Client(timeout=600.0)
        relay = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _relay(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with relay.lock:
                    now = time.monotonic()
                    if relay.down_until == float("inf"):  # down at the start: this first request goes unanswered
                        relay.down_until = now
                        self.close_connection = True
                        return
                    if now < relay.down_until:  # restarting: the connection drops
                        self.close_connection = True
                        return
                    backend = relay.backend
                    check = b'"prompt_logprobs"' in body
                    if method == "POST":
                        relay.posts[backend, check] += 1
                if method == "POST" and not check and relay.hold is not None:
                    relay.hold.wait(HOLD_MAX_S)
                    time.sleep(HOLD_GRACE_S)
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
                reply = relay.client.request(method, backend + self.path, content=body, headers=headers)
                self.send_response(reply.status_code)
                self.send_header("Content-Type", reply.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(reply.content)))
                self.end_headers()
                self.wfile.write(reply.content)
                if method == "POST" and reply.status_code == 200:
                    if check:
                        relay.checked.set()
                    with relay.lock:
                        relay.answered += 1
                        if relay.switch_after is not None and relay.answered == relay.switch_after:
                            relay.down_until = time.monotonic() + DOWN_S  # the node restarts ...
                            relay.backend = relay.then  # ... as another server

            def do_GET(self):
                self._relay("GET")

            def do_POST(self):
                self._relay("POST")

        self.httpd = StubHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.client.close()

    def __enter__(self) -> "NodeRelay":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def test_01b_leaves_aside_a_node_that_comes_back_serving_another_model(tmp_path, vllm_server, vllm_server_k25,
                                                                        toy_llama, toy_meta):
    """01b's only --vllm-url is a node serving the toy Llama; after 4 answers it restarts serving another model (the
    K2.5 toy, another name). Before, the pool took it back without asking what it serves (it had answered before)
    and sent it the rest; now it reads /v1/models again, names the node and what it serves, leaves it aside, and
    01b stops (exit 2) with the rest listed as retryable, none of them sent to the other model."""
    from test_generate_vllm import _door_argv, _questions

    questions = _questions(tmp_path, 12)
    with NodeRelay(vllm_server.url, then=vllm_server_k25.url, switch_after=4) as node:
        res = subprocess.run(_door_argv(tmp_path, toy_llama, toy_meta, [node.url], "--concurrency", "2",
                                        "--max-retries", "3", "--retry-backoff-s", "1"),
                             cwd=REPO, capture_output=True, text=True, timeout=600)
    other, ours = vllm_server_k25.served_model_name, vllm_server.served_model_name
    assert node.posts[vllm_server_k25.url, False] == 0, res.stderr[-3000:]  # nothing sent to the other model
    assert f"{node.url} answers again but serves {other}, not {ours}: left aside" in res.stderr, res.stderr[-3000:]
    assert res.returncode == 2, res.stderr[-3000:]
    dd = DataDir(tmp_path)
    answered = {r.id for r in load_responses(dd.responses)}
    errored = {e.id: e for e in load_request_errors(dd.synthetic_errors)}
    assert len(answered) >= 4 and answered | set(errored) == {q.id for q in questions}
    assert all(e.kind == "connection" and f"serves {other}, not {ours}" in e.message for e in errored.values())
