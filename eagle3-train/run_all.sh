#!/usr/bin/env bash
# Run the five stages in order for one profile, target, data and work directory; with --eval or
# --eval-prompts, then stage 06 (the exported draft's acceptance in vLLM, and its verdict) into WORK/eval.
#
#   eagle3-train/run_all.sh --profile rtx-pro-6000-8x --target /models/Kimi-K2.5 --trust-remote-code \
#       --data mlabonne/open-perfectblend --work /nvme/eagle3-run
#
# options:  --python PY            interpreter (default: $PYTHON, else python3)
#           --trust-remote-code    passed to the stages that load the target (01, 02, 04)
#           --args-0N "FLAGS"      extra flags for stage N, e.g. --args-04 "--epochs 3 --lr 5e-4"
#           --eval                 after 05, run 06_evaluate.py on its default prompts (eagle3-train/samples/
#                                  eval_prompts.jsonl: chat, code, maths, tool calls, multi-turn) into WORK/eval,
#                                  given WORK's checkpoints, data and vocab (a moved WORK needs no --args-06)
#           --eval-prompts FILE    the same on your prompts (jsonl of OpenAI messages, optional `category`);
#                                  a verdict that fails (tau ~1: a broken draft) stops the run with its line
#           --from NN              start at stage NN (earlier ones must be finished: their manifest complete)
#           --slice-rows N         a run larger than the disk: the training rows in slices of N; per slice 02
#                                  extracts it (+ the validation rows), 04 trains on it continuing one run (one
#                                  optimizer, one lr schedule over all slices x epochs), its states are deleted;
#                                  epochs > 1 re-extract every slice. --plan prints N for the free disk.
#                                  kill/rerun resumes at the right slice and step (eagle3_pipeline/slices.py);
#                                  a WORK whose 04 trained otherwise (unsliced, another N, epochs or input) is refused
#           --node-wait S          a node (below) waiting for a stage another node runs gives up after S seconds in
#                                  which nothing in WORK/logs or that stage's output changed (default 1800)
#           --status               show each stage's state and log (a missing log says so), then exit; a stage
#                                  is `stale` when a file it wrote changed or its input is not finished (says which)
#           --print-config         print every stage's resolved config (value # source), then exit
#           --plan [--rows N --tokens-per-row T] [RATES]
#                                  the run plan (hidden-state bytes in bf16 and fp8, disk, read bandwidth,
#                                  hours of regeneration, extraction and training, recommendation) from
#                                  WORK/data's manifest or N x T tokens; writes nothing. RATES (python -m
#                                  eagle3_pipeline.plan --help): --decode-tokens-per-s, --extract-tokens-per-s,
#                                  --train-tokens-per-s, --disk-read-gb-s, --disk-write-gb-s, --extract-disk-fraction,
#                                  --answer-tokens-per-row, --free-disk-gb;
#                                  its `slices` lines plan a sliced run (--slice-rows N: that size, else the most that fit)
#
# Logs: WORK/logs/0N_<stage>.log per stage (appended, one header per attempt) and WORK/logs/run_all.log.
# Every stage is run every time, and each decides by the one rule for "done" (NOTES.md, "Reliability"):
# a finished stage (complete manifest, same inputs and output-changing settings) is a no-op in
# seconds; a stale one stops the run saying which field changed and both values; an unfinished one
# resumes its own partial work (02 skips landed rows, 04 resumes from the newest epoch checkpoint).
# So after a disconnect, a kill or a reboot the same command continues where it stopped, and after
# new data or new --args-0N the stages downstream are never reported finished for the old ones.
#
# Over SSH, inside tmux (the run survives a dropped connection; reattach to watch):
#   tmux new -s eagle3 'eagle3-train/run_all.sh --profile ... --work W; exec bash'
#   tmux attach -t eagle3            # later, from a new SSH session
# or with nohup, following the log:
#   nohup eagle3-train/run_all.sh --profile ... --work W > W.out 2>&1 &   then  tail -f W/logs/run_all.log
# Without either, a dropped connection (SIGHUP) does not stop the run: the driver ignores SIGHUP
# and keeps writing WORK/logs. Ctrl-C or kill -TERM <driver pid> stops the running stage cleanly
# (stage 04 saves its position and the rerun continues from that step); a second Ctrl-C kills it. Only one driver runs per WORK: a second one (or a restart while a stage from a
# killed driver still runs) is refused, exit 75. A failed stage stops the driver with the stage's exit code and its
# reason (its error line; else its last meaningful line); a stage's own 75 (e.g. 04's stall watch) says so. Every stage runs in its own process group,
# recorded in WORK/logs/current_stage.
#
# Several nodes (WORK on a filesystem every node mounts): on EVERY node the same command, started in any order, with
# its own --node-rank and node 0's address in --rdzv-endpoint; with --args-02 "--world-size N --rank R" too, each
# node also extracts its share of the rows (one rank per node, e.g. TP 8 on each 8-GPU node):
#   eagle3-train/run_all.sh --profile h200-8x --target T --data D --work W --args-02 "--world-size 2 --rank 0" \
#       --args-04 "--nnodes 2 --node-rank 0 --rdzv-endpoint 10.0.0.1:29500"   (node 1: --rank 1, --node-rank 1)
# Node 0 runs 01, its 02 rank, waits for the other ranks, then 03, 04 holding global rank 0 (checkpoints, metrics,
# manifest), 05 (and 06). Another node waits for node 0's 01, runs its 02 rank, waits for 02's other ranks and 03,
# then runs its part of 04, with its own driver lock and logs (WORK/logs/run_all.nodeR.log, 02_extract.nodeR.log,
# 04_train.nodeR.log), so the drivers share one WORK. A wait lasts while node 0's or another node's logs or the awaited
# output change; --node-wait seconds without a change end it (exit 3, naming the stage). A node that dies in 04 stops
# the others within ~30 s with one line naming it; the same commands resume every node.
# DeepSpeed instead: --args-04 "--launcher deepspeed --hostfile H --nnodes 2", started once on node 0.
set -euo pipefail
trap '' HUP PIPE  # an SSH drop must not stop the run; a closed terminal must not kill the driver

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
profile="" target="" data="" work="" from="" trust="" mode=run rows="" tokens_per_row="" slice_rows="" node_wait=1800
evaluate="" eval_prompts=""
plan_rates=()  # --plan's rate flags, passed to eagle3_pipeline.plan as given
declare -A extra=([01]="" [02]="" [03]="" [04]="" [05]="" [06]="")
while [[ $# -gt 0 ]]; do
  case "$1" in
    --profile|--target|--data|--work|--python|--from)
      [[ $# -ge 2 ]] || { echo "run_all.sh: $1 needs a value (see --help)" >&2; exit 2; }
      declare "${1#--}=$2"; shift 2 ;;
    --trust-remote-code) trust="--trust-remote-code"; shift ;;
    --args-0[1-6])
      [[ $# -ge 2 ]] || { echo "run_all.sh: $1 needs a value (see --help)" >&2; exit 2; }
      extra[${1#--args-}]="$2"; shift 2 ;;
    --eval) evaluate=1; shift ;;
    --eval-prompts)
      [[ $# -ge 2 ]] || { echo "run_all.sh: $1 needs a value (see --help)" >&2; exit 2; }
      evaluate=1 eval_prompts="$2"; shift 2 ;;
    --status) mode=status; shift ;;
    --print-config) mode=print; shift ;;
    --plan) mode=plan; shift ;;
    --rows|--tokens-per-row|--slice-rows|--node-wait)
      [[ $# -ge 2 ]] || { echo "run_all.sh: $1 needs a value (see --help)" >&2; exit 2; }
      v="${1#--}"; declare "${v//-/_}=$2"; shift 2 ;;
    --decode-tokens-per-s|--extract-tokens-per-s|--train-tokens-per-s|--disk-read-gb-s|--disk-write-gb-s|--extract-disk-fraction|--answer-tokens-per-row|--free-disk-gb)
      [[ $# -ge 2 ]] || { echo "run_all.sh: $1 needs a value (see --help)" >&2; exit 2; }
      plan_rates+=("$1" "$2"); shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_all.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
# A node other than node 0: of a multi-node stage 04 (--args-04 "... --node-rank R"), or running a stage 02 rank
# R > 0 alone (--args-02 "... --rank R"). It runs only those, beside node 0's driver on the same WORK, so its lock,
# driver log, stage logs and current-stage file carry its rank.
node_rank=0 extract_rank=""
[[ " ${extra[04]} " =~ [[:space:]]--node-rank[=[:space:]]+([0-9]+)[[:space:]] ]] && node_rank=$((10#${BASH_REMATCH[1]}))
[[ " ${extra[02]} " =~ [[:space:]]--rank[=[:space:]]+([0-9]+)[[:space:]] ]] && extract_rank=$((10#${BASH_REMATCH[1]}))
node_suffix=""
if (( node_rank > 0 )); then node_suffix=".node$node_rank"
elif (( ${extract_rank:-0} > 0 )); then node_suffix=".rank$extract_rank"; fi
[[ "$node_wait" =~ ^[0-9]+$ ]] || { echo "run_all.sh: --node-wait takes seconds" >&2; exit 2; }
[[ -z "$extract_rank" || -z "$slice_rows" || $mode == plan ]] || { echo "run_all.sh: --slice-rows runs on one node (its 02 runs between slices): --args-02 --rank is refused" >&2; exit 2; }
[[ -z "$node_suffix" || -z "$slice_rows" || $mode == plan ]] || { echo "run_all.sh: --slice-rows runs on one node (its 02 runs between slices): --node-rank $node_rank is refused" >&2; exit 2; }
required=(work)
case $mode in status) ;; plan) required+=(profile target) ;; *) required+=(profile target data) ;; esac
for opt in "${required[@]}"; do
  [[ -n "${!opt}" ]] || { echo "run_all.sh: --$opt is required (see --help)" >&2; exit 2; }
done
[[ -z "$from" || "$from" =~ ^0[1-6]$ ]] || { echo "run_all.sh: --from takes 01..06" >&2; exit 2; }
[[ "$from" != 06 || -n "$evaluate" ]] || { echo "run_all.sh: --from 06 needs --eval or --eval-prompts" >&2; exit 2; }
[[ -z "$slice_rows" || "$slice_rows" =~ ^[1-9][0-9]*$ ]] || { echo "run_all.sh: --slice-rows takes a row count" >&2; exit 2; }
[[ -z "$slice_rows" || -z "$from" || $mode == plan ]] || { echo "run_all.sh: --from does not combine with --slice-rows (each slice resumes by itself)" >&2; exit 2; }
[[ -z "$slice_rows" || $mode == plan ]] || extra[04]+=" --slice-rows $slice_rows"

# stage table: number, name, output dir (its manifest.json says whether it is finished), script
nums=(01 02 03 04 05)
declare -A name=([01]=prepare [02]=extract [03]=vocab [04]=train [05]=export [06]=evaluate)
declare -A out=([01]="$work/data" [02]="$work/data/hidden_states" [03]="$work/vocab" [04]="$work/checkpoints" [05]="$work/draft"
                [06]="$work/eval")
declare -A script=([01]=01_prepare_dataset.py [02]=02_extract_hidden_states.py [03]=03_build_vocab_mapping.py
                   [04]=04_train.py [05]=05_export.py [06]=06_evaluate.py)
[[ -z "$evaluate" ]] || nums+=(06)
stage_args() {  # the flags of stage $1, one per line (values may hold spaces)
  case "$1" in
    01) printf '%s\n' --target "$target" --data "$data" --output "$work/data" ;;
    02) printf '%s\n' --target "$target" --data "$work/data" ;;
    03) printf '%s\n' --data "$work/data" --output "$work/vocab" ;;
    04) printf '%s\n' --target "$target" --data "$work/data" --vocab "$work/vocab" --output "$work/checkpoints" ;;
    05) printf '%s\n' --checkpoints "$work/checkpoints" --vocab "$work/vocab" --output "$work/draft" ;;
    # 06 reads the training run behind the draft (04), its data (01) and vocab (03): this WORK's, as 05 gets --vocab
    # (the paths 05's and 04's manifests recorded are gone once WORK moved)
    06) printf '%s\n' --draft "$work/draft" --checkpoints "$work/checkpoints" --data "$work/data" --vocab "$work/vocab" \
          --output "$work/eval"
        [[ -z "$eval_prompts" ]] || printf '%s\n' --prompts "$eval_prompts" ;;
  esac
  [[ -n "$trust" && "$1" =~ ^0[1246]$ ]] && printf '%s\n' "$trust"
  return 0
}
stage_command() {  # fills the array `cmd` for stage $1
  local line words=()
  cmd=("$python" -u "$here/${script[$1]}" --profile "$profile")
  while IFS= read -r line; do cmd+=("$line"); done < <(stage_args "$1")
  read -r -a words <<< "${extra[$1]}"  # --args-0N is split at spaces (no quoting inside, no globbing)
  cmd+=("${words[@]}")
}
finished() {  # finished DIR: the stage output there has a complete manifest
  [[ -f "$1/manifest.json" ]] && grep -Eq '"complete":[[:space:]]*true' "$1/manifest.json"
}

