"""Benchmark stage 01b against speculators' own ``speculators regenerate-responses`` on one vLLM CPU server.

Same server (toy Llama verifier, ``--reasoning-parser kimi_k2``), same prompts (single-turn), same concurrency, same
max tokens and sampling extras; every request generates exactly ``--max-tokens`` tokens (all special tokens but
``</think>`` are banned by logit_bias, ``thinking_token_budget`` ends the reasoning), so both clients ask the server
for identical work. Each tool runs as its own process (interpreter start, tokenizer load and output writing
included). After one warm-up run of each, the tools alternate which goes first in each of ``--repeats`` rounds, so
a slow spell of the shared machine falls on both. Per run it reports the wall time, the samples lost (asked minus
written), the machine's load average, and what the server saw: ``vllm:num_requests_running`` / ``waiting``
sampled every 0.25 s (averaged over the run's wall time and over the time any request ran) and the per-request
histograms' means over the run (e2e, queue, prefill, decode). The table: every run, the medians, the ratio
ours/theirs.

``--timeline``: ours runs through ``bench/timeline_01b.py`` (01b with its request steps timed: send, reply read,
parsed, post-processed and written; event-loop lag) and the per-run JSON gets a summary of that timeline.

Usage:
    .venv/bin/python bench/bench_generate.py --prompts 200 --concurrency 32 --max-tokens 64 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eagle3pipe.records import DataDir, Question, check_synthetic, write_jsonl_atomic  # noqa: E402
from eagle3pipe.server import VllmServer, group_cpu_seconds  # noqa: E402
from eagle3pipe.vllm_client import read_metrics  # noqa: E402
from eagle3pipe.toy import BPE_VOCAB_SIZE, MODEL_VOCAB_SIZE, SPECIAL_TOKENS, build_toy_verifier  # noqa: E402

log = logging.getLogger("bench_generate")


def sampling_extras(reasoning_tokens: int) -> dict:
    response_id = BPE_VOCAB_SIZE + SPECIAL_TOKENS.index("</think>")
    bias = {str(t): -100 for t in range(BPE_VOCAB_SIZE, MODEL_VOCAB_SIZE) if t != response_id}
    return {"thinking_token_budget": reasoning_tokens, "logit_bias": bias}


HISTOGRAMS = {"e2e": "vllm:e2e_request_latency_seconds", "queue": "vllm:request_queue_time_seconds",
              "prefill": "vllm:request_prefill_time_seconds", "decode": "vllm:request_decode_time_seconds"}


class ServerLoad(threading.Thread):
    """Samples the server's running/waiting request gauges every ``every_s`` while one tool runs; the histogram
    sums and counts are read at the start and the end, so their means cover exactly the run."""

    def __init__(self, url: str, every_s: float = 0.25):
        super().__init__(daemon=True)
        self.url, self.every_s = url, every_s
        self.samples: list[tuple[float, float]] = []  # (running, waiting)
        self.stop = threading.Event()
        self.before = read_metrics(url)
        self.started = time.perf_counter()
        self.first_seen: float | None = None  # first scrape with a request of this run running, waiting or done
        self.last_done: float | None = None  # first scrape at which every request of this run had finished

    def run(self) -> None:
        e2e = HISTOGRAMS["e2e"] + "_count"
        base = self.before.value(e2e)
        while not self.stop.wait(self.every_s):
            try:
                m = read_metrics(self.url)
            except Exception:  # a missed scrape is a missing sample, nothing more
                continue
            now = time.perf_counter() - self.started
            self.samples.append((m.running, m.waiting))
            if self.first_seen is None and (m.running or m.waiting or m.value(e2e) > base):
                self.first_seen = now
            if self.first_seen is not None and not (m.running or m.waiting) and m.value(e2e) > base:
                self.last_done = self.last_done or now
            elif m.running or m.waiting:
                self.last_done = None

    def finish(self) -> dict:
        self.stop.set()
        self.join()
        after = read_metrics(self.url)
        busy = [r for r, _ in self.samples if r > 0]
        out = {"running_avg": round(statistics.fmean(r for r, _ in self.samples), 2) if self.samples else 0.0,
               "running_avg_while_busy": round(statistics.fmean(busy), 2) if busy else 0.0,
               "waiting_avg": round(statistics.fmean(w for _, w in self.samples), 2) if self.samples else 0.0,
               "busy_s": round(len(busy) * self.every_s, 1),
               # from the tool's start to its first request on the server, and from its last one to its exit
               "start_to_first_request_s": None if self.first_seen is None else round(self.first_seen, 2),
               "serving_s": None if None in (self.first_seen, self.last_done)
               else round(self.last_done - self.first_seen, 2)}
        for short, name in HISTOGRAMS.items():
            n = after.value(name + "_count") - self.before.value(name + "_count")
            total = after.value(name + "_sum") - self.before.value(name + "_sum")
            out[f"{short}_mean_s"] = round(total / n, 3) if n else None
        e2e = HISTOGRAMS["e2e"] + "_count"
        out["requests"] = int(after.value(e2e) - self.before.value(e2e))
        # Little's law over the serving window: how many of the tool's requests the engine held on average (the
        # gauges above are sampled, this one is exact given the window)
        out["engine_in_flight_avg"] = (round(out["requests"] * out["e2e_mean_s"] / out["serving_s"], 1)
                                       if out["serving_s"] and out["e2e_mean_s"] else None)
        return out


def measured(fn, url: str, server_pgid: int, *a):
    """Run one tool under a ServerLoad sampler; its figures, the load average at the start, and the CPU seconds the
    tool's process and the server's processes used during the run."""
    load = os.getloadavg()[0]
    sampler = ServerLoad(url)
    server_cpu, child = group_cpu_seconds(server_pgid), resource.getrusage(resource.RUSAGE_CHILDREN)
    sampler.start()
    try:
        wall, finished, rows, extra = fn(*a)
    finally:
        server = sampler.finish()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if server["serving_s"] is not None:
        server["last_request_to_exit_s"] = round(wall - server["start_to_first_request_s"] - server["serving_s"], 2)
    server["cpu_s"] = round(group_cpu_seconds(server_pgid) - server_cpu, 2)
    client_cpu = (after.ru_utime - child.ru_utime) + (after.ru_stime - child.ru_stime)
    return {"wall_s": round(wall, 2), "finished": finished, "rows": rows, "loadavg_1m": round(load, 2),
            "client_cpu_s": round(client_cpu, 2), "server": server, **extra}


def run_ours(work: Path, verifier: Path, url: str, args, extras: dict, meta: dict) -> tuple[float, int, int, dict]:
    data_dir = work / "ours"
    DataDir(data_dir).synthetic.mkdir(parents=True, exist_ok=True)
    write_jsonl_atomic(DataDir(data_dir).questions, [q.to_json() for q in args.questions])
    script = "bench/timeline_01b.py" if args.timeline else "01b_generate_synthetic.py"
    timeline = work / "timeline.json"
    env = {**os.environ, "EAGLE3PIPE_TIMELINE": str(timeline)} if args.timeline else None
    cmd = [sys.executable, str(REPO / script), "--data-dir", str(data_dir), "--verifier",
           str(verifier), "--vllm-url", url, "--think-token-id", str(meta["think_token_id"]), "--response-token-id",
           str(meta["response_token_id"]), "--concurrency", str(args.concurrency), "--max-completion-tokens",
           str(args.max_tokens), "--min-completion-tokens", "1", "--temperature", "0.6", "--top-p", "0.95",
           "--include-truncated", "--overwrite", "--request-extra-json", json.dumps(extras)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"01b failed:\n{proc.stderr[-3000:]}")
    check = check_synthetic(DataDir(data_dir), [q.id for q in args.questions])
    extra = {"timeline": json.loads(timeline.read_text())} if args.timeline else {}
    return wall, check.finished, check.trained, extra


def run_theirs(work: Path, verifier: Path, url: str, args, extras: dict, rep: int) -> tuple[float, int, int, dict]:
    dataset = work / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"id": q.id, "messages": q.messages}) + "\n" for q in args.questions))
    outfile = work / f"theirs_{rep}.jsonl"
    cmd = [str(REPO / ".venv" / "bin" / "speculators"), "regenerate-responses", "--endpoint",
           f"{url}/v1/chat/completions", "--model", str(verifier), "--dataset", str(dataset), "--limit",
           str(len(args.questions)), "--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens),
           "--sampling-params", json.dumps({"temperature": 0.6, "top_p": 0.95, **extras}), "--outfile",
           str(outfile)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"speculators failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in outfile.read_text().splitlines() if line.strip()]
    written = len({r["primary_id"] for r in rows})
    return wall, written, len(rows), {}


def markdown_table(result: dict) -> str:
    """BENCHMARKS.md's table of one run of this script: every run's figures per tool, then the medians."""
    columns = [("wall s", lambda r: r["wall_s"]), ("start s", lambda r: r["server"]["start_to_first_request_s"]),
               ("serving s", lambda r: r["server"]["serving_s"]),
               ("engine held", lambda r: r["server"]["engine_in_flight_avg"]),
               ("running while busy", lambda r: r["server"]["running_avg_while_busy"]),
               ("e2e s", lambda r: r["server"]["e2e_mean_s"]), ("server CPU s", lambda r: r["server"]["cpu_s"]),
               ("client CPU s", lambda r: r["client_cpu_s"]), ("load", lambda r: r["loadavg_1m"]),
               ("lost", lambda r: result["prompts"] - r["finished"])]
    lines = ["| tool | " + " | ".join(c for c, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for tool, rs in result["runs"].items():
        lines.append(f"| {tool} | " + " | ".join(", ".join(str(get(r)) for r in rs) for _, get in columns) + " |")
    med, srv, held = (result["median_wall_s"], result["serving_s_median"], result["engine_in_flight_avg_median"])
    lines.append(f"\nMedians {med['ours']:g} s vs {med['theirs']:g} s: **{result['ratio_ours_over_theirs']}x**; "
                 f"serving {srv['ours']:g} s vs {srv['theirs']:g} s "
                 f"({srv['ours'] / srv['theirs'] if srv['theirs'] else float('nan'):.2f}x); engine held "
                 f"{held['ours']:g} vs {held['theirs']:g} (running while busy "
                 f"{result['running_avg_while_busy_median']['ours']:g} vs "
                 f"{result['running_avg_while_busy_median']['theirs']:g}); client CPU s {result['client_cpu_s_median']['ours']:g} vs "
                 f"{result['client_cpu_s_median']['theirs']:g}; samples lost {result['lost']}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reasoning-tokens", type=int, default=16, help="thinking_token_budget: </think> forced here")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeline", action="store_true", help="time ours request by request (bench/timeline_01b.py)")
    p.add_argument("--work-dir", default="", help="folder for the toy, prompts and outputs (default: a temp dir)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # one line per /metrics scrape otherwise
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_generate_"))
    verifier = build_toy_verifier(work / "toy_llama", "llama", seed=0)
    meta = json.loads((verifier / "toy_verifier.json").read_text())
    args.questions = [Question(id=f"b{i:04d}", source="bench", messages=[
        {"role": "user", "content": f"Question {i}: what is {i} + {3 * i}? Sort [{i}, {7 * i % 13}, 5]."}])
        for i in range(args.prompts)]
    extras = sampling_extras(args.reasoning_tokens)
    with VllmServer(verifier, extra_args=["--reasoning-parser", "kimi_k2", "--max-model-len", "2048"],
                    log_file=work / "vllm.log") as server:
        log.info("server up in %.0f s at %s", server.start_seconds, server.url)
        url = server.url
        # warm-up of both: first requests on a fresh server, and each tool's first start, are slower
        warm = argparse.Namespace(**{**vars(args), "questions": args.questions[:32], "timeline": False})
        run_ours(work, verifier, url, warm, extras, meta)
        run_theirs(work, verifier, url, warm, extras, -1)
        runs: dict[str, list[dict]] = {"ours": [], "theirs": []}
        for rep in range(args.repeats):
            order = ("ours", "theirs") if rep % 2 == 0 else ("theirs", "ours")
            for tool in order:
                if tool == "ours":
                    r = measured(run_ours, url, server.pid, work, verifier, url, args, extras, meta)
                else:
                    r = measured(run_theirs, url, server.pid, work, verifier, url, args, extras, rep)
                runs[tool].append(r)
                log.info("%-6s rep %d: %.1f s (first request after %s s, serving %s s, engine held %s), %d "
                         "written, load %.1f, server running avg %.1f (busy %.1f), e2e %.2f s, CPU s: server %.1f, "
                         "client %.1f", tool, rep, r["wall_s"], r["server"]["start_to_first_request_s"],
                         r["server"]["serving_s"], r["server"]["engine_in_flight_avg"], r["finished"],
                         r["loadavg_1m"], r["server"]["running_avg"],
                         r["server"]["running_avg_while_busy"], r["server"]["e2e_mean_s"] or 0, r["server"]["cpu_s"],
                         r["client_cpu_s"])
    med = {t: statistics.median(r["wall_s"] for r in rs) for t, rs in runs.items()}
    result = {
        "prompts": args.prompts, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "median_wall_s": med,
        "ratio_ours_over_theirs": round(med["ours"] / med["theirs"], 3),
        "running_avg_median": {t: statistics.median(r["server"]["running_avg"] for r in rs) for t, rs in runs.items()},
        "serving_s_median": {t: statistics.median(r["server"]["serving_s"] or 0 for r in rs) for t, rs in runs.items()},
        "engine_in_flight_avg_median": {t: statistics.median(r["server"]["engine_in_flight_avg"] or 0 for r in rs)
                                        for t, rs in runs.items()},
        "start_to_first_request_s_median": {t: statistics.median(r["server"]["start_to_first_request_s"] or 0
                                                                  for r in rs) for t, rs in runs.items()},
        "running_avg_while_busy_median": {t: statistics.median(r["server"]["running_avg_while_busy"] for r in rs)
                                          for t, rs in runs.items()},
        "server_cpu_s_median": {t: statistics.median(r["server"]["cpu_s"] for r in rs) for t, rs in runs.items()},
        "client_cpu_s_median": {t: statistics.median(r["client_cpu_s"] for r in rs) for t, rs in runs.items()},
        "lost": {t: [args.prompts - r["finished"] for r in rs] for t, rs in runs.items()},
        "runs": runs,
    }
    print(json.dumps(result, indent=2))
    print(markdown_table(result))
    (work / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    log.info("result written to %s", work / "result.json")


if __name__ == "__main__":
    main()
