"""Benchmark stage 01b against speculators' own ``speculators regenerate-responses`` on one vLLM CPU server.

Same server (toy Llama verifier, ``--reasoning-parser kimi_k2``), same prompts (single-turn), same concurrency, same
max tokens and sampling extras; every request generates exactly ``--max-tokens`` tokens (all special tokens but
``</think>`` are banned by logit_bias, ``thinking_token_budget`` ends the reasoning), so both clients ask the server
for identical work. Each tool runs as its own process (interpreter start, tokenizer load and output writing
included), alternating, ``--repeats`` times; the table reports median wall seconds, ratio ours/theirs, and samples
lost (asked minus written).

Usage:
    .venv/bin/python bench/bench_generate.py --prompts 200 --concurrency 32 --max-tokens 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eagle3pipe.records import DataDir, Question, check_synthetic, write_jsonl_atomic  # noqa: E402
from eagle3pipe.server import VllmServer  # noqa: E402
from eagle3pipe.toy import BPE_VOCAB_SIZE, MODEL_VOCAB_SIZE, SPECIAL_TOKENS, build_toy_verifier  # noqa: E402

log = logging.getLogger("bench_generate")


def sampling_extras(reasoning_tokens: int) -> dict:
    response_id = BPE_VOCAB_SIZE + SPECIAL_TOKENS.index("</think>")
    bias = {str(t): -100 for t in range(BPE_VOCAB_SIZE, MODEL_VOCAB_SIZE) if t != response_id}
    return {"thinking_token_budget": reasoning_tokens, "logit_bias": bias}


def run_ours(work: Path, verifier: Path, url: str, args, extras: dict, meta: dict) -> tuple[float, int, int]:
    data_dir = work / "ours"
    DataDir(data_dir).synthetic.mkdir(parents=True, exist_ok=True)
    write_jsonl_atomic(DataDir(data_dir).questions, [q.to_json() for q in args.questions])
    cmd = [sys.executable, str(REPO / "01b_generate_synthetic.py"), "--data-dir", str(data_dir), "--verifier",
           str(verifier), "--vllm-url", url, "--think-token-id", str(meta["think_token_id"]), "--response-token-id",
           str(meta["response_token_id"]), "--concurrency", str(args.concurrency), "--max-completion-tokens",
           str(args.max_tokens), "--min-completion-tokens", "1", "--temperature", "0.6", "--top-p", "0.95",
           "--include-truncated", "--overwrite", "--request-extra-json", json.dumps(extras)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"01b failed:\n{proc.stderr[-3000:]}")
    check = check_synthetic(DataDir(data_dir), [q.id for q in args.questions])
    return wall, check.finished, check.trained


def run_theirs(work: Path, verifier: Path, url: str, args, extras: dict, rep: int) -> tuple[float, int, int]:
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
    return wall, written, len(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reasoning-tokens", type=int, default=16, help="thinking_token_budget: </think> forced here")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work-dir", default="", help="folder for the toy, prompts and outputs (default: a temp dir)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
        run_ours(work, verifier, server.url, argparse.Namespace(**{**vars(args), "questions": args.questions[:8]}),
                 extras, meta)  # warm-up: first requests on a fresh server are slower
        ours, theirs = [], []
        for rep in range(args.repeats):
            ours.append(run_ours(work, verifier, server.url, args, extras, meta))
            log.info("ours   rep %d: %.1f s, %d finished, %d data rows", rep, *ours[-1])
            theirs.append(run_theirs(work, verifier, server.url, args, extras, rep))
            log.info("theirs rep %d: %.1f s, %d conversations written, %d rows", rep, *theirs[-1])
    ours_s = statistics.median(w for w, _, _ in ours)
    theirs_s = statistics.median(w for w, _, _ in theirs)
    result = {
        "prompts": args.prompts, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "ours_wall_s": [round(w, 2) for w, _, _ in ours],
        "theirs_wall_s": [round(w, 2) for w, _, _ in theirs], "ours_median_s": round(ours_s, 2),
        "theirs_median_s": round(theirs_s, 2), "ratio_ours_over_theirs": round(ours_s / theirs_s, 3),
        "ours_lost": [args.prompts - n for _, n, _ in ours], "theirs_lost": [args.prompts - n for _, n, _ in theirs],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
