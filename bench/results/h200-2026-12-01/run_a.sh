#!/bin/bash
# device call A: item 6 GPU tests (new code, then the code before the fix), stage 02 bench (profile, GIL probe,
# writes, end to end bf16/fp8, compile)
set -o pipefail
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl && export PYTHONPATH=/tmp/site || exit
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
echo "== gpu tests, this branch"; python3 -m pytest -q -m gpu tests/test_extract_gpu.py -p no:cacheprovider 2>&1 | tail -6 | tee $OUT/gpu_tests_new.txt
echo "== gpu tests, code before the fix"; (cd ../h3_old && python3 -m pytest -q -m gpu tests/test_extract_gpu.py -p no:cacheprovider -k event 2>&1 | tail -8 | tee $OUT/gpu_tests_old.txt)
echo "== bench_extract"; python3 bench/bench_extract.py --out $OUT --disk-dir /tmp/bench_extract > $OUT/bench_extract.log 2>&1; echo "rc=$?"
grep -v "Progress" $OUT/bench_extract.log | tail -5
python3 - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/results.json"))
for k, v in r.items():
    if k == "end_to_end":
        for e in v: print({kk: vv for kk, vv in e.items() if not kk.startswith("stored")})
    else: print(k, v)
PY
