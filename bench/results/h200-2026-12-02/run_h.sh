#!/bin/bash
# device call H (issue 18): 04 online vs offline on one H200 at K2.5 draft dims, extraction replayed from files
# (bench/bench_online_gpu.py). Call H: before packing ahead; I (--online-first): packed ahead in a thread; J: packed
# ahead into pinned memory (the code now).
# Run from the root of a copy of the branch with the wheels in .whl/: bash bench/results/h200-2026-12-02/run_h.sh [--online-first]
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
timeout 540 python3 bench/bench_online_gpu.py --work /tmp/bench --out $OUT "$@" > $OUT/bench_online_gpu.log 2>&1; echo "rc=$?"
grep -h "bench_online_gpu: \|Error\|error:\|Traceback" $OUT/bench_online_gpu.log | cut -c1-900 | tail -12
for f in /tmp/bench/data_nproc0_*.log; do echo "== $f"; grep -v "^\s*$" "$f" | grep -i "error\|online\|Training:" | tail -4 | cut -c1-400; cp "$f" $OUT/; done
true
