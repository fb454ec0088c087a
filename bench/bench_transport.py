"""Which HTTP client, pool setting and scheduling keeps the vLLM server fullest: 01b's body sent many ways (issue 22).

Same server, prompts and body as bench_generate.py / bench_request_fields.py (toy Llama, ``--reasoning-parser
kimi_k2``, 01b's request body, every request generates exactly ``--max-tokens`` tokens). One process, one server;
the same ``--prompts`` requests at ``--concurrency`` are sent by each variant, the variants rotating which goes first
round by round (one warm-up run of each first). Per run: what the server saw (bench_generate.ServerLoad: serving
window, the engine-held average by Little's law from /metrics), wall seconds, the server's CPU seconds and this
process's CPU seconds (the /metrics sampler thread included, the same for every variant). Variants:

- ``openai_post``: the openai client 01b used until 2026-12-02 (``make_async_client`` + its low-level ``post``);
- ``httpx2``: a plain ``httpx2.AsyncClient`` (pool ``concurrency + 8``, keep-alive for all);
- ``aiohttp``: an ``aiohttp.ClientSession`` (connector limit ``concurrency + 8``, keep-alive);
- ``aiohttp_limit0``: as speculators sets it up (``TCPConnector(limit=0)``: no pool limit);
- ``aiohttp_exact_pool``: connector limit = concurrency exactly;
- ``aiohttp_no_keepalive``: ``force_close=True`` (a new connection per request);
- ``aiohttp_semaphore``: every request its own task up front, a semaphore of ``concurrency`` around the send
  (instead of one worker per slot pulling the next prompt as soon as its reply is read);
- ``session_post``: eagle3pipe.server's transport as 01b now uses it (``make_session`` + ``post_json``), so the
  bench measures the shipped code, error classification included.

All but ``aiohttp_semaphore`` schedule as 01b does: one worker per slot.

Usage:
    .venv/bin/python bench/bench_transport.py --prompts 200 --concurrency 32 --max-tokens 64 --repeats 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx2

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_generate import ServerLoad, sampling_extras  # noqa: E402
from bench_request_fields import bodies  # noqa: E402
from eagle3pipe import vllm_client as srv  # noqa: E402
from eagle3pipe.server import VllmServer, group_cpu_seconds  # noqa: E402
from eagle3pipe.vllm_client import make_async_client  # noqa: E402
from eagle3pipe.toy import build_toy_verifier  # noqa: E402

log = logging.getLogger("bench_transport")
VARIANTS = ("openai_post", "httpx2", "aiohttp", "aiohttp_limit0", "aiohttp_exact_pool", "aiohttp_no_keepalive",
            "aiohttp_semaphore", "session_post")


async def send_all(variant: str, url: str, body: dict, prompts: list[str], concurrency: int) -> tuple[float, float]:
    """Send every prompt; returns (first send, last reply) in time.perf_counter()."""
    import aiohttp

    payloads = [{**body, "messages": [{"role": "user", "content": p}]} for p in prompts]
    pool = concurrency + 8
    close = None
    if variant == "openai_post":
        client = make_async_client(url, 600, max_connections=pool)
        close = client.close

        async def post(payload: dict):
            return json.loads((await client.post("/chat/completions", cast_to=httpx2.Response, body=payload,
                                                  options={"timeout": 600})).content)
    elif variant == "httpx2":
        client = httpx2.AsyncClient(timeout=600, limits=httpx2.Limits(max_connections=pool,
                                                                      max_keepalive_connections=pool))
        close = client.aclose

        async def post(payload: dict):
            r = await client.post(f"{url}/v1/chat/completions", json=payload)
            r.raise_for_status()
            return json.loads(r.content)
    elif variant == "session_post":
        session = srv.make_session(600, max_connections=pool)
        close = session.close
        target = srv.api_base(url) + "/chat/completions"

        async def post(payload: dict):
            return await srv.post_json(session, target, payload, 600)
    else:
        limit = {"aiohttp_limit0": 0, "aiohttp_exact_pool": concurrency}.get(variant, pool)
        connector = aiohttp.TCPConnector(limit=limit, force_close=variant == "aiohttp_no_keepalive")
        session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600))
        close = session.close
        target = f"{url}/v1/chat/completions"

        async def post(payload: dict):
            async with session.post(target, json=payload) as r:
                r.raise_for_status()
                return json.loads(await r.read())

    sent: list[float] = []
    done: list[float] = []
    send = post

    async def post(payload: dict):  # noqa: F811  (times the first send and the last reply)
        sent.append(time.perf_counter())
        out = await send(payload)
        done.append(time.perf_counter())
        return out

    try:
        if variant == "aiohttp_semaphore":
            sem = asyncio.Semaphore(concurrency)

            async def one(payload: dict) -> None:
                async with sem:
                    await post(payload)

            await asyncio.gather(*(one(p) for p in payloads))
        else:
            queue = list(reversed(payloads))

            async def worker() -> None:
                while queue:
                    await post(queue.pop())

            await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await close()
    return min(sent), max(done)


def one_run(server, variant: str, body: dict, prompts: list[str], concurrency: int) -> dict:
    load = os.getloadavg()[0]
    sampler = ServerLoad(server.url)
    cpu0, server_cpu0, t0 = time.process_time(), group_cpu_seconds(server.pid), time.perf_counter()
    sampler.start()
    try:
        first_sent, last_done = asyncio.run(send_all(variant, server.url, body, prompts, concurrency))
        wall = time.perf_counter() - t0
        deadline = time.perf_counter() + 3.0  # let the sampler see the server idle (its serving window's end)
        while sampler.last_done is None and time.perf_counter() < deadline:
            time.sleep(0.05)
    finally:
        seen = sampler.finish()
    window = last_done - first_sent
    # Little's law over the client's exact window (first send to last reply): how many of the requests the engine
    # held on average; the sampler's window (0.25 s scrapes) gives "engine_held_scraped", as bench_generate.py
    return {"wall_s": round(wall, 2), "window_s": round(window, 2),
            "engine_held": round(seen["requests"] * seen["e2e_mean_s"] / window, 1),
            "serving_s": seen["serving_s"], "engine_held_scraped": seen["engine_in_flight_avg"],
            "e2e_mean_s": seen["e2e_mean_s"], "requests": seen["requests"],
            "server_cpu_s": round(group_cpu_seconds(server.pid) - server_cpu0, 2),
            "client_cpu_s": round(time.process_time() - cpu0, 2), "loadavg_1m": round(load, 2)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reasoning-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--work-dir", default="")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # one line per /metrics scrape otherwise
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_transport_"))
    verifier = build_toy_verifier(work / "toy_llama", "llama", seed=0)
    prompts = [f"Question {i}: what is {i} + {3 * i}? Sort [{i}, {7 * i % 13}, 5]." for i in range(args.prompts)]
    body = bodies(str(verifier), args.max_tokens, sampling_extras(args.reasoning_tokens))["ours"]
    names = list(args.variants)
    with VllmServer(verifier, extra_args=["--reasoning-parser", "kimi_k2", "--max-model-len", "2048"],
                    log_file=work / "vllm.log") as server:
        for name in names:  # warm-up: the server's first requests, each client's first connections
            one_run(server, name, body, prompts[:32], args.concurrency)
        runs: dict[str, list[dict]] = {k: [] for k in names}
        for rep in range(args.repeats):
            for name in names[rep % len(names):] + names[:rep % len(names)]:  # rotate who goes first
                runs[name].append(one_run(server, name, body, prompts, args.concurrency))
                log.info("%-22s rep %d: %s", name, rep, runs[name][-1])
    keys = ("engine_held", "window_s", "engine_held_scraped", "serving_s", "wall_s", "server_cpu_s", "client_cpu_s", "e2e_mean_s", "loadavg_1m")
    result = {"prompts": args.prompts, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "median": {k: {m: statistics.median(r[m] or 0 for r in rs) for m in keys} for k, rs in runs.items()},
              "runs": runs}
    print(json.dumps(result, indent=2))
    print("\n| variant | engine held | window s | engine held (scraped) | wall s | server CPU s | client CPU s | load |")
    print("|---|---|---|---|---|---|---|---|")
    for k, rs in runs.items():
        med = result["median"][k]
        cells = [", ".join(str(r[m]) for r in rs) + f" (**{med[m]:g}**)" if m != "loadavg_1m"
                 else ", ".join(str(r[m]) for r in rs)
                 for m in ("engine_held", "window_s", "engine_held_scraped", "wall_s", "server_cpu_s", "client_cpu_s", "loadavg_1m")]
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
