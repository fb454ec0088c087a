#!/usr/bin/env bash
# Run the pipeline's stages in order: 01 prepare -> 01b generate (only with a vLLM URL; otherwise 02 reads
# prepared/) -> 02 extract -> 03 vocab -> 04 train -> 05 evaluate.
#
# Usage:
#   ./run_all.sh --config configs/kimi_k25.yaml [--vllm-url http://host:8000] [--from 02_extract | --only 04_train]
#                [--to 04_train] [--force]
#   nohup ./run_all.sh --config configs/kimi_k25.yaml > run_all.out 2>&1 &   tail -f run_all.out
#
# Each stage logs to <data_dir>/logs/<stage>.log (the stage's own log) and to the terminal; the whole run's output,
# tracebacks included, is appended to <data_dir>/logs/run_all.log. A stage that exited 0 leaves a marker
# <data_dir>/run_all/<stage>.done holding its config hash; a rerun with the same config skips it (--force re-runs).
# A stage that runs makes every later stage run too. The first failing stage stops the run, naming itself and its
# log. Stage names: 01_prepare 01b_generate 02_extract 03_vocab 04_train 05_evaluate (a number alone works: 02).
set -uo pipefail

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }

# Everything runs inside main(): bash reads a function whole before calling it, so editing or updating this
# file (git pull) while a long nohup run is in progress cannot change the running script under its feet.
main() {

  REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
  PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
  CONFIG="" FROM="" ONLY="" TO="" FORCE=0
  VLLM_URLS=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --config) CONFIG="$2"; shift 2 ;;
      --vllm-url) VLLM_URLS+=("$2"); shift 2 ;;
      --from) FROM="$2"; shift 2 ;;
      --only) ONLY="$2"; shift 2 ;;
      --to) TO="$2"; shift 2 ;;
      --force) FORCE=1; shift ;;
      -h|--help) usage; exit 0 ;;
      *) echo "run_all.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
  done
  [ -n "$CONFIG" ] || { echo "run_all.sh: --config FILE is required (see --help)" >&2; exit 2; }
  [ -f "$CONFIG" ] || { echo "run_all.sh: config file not found: $CONFIG" >&2; exit 2; }
  CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"
  cd "$REPO" || exit 2

  PLAN_ARGS=(plan --config "$CONFIG")
  [ ${#VLLM_URLS[@]} -gt 0 ] && PLAN_ARGS+=(--vllm-url "${VLLM_URLS[@]}")
  PLAN="$("$PYTHON" -m eagle3pipe.run_all "${PLAN_ARGS[@]}")" || exit 2
  DATA_DIR="$("$PYTHON" -m eagle3pipe.run_all data-dir --config "$CONFIG")" || exit 2
  mkdir -p "$DATA_DIR/logs"
  RUN_LOG="$DATA_DIR/logs/run_all.log"

  say() { echo "$(date '+%Y-%m-%d %H:%M:%S') run_all: $*" | tee -a "$RUN_LOG" >&2; }

  # "02" matches "02_extract"; a full name matches itself.
  matches() { [ -n "$2" ] && { [ "$1" = "$2" ] || [ "${1%%_*}" = "$2" ]; }; }
  for want in "$FROM" "$ONLY" "$TO"; do
    [ -z "$want" ] && continue
    found=0
    while IFS=$'\t' read -r name _; do matches "$name" "$want" && found=1; done <<< "$PLAN"
    if [ $found -eq 0 ]; then
      echo "run_all.sh: no stage '$want' in this run (stages: $(cut -f1 <<< "$PLAN" | tr '\n' ' '))" >&2; exit 2
    fi
  done

  mapfile -t ALL_MARKERS < <(cut -f4 <<< "$PLAN")
  say "config $CONFIG, data dir $DATA_DIR, python $PYTHON"
  started=0 ; [ -z "$FROM" ] && started=1
  ran_upstream=0
  idx=-1
  while IFS=$'\t' read -r name script hash marker log stage_config extra; do
    idx=$((idx + 1))
    matches "$name" "$FROM" && started=1
    if [ -n "$ONLY" ] && ! matches "$name" "$ONLY"; then continue; fi
    if [ $started -eq 0 ]; then say "$name: before --from $FROM, not run"; continue; fi
    if [ $FORCE -eq 0 ] && [ $ran_upstream -eq 0 ] && [ -f "$marker" ] && [ "$(cat "$marker")" = "$hash" ]; then
      say "$name: done before with this config (marker $marker), skipped"
    else
      say "$name: running $(basename "$script") (log $log)"
      # This stage's output changes: later stages are no longer done, even in a later run.
      rm -f "$marker" "${ALL_MARKERS[@]:$((idx + 1))}"
      # shellcheck disable=SC2086  # extra holds whitespace-separated flags by design
      "$PYTHON" "$script" --config "$stage_config" $extra < /dev/null 2>&1 | tee -a "$RUN_LOG"
      rc=${PIPESTATUS[0]}
      if [ "$rc" -ne 0 ]; then
        say "FAILED at stage $name (exit status $rc); its log: $log (whole run: $RUN_LOG)"
        exit "$rc"
      fi
      mkdir -p "$(dirname "$marker")"
      echo "$hash" > "$marker.tmp.$$" && mv "$marker.tmp.$$" "$marker"
      ran_upstream=1
      say "$name: finished"
    fi
    matches "$name" "$TO" && { say "stopping after $name (--to $TO)"; break; }
  done <<< "$PLAN"
  say "all requested stages finished"
}

main "$@"
exit $?
