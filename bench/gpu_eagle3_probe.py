"""vLLM's EAGLE-3 serving of our export on a GPU, with nothing of ours but the files (issue 28): the first device call
of a session, which carries vLLM's core bundle and no wheels of ours, so this script uses the standard library alone.

On 2026-12-02 stage 05's EAGLE-3 server failed to start on vLLM 0.26's GPU build and its engine's cause was not
captured. This script starts ``vllm serve VERIFIER --speculative-config {eagle3, DRAFT, k, attention_backend}`` with the flags
05 gives it (CUDA graphs on), and, if the engine dies in start-up, keeps its whole log and its engine's error lines
and tries the next attempt (another draft attention backend, ``--enforce-eager``), so one call tells which
difference matters. The first call (2026-12-04) found the cause: vLLM < 0.29 plans FlashAttention-3 for the draft
with the verifier's head geometry (``eagle3pipe.evaluate.draft_serving``); the second, that 0.26's default V2 model
runner ignores the draft's own attention_backend. The default attempts are the workaround 05 now applies:
FlexAttention for the draft alone on the V1 model runner, with and without CUDA graphs. Once a server answers, it sends the held-out prompts greedily (the chat template with
thinking on, as 05 does) at each concurrency, reads vLLM's spec-decode counters from ``/metrics`` before and after
(acceptance length = 1 + accepted / drafts, as ``eagle3pipe.acceptance`` computes it) and then serves the verifier
alone with the same flags for the tokens/s baseline. Everything lands in ``--out`` (summary JSON, server logs).

Usage (device, vLLM's bundle unpacked to /tmp/site; a draft trained anywhere, e.g. the CPU demo's export carried):
    PYTHONPATH=/tmp/site python3 bench/gpu_eagle3_probe.py --verifier data/ci/verifier \\
        --draft data/demo/checkpoints/final --prompts data/demo/eval_prompts.jsonl --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from pathlib import Path

SPEC = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total")
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def counters(base: str) -> dict[str, float]:
    """Every un-labelled-by-position spec-decode counter of /metrics, summed over label sets."""
    out: dict[str, float] = {}
    for line in get(base + "/metrics").splitlines():
        m = re.match(r"^(vllm:spec_decode_[a-z_]+_total)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            key = m.group(1) + (("@" + p.group(1)) if (p := re.search(r'position="(\d+)"', m.group(2) or "")) else "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def engine_cause(log: str) -> list[str]:
    """The engine's own error lines: what 'Engine core initialization failed. See root cause above' points at."""
    lines = log.splitlines()
    keep = [i for i, ln in enumerate(lines) if re.search(r"(Error|Exception|error:|assert|Traceback)", ln)
            and "EngineCore" in ln]
    return [lines[i][-400:] for i in keep[:40]]


class Server:
    def __init__(self, name: str, args: list[str], out: Path, timeout_s: float, env: dict | None = None):
        self.name, self.port = name, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = out / f"{name}.log"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port",
               str(self.port), *args]
        say(f"{name}: {' '.join(cmd)}")
        self.t = time.monotonic()
        self.fh = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.fh, stderr=subprocess.STDOUT, start_new_session=True,
                                     stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
        self.ready = False
        while time.monotonic() - self.t < timeout_s:
            if self.proc.poll() is not None:
                break
            try:
                if get(self.base + "/health", 2) is not None:
                    self.ready = True
                    break
            except Exception:  # noqa: BLE001 (not up yet)
                time.sleep(1)
        self.start_s = round(time.monotonic() - self.t, 1)
        say(f"{name}: {'ready' if self.ready else 'FAILED (exit %s)' % self.proc.poll()} after {self.start_s} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.fh.close()


def send_all(base: str, prompts: list[dict], concurrency: int, max_tokens: int) -> dict:
    todo = list(prompts)
    lock = threading.Lock()
    tokens, errors = [], []

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                p = todo.pop(0)
            try:
                r = post(base + "/v1/chat/completions", {
                    "model": "verifier", "messages": p["messages"], "max_completion_tokens": max_tokens,
                    "temperature": 0.0, "seed": 0, "chat_template_kwargs": {"thinking": True}})
                with lock:
                    tokens.append(r["usage"]["completion_tokens"])
            except Exception as e:  # noqa: BLE001 (counted)
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:300])

    t = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - t
    return {"requests": len(tokens), "errors": errors[:5], "completion_tokens": sum(tokens), "wall_s": round(wall, 3),
            "tokens_per_s": round(sum(tokens) / wall, 1) if wall else None}


