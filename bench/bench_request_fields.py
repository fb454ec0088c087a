"""What each field of 01b's request body costs the vLLM server, against speculators' body, on one CPU server.

Same server and prompts as bench_generate.py (toy Llama, ``--reasoning-parser kimi_k2``, every request generates
exactly ``--max-tokens`` tokens); one plain httpx2 client sends the same 200 chat requests at the same concurrency
with each body variant, the variants alternating round by round. Per run: wall seconds, the server's CPU seconds
(all its processes) and its mean e2e latency. Variants:

- ``ours``: 01b's body: ``max_completion_tokens``, ``return_token_ids``, ``spaces_between_special_tokens: false``,
  ``chat_template_kwargs: {thinking: true}``;
- ``theirs``: speculators' ``regenerate-responses`` body: ``max_tokens``, ``return_token_ids``;
- ``ours_no_spaces_flag``, ``ours_no_template_kwargs``: ours less one field;
- any of these with ``_via_openai_client``: sent through the openai client 01b uses (same low-level post), to
  separate the client from the body.

Usage:
    .venv/bin/python bench/bench_request_fields.py --prompts 200 --concurrency 32 --max-tokens 64 --repeats 3
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

from bench_generate import HISTOGRAMS, sampling_extras  # noqa: E402
from eagle3pipe.server import VllmServer, group_cpu_seconds  # noqa: E402
from eagle3pipe.vllm_client import make_async_client, read_metrics  # noqa: E402
from eagle3pipe.toy import build_toy_verifier  # noqa: E402

log = logging.getLogger("bench_request_fields")
OPENAI_SUFFIX = "_via_openai_client"


def bodies(model: str, max_tokens: int, extras: dict) -> dict[str, dict]:
    sampling = {"temperature": 0.6, "top_p": 0.95, **extras}
    ours = {"model": model, "max_completion_tokens": max_tokens, **sampling, "return_token_ids": True,
            "spaces_between_special_tokens": False, "chat_template_kwargs": {"thinking": True}}
    theirs = {**sampling, "model": model, "max_tokens": max_tokens, "return_token_ids": True}
    no_spaces = {k: v for k, v in ours.items() if k != "spaces_between_special_tokens"}
    no_kwargs = {k: v for k, v in ours.items() if k != "chat_template_kwargs"}
    return {"ours": ours, "theirs": theirs, "ours_no_spaces_flag": no_spaces, "ours_no_template_kwargs": no_kwargs}


async def send_all(url: str, body: dict, prompts: list[str], concurrency: int, via_openai: bool = False) -> None:
    """Send every prompt with ``body``, ``concurrency`` at a time: a plain httpx2 client, or (``via_openai``) the
    openai client 01b uses, through the same low-level post 01b makes."""
    queue = list(reversed(prompts))
    if via_openai:
        client = make_async_client(url, 600, max_connections=concurrency + 8)

        async def post(payload: dict) -> bytes:
            return (await client.post("/chat/completions", cast_to=httpx2.Response, body=payload,
                                      options={"timeout": 600})).content
    else:
        client = httpx2.AsyncClient(timeout=600, limits=httpx2.Limits(max_connections=concurrency + 8))

        async def post(payload: dict) -> bytes:
            r = await client.post(f"{url}/v1/chat/completions", json=payload)
            r.raise_for_status()
            return r.content

    async def worker() -> None:
        while queue:
            prompt = queue.pop()
            json.loads(await post({**body, "messages": [{"role": "user", "content": prompt}]}))

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await (client.close() if via_openai else client.aclose())


def one_run(server, body: dict, prompts: list[str], concurrency: int, via_openai: bool = False) -> dict:
    before, cpu0, t0 = read_metrics(server.url), group_cpu_seconds(server.pid), time.perf_counter()
    asyncio.run(send_all(server.url, body, prompts, concurrency, via_openai))
    wall, cpu = time.perf_counter() - t0, group_cpu_seconds(server.pid) - cpu0
    after = read_metrics(server.url)
    n = after.value(HISTOGRAMS["e2e"] + "_count") - before.value(HISTOGRAMS["e2e"] + "_count")
    e2e = (after.value(HISTOGRAMS["e2e"] + "_sum") - before.value(HISTOGRAMS["e2e"] + "_sum")) / max(n, 1)
    return {"wall_s": round(wall, 2), "server_cpu_s": round(cpu, 2), "e2e_mean_s": round(e2e, 3),
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reasoning-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work-dir", default="")
    p.add_argument("--variants", nargs="+", default=["ours", "theirs", "ours_no_spaces_flag",
                                                     "ours_no_template_kwargs"],
                   help=f"bodies to compare; a name ending in {OPENAI_SUFFIX} sends that body through 01b's client")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # one line per /metrics scrape otherwise
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_fields_"))
    verifier = build_toy_verifier(work / "toy_llama", "llama", seed=0)
    prompts = [f"Question {i}: what is {i} + {3 * i}? Sort [{i}, {7 * i % 13}, 5]." for i in range(args.prompts)]
    with VllmServer(verifier, extra_args=["--reasoning-parser", "kimi_k2", "--max-model-len", "2048"],
                    log_file=work / "vllm.log") as server:
        variants = bodies(str(verifier), args.max_tokens, sampling_extras(args.reasoning_tokens))
        one_run(server, variants["ours"], prompts[:32], args.concurrency)  # warm-up
        names = [k for k in variants if k in args.variants] + [
            v for v in args.variants if v.endswith(OPENAI_SUFFIX)]
        runs: dict[str, list[dict]] = {k: [] for k in names}
        for rep in range(args.repeats):
            for name in names[rep % len(names):] + names[:rep % len(names)]:  # rotate who goes first
                body = variants[name.removesuffix(OPENAI_SUFFIX)]
                runs[name].append(one_run(server, body, prompts, args.concurrency, name.endswith(OPENAI_SUFFIX)))
                log.info("%-24s rep %d: %s", name, rep, runs[name][-1])
    result = {"prompts": args.prompts, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "median": {k: {m: statistics.median(r[m] for r in rs) for m in ("wall_s", "server_cpu_s", "e2e_mean_s")}
                         for k, rs in runs.items()}, "runs": runs}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
