#!/bin/bash
# device call C: stage 04 bench: the bare speculators step, then 04_train end to end from bf16 and fp8 files
set -o pipefail
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl && export PYTHONPATH=/tmp/site || exit
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
python3 bench/bench_train.py --work /tmp/bench --out $OUT --drop-cache --bare-steps 12 --samples 80 > $OUT/bench_train.log 2>&1; echo "rc=$?"
grep -i "error\|Traceback" $OUT/bench_train.log | head -5
tail -c 2500 $OUT/bench_train.log
