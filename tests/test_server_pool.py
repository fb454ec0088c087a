"""ServerPool with real vLLM CPU servers behind a relay that stands for one node: a node restarted with another model
(stage 01b, test_generate_vllm.py) or other weights under the same name (stage 02, test_extract_vllm.py) is not taken
back as it was (issue 26 item 6). ``NodeRelay`` only forwards and drops connections; every answer comes from a real
server. The drills live beside the servers they use (issue 30: the 01b one moved to test_generate_vllm.py, which
starts the same two session servers, so that they are not started a second time in another xdist worker)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler

import httpx2
import pytest

from test_generate import StubHTTPServer

pytestmark = pytest.mark.integration
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

