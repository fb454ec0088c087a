#!/bin/bash
# The wheels bench/gpu_route.sh installs on the device (its image lacks them; it has no network): the versions this
# checkout's .venv holds, for the device's Python 3.12, into .gpuwork/whl (~4 MB, ignored by git). Run here, once a
# checkout, after scripts/setup_env.sh; carry .gpuwork/whl with the call that first runs gpu_route.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpuwork/whl}
mkdir -p "$DEST"
pins=()
for p in openai httpx2 httpcore2 truststore idna anyio speculators hs-connectors datasets dill multiprocess fsspec \
         pydantic-settings python-dotenv loguru; do
  v=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$p'))")
  pins+=("$p==$v")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --platform any -d "$DEST" "${pins[@]}"
ls "$DEST"; du -sh "$DEST"