def measure(server: Server, prompts: list[dict], levels: list[int], max_tokens: int, spec: bool) -> dict:
    out = {}
    send_all(server.base, prompts[:2], 2, 16)  # warm-up, not counted
    for c in levels:
        before = counters(server.base) if spec else {}
        r = send_all(server.base, prompts, c, max_tokens)
        if spec:
            after = counters(server.base)
            d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            drafts = d.get(SPEC[0], 0.0)
            r["spec_decode_delta"] = d
            r["acceptance_length"] = round(1 + d.get(SPEC[2], 0.0) / drafts, 4) if drafts else None
            per_pos = sorted((int(k.split("@")[1]), v) for k, v in d.items() if "@" in k)
            r["acceptance_by_position"] = [round(v / drafts, 4) for _, v in per_pos] if drafts else []
        out[f"concurrency_{c}"] = r
        say(f"{server.name}: concurrency {c}: {json.dumps(r)[:600]}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", type=Path, required=True)
    p.add_argument("--draft", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="probe_summary.json and probe_logs.tar.gz")
    p.add_argument("--work", type=Path, default=Path("/tmp/probe"), help="server logs, the altered draft")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--flags", default="--gpu-memory-utilization 0.06 --kv-cache-memory-bytes 2G",
                   help="the flags stage 05 gave its servers in bench/gpu_route.py")
    p.add_argument("--start-timeout-s", type=float, default=200)
    p.add_argument("--attempts", nargs="+", default=["v1_flex=FLEX_ATTENTION+v1", "v1_flex_eager=FLEX_ATTENTION+v1+eager"],
                   help="NAME=BACKEND[+eager][+v1] tried in turn until a server starts (BACKEND vllm: vLLM's choice; "
                        "v1: VLLM_USE_V2_MODEL_RUNNER=0). On 0.26 (2026-12-04) 'vllm', 'vllm+eager', "
                        "'FLEX_ATTENTION' and 'FLEX_ATTENTION+eager' died: scheduler_metadata must have shape "
                        "(the V2 runner ignores the draft's attention_backend)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    prompts = [json.loads(ln) for ln in args.prompts.read_text().splitlines() if ln.strip()][:args.num_prompts]
    summary: dict = {"k": args.k, "prompts": len(prompts), "flags": args.flags, "attempts": []}

    def save():
        (args.out / "probe_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        with tarfile.open(args.out / "probe_logs.tar.gz", "w:gz") as tf:
            for log in sorted(args.work.glob("*.log")):
                tf.add(log, arcname=log.name)

    base = ["--model", str(args.verifier), "--served-model-name", "verifier", "--tensor-parallel-size", "1",
            *args.flags.split()]
    # the attempts, in turn, until a server starts: NAME=BACKEND[+eager] (BACKEND "vllm" = vLLM's own choice)
    server = None
    for attempt in args.attempts:
        name, _, how = attempt.partition("=")
        backend, *options = how.split("+")
        spec = {"method": "eagle3", "model": str(args.draft.resolve()), "num_speculative_tokens": args.k}
        if backend != "vllm":
            spec["attention_backend"] = backend
        extra = ["--enforce-eager"] if "eager" in options else []
        env = {"VLLM_USE_V2_MODEL_RUNNER": "0"} if "v1" in options else {}
        s = Server(name, [*base, "--speculative-config", json.dumps(spec), *extra], args.work, args.start_timeout_s,
                   env)
        entry = {"name": name, "speculative_config": spec, "extra": extra, "env": env, "ready": s.ready,
                 "start_s": s.start_s}
        summary["attempts"].append(entry)
        if not s.ready:
            s.stop()
            entry["engine_cause"] = engine_cause(s.log.read_text(errors="replace"))
            save()
            continue
        server = s
        break
    if server is None:
        save()
        say("no EAGLE-3 server started")
        return
    try:
        summary["draft"] = measure(server, prompts, args.concurrency, args.max_tokens, spec=True)
    finally:
        server.stop()
    save()
    alone = Server("verifier_alone", [*base, *summary["attempts"][-1]["extra"]], args.work, args.start_timeout_s,
                   summary["attempts"][-1]["env"])
    try:
        if alone.ready:
            summary["verifier_alone"] = measure(alone, prompts, args.concurrency, args.max_tokens, spec=False)
            for level, r in summary["draft"].items():
                b = summary["verifier_alone"].get(level, {}).get("tokens_per_s")
                if b and r.get("tokens_per_s"):
                    r["speedup"] = round(r["tokens_per_s"] / b, 3)
    finally:
        alone.stop()
    save()
    say(json.dumps(summary)[-4000:])


if __name__ == "__main__":
    main()
