#!/usr/bin/env bash
# The measurements that need a GPU, in one command for a borrowed GPU machine (no network,
# a bare start each time: ../shared/gpu/README.md). From the project root, with .gpu/ made
# by ../shared/gpu/prepare.sh and taken along:
#
#   bash tests/gpu_checks.sh all            # one call of at most 10 minutes: see below
#   bash tests/gpu_checks.sh memory step    # results under $OUT (or /tmp/gpu-checks)
#   bash tests/gpu_checks.sh sharp          # a call of its own: it takes up to 450 s
#   bash tests/gpu_checks.sh tests          # the other tests marked gpu, up to 240 s
#   bash tests/gpu_checks.sh diagnose       # the open GPU questions' readings, ~8 minutes
#   bash tests/gpu_checks.sh shards         # a SHARP shard timed and its RNG kept on the GPU
#
# `all` runs the memory tests and the SHARP bench at once (the tests measure their own
# process's peaks, and end while the bench simulates and starts its two nodes: its timed
# half may overlap their last seconds), then `shoal bench step` with as many rounds (3 at
# most) as fit before ALL_S seconds (default 570) have passed since it began.
#
# Each check has its own time limit and its own files, so one that fails or runs long
# leaves the others' results: machine.txt (GPU, driver, torch, CUDA, each check's exit
# status), memory.txt (the memory tests marked gpu: predicted peaks against torch's),
# step.json (`shoal bench step`: the plain loop, Shoal without in-memory copies, and Shoal
# with them in alternate windows of its steps: their overhead and interval) and sharp.json (`shoal bench sharp`: the SHARP executor
# beside its peers, copies on) and tests.txt (the other tests marked gpu: the copies on a
# side stream, pinned memory, a worker's measured overhead, one stage's step on the GPU, a
# SHARP shard's saved tensors moved storage by storage, its tasks timed by the GPU and its
# forwards run again under their RNG).
#
# `diagnose` takes the readings the open GPU goals need first (docs/benchmarks.md): the
# tests of a SHARP shard moved onto the GPU (shards.txt: its tasks timed by the GPU, its
# forwards run again under their RNG), up to three rounds of the step bench in 240 s, a run
# each (step-1.json, ...: the copies' cost in alternate windows of one job, each pair's ms;
# the goal's figure is the median of the rounds' copies_overhead), the copier's tests
# (copier.txt: does a copy run beside the compute stream? does the staged candidate copy
# exactly?), `shoal bench copier` (copier-tensors.json: what the copies cost a plain loop's
# steps, windows with and without them in turn within seconds, apart from the engine; ~30 s;
# copier-staged.json: the same with the candidate that copies through a staging buffer on
# the device, a chunk at a time) and the SHARP bench at batch 16384
# (sharp.json: its workers' busy share and each task's wall time beside its compute) in
# the time left (220 s at most), one after another so that none times the others' load.
set -u
cd "$(dirname "$0")/.."
began=$(date +%s)
. .gpu/setup.sh
export PYTHONUNBUFFERED=1
out="${OUT:-/tmp/gpu-checks}"
mkdir -p "$out"

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  nproc
} >> "$out/machine.txt" 2>&1

memory() {
  timeout 150 python3 -m pytest -q -s -o addopts= -m gpu tests/workers/test_memory_on_gpu.py \
    > "$out/memory.txt" 2>&1
}

step() {  # step [rounds [limit_s [name]]]: the result in name.json (step.json)
  timeout "${2:-300}" shoal bench step --device cuda --json --steps 20 --repeats 3 \
    --rounds "${1:-3}" > "$out/${3:-step}.json" 2> "$out/${3:-step}.err"
}

sharp() {  # SHARP_BATCH: rows per step (the bench's default when unset)
  timeout "${SHARP_S:-450}" shoal bench sharp --device cuda --json --steps 4 \
    ${SHARP_BATCH:+--batch-size "$SHARP_BATCH"} > "$out/sharp.json" 2> "$out/sharp.err"
}

rounds_apart() {  # rounds_apart count limit_s: the step bench's rounds, one run each
  # (step-1.json, ...), each begun while 60 s of limit_s are left: a run cut short by the
  # limit costs its own round only, not the rounds before it.
  local until=$(($(date +%s) + $2)) n=1 left
  while [ "$n" -le "$1" ]; do
    left=$((until - $(date +%s)))
    if [ "$left" -lt 60 ]; then
      echo "step round $n skipped: $left s left" >> "$out/machine.txt"
      return 0
    fi
    step 1 "$left" "step-$n" || return
    n=$((n + 1))
  done
}

copier() {
  timeout 120 python3 -m pytest -q -o addopts= -m gpu tests/workers/pipeline/test_copier.py \
    tests/service/test_bench_staged_copier.py > "$out/copier.txt" 2>&1
}

shards() {
  timeout 90 python3 -m pytest -q -o addopts= -m gpu tests/workers/sharp/test_moved_shards.py \
    > "$out/shards.txt" 2>&1
}

copier_bench() {  # Shoal's copier, then the staged candidate, in the same conditions
  local which
  for which in tensors staged; do
    timeout 120 shoal bench copier --device cuda --json --rounds 8 --copier "$which" \
      > "$out/copier-$which.json" 2> "$out/copier-$which.err" || return
  done
}

tests() {
  timeout 240 python3 -m pytest -q -o addopts= -m gpu tests/workers/pipeline/test_copier.py \
    tests/workers/pipeline/test_stage_copies.py tests/workers/test_device_memory.py \
    tests/workers/pipeline/test_peer_to_peer.py tests/workers/sharp/test_saved.py \
    tests/workers/sharp/test_moved_shards.py tests/service/test_bench_staged_copier.py \
    > "$out/tests.txt" 2>&1
}

ran() {  # ran check: runs it and notes its exit status
  "$@"
  echo "$1 rc $?" >> "$out/machine.txt"
}

all() {
  ran memory &
  ran sharp &
  wait
  local left=$((${ALL_S:-570} - ($(date +%s) - began)))
  local rounds=$(((left - 30) / 100))  # a round of the step bench: about 100 s on an H100
  if [ "$rounds" -ge 1 ]; then
    ran step $((rounds > 3 ? 3 : rounds)) $((left - 10))
  else
    echo "step skipped: $left s left" >> "$out/machine.txt"
  fi
}

diagnose() {
  ran shards
  ran rounds_apart 3 240  # the copies' cost in alternate windows: a GPU goal's reading
  ran copier
  ran copier_bench
  local left=$((${ALL_S:-570} - ($(date +%s) - began)))
  if [ "$left" -gt 60 ]; then
    SHARP_BATCH=16384 SHARP_S=$((left - 10 < 220 ? left - 10 : 220)) ran sharp
  else
    echo "sharp skipped: $left s left" >> "$out/machine.txt"
  fi
}

for check in "$@"; do
  case "$check" in
    all) all ;;
    diagnose) diagnose ;;
    memory | step | sharp | tests | copier | copier_bench | shards) ran "$check" ;;
    *)
      echo "unknown check $check: use all, diagnose, memory, step, sharp, tests, copier," \
        "copier_bench or shards" >&2
      exit 2 ;;
  esac
done
cat "$out/machine.txt"