if [[ $mode == status ]]; then
  # the stages' own rule for "done" (recorded inputs = the upstream outputs on disk now), not a grep
  PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" "$python" -m eagle3_pipeline.status --work "$work" || exit $?
  # every driver on WORK: node 0's (current_stage) and other nodes' or 02 ranks' (current_stage.nodeN / .rankN)
  for record in "$work/logs/current_stage" "$work/logs"/current_stage.node* "$work/logs"/current_stage.rank*; do
    [[ -f "$record" ]] || continue
    suffix="${record##*/current_stage}" who=""
    [[ -z "$suffix" ]] || { who="${suffix#.}"; who=" on ${who%%[0-9]*} ${who##*[a-z]}"; }  # " on node 1"
    read -r n pid _ < "$record" || true
    [[ -n "${n:-}" && -n "${name[$n]:-}" ]] || continue
    lock="$work/logs/.run_all$suffix.lock" log="$work/logs/${n}_${name[$n]}$suffix.log"
    # its driver's lock held: running (the pid may be another node's, where the filesystem's flock spans nodes; a copied
    # work dir carries the file, not the lock). Node 0's driver and the others' each say so.
    if [[ -f "$lock" ]] && ! flock -n "$lock" true; then
      echo "running$who: stage $n (process group $pid); tail -f $log"
    else
      echo "nothing running$who (last started: stage $n)"
    fi
  done
  exit 0
