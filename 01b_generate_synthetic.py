#!/usr/bin/env python3
"""Stage 01b: regenerate every answer with the target itself through vLLM servers (reasoning + exact ids): running
ones (--vllm-url, repeatable), or, without a URL, one it starts and stops itself (--server-args, generate.server_args).

Usage (the server runs elsewhere, e.g. `vllm serve moonshotai/Kimi-K2.5 --reasoning-parser kimi_k2 ...`):
    nohup python 01b_generate_synthetic.py --config configs/kimi_k25.yaml \\
        --vllm-url http://gpu-node-1:8000 --vllm-url http://gpu-node-2:8000 --concurrency 128 > 01b.out 2>&1 &
    tail -f data/logs/01b_generate.log          # progress lines; rerun the same command to resume

Reads:  <data_dir>/prepared/questions.jsonl (stage 01), the verifier's tokenizer (special-id cross-check, and
        rebuilding ids when a server returns none), the servers' /v1/chat/completions and /metrics.
Writes: <data_dir>/synthetic/{responses.jsonl, data.jsonl, errors.jsonl, provenance.json}, logs/01b_generate.log.
All logic lives in eagle3pipe/generate.py; the vLLM client in eagle3pipe/server.py.
"""

import sys

from eagle3pipe.cli import run_stage
from eagle3pipe.generate import run_generate

if __name__ == "__main__":
    sys.exit(run_stage("generate", "01b_generate", run_generate, __doc__))
