"""Stage 01b with each request's steps timed, for bench_generate.py --timeline (a measuring wrapper, not a stage).

Runs ``01b_generate_synthetic.py``'s entry point with ``Generator``'s steps wrapped: per request the time it was
sent, its reply read (status, headers and body), parsed, post-processed and written; and the event loop's lag
(how late a 10 ms sleep wakes) and the garbage collector's pauses. Writes a summary JSON to
``$EAGLE3PIPE_TIMELINE`` at exit. Usage: as 01b_generate_synthetic.py, with EAGLE3PIPE_TIMELINE set.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eagle3pipe import generate_requests as gr  # noqa: E402
from eagle3pipe.cli import run_stage  # noqa: E402
from eagle3pipe.generate import run_generate  # noqa: E402

events: list[dict] = []
lags: list[float] = []
gc_pauses: list[tuple[int, float]] = []  # (generation, seconds) of every collection during the run
_gc_started = [0.0]


def on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    else:
        gc_pauses.append((info["generation"], time.perf_counter() - _gc_started[0]))
t_start = time.monotonic()

_ask, _finish, _run = gr.Generator._ask, gr.Generator._finish, gr.Generator.run


async def timed_ask(self, idx, model, q):
    ev = {"id": q.id, "send": time.monotonic()}
    events.append(ev)
    out = await _ask(self, idx, model, q)
    ev["reply"] = time.monotonic()
    return out


def timed_finish(self, q, p, url, latency_s):
    t0 = time.monotonic()
    _finish(self, q, p, url, latency_s)
    for ev in reversed(events):
        if ev["id"] == q.id:
            ev["finish_start"], ev["finish_end"] = t0, time.monotonic()
            break


async def timed_run(self, todo):
    async def lag() -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append(time.monotonic() - t - 0.01)

    task = asyncio.create_task(lag())
    gc.callbacks.append(on_gc)
    try:
        await _run(self, todo)
    finally:
        gc.callbacks.remove(on_gc)
        task.cancel()


def pct(values, q):
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 4) if values else None


def summary() -> dict:
    done = [e for e in events if "finish_end" in e]
    if not done:
        return {"requests": 0}
    first, last = min(e["send"] for e in done), max(e["finish_end"] for e in done)
    reply = [e["reply"] - e["send"] for e in done]
    wait_finish = [e["finish_start"] - e["reply"] for e in done]  # reply read -> post-processing starts (parse)
    finish = [e["finish_end"] - e["finish_start"] for e in done]
    sends = sorted(e["send"] for e in done)
    # the client's own view of requests in flight: request intervals overlapping, averaged over the sending span
    in_flight = sum(reply) / (last - first)
    return {
        "requests": len(done), "process_to_first_send_s": round(first - t_start, 3),
        "sending_span_s": round(last - first, 3), "client_in_flight_avg": round(in_flight, 2),
        "reply_s": {"median": pct(reply, 0.5), "p90": pct(reply, 0.9)},
        "parse_s": {"median": pct(wait_finish, 0.5), "max": pct(wait_finish, 1.0)},
        "postprocess_write_s": {"median": pct(finish, 0.5), "p99": pct(finish, 0.99), "sum": round(sum(finish), 3)},
        "first_32_sends_span_s": round(sends[min(31, len(sends) - 1)] - sends[0], 3),
        "loop_lag_s": {"median": pct(lags, 0.5), "p99": pct(lags, 0.99), "max": pct(lags, 1.0)},
        "gc": {f"gen{g}": {"count": len(ds), "total_s": round(sum(ds), 3), "max_s": round(max(ds, default=0.0), 3)}
               for g in (0, 1, 2) for ds in [[d for x, d in gc_pauses if x == g]]},
    }


def dump() -> None:
    out = os.environ.get("EAGLE3PIPE_TIMELINE")
    if out:
        Path(out).write_text(json.dumps(summary(), indent=2) + "\n")


if __name__ == "__main__":
    gr.Generator._ask, gr.Generator._finish, gr.Generator.run = timed_ask, timed_finish, timed_run
    atexit.register(dump)
    code = run_stage("generate", "01b_generate", run_generate, __doc__)
    dump()
    sys.exit(code)