fi

if [[ $mode == plan ]]; then
  plan=("$python" -m eagle3_pipeline.plan --target "$target" --profile "$profile" --work "$work")
  [[ -n "$rows" ]] && plan+=(--rows "$rows")
  [[ -n "$tokens_per_row" ]] && plan+=(--tokens-per-row "$tokens_per_row")
  [[ -n "$slice_rows" ]] && plan+=(--slice-rows "$slice_rows")
  plan+=("${plan_rates[@]}")
  PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec "${plan[@]}"
fi

if [[ $mode == print ]]; then
  for n in "${nums[@]}"; do
    stage_command "$n"
    echo "## ${n}_${name[$n]}"
    "${cmd[@]}" --print-config
  done
  exit 0
fi

mkdir -p "$work/logs"
driver_log="$work/logs/run_all$node_suffix.log"
say() {  # to the driver log, and to the terminal while there is one
  local line; line="[$(date '+%F %T')] $*"
  printf '%s\n' "$line" >> "$driver_log"
  printf '%s\n' "$line" 2>/dev/null || true
}
die() {  # die CODE MESSAGE
  local code="$1"; shift
  say "run_all: $*"
  printf 'run_all.sh: %s\n' "$*" >&2 2>/dev/null || true
  exit "$code"
}

# One driver per work directory. The lock (fd 9) is inherited by each stage, so it stays held
# while a stage started by a killed driver is still running.
exec 9>>"$work/logs/.run_all$node_suffix.lock"
if ! flock -w 2 9; then  # a short grace: processes killed a moment ago may still be exiting
  running=$(cat "$work/logs/current_stage$node_suffix" 2>/dev/null || true)
  die 75 "another run_all or a stage it started is still running in $work (stage, process group: ${running:-?}); wait for it (run_all.sh --status --work $work) or stop it (kill -TERM -- -PGID), then rerun"
