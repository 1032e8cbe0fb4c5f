#!/usr/bin/env bash
# The GPU suite, in one call on the device machine (no nox there): card facts, GPU tests, compute-sanitizer
# memcheck on a representative case, then whatever extra steps are named (tune, bench-quick, bench).
# Usage: bash ci/gpu_suite.sh [tests|tests-quick] [sanitize] [tune|tune-quick] [bench|bench-quick] [dispatch]
#        [profile] [table3-small] [forward-profile] [ats-kernels] [tome-peer] [families] [validate-ranks (2+ GPUs)]
# tests: every test with --full (the long sweeps too); tests-quick: without them. Both run the test files in
# TEST_JOBS (default 4) pytest processes on the one GPU, files balanced by a rough cost; logs $OUT/gpu_tests_<i>.log.
# Set RAGGED_BENCH_COMMIT to the commit's short sha for the e2e steps (the device copy has no .git).
# Results go under $OUT (default /tmp/ragged-vit-out).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/ragged-vit-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
status=0
# The library is imported as the installed package ragged_vit: install this checkout (editable) with what the machine
# already has (no network there: no dependencies, no build isolation).
"$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
  || { echo "pip install -e . failed:"; tail -20 "$OUT/install.log"; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/card.txt"
"$PY" -c "import torch, triton, timm; print('torch', torch.__version__, 'triton', triton.__version__, 'timm', timm.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/card.txt"
# TEST_SHARD=i/n runs every n-th test file from the i-th (a subset for a short call); TEST_PATHS, if set, wins.
if [ -z "${TEST_PATHS:-}" ] && [ -n "${TEST_SHARD:-}" ]; then
  shard_i=${TEST_SHARD%/*}; shard_n=${TEST_SHARD#*/}
  TEST_PATHS=$(ls tests/test_*.py | awk -v i="$shard_i" -v n="$shard_n" '(NR - i) % n == 0' | tr '\n' ' ')
fi

# Rough relative cost (about seconds at --full with the other processes beside it; unlisted: 5) of each unit: a file,
# or one test function of a heavy file (a "file::function" unit; the file's other tests are then a unit of their own,
# which deselects it). Only the balance uses them: a wrong one costs wall time, never a test.
TEST_COST="test_triton_attention.py::test_qkv_layout_gpu=240 test_triton_attention.py::test_qkv_layout_key_bias_gpu=100
test_triton_attention.py=150 test_triton_pack.py::test_pack_family_gpu=330 test_triton_pack.py=80
test_pipelines_gpu.py::test_backend_matches_fp32_reference=120 test_pipelines_gpu.py=60 test_triton_merging.py=150
test_bench_gate.py=70 test_modes.py=65 test_graphs_gpu.py=60 test_rotary.py=60 test_triton_ats.py=50
test_triton_dynamicvit.py=25 test_triton_evit.py=20 test_triton_threshold_l2.py=15 test_pipelines.py=15
test_pipelines_tome.py=15 test_validate.py=15 test_models.py=10 test_eva.py=10 test_dynamic_size.py=10"

# The TEST_JOBS argument lists of run_tests, one line each: units in order of cost, each to the least loaded list.
balance_tests() {
  "$PY" - "$1" "$TEST_COST" "${@:2}" <<'PYEOF'
import sys
from pathlib import Path

jobs, table, paths = int(sys.argv[1]), sys.argv[2].split(), sys.argv[3:]
cost = {key: int(value) for key, value in (item.rsplit("=", 1) for item in table)}
units = []  # (seconds, file, function or None)
for path in paths:
    name = Path(path.split("::")[0]).name
    carved = [key.split("::")[1] for key in cost if "::" in key and key.split("::")[0] == name and "::" not in path]
    units += [(cost[f"{name}::{f}"], path, f) for f in carved] + [(cost.get(name, 5), path, None)]
bins = [[] for _ in range(jobs)]
loads = [0] * jobs
for seconds, path, function in sorted(units, key=lambda u: -u[0]):
    least = loads.index(min(loads))
    bins[least].append((path, function))
    loads[least] += seconds
for load, units in zip(loads, bins):
    if not units:
        continue  # fewer units than lists (pytest without paths would run every test)
    args = []
    for path, function in units:
        if function is not None:
            args.append(f"{path}::{function}")
        else:  # the file's other tests: its functions carved into other lists are deselected here
            args.append(path)
            args += [f"--deselect={p}::{f}" for p, f in (u for b in bins if b is not units for u in b) if f and p == path]
    print(load, *args)
PYEOF
}

# run_tests LABEL [pytest args...]: the test files (or TEST_PATHS) in TEST_JOBS parallel pytest processes, balanced by
# balance_tests; fails when any process fails; one summary line for them all.
run_tests() {
  local label=$1; shift
  local jobs=${TEST_JOBS:-4} i start=$SECONDS pids=() rcs=() lines=()
  mapfile -t lines < <(balance_tests "$jobs" ${TEST_PATHS:-$(ls tests/test_*.py)})
  jobs=${#lines[@]}
  rm -f "$OUT"/gpu_tests_*.log
  for ((i = 0; i < jobs; i++)); do
    local load=${lines[i]%% *} args=${lines[i]#* }
    echo "tests ($label) process $i, about $load s: $args" > "$OUT/gpu_tests_$i.log"
    # each process its share of the cores for the CPU-side references (16 threads each would oversubscribe them)
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( ($(nproc) + jobs - 1) / jobs ))} \
      "$PY" -m pytest $args -q -p no:cacheprovider --durations=15 "$@" >> "$OUT/gpu_tests_$i.log" 2>&1 &
    pids[i]=$!
  done
  local failed=0 passed=0 skipped=0 errors=0 bad=0
  for ((i = 0; i < jobs; i++)); do
    wait "${pids[i]}"; rcs[i]=$?
    local last; last=$(grep -E "^=* ?[0-9]+ (passed|failed|skipped|error)" "$OUT/gpu_tests_$i.log" | tail -1)
    for word in passed failed skipped error; do
      local n; n=$(grep -oE "[0-9]+ $word" <<< "$last" | awk '{print $1}')
      case $word in passed) passed=$((passed + ${n:-0}));; failed) failed=$((failed + ${n:-0}));;
                    skipped) skipped=$((skipped + ${n:-0}));; error) errors=$((errors + ${n:-0}));; esac
    done
    if [ "${rcs[i]}" -ne 0 ]; then
      bad=1; echo "--- process $i failed (rc ${rcs[i]}): $OUT/gpu_tests_$i.log"
      grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_$i.log" | head -20; tail -3 "$OUT/gpu_tests_$i.log"
    fi
  done
  cat "$OUT"/gpu_tests_*.log > "$OUT/gpu_tests.log"
  echo "gpu tests ($label): $passed passed, $failed failed, $skipped skipped, $errors errors in $jobs processes," \
       "wall $((SECONDS - start)) s (rc ${rcs[*]})"
  return $bad
}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests sanitize)
for step in "${steps[@]}"; do
  case "$step" in
    tests) run_tests full --full || status=1 ;;
    tests-quick) run_tests quick || status=1 ;;
    sanitize) compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" -m ci.sanitize_case > "$OUT/sanitize.log" 2>&1 \
                && echo "memcheck: clean" || { echo "memcheck: FAILED"; tail -30 "$OUT/sanitize.log"; status=1; } ;;
    tune) "$PY" -m ci.tune_attention --out "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log" | tail -40 ;;
    dispatch) "$PY" -m ci.dispatch_profile 2>&1 | tee "$OUT/dispatch.log" ;;
    tune-quick) "$PY" -m ci.tune_attention --quick --out "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log" | tail -30 ;;
    bench) "$PY" -m benchmarks.report_attention --out "$OUT/attention.json" 2>&1 | tee "$OUT/bench.log" | tail -40 ;;
    bench-quick) "$PY" -m benchmarks.report_attention --quick --out "$OUT/attention.json" 2>&1 | tee "$OUT/bench.log" | tail -30 ;;
    bench-gate) "$PY" -m benchmarks.run_bench --quick --export "$OUT" 2>&1 | tee "$OUT/bench_gate.log" | grep -E "^(\||gate|run_bench|baselines)" || status=1 ;;  # benchmarks/run_bench.py
    profile) for cell in "64 0" "64 50"; do set -- $cell
               ncu --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section Occupancy \
                   --section LaunchStats -k regex:_ragged -s 2 -c 1 "$PY" -m ci.profile_attention --batch $1 --pruned $2 \
                   > "$OUT/ncu_B$1_p$2.txt" 2>&1; grep -E "Duration|Throughput|Pipe|Issue|Stall|Occupancy|Registers|Shared" "$OUT/ncu_B$1_p$2.txt" | head -40
             done ;;
    table3-small) "$PY" -m benchmarks.report_e2e --part table3 --batches 1,4,64 --tag b1-4-64 --out "$OUT" \
                    --max-minutes 8 2>&1 | grep -v Warning | tee "$OUT/table3.log" | tail -60 ;;
    forward-profile) "$PY" -m ci.forward_profile --compile-blocks --serial-decisions --workloads l2_calibrated,ats \
                       --out "$OUT/forward_profile.json" 2>&1 | grep "^|" ;;
    ats-kernels) "$PY" -m ci.ats_kernels 2>&1 | tail -5 ;;
    tome-peer) "$PY" -m benchmarks.tome_peer --batches 1,4,64 --adaptive-batches 64 --r 13 --out "$OUT/tome_peer.json" \
                 2>&1 | grep -v Warning | tee "$OUT/tome_peer.log" | tail -40 ;;
    families) "$PY" -m ci.model_families --speed --max-minutes 8.2 --out "$OUT/families.json" 2>&1 | tail -20 ;;
    validate-ranks) "$PY" -m ci.validate_ranks --out "$OUT/validate_ranks" 2>&1 | tail -12 || status=1 ;;
    *) echo "unknown step: $step"; status=2 ;;
  esac
done
exit $status
