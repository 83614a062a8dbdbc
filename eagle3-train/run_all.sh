#!/usr/bin/env bash
# Run the five stages in order for one profile, target, data and work directory.
#
#   eagle3-train/run_all.sh --profile rtx-pro-6000-8x --target /models/Kimi-K2.5 \
#       --data mlabonne/open-perfectblend --work /nvme/eagle3-run [--python .venv/bin/python] \
#       [--args-01 "..."] ... [--args-05 "..."]
#
# Each stage logs to WORK/logs/0N_<stage>.log (and the terminal). A stage whose output holds a
# finished manifest.json is skipped, and every stage resumes its own partial work, so after a
# disconnect or a kill the same command continues where it stopped. Over SSH, run it inside
# tmux (`tmux new -s eagle3`, reattach with `tmux attach -t eagle3`) or with
# `nohup ... > WORK/run_all.out 2>&1 &`.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
profile="" target="" data="" work=""
declare -A extra=([01]="" [02]="" [03]="" [04]="" [05]="")
while [[ $# -gt 0 ]]; do
  case "$1" in
    --profile) profile="$2"; shift 2 ;;
    --target) target="$2"; shift 2 ;;
    --data) data="$2"; shift 2 ;;
    --work) work="$2"; shift 2 ;;
    --python) python="$2"; shift 2 ;;
    --args-0[1-5]) extra[${1#--args-}]="$2"; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "run_all.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
for name in profile target data work; do
  [[ -n "${!name}" ]] || { echo "run_all.sh: --$name is required (see --help)" >&2; exit 2; }
done
mkdir -p "$work/logs"

finished() {  # finished DIR: the stage output there has a complete manifest
  [[ -f "$1/manifest.json" ]] && grep -q '"complete": true' "$1/manifest.json"
}

stage() {  # stage NN NAME OUTPUT_DIR SCRIPT ARGS...
  local num="$1" name="$2" out="$3" script="$4"; shift 4
  if finished "$out"; then
    echo "== $num $name: finished earlier ($out/manifest.json), skipping"
    return 0
  fi
  echo "== $num $name -> $out (log: $work/logs/${num}_$name.log)"
  local start=$SECONDS
  # shellcheck disable=SC2086
  "$python" "$here/$script" --profile "$profile" "$@" ${extra[$num]} 2>&1 | tee "$work/logs/${num}_$name.log"
  echo "== $num $name: done in $((SECONDS - start)) s"
}

stage 01 prepare "$work/data" 01_prepare_dataset.py --target "$target" --data "$data" --output "$work/data"
stage 02 extract "$work/data/hidden_states" 02_extract_hidden_states.py --target "$target" --data "$work/data"
stage 03 vocab "$work/vocab" 03_build_vocab_mapping.py --data "$work/data" --output "$work/vocab"
stage 04 train "$work/checkpoints" 04_train.py --target "$target" --data "$work/data" --vocab "$work/vocab" --output "$work/checkpoints"
stage 05 export "$work/draft" 05_export.py --checkpoints "$work/checkpoints" --output "$work/draft"
echo "exported draft: $work/draft"
cat "$work/draft/serve_command.txt"
