#!/usr/bin/env bash
# The measurements that need a GPU, in one command for a borrowed GPU machine (no network,
# a bare start each time: ../shared/gpu/README.md). From the project root, with .gpu/ made
# by ../shared/gpu/prepare.sh and taken along:
#
#   bash tests/gpu_checks.sh memory step    # results under $OUT (or /tmp/gpu-checks)
#   bash tests/gpu_checks.sh sharp          # a call of its own: it takes up to 450 s
#   bash tests/gpu_checks.sh tests          # the other tests marked gpu, up to 240 s
#
# Each check has its own time limit and its own files, so one that fails or runs long
# leaves the others' results: machine.txt (GPU, driver, torch, CUDA, each check's exit
# status), memory.txt (the memory tests marked gpu: predicted peaks against torch's),
# step.json (`shoal bench step`: the plain loop, Shoal without and with in-memory copies,
# their overhead and interval) and sharp.json (`shoal bench sharp`: the SHARP executor
# beside its peers, copies on) and tests.txt (the other tests marked gpu: the copies on a
# side stream, pinned memory, a worker's measured overhead, one stage's step on the GPU).
set -u
cd "$(dirname "$0")/.."
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

for check in "$@"; do
  case "$check" in
    memory)
      timeout 150 python3 -m pytest -q -s -o addopts= -m gpu tests/workers/test_memory_on_gpu.py \
        > "$out/memory.txt" 2>&1 ;;
    step)
      timeout 300 shoal bench step --device cuda --json --steps 20 --repeats 3 --rounds 3 \
        > "$out/step.json" 2> "$out/step.err" ;;
    sharp)
      timeout 450 shoal bench sharp --device cuda --json --steps 4 \
        > "$out/sharp.json" 2> "$out/sharp.err" ;;
    tests)
      timeout 240 python3 -m pytest -q -o addopts= -m gpu tests/workers/pipeline/test_copier.py \
        tests/workers/pipeline/test_stage_copies.py tests/workers/test_device_memory.py \
        tests/workers/pipeline/test_peer_to_peer.py > "$out/tests.txt" 2>&1 ;;
    *)
      echo "unknown check $check: use memory, step, sharp or tests" >&2
      exit 2 ;;
  esac
  echo "$check rc $?" >> "$out/machine.txt"
done
cat "$out/machine.txt"
