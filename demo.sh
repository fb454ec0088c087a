#!/usr/bin/env bash
# The one-command CPU demo: the whole pipeline on a toy reasoning verifier, ending with a real acceptance table.
#
#   ./demo.sh                        # installs what it needs, then about 15 minutes on 2 cores
#   CONFIG=configs/demo.yaml ./demo.sh --force      # redo every stage (flags go to run_all.sh)
#   DEMO_VERIFIER_ARGS="--steps 60 --num-train-tasks 600" DEMO_SKIP_SETUP=1 CONFIG=small.yaml ./demo.sh  # CI
#
# 1. scripts/setup_env.sh: creates .venv (pipeline) and .venv-vllm (vLLM CPU) if missing (idempotent);
# 2. trains the ci-size toy reasoning verifier into data/demo/verifier (reused when already built) and writes its
#    human-written chat dataset (data/demo/chats.jsonl) and held-out prompts (data/demo/eval_prompts.jsonl);
# 3. starts a vLLM CPU server with the verifier, runs stages 01 -> 04 through run_all.sh (01b regenerates the
#    answers with the verifier), stops the server;
# 4. runs stage 05 through run_all.sh (it starts vLLM with the draft, then without) and prints eval/report.md.
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

  log "building the ci-size toy reasoning verifier in $VERIFIER (cached after the first run)"
  # shellcheck disable=SC2086  # DEMO_VERIFIER_ARGS holds flags
  "$PY" -m eagle3pipe.toy_reasoning --size ci --out "$VERIFIER" --chats "$DATASET" --eval-prompts "$PROMPTS" \
    ${DEMO_VERIFIER_ARGS:-} 2>&1 | tee -a "$DATA_DIR/logs/00_toy_verifier.log"

  PORT="$("$PY" -c 'from eagle3pipe.server import free_port; print(free_port())')"
  URL="http://127.0.0.1:$PORT"
  SERVER_LOG="$DATA_DIR/logs/demo_vllm_generate.log"
  SERVER_PID=""
  stop_server() {
    if [ -n "$SERVER_PID" ]; then
      kill -TERM -- "-$SERVER_PID" 2>/dev/null || true   # its own process group (setsid): workers too
      for _ in $(seq 20); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
      kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
      SERVER_PID=""
    fi
  }
  trap stop_server EXIT INT TERM

  log "starting vLLM CPU server for the verifier on $URL (log $SERVER_LOG)"
  VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
    setsid "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$VERIFIER" --host 127.0.0.1 --port "$PORT" \
    --enforce-eager --reasoning-parser kimi_k2 --served-model-name verifier >> "$SERVER_LOG" 2>&1 &
  SERVER_PID=$!
  for i in $(seq 300); do
    if "$PY" -c "import httpx2,sys; sys.exit(httpx2.get('$URL/v1/models', timeout=2).status_code != 200)" 2>/dev/null
    then break; fi
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "demo: vLLM exited during start-up; see $SERVER_LOG" >&2; exit 1; }
    [ "$i" -eq 300 ] && { echo "demo: vLLM did not answer in 300 s; see $SERVER_LOG" >&2; exit 1; }
    sleep 1
  done
  log "vLLM ready; running stages 01 -> 04"

  ./run_all.sh --config "$CONFIG" --vllm-url "$URL" --to 04_train "$@"
  stop_server
  log "generation server stopped; running stage 05"
  ./run_all.sh --config "$CONFIG" --vllm-url "$URL" --only 05_evaluate "$@"

  echo
  echo "== Acceptance table ($DATA_DIR/eval/report.md; plot: $DATA_DIR/eval/acceptance.png) =="
  cat "$DATA_DIR/eval/report.md"
}

main "$@"
