#!/usr/bin/env bash
# The README's test command: installs what the tests need (both environments), then runs the whole suite,
# unit and integration (real vLLM CPU server) tests alike, in TEST_WORKERS processes (default 2; one test
# file per process at a time, so a file's vLLM server is started once). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup_env.sh --vllm
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
