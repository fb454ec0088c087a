#!/bin/bash
# device call D: stage 02 fp8 (forward and writes close): two repeats eager, a profiled stage run vs its forward,
# then two repeats with compiled decoder layers
set -o pipefail
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl && export PYTHONPATH=/tmp/site || exit
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
python3 bench/bench_extract.py --out $OUT --disk-dir /tmp/bench_extract --skip-forward --skip-probes --skip-writes --skip-compile --storages fp8 --repeats 2 --profile-stage-tokens 100000 --e2e-compiled --e2e-tokens 480000 > $OUT/bench_extract_fp8.log 2>&1; echo "rc=$?"
grep -i "error\|Traceback" $OUT/bench_extract_fp8.log | head -5
python3 - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/results.json"))
for k, v in r.items():
    if k == "end_to_end":
        for e in v: print({kk: vv for kk, vv in e.items() if not kk.startswith("stored")})
    elif k not in ("versions", "disk"): print(k, v)
PY
