#!/bin/bash
# device call F (issue 17): DDP's cost at one GPU. 04_train.py under `torchrun --nproc-per-node 1` (DDP, NCCL) vs the
# plain process, interleaved twice on the same fp8 files, K2.5 draft dims, 32768-token rows (the K2.5 default).
# Run from the root of a copy of the branch with the wheels in .whl/: bash bench/results/h200-2026-12-01c/run_f.sh
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
timeout 530 python3 bench/bench_train.py --work /tmp/bench --out $OUT --skip bare --storage fp8 --nproc 0 1 \
    --repeat 2 > $OUT/bench_train.log 2>&1; echo "f rc=$?"
grep -h "e2e_\|Error\|error:\|Traceback" $OUT/bench_train.log | cut -c1-600 | tail -12
for f in /tmp/bench/data_fp8_nproc*.log; do echo "== $f"; grep -v "^\s*$" "$f" | grep -i "error\|training \|Training:" | tail -3 | cut -c1-400; done
cp /tmp/bench/data_fp8_nproc1.log $OUT/ 2>/dev/null; true
