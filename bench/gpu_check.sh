#!/usr/bin/env bash
# Issue 14's checks on a lent GPU machine, in one call: bench/gpu.py,
# bench/gpu_qos.py, bench/ttft.py (a 1B model; TTFT_IDLE_S, TTFT_PREFIXES), the
# CUDA tests, the daemon and client tests with the daemon on CUDA.
#
# Usage (repository root of a plain checkout; no install needed):
#     OUT=/tmp/gpu-out bash bench/gpu_check.sh [steps]
# steps: any of env bench qos ttft cuda daemon restart (default: all but restart, in that order:
# the benchmarks first, on an idle host; xdist test workers left a load average
# of 10-11 on 16 cores, which halved the copy kernel's fragment bandwidth).
# Each step has its own time limit, so one that hangs costs only its share.
# Logs and JSON go to $OUT (at most 8 files: the device tool returns no more).
# The machine has CUDA torch, CuPy, msgpack, xxhash, psutil but no pyzmq:
# wheels in .whl/ are installed to /tmp/site first (see bench/README.md).
set -uo pipefail
OUT=${OUT:?set OUT to a folder for logs and results}
PY=${PY:-python3}
steps=${*:-env bench qos ttft cuda daemon}  # restart: bench/restart.py, asked for by name
mkdir -p "$OUT"
root=$(pwd)

if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
# kvtier is a namespace package whose subpackages are the repository's folders:
# map them without installing.
ns=/tmp/kvtier-ns
rm -rf "$ns" && mkdir -p "$ns/kvtier"
for d in tiers client daemon tools integrations testing; do ln -s "$root/$d" "$ns/kvtier/$d"; done
export PYTHONPATH="$ns:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

pytest_args=(-q -rfE --tb=short --timeout 120 -p no:cacheprovider)
log="$OUT/check.log"
step() { printf '\n==== %s (%s) ====\n' "$1" "$(date -u +%T)" | tee -a "$log"; }

for s in $steps; do
  case $s in
  env)
    step env
    { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
      $PY -c 'import torch, cupy, zmq, msgpack, xxhash, psutil, sys
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "cupy", cupy.__version__,
      "pyzmq", zmq.__version__, torch.cuda.get_device_name(0))'
      nproc; numactl --hardware 2>/dev/null | head -3; ulimit -l; } 2>&1 | tee -a "$log" ;;
  cuda)
    step "pytest -m cuda"
    timeout 150 $PY -m pytest "${pytest_args[@]}" -m cuda -n 8 tests/ --ignore tests/daemon/test_remote_tier_daemons.py \
      --ignore tests/tiers/test_pool_remote.py --ignore tests/tiers/test_remote_tier.py 2>&1 | tee "$OUT/cuda-tests.log" | tail -40 | tee -a "$log" ;;
  daemon)
    # The daemon's device is 'auto': CUDA here; engines' KV on CUDA goes by
    # IPC (the cuda-marked client tests). Redis tests need what this machine
    # lacks; the install test needs an index. -v, so that a step cut off by
    # its limit still names the tests that failed before it.
    step "daemon, client, example tests (daemon on CUDA)"
    timeout 240 $PY -m pytest "${pytest_args[@]}" -v -m "not install" -n 15 \
      tests/daemon tests/client tests/examples --ignore tests/daemon/test_remote_tier_daemons.py 2>&1 \
      | grep -v -e Benchmark -e PASSED | tee "$OUT/daemon-tests.log" | tail -40 | tee -a "$log" ;;
  bench)
    step "bench/gpu.py"
    timeout 150 $PY bench/gpu.py --out "$OUT" 2>&1 | tee -a "$log" ;;
  qos)
    step "bench/gpu_qos.py"
    timeout 150 $PY bench/gpu_qos.py --out "$OUT" 2>&1 | tee -a "$log" ;;
  ttft)
    idle=${TTFT_IDLE_S:-0}
    for prefix in ${TTFT_PREFIXES:-2048 8192}; do
      step "bench/ttft.py 1b, prefix $prefix, idle $idle s"
      timeout 60 $PY bench/ttft.py --model-size 1b --prefix-tokens "$prefix" --reps 3 --idle-s "$idle" \
        --json-out "$OUT/ttft-1b-daemon-cuda-$prefix-idle$idle.json" 2>&1 | tail -30 | tee -a "$log"
    done ;;
  restart)
    # Issue 34: SIGKILL a daemon with a 4 GiB pinned CPU tier; the new one adopts it and pins it again.
    step "bench/restart.py (4 GiB, pinned)"
    timeout 240 $PY bench/restart.py --out "$OUT" 2>&1 | tail -20 | tee -a "$log" ;;
  *) echo "unknown step $s: choose from env bench qos ttft cuda daemon restart" >&2; exit 2 ;;
  esac
done
step done
