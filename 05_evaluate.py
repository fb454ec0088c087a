#!/usr/bin/env python3
"""Stage 05: acceptance length, per-position acceptance and tokens/s of drafts, measured in vLLM on named benchmarks.

Usage:
    python 05_evaluate.py --config configs/demo.yaml
    python 05_evaluate.py --config configs/kimi_k25.yaml --benchmarks mtbench gsm8k humaneval math500 \\
        --num-prompts 80 --num-speculative-tokens 3 --baseline-draft /models/Kimi-K2-Instruct-eagle3 \\
        --concurrency 1 8 16
    python 05_evaluate.py --config configs/kimi_k25.yaml --benchmarks gsm8k=gsm8k_test.jsonl  # offline copy
    python 05_evaluate.py --config configs/kimi_k25_dflash.yaml --benchmarks mtbench gsm8k humaneval math500 \\
        --baseline-draft eagle3=/data/eagle3-kimi-k25/checkpoints/final   # DFlash (k = 7) beside EAGLE-3 (k = 3)
    python 05_evaluate.py --config configs/kimi_k25.yaml --prompts held_out.jsonl \\
        --eval-url http://gpu-box:8000 --baseline-url http://gpu-box:8001     # servers you started yourself
Reads:  <data_dir>/checkpoints/final (or --draft DIR), each --baseline-draft DIR, the verifier folder, the prompt
        sets (--prompts: one JSONL chat file; --benchmarks: known sets from the hub via `datasets`, NAME=FILE, or
        chat files); num_prompts per set, chosen by --seed. Starts `vllm.entrypoints.openai.api_server` once per
        draft with --speculative-config (method eagle3 at --num-speculative-tokens, or dflash at the draft's own
        block - 1; same verifier), then once without a draft (the
        verifier alone; --no-baseline / --baseline-url), one at a time; every set at every --concurrency level.
Writes: <data_dir>/eval/{report.json (raw counters, server commands), report.md (rows = sets, columns = drafts),
        acceptance.png}, logs/05_evaluate.log, logs/05_vllm_*.log.
Acceptance length = 1 + accepted / drafts (mean tokens per verify step), from each response's own counters
(vLLM --per-request-spec-decode-metrics, set on servers started here) or else the server's /metrics delta.
Servers started here: CPU-only flags only on a CPU build of vLLM; --server-args replaces the defaults;
--tensor-parallel-size, --trust-remote-code and the start timeout come from the config.
All logic lives in eagle3pipe/evaluate.py (sets: eagle3pipe/eval_sets.py).
"""

import sys

from eagle3pipe.cli import run_stage
from eagle3pipe.evaluate import run_evaluate

if __name__ == "__main__":
    sys.exit(run_stage("evaluate", "05_evaluate", run_evaluate, __doc__))
