#!/bin/bash
# device call B: gpu tests (per-sample writers), then the stage 02 bench: forward, profile, GIL probe, writes,
# end to end bf16/fp8 eager, then fp8/bf16 with compiled decoder layers
set -o pipefail
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl && export PYTHONPATH=/tmp/site || exit
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
echo "== gpu tests"; python3 -m pytest -q -m gpu tests/test_extract_gpu.py -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/gpu_tests.txt
echo "== bench_extract"; python3 bench/bench_extract.py --out $OUT --disk-dir /tmp/bench_extract --skip-compile --e2e-compiled --e2e-tokens 480000 > $OUT/bench_extract.log 2>&1; echo "rc=$?"
grep -v "Progress" $OUT/bench_extract.log | grep -i "error\|Traceback" | head -5
python3 - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/results.json"))
for k, v in r.items():
    if k == "end_to_end":
        for e in v: print({kk: vv for kk, vv in e.items() if not kk.startswith("stored")})
    elif k not in ("versions", "disk"): print(k, v)
PY
