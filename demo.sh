#!/usr/bin/env bash
# The one-command CPU demo: the whole pipeline on the shipped toy reasoning verifier, ending with a real acceptance
# table from vLLM.
#
#   ./demo.sh                                   # installs what it needs, then ~10 minutes on 2 idle cores
#   CONFIG=configs/demo.yaml ./demo.sh --force  # redo every stage (flags go to run_all.sh)
#   DEMO_SKIP_SETUP=1 CONFIG=small.yaml ./demo.sh   # CI (tests/test_run_all_demo.py)
#
# 1. scripts/setup_env.sh: creates .venv (pipeline) and .venv-vllm (vLLM CPU) if missing (idempotent);
# 2. writes the human-written chat dataset and the held-out prompts of the toy task mix (seconds; the verifier
#    itself is shipped in data/ci/verifier, trained once by `python -m eagle3pipe.toy_reasoning --size ci
#    --out data/ci/verifier`, so the demo never trains it);
# 3. starts a vLLM CPU server with the verifier (python -m eagle3pipe.server) and, while it starts, stage 01;
#    then stage 01b through run_all.sh (it regenerates the answers with the verifier) and stops the server;
# 4. stages 02 -> 05 through run_all.sh (05 starts vLLM with the draft) and prints eval/report.md.
# The server is stopped on every way out: a normal end, an error, Ctrl-C, SIGTERM, and SIGKILL of this script
# (the server process notices its parent is gone; if it is killed too, its guard stops vLLM).
set -euo pipefail

# Inside main(): bash reads it whole first, so updating this file mid-run cannot break a running demo.
main() {
  REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
  cd "$REPO"
  CONFIG="${CONFIG:-configs/demo.yaml}"
  PY="$REPO/.venv/bin/python"
  VLLM_PY="${EAGLE3PIPE_VLLM_PYTHON:-$REPO/.venv-vllm/bin/python}"

  log() { echo "$(date '+%H:%M:%S') demo: $*" >&2; }

  if [ "${DEMO_SKIP_SETUP:-0}" != 1 ] && [ -f scripts/setup_env.sh ]; then
    log "setting up environments (scripts/setup_env.sh; quick when they exist)"
    bash scripts/setup_env.sh --vllm
  fi
  [ -x "$PY" ] || { echo "demo: $PY missing: run scripts/setup_env.sh" >&2; exit 2; }
  [ -x "$VLLM_PY" ] || { echo "demo: $VLLM_PY missing: run scripts/setup_env.sh" >&2; exit 2; }

  # Paths come from the config, so the demo and run_all.sh agree on them.
  read -r DATA_DIR VERIFIER PROMPTS DATASET < <("$PY" - "$CONFIG" <<'EOF'
import sys
from eagle3pipe.config import load_config
c = load_config(sys.argv[1])
print(c.shared.data_dir, c.shared.verifier, c.evaluate.prompts, c.prepare.dataset[0])
EOF
  )
  mkdir -p "$DATA_DIR/logs"
  if [ ! -f "$VERIFIER/model.safetensors" ]; then
    echo "demo: no verifier in $VERIFIER: rebuild it with \`$PY -m eagle3pipe.toy_reasoning --size ci --out $VERIFIER\`" >&2
    exit 2
  fi
  log "writing the toy chat dataset ($DATASET) and held-out prompts ($PROMPTS)"
  "$PY" -m eagle3pipe.toy_reasoning --chats "$DATASET" --eval-prompts "$PROMPTS" 2>&1 \
    | tee -a "$DATA_DIR/logs/00_toy_data.log"

  PORT="$("$PY" -c 'from eagle3pipe.server import free_port; print(free_port())')"
  URL="http://127.0.0.1:$PORT"
  SERVER_LOG="$DATA_DIR/logs/demo_vllm_generate.log"
  READY="$DATA_DIR/logs/.demo_vllm_ready"
  rm -f "$READY"
  SERVER_PID=""
  stop_server() {
    if [ -n "$SERVER_PID" ]; then
      kill -TERM "$SERVER_PID" 2>/dev/null || true  # it stops vLLM (whole process group), then exits
      wait "$SERVER_PID" 2>/dev/null || true
      SERVER_PID=""
    fi
  }
  trap stop_server EXIT
  trap 'stop_server; exit 130' INT
  trap 'stop_server; exit 143' TERM

  log "starting vLLM CPU server for the verifier on $URL (log $SERVER_LOG); stage 01 meanwhile"
  EAGLE3PIPE_VLLM_PYTHON="$VLLM_PY" "$PY" -m eagle3pipe.server --model "$VERIFIER" --port "$PORT" \
    --log "$SERVER_LOG" --served-model-name verifier --ready-file "$READY" -- --reasoning-parser kimi_k2 \
    >> "$DATA_DIR/logs/demo_server.log" 2>&1 &
  SERVER_PID=$!

  ./run_all.sh --config "$CONFIG" --vllm-url "$URL" --only 01_prepare "$@"
  # no fixed deadline: the server process exits (and says why in its log) if vLLM dies or hangs
  while [ ! -f "$READY" ]; do
    kill -0 "$SERVER_PID" 2>/dev/null || {
      echo "demo: the vLLM server did not start; see $SERVER_LOG and $DATA_DIR/logs/demo_server.log" >&2; exit 1; }
    sleep 1
  done
  log "vLLM ready; running stage 01b"
  ./run_all.sh --config "$CONFIG" --vllm-url "$URL" --only 01b_generate "$@"
  stop_server  # the later stages do not need it: its cores go to them
  log "generation server stopped; running stages 02 -> 05"
  # the URL stays on the command line: with it, run_all reads 01b's output (synthetic/) in 02 and 03
  ./run_all.sh --config "$CONFIG" --vllm-url "$URL" --from 02_extract "$@"

  echo
  echo "== Acceptance and tokens/s tables: rows = prompt sets, columns = drafts ($DATA_DIR/eval/report.md; plot: $DATA_DIR/eval/acceptance.png) =="
  cat "$DATA_DIR/eval/report.md"
}

main "$@"
