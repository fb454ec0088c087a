#!/bin/bash
# Device side of issue 28's GPU runs (the lent H200: Python 3.12, torch 2.11+cu130, no vLLM, no network), run from
# the repository root the device receives, with vLLM 0.26.0's GPU bundle (../shared/gpu-vllm/build_bundle.sh ->
# .vllmgpu/: core.tar.xz, moe.tar.xz, unpack.py) in $BUNDLE and the project's wheels the image lacks in $WHL
# (.gpuwork/whl: openai 3.57, httpx2/httpcore2, truststore, idna, anyio, speculators, hs-connectors, datasets, dill,
# multiprocess, fsspec, pydantic-settings, python-dotenv, loguru; `pip download --no-deps --only-binary=:all:
# --python-version 3.12` of the versions .venv holds, 4.3 MB). A call carries at most 64 MiB with the repository
# (15.6 MiB): the core bundle (45 MiB) and the wheels fit beside it only without data/bench/verifier's weights (10 MiB,
# unused here: move them aside for that call), so the phases are device calls in a row, each while the machine is
# still warm (/tmp is kept 30 s after a call); each unpacks only what /tmp/site lacks. 2026-12-05's calls:
#   1. carry core + unpack.py + .gpuwork/whl:  TRACKS=ci MIN_EVAL_S=250 bash bench/gpu_route.sh route
#   2. carry moe + unpack.py:  CONFIGS=ci bash bench/gpu_route.sh eval (in the background) beside TRACKS=k25 ... route
#   3. nothing carried:  CONFIGS=k25 bash bench/gpu_route.sh eval
#
#   bash bench/gpu_route.sh probe   # carry core.tar.xz + unpack.py + a trained ci draft (data/demo/checkpoints/final
#                                   # and data/demo/eval_prompts.jsonl from ./demo.sh): vLLM's EAGLE-3 serving of our
#                                   # export with the standard library alone (bench/gpu_eagle3_probe.py)
#   bash bench/gpu_route.sh core    # carry core.tar.xz: our transformers backend's per-layer times at K2.5 dims
#                                   # (bench_slice_gpu.py --part transformers)
#   bash bench/gpu_route.sh route   # carry moe.tar.xz + .gpuwork/whl: every stage on the GPU for the $TRACKS
#                                   # (default ci,k25,online,drill,drill_vllm_example; bench/gpu_route.py)
#   bash bench/gpu_route.sh speed   # carry core.tar.xz + unpack.py + .gpuwork/whl: issue 46's GPU-scale verifier
#                                   # (TRACKS=gpu-dense, or gpu-k25 with moe.tar.xz) trained here, 01 -> 05 for each
#                                   # draft (bench/gpu_route.py --speed-*); repeat on the warm machine to go on
#                                   # gpu-k25 in three calls: `TRACKS=gpu-k25 SPEED_ARGS=--speed-verifier-only`
#                                   # carrying core + unpack.py + whl, then the same without that flag carrying
#                                   # moe.tar.xz + unpack.py, then again carrying nothing
#   bash bench/gpu_route.sh profile # after `speed`: vLLM's torch profiler on a speculation step of each draft in
#                                   # $VARIANTS at concurrency 1 and 16 (bench/gpu_step_profile.py)
#   bash bench/gpu_route.sh eval    # 05 on what `route` left in /tmp/gr (CONFIGS="ci k25", side by side): the export
#                                   # on vLLM's EAGLE-3 and the verifier alone, when `route` ran out of time before it
#                                   # (a 04 it cut is resumed first)
#   bash bench/gpu_route.sh slice   # K2.5-dims slices served by vLLM with our connector (bench_slice_gpu.py --part vllm)
#
# vLLM's processes see /tmp/site and this repository only (gpu_route.py writes an interpreter wrapper); ours see
# /tmp/ours first (openai 3.x) then /tmp/site (pydantic etc.). Logs and results go to $OUT.
set -o pipefail
BUNDLE=${BUNDLE:-.vllmgpu}
WHL=${WHL:-.gpuwork/whl}
OUT=${OUT:-/tmp/gpu_route_out}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_HOST_IP=127.0.0.1 VLLM_NO_USAGE_STATS=1
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
unpack() {  # unpack.py BUNDLE.tar.xz over /tmp/site unless that part is there already
  if [ "$1" = core ] && [ -f /tmp/site/vllm/__init__.py ]; then return 0; fi
  if [ "$1" = moe ] && [ -f /tmp/site/vllm/_moe_C_stable_libtorch.abi3.so ]; then return 0; fi
  python3 "$BUNDLE/unpack.py" "$BUNDLE/$1.tar.xz" && say "unpacked $1"
}
ours() {  # our wheels to /tmp/ours, once
  [ -d /tmp/ours/speculators ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/ours "$WHL"/*.whl || return 1
  say "wheels installed"
}

case "$1" in
  probe)
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
    unpack core || exit 1
    say "vllm: $(PYTHONPATH=/tmp/site python3 -c 'import vllm; print(vllm.__version__)' 2>&1 | tail -1)"
    PYTHONPATH=/tmp/site timeout "${PROBE_TIMEOUT_S:-540}" python3 bench/gpu_eagle3_probe.py \
      --verifier data/ci/verifier --draft "${DRAFT:-data/demo/checkpoints/final}" \
      --prompts "${PROMPTS:-data/demo/eval_prompts.jsonl}" --out "$OUT" > "$OUT/probe.log" 2>&1
    say "gpu_eagle3_probe: exit $?"
    tail -c 5000 "$OUT/probe.log"
    ;;
  core)
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
    unpack core || exit 1
    say "vllm: $(PYTHONPATH=/tmp/site python3 -c 'import vllm; print(vllm.__version__)' 2>&1 | tail -1)"
    timeout 300 python3 bench/bench_slice_gpu.py --work /tmp/slice --out "$OUT" --part transformers \
      > "$OUT/slice_transformers.log" 2>&1; say "bench_slice_gpu transformers: exit $?"
    tail -25 "$OUT/slice_transformers.log"
    ;;
  route)  # moe only where it was carried (the ci track alone needs none: a call can carry core and the wheels)
    unpack core && ours || exit 1
    if [ -f "$BUNDLE/moe.tar.xz" ]; then unpack moe || exit 1; fi
    export PYTHONPATH=/tmp/ours:/tmp/site
    timeout 565 python3 bench/gpu_route.py --work /tmp/gr --out "$OUT" --vllm-site /tmp/site \
      --tracks "${TRACKS:-ci,k25,online,drill,drill_vllm_example}" --deadline-s "${DEADLINE_S:-520}" \
      --min-eval-s "${MIN_EVAL_S:-0}" \
      > "$OUT/gpu_route.log" 2>&1
    say "gpu_route: exit $?"
    grep -E "FAILED|exit [1-9]|states vLLM|drill:" "$OUT/gpu_route.log" | cut -c1-600 | tail -20
    python3 -c "import json,sys; s=json.load(open('$OUT/summary.json')); print(json.dumps(s)[-7000:])"
    ;;
  speed)  # issue 46: $TRACKS (default gpu-dense) from its verifier to 05 for every draft; resumable: repeat the
          # same call on the warm machine until summary.json shows each draft's eval (moe.tar.xz for gpu-k25)
    unpack core && ours || exit 1
    if [ -f "$BUNDLE/moe.tar.xz" ]; then unpack moe || exit 1; fi
    export PYTHONPATH=/tmp/ours:/tmp/site
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
    timeout "${SPEED_TIMEOUT_S:-585}" python3 bench/gpu_route.py --work /tmp/gr --out "$OUT" --vllm-site /tmp/site \
      --tracks "${TRACKS:-gpu-dense}" --deadline-s "${DEADLINE_S:-560}" --min-eval-s "${MIN_EVAL_S:-150}" \
      ${SPEED_ARGS:-} >> "$OUT/gpu_route.log" 2>&1
    say "gpu_route speed: exit $?"
    grep -E "\] (gpu-|run)|FAILED" "$OUT/gpu_route.log" | cut -c1-400 | tail -30
    cp /tmp/gr/*_verifier/toy_reasoning.json "$OUT/" 2>/dev/null
    for f in /tmp/gr/gpu-*_*/eval/report.md; do [ -f "$f" ] && { d=$(basename "$(dirname "$(dirname "$f")")");
      cp "$f" "$OUT/${d}_report.md"; cp "$(dirname "$f")/report.json" "$OUT/${d}_report.json"; }; done
    python3 -c "import json; s=json.load(open('$OUT/summary.json')); print(json.dumps(s)[-5000:])"
    ;;
  profile)  # issue 46: where a speculation step's time goes, for the speed track's drafts (after `speed`): vLLM's torch
            # profiler at concurrency 1 and 16 (bench/gpu_step_profile.py), $VARIANTS (default eagle3) of $SIZE
    export PYTHONPATH=/tmp/ours:/tmp/site EAGLE3PIPE_VLLM_PYTHON=/tmp/gr/vllm_python
    S=${SIZE:-gpu-dense}
    for v in ${VARIANTS:-eagle3}; do
      timeout "${PROFILE_TIMEOUT_S:-400}" python3 bench/gpu_step_profile.py --verifier "/tmp/gr/${S}_verifier" \
        --draft "/tmp/gr/${S}_${v}/checkpoints/final" --prompts "/tmp/gr/${S}_inputs/eval_prompts.jsonl" \
        --out "$OUT/profile_${S}_${v}" --levels ${LEVELS:-1 16} > "$OUT/profile_${S}_${v}.log" 2>&1
      say "profile $S $v: exit $?"; tail -30 "$OUT/profile_${S}_${v}.log"
      rm -rf "$OUT/profile_${S}_${v}/traces"  # large; profile.json holds what was read from them
    done
    ;;
  eval)  # the configs side by side; a 04 that route's deadline cut is resumed first (run_all's printed command)
    ours || exit 1
    export PYTHONPATH=/tmp/ours:/tmp/site EAGLE3PIPE_VLLM_PYTHON=/tmp/gr/vllm_python PYTHON=python3
    for c in ${CONFIGS:-ci}; do
      (
        if [ ! -f "/tmp/gr/$c/checkpoints/final/model.safetensors" ]; then
          timeout 300 bash run_all.sh --config "/tmp/gr/$c.yaml" --from 03_vocab --to 04_train \
            > "$OUT/${c}_04_resume.log" 2>&1; say "04 $c resumed: exit $?"
        fi
        timeout "${EVAL_TIMEOUT_S:-540}" python3 05_evaluate.py --config "/tmp/gr/$c.yaml" > "$OUT/${c}_05.log" 2>&1
        say "05 $c: exit $?"
        cp "/tmp/gr/$c/eval/report.json" "$OUT/${c}_report.json" && tail -20 "/tmp/gr/$c/eval/report.md"
      ) &
    done
    wait
    ;;
  slice)
    unpack core && unpack moe && ours || exit 1
    export PYTHONPATH=/tmp/ours:/tmp/site
    timeout 570 python3 bench/bench_slice_gpu.py --work /tmp/slice --out "$OUT" --part vllm --vllm-site /tmp/site "${@:2}" \
      > "$OUT/slice_vllm.log" 2>&1; say "bench_slice_gpu vllm: exit $?"
    tail -c 6000 "$OUT/slice_vllm.log"
    tar -czf "$OUT/slice_logs.tar.gz" -C /tmp/slice --wildcards '*.log' 2>/dev/null
    ;;
  *) echo "usage: bash bench/gpu_route.sh probe|core|route|speed|profile|eval|slice" >&2; exit 2 ;;
esac