fi

child="" stop_requests=0 rank_children=() unfinished_ok=""
declare -A attempt_at=()  # stage -> where this run's attempt begins in its log (what the stage printed this time)
on_stop() {  # Ctrl-C / kill -TERM: stop the running stage (TERM, then KILL on a second request)
  stop_requests=$((stop_requests + 1))
  local pg
  [[ -n "$child" || ${#rank_children[@]} -gt 0 ]] || exit 130
  for pg in $child "${rank_children[@]}"; do
    if (( stop_requests == 1 )); then
      say "run_all: stopping stage (kill -TERM -- -$pg); again to kill it"
      kill -TERM -- "-$pg" 2>/dev/null || true
    else
      kill -KILL -- "-$pg" 2>/dev/null || true
    fi
  done
}
trap on_stop INT TERM

failure_reason() {  # failure_reason LOG: why the stage's last attempt in LOG (after its last "run_all attempt" header)
  # failed: its `error: ` line; else a stall watch's line (it names --stall-minutes; a stack dump follows it); else a
  # traceback's exception line; else its last line (a progress bar's last state), never an empty reason
  awk '/^==== .*run_all attempt/ { err = ""; stall = ""; exc = ""; last = ""; next }
    { sub(/.*\r/, "") }
    /^error: / { err = substr($0, 8) }
    /stalled: no training step or validation batch/ { stall = $0 }
    /^[A-Za-z_][A-Za-z0-9_.]*(Error|Exception|Interrupt|Exit)(: |$)/ { exc = $0 }
    /[^[:space:]]/ && !/^  File "/ && !/^    / { last = $0 }
    END {
      if (err != "") r = err; else if (stall != "") r = stall
      else if (exc != "") r = "no error line; it ended in " exc
      else if (last != "") r = "no error line; its last line: " last
      else r = "no error line and no output"
      print substr(r, 1, 800) }' "$1" 2>/dev/null || echo "its log $1 cannot be read"
}
exit_note() {  # exit_note RC: a stage's exit code as the driver reports it (75 is also the driver's own code)
  if (( $1 == 75 )); then
    echo "exit 75 from the stage itself (a temporary stop: rerunning resumes), not run_all's own 75 (another driver)"
  else
    echo "exit $1"
  fi
}

run_stage() {  # run_stage NN: the stage in its own process group, its output appended to its log
  local n="$1" log="$work/logs/${1}_${name[$1]}$node_suffix.log" start=$SECONDS rc=0 offset viewer
  stage_command "$n"
  printf '\n==== %s  run_all attempt: %s\n' "$(date '+%F %T')" "${cmd[*]}" >> "$log"
  say "== $n ${name[$n]} -> ${out[$n]} (log: $log)"
  offset=$(stat -c %s "$log")
  attempt_at[$n]=$offset
  setsid "${cmd[@]}" >> "$log" 2>&1 < /dev/null &
  child=$!
  echo "$n $child" > "$work/logs/current_stage$node_suffix"
  tail -c "+$((offset + 1))" -s 0.2 -f --pid="$child" "$log" 2>/dev/null &  # show it while it runs
  viewer=$!
  wait "$child" || rc=$?
  while kill -0 "$child" 2>/dev/null; do rc=0; wait "$child" || rc=$?; done  # a signal interrupted wait
  wait "$viewer" 2>/dev/null || true
  child=""
  if (( stop_requests > 0 )); then
    die 130 "stopped during $n ${name[$n]} (exit $rc); rerun the same command to continue"
  fi
  if (( rc != 0 )); then
    die "$rc" "$n ${name[$n]} failed ($(exit_note "$rc")) after $((SECONDS - start)) s: $(failure_reason "$log"); see $log, fix, then rerun the same command (finished stages are no-ops)"
  fi
  if [[ -z "$unfinished_ok" ]] && ! finished "${out[$n]}"; then
    die 3 "$n ${name[$n]} exited 0 but ${out[$n]}/manifest.json is not complete (--world-size > 1: run the other ranks, then rerun; --check/--dry-run in --args-$n stop early)"
  fi
  say "== $n ${name[$n]}: done in $((SECONDS - start)) s"
}

activity() {  # what changes while another node works: WORK/logs (but this driver's log) and the awaited output
  { stat -c '%n %s %Y' "$work/logs"/* "$1" 2>/dev/null || true; } | { grep -vF "$driver_log " || true; } | cksum
}

await_stage() {  # await_stage NN WHO: wait until WHO (another node, or 02's other ranks) finishes stage NN; give up after
  # --node-wait seconds in which nothing in WORK/logs or its output changed
  local n="$1" who="$2" seen=$SECONDS last="" now
  finished "${out[$n]}" && return 0
  say "== $n ${name[$n]}: waiting for $who to finish it (${out[$n]}/manifest.json); gives up after $node_wait s without a change in $work/logs or ${out[$n]} (--node-wait)"
  while ! finished "${out[$n]}"; do
    now=$(activity "${out[$n]}")
    [[ "$now" == "$last" ]] || { last=$now; seen=$SECONDS; }
    (( SECONDS - seen < node_wait )) || die 3 "gave up waiting for $who to finish $n ${name[$n]}: nothing in $work/logs or ${out[$n]} changed for $node_wait s (--node-wait); start or fix $who, then rerun the same command"
    sleep 2 & wait $! || true  # a signal runs on_stop at once
  done
  say "== $n ${name[$n]}: finished by $who"
}

extract_ranks() {  # stage 02's resolved world_size and tensor_parallel_size (the profile's), or "1 0" when
  # --args-02 runs one rank itself (--rank) or the config cannot be printed
  local text ws tp
  [[ " ${extra[02]} " == *" --rank "* ]] && { echo "1 0"; return; }
  stage_command 02
  text=$("${cmd[@]}" --print-config 2>/dev/null) || { echo "1 0"; return; }
  ws=$(sed -n 's/^world_size = \([0-9]*\).*/\1/p' <<< "$text")
  tp=$(sed -n 's/^tensor_parallel_size = \([0-9]*\).*/\1/p' <<< "$text")
  echo "${ws:-1} ${tp:-1}"
}

run_ranks() {  # run_ranks WS TP: stage 02 as WS data-parallel ranks (--rank r), rank r on GPUs r*TP..r*TP+TP-1 of
  # CUDA_VISIBLE_DEVICES (or of 0..WS*TP-1), each in its own process group and log; the last rank to finish
  # writes the one manifest (02_extract_hidden_states.py, step 5)
  local ws="$1" tp="$2" log="$work/logs/02_${name[02]}.log" start=$SECONDS r rc=0 failed="" gpus=() devices pid
  IFS=, read -r -a gpus <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((ws * tp - 1)))}"
  (( ${#gpus[@]} >= ws * tp )) || die 2 "02: $ws ranks x tensor parallel $tp need $((ws * tp)) GPUs, CUDA_VISIBLE_DEVICES has ${#gpus[@]}"
  stage_command 02
  say "== 02 ${name[02]} -> ${out[02]}: $ws data-parallel ranks x tensor parallel $tp (logs: ${log%.log}.rankN.log)"
  rank_children=()
  for ((r = 0; r < ws; r++)); do
    devices=$(IFS=,; echo "${gpus[*]:$((r * tp)):$tp}")
    printf '\n==== %s  run_all attempt (rank %d/%d, GPUs %s): %s --rank %d\n' "$(date '+%F %T')" "$r" "$ws" "$devices" \
      "${cmd[*]}" "$r" >> "${log%.log}.rank$r.log"
    CUDA_VISIBLE_DEVICES="$devices" setsid "${cmd[@]}" --rank "$r" >> "${log%.log}.rank$r.log" 2>&1 < /dev/null &
    rank_children+=("$!")
  done
  echo "02 ${rank_children[*]}" > "$work/logs/current_stage"
  for ((r = 0; r < ws; r++)); do
    pid=${rank_children[$r]}
    rc=0; wait "$pid" || rc=$?
    while kill -0 "$pid" 2>/dev/null; do rc=0; wait "$pid" || rc=$?; done  # a signal interrupted wait
    (( rc == 0 )) || failed+=" rank $r ($(exit_note "$rc"): $(failure_reason "${log%.log}.rank$r.log" | cut -c1-300))"
  done
  rank_children=()
  (( stop_requests == 0 )) || die 130 "stopped during 02 ${name[02]}; rerun the same command to continue"
  [[ -z "$failed" ]] || die 1 "02 ${name[02]} failed:$failed; see ${log%.log}.rankN.log, fix, then rerun the same command"
  finished "${out[02]}" || die 3 "02 ${name[02]}: every rank exited 0 but ${out[02]}/manifest.json is not complete"
  say "== 02 ${name[02]}: done in $((SECONDS - start)) s ($ws ranks)"
}

run_sliced() {  # --slice-rows: 01 and 03 once; per run position (epoch x slice) 02 --rows, 04 --slice-index, release
  local lines=() i g sel state next rc=0 text err ws tp base02="${extra[02]}" base04="${extra[04]}"
  run_stage 01
  stage_command 04
  # the schedule from stage 04's own flags; a changed slice size or input is refused here, before any extraction
  text=$(PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" "$python" -m eagle3_pipeline.slices schedule -- "${cmd[@]:3}" 2>&1) || rc=$?
  (( rc == 0 )) || die "$rc" "sliced run refused: $(grep '^error: ' <<< "$text" | tail -n 1 | cut -c8-800)"
  mapfile -t lines <<< "$text"
  run_stage 03
  say "run_all: sliced run, ${#lines[@]} run position(s) (slices x epochs) of --slice-rows $slice_rows training rows"
  for ((i = 0; i < ${#lines[@]}; i++)); do
    read -r g sel state <<< "${lines[$i]}"
    next=""; (( i + 1 < ${#lines[@]} )) && read -r _ next _ <<< "${lines[$((i + 1))]}"
    if [[ $state == todo ]]; then
      say "== run position $((g + 1))/${#lines[@]}: rows $sel"
      extra[02]="$base02 --rows $sel"
      if read -r ws tp < <(extract_ranks) && (( ws > 1 )) && ! finished "${out[02]}"; then
        run_ranks "$ws" "$tp"  # the profile's data-parallel extraction, over this slice's rows
      else
        run_stage 02
      fi
      extra[04]="$base04 --slice-index $g"; unfinished_ok=$(( g + 1 < ${#lines[@]} )); (( unfinished_ok )) || unfinished_ok=""
      run_stage 04; unfinished_ok=""
    fi
    # the trained slice's states go (stage 02's manifest and fingerprints are kept as the record), only once 04's
    # manifest records training on exactly them
    rc=0; text=$(PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" "$python" -m eagle3_pipeline.slices release \
      --data "$work/data" --keep "$next" --checkpoints "$work/checkpoints" 2>&1) || rc=$?
    printf '%s\n' "$text" >> "$driver_log"
    if (( rc != 0 )); then
      err=$(grep '^error: ' <<< "$text" | tail -n 1 | cut -c8-800 || true)
      die "$rc" "the states of rows $sel were not released: ${err:-see $driver_log}"
    fi
  done
  extra[02]="$base02" extra[04]="$base04"
  run_stage 05
  [[ -z "$evaluate" ]] || run_stage 06
}

say "run_all: profile $profile, target $target, data $data, work $work (driver pid $$)"
if command -v nvidia-smi > /dev/null; then
  say "gpus: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | sort | uniq -c | tr -s ' \n' ' ')"
fi
[[ -z "$slice_rows" ]] || nums=()  # the sliced run's own order
[[ -z "$slice_rows" ]] || run_sliced
if [[ -n "$node_suffix" ]]; then  # a node other than node 0: its 02 rank and its part of 04 only
  unfinished_ok=1  # the other ranks' rows complete 02; global rank 0 (node 0) writes 04's manifest
  await_stage 01 "node 0"
  [[ -z "$extract_rank" ]] || run_stage 02
  if (( node_rank > 0 )); then
    if [[ -n "$extract_rank" ]]; then await_stage 02 "02's other ranks"; else await_stage 02 "node 0"; fi
    await_stage 03 "node 0"
    run_stage 04
  fi
  rm -f "$work/logs/current_stage$node_suffix"
  if (( node_rank > 0 )); then
    say "run_all: node $node_rank finished its part of 04; node 0 writes its manifest, then runs 05${evaluate:+ and 06}"
  else
    say "run_all: stage 02 rank $extract_rank finished; the rank that finishes last writes 02's manifest"
  fi
  exit 0
fi
for n in "${nums[@]}"; do
  if [[ -n "$from" && "$n" < "$from" ]]; then
    finished "${out[$n]}" || die 3 "--from $from: stage $n ${name[$n]} is not finished; rerun without --from"
    say "== $n ${name[$n]}: not run (--from $from)"
  elif [[ $n == 02 && -n "$extract_rank" ]]; then  # rank 0 of an extraction whose other ranks run on other nodes
    unfinished_ok=1; run_stage 02; unfinished_ok=""
    await_stage 02 "02's other ranks (another node's run_all.sh --args-02 \"... --rank R\")"
  elif [[ $n == 02 ]] && read -r ws tp < <(extract_ranks) && (( ws > 1 )) && ! finished "${out[02]}"; then
    run_ranks "$ws" "$tp"  # the profile's data-parallel extraction (extract.world_size)
  else
    run_stage "$n"  # a finished stage checks its identity and does nothing
  fi
done
rm -f "$work/logs/current_stage"
say "run_all: all five stages finished${evaluate:+, then 06 evaluate}"
[[ -f "$work/checkpoints/summary.txt" ]] && say "training summary: $work/checkpoints/summary.txt; curves: $work/checkpoints/plots/"
say "exported draft: $work/draft"
# the serve line stage 05 printed in this run (derived from --output now), never a file a copied work dir carries
[[ -z "${attempt_at[05]:-}" ]] || tail -c "+$((attempt_at[05] + 1))" "$work/logs/05_export.log" |
  sed -n 's/^\(serve: \)\{0,1\}\(vllm serve .*\)/\2/p' | tail -n 1
[[ -z "$evaluate" ]] || say "evaluation: $work/eval/report.txt, report.png (tau in vLLM, per position and category)"
