#!/usr/bin/env bash
# Run the pipeline's stages in order: 01 prepare -> 01b generate (with a vLLM URL, or generate.server_args: then 01b
# starts its own server, as configs/kimi_k25.yaml does) -> 02 extract -> 03 vocab -> 04 train -> 05 evaluate.
#
# Usage:
#   ./run_all.sh --config configs/kimi_k25.yaml [--vllm-url http://host:8000] [--from 02_extract | --only 04_train]
#                [--to 04_train] [--force] [--allow-human-answers]
#   nohup ./run_all.sh --config configs/kimi_k25.yaml > run_all.out 2>&1 &   tail -f run_all.out
#   ./run_all.sh --config FILE --check | --plan | --status [--drops | --json]
#                (run nothing: check this node / cost the run / show each stage's state, progress, ETA and drops;
#                 --drops also lists every dropped sample, --json prints the status as JSON)
#   ./run_all.sh --config FILE --print-recipe two-node [--nodes HOST0,HOST1] [--verifier-config config.json]
#                (run nothing: print the exact per-node commands of a two-node run for this config, each in the
#                 environment that runs it: which node serves the verifier for 01b and 02, which trains, the shared
#                 data dir; docs/two-node.md. --verifier-config: a copy of the verifier's config.json, on a node
#                 without the model folder)
#
# Each stage logs to <data_dir>/logs/<stage>.log (the stage's own log) and to the terminal; the whole run's output,
# tracebacks included, is appended to <data_dir>/logs/run_all.log. A stage that exited 0 leaves a marker
# <data_dir>/run_all/<stage>.done holding its config hash; a rerun with the same config skips it (--force re-runs).
# A stage that runs makes every later stage run too. The first failing stage stops the run, naming itself, its
# error, its log and the command that resumes (also printed at the start, for a run that is killed or loses its
# node): run again, it continues where the run stopped, 04 from its newest checkpoint (--resume, given when this
# run_all started 04 with the same config and 04 did not finish). Stopping run_all (kill PID, Ctrl-C) stops the
# running stage cleanly and waits for it (a second signal kills it). Without a vLLM URL or generate.server_args,
# 01b is skipped and 02-04 read synthetic/ when an earlier 01b finished it, else prepared/ (with thinking on, only
# with --allow-human-answers). Before the first stage starts, every stage this run will run checks its config
# settings (a refusal by 05 stops the run before 01, not after 04). Stage names:
# 01_prepare 01b_generate 02_extract 03_vocab 04_train 05_evaluate (a number alone works: 02).
# Stage 04 runs under torchrun on train.nproc_per_node processes of this node when that is more than 1 (0, the
# default, means every GPU torch sees; 1 on CPU); several nodes: --print-recipe two-node. Before the first stage after
# 01 that runs, the plan's disk estimate of the whole run is checked against the data dir's free space
# (python -m eagle3pipe.costs --check-disk; extract.force_disk starts anyway).
set -uo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

