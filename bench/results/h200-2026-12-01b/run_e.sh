#!/bin/bash
# device call E (issue 12 item 5): H200 peak memory of the K2.5 draft step at the packed-row lengths the K2.5
# config allows (train.total_seq_len), frozen and trained lm_head; 49152 to see where an H200 stops.
# Run from the repo root: bash bench/results/h200-2026-12-01b/run_e.sh
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p $OUT/e1 $OUT/e2
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 420 python3 bench/bench_train.py --work /tmp/bench --out $OUT/e1 --skip e2e --bare-steps 5 \
    --bare-tokens 16384 32768 --bare-lm-head > $OUT/e1/bench_train.log 2>&1; echo "e1 rc=$?"
timeout 150 python3 bench/bench_train.py --work /tmp/bench2 --out $OUT/e2 --skip bare --bare-tokens 49152 \
    > $OUT/e2/bench_train.log 2>&1; echo "e2 rc=$?"
grep -h "bare\|Error\|Traceback" $OUT/e1/bench_train.log $OUT/e2/bench_train.log | grep -v Warning | cut -c1-400 | tail -20