# Everything runs inside main(): bash reads a function whole before calling it, so editing or updating this
# file (git pull) while a long nohup run is in progress cannot change the running script under its feet.
main() {

  REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
  PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
  RESUME_CMD="$(printf '%q ' "$0" "$@")"  # the command as typed: rerunning it resumes
  CONFIG="" FROM="" ONLY="" TO="" FORCE=0 ALLOW_HUMAN=0 MODE="" RECIPE="" NODES="" VERIFIER_CONFIG=""
  STATUS_ARGS=()
  VLLM_URLS=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --config) CONFIG="$2"; shift 2 ;;
      --vllm-url) VLLM_URLS+=("$2"); shift 2 ;;
      --from) FROM="$2"; shift 2 ;;
      --only) ONLY="$2"; shift 2 ;;
      --to) TO="$2"; shift 2 ;;
      --force) FORCE=1; shift ;;
      --allow-human-answers) ALLOW_HUMAN=1; shift ;;
      --check|--plan|--status) MODE="${1#--}"; shift ;;
      --drops|--json) STATUS_ARGS+=("$1"); shift ;;  # --status's
      --print-recipe) MODE=recipe; RECIPE="${2:-}"; shift; [ $# -gt 0 ] && shift ;;
      --nodes) NODES="${2:-}"; shift; [ $# -gt 0 ] && shift ;;
      --verifier-config) VERIFIER_CONFIG="${2:-}"; shift; [ $# -gt 0 ] && shift ;;
      -h|--help) usage; exit 0 ;;
      *) echo "run_all.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
  done
  [ -n "$CONFIG" ] || { echo "run_all.sh: --config FILE is required (see --help)" >&2; exit 2; }
  if [ ${#STATUS_ARGS[@]} -gt 0 ] && [ "$MODE" != status ]; then
    echo "run_all.sh: ${STATUS_ARGS[*]} go with --status (see --help)" >&2; exit 2
  fi
  [ -f "$CONFIG" ] || { echo "run_all.sh: config file not found: $CONFIG" >&2; exit 2; }
  CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"
  cd "$REPO" || exit 2

  URL_ARGS=() ; [ ${#VLLM_URLS[@]} -gt 0 ] && URL_ARGS=(--vllm-url "${VLLM_URLS[@]}")
  case "$MODE" in  # report and exit: nothing runs
    check) exec "$PYTHON" -m eagle3pipe.doctor --config "$CONFIG" "${URL_ARGS[@]}" ;;
    plan) exec "$PYTHON" -m eagle3pipe.costs --config "$CONFIG" "${URL_ARGS[@]}" ;;
    status) exec "$PYTHON" -m eagle3pipe.status --config "$CONFIG" "${STATUS_ARGS[@]}" ;;
    recipe) exec "$PYTHON" -m eagle3pipe.recipe "$RECIPE" --config "$CONFIG" ${NODES:+--nodes "$NODES"} \
                 ${VERIFIER_CONFIG:+--verifier-config "$VERIFIER_CONFIG"} ;;
  esac

  PLAN_ARGS=(plan --config "$CONFIG")
  [ ${#VLLM_URLS[@]} -gt 0 ] && PLAN_ARGS+=(--vllm-url "${VLLM_URLS[@]}")
  [ $ALLOW_HUMAN -eq 1 ] && PLAN_ARGS+=(--allow-human-answers)
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

  # Every stage this run will run (--from, --only, --to) checks its settings now, as its door would: a setting 05
  # refuses must not wait for the hours of 01b to 04
  SELECTED=() ; picked=0 ; [ -z "$FROM" ] && picked=1
  while IFS=$'\t' read -r name _; do
    matches "$name" "$FROM" && picked=1
    if [ -n "$ONLY" ]; then matches "$name" "$ONLY" && SELECTED+=("$name"); continue; fi
    [ $picked -eq 1 ] && SELECTED+=("$name")
    matches "$name" "$TO" && break
  done <<< "$PLAN"
  "$PYTHON" -m eagle3pipe.run_all check --config "$(head -n 1 <<< "$PLAN" | cut -f7)" "${URL_ARGS[@]}" \
    --stages "${SELECTED[@]}" || exit 2

  # A signal to run_all goes to the running stage as SIGTERM (the stage flushes its files and releases its lock);
  # run_all then waits for it. A second signal kills the stage. The stage runs in the background so that these
  # traps run at once (bash defers traps while a foreground command runs); as an asynchronous command of a
  # non-interactive shell it ignores SIGINT, so Ctrl-C reaches it only through here.
  STAGE_PID="" SIGNALLED="" SIGNAL_STATUS=0
  on_signal() {
    if [ -n "$STAGE_PID" ] && kill -0 "$STAGE_PID" 2>/dev/null; then
      if [ -z "$SIGNALLED" ]; then
        say "received SIG$1: stopping stage $name (pid $STAGE_PID) and waiting for it (send again to kill it)"
        kill -TERM "$STAGE_PID" 2>/dev/null
      else
        say "received SIG$1 again: killing stage $name (pid $STAGE_PID)"
        kill -KILL "$STAGE_PID" 2>/dev/null
      fi
    fi
    SIGNALLED="$1" SIGNAL_STATUS="$2"
  }
  trap 'on_signal TERM 143' TERM
  trap 'on_signal INT 130' INT
  trap 'on_signal HUP 129' HUP

  mapfile -t ALL_MARKERS < <(cut -f4 <<< "$PLAN")
  mapfile -t ALL_STARTED < <(cut -f5 <<< "$PLAN")
  say "config $CONFIG, data dir $DATA_DIR, python $PYTHON"
  say "to resume after an interruption, run: $RESUME_CMD"
  reached=0 ; [ -z "$FROM" ] && reached=1  # --from's stage reached (not "started": that is each row's marker path)
  ran_upstream=0 costs_checked=0
  idx=-1
  while IFS=$'\t' read -r name script hash marker started log stage_config launcher resume extra; do
    idx=$((idx + 1))
    matches "$name" "$FROM" && reached=1
    if [ -n "$ONLY" ] && ! matches "$name" "$ONLY"; then continue; fi
    if [ $reached -eq 0 ]; then say "$name: before --from $FROM, not run"; continue; fi
    if [ -n "$SIGNALLED" ]; then
      say "stopped by SIG$SIGNALLED before $name; to resume: $RESUME_CMD"; exit "$SIGNAL_STATUS"
    fi
    if [ $FORCE -eq 0 ] && [ $ran_upstream -eq 0 ] && [ -f "$marker" ] && [ "$(cat "$marker")" = "$hash" ]; then
      say "$name: done before with this config (marker $marker), skipped"
    else
      if [ "$name" != "01_prepare" ] && [ $costs_checked -eq 0 ]; then
        # the whole run's disk, before 01b spends its hours (01 has run: its questions are counted)
        costs_checked=1
        if ! "$PYTHON" -m eagle3pipe.costs --config "$stage_config" "${URL_ARGS[@]}" --check-disk \
             < /dev/null > >(tee -ia "$RUN_LOG") 2>&1; then
          say "FAILED before stage $name: the plan's disk check (above); resume with: $RESUME_CMD"
          exit 2
        fi
      fi
      say "$name: running $(basename "$script") (log $log)"
      # started before with this config and not finished (its marker is removed when it finishes, and when a stage
      # before it runs again): its resume flags (04: --resume) continue that run instead of refusing it
      resume_flags=""
      if [ "$resume" != "-" ] && [ -f "$started" ] && [ "$(cat "$started")" = "$hash" ]; then
        resume_flags="$resume"
        say "$name: continuing the run an earlier run_all started with this config ($resume)"
      fi
      # This stage's output changes: later stages are no longer done, even in a later run.
      rm -f "$marker" "${ALL_MARKERS[@]:$((idx + 1))}" "${ALL_STARTED[@]:$((idx + 1))}"
      mkdir -p "$(dirname "$started")"
      echo "$hash" > "$started.tmp.$$" && mv "$started.tmp.$$" "$started"
      log_start=$(stat -c %s "$log" 2>/dev/null || echo 0)
      # launcher: "-" (the interpreter) or a module and its flags, e.g. torchrun for 04 (train.nproc_per_node)
      LAUNCH=("$PYTHON")
      # shellcheck disable=SC2206  # launcher holds whitespace-separated words by design
      [ "$launcher" != "-" ] && LAUNCH+=(-m $launcher) && say "$name: on $launcher"
      # shellcheck disable=SC2086  # extra and resume_flags hold whitespace-separated flags by design
      "${LAUNCH[@]}" "$script" --config "$stage_config" $extra $resume_flags < /dev/null > >(tee -ia "$RUN_LOG") 2>&1 &
      STAGE_PID=$!
      while :; do
        wait "$STAGE_PID"; rc=$?
        # wait also returns when a trapped signal arrives: go on waiting while the stage still runs
        if [ $rc -gt 128 ] && kill -0 "$STAGE_PID" 2>/dev/null; then continue; fi
        break
      done
      STAGE_PID=""
      if [ -n "$SIGNALLED" ]; then
        say "stopped by SIG$SIGNALLED during $name (its exit status $rc); to resume: $RESUME_CMD"
        exit "$SIGNAL_STATUS"
      fi
      if [ "$rc" -ne 0 ]; then
        # the stage's own one-line error (cli.run_stage logs it as "<stage> failed: ..." or "refused: ...")
        why="$(tail -c +$((log_start + 1)) "$log" 2>/dev/null | grep -E ' ERROR .*(failed|refused): ' | tail -n 1 \
               | sed -E 's/.* (failed|refused): //')"
        say "FAILED at stage $name (exit status $rc)${why:+: $why}"
        say "its log: $log (whole run: $RUN_LOG); after fixing the cause, resume with: $RESUME_CMD"
        exit "$rc"
      fi
      mkdir -p "$(dirname "$marker")"
      echo "$hash" > "$marker.tmp.$$" && mv "$marker.tmp.$$" "$marker"
      rm -f "$started"
      ran_upstream=1
      say "$name: finished"
    fi
    matches "$name" "$TO" && { say "stopping after $name (--to $TO)"; break; }
  done <<< "$PLAN"
  say "all requested stages finished"
}

main "$@"
exit $?
