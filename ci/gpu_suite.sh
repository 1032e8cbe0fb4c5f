#!/usr/bin/env bash
# The GPU suite, in one call on the device machine (no nox there): card facts, GPU tests, compute-sanitizer
# memcheck on a representative case, then whatever extra steps are named (tune, bench-quick, bench).
# Usage: bash ci/gpu_suite.sh [tests|tests-quick] [sanitize] [tune|tune-quick|tune-linear] [bench|bench-quick] [dispatch]
#        [profile] [table3-small] [forward-profile] [ats-kernels] [tome-peer] [tome-adaptive] [families] [rope-models] [rope-profile] [naflex] [issue41]
#        [validate-ranks (2+ GPUs)]
# tests: every test with --full (the long sweeps too); tests-quick: without them. Both run ci/gpu_tests.py: TEST_JOBS
# (default 8) pytest-xdist workers on the one GPU, then the timed tests alone; TEST_PATHS picks test files; logs
# $OUT/gpu_tests_<i>.log.
# rope-models: the default call on RoPE models (ROPE_MODELS, "model:size" words; default issue 40's three); naflex:
# NaFlex batches (NAFLEX_BATCHES, issue 40's 64 first; NAFLEX_MODES: timm's compile modes); rope-profile: the forward
# profiles of ROPE_PROFILE_MODELS (DINOv3 and EVA-02) and DeiT-B beside them at
# ROPE_PROFILE_BATCHES (4,64), for what RoPE adds.
# issue41: the default call's latency run (both timm modes) into $OUT/default_call_latency.json, adding to a run
# already there (--append): it takes more than one 10-minute call, so split it, e.g. ISSUE41_BATCHES=1,4, then the
# stored file copied to $OUT and ISSUE41_BATCHES=64,256 ISSUE41_ROWS=timm_compiled,default (max-autotune is judged at
# B = 1 only).
# tome-peer: ToMe against its peer, fixed r (~8-9 min on an H200); tome-adaptive: the adaptive rows' own run (its file
# joins tome_peer.json in the results: benchmarks/make_results.py).
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
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests sanitize)
for step in "${steps[@]}"; do
  case "$step" in
    tests) "$PY" -m ci.gpu_tests --jobs "${TEST_JOBS:-8}" --log-dir "$OUT" ${TEST_PATHS:-} || status=1 ;;
    tests-quick) "$PY" -m ci.gpu_tests quick --jobs "${TEST_JOBS:-8}" --log-dir "$OUT" ${TEST_PATHS:-} || status=1 ;;
    sanitize) compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" -m ci.sanitize_case > "$OUT/sanitize.log" 2>&1 \
                && echo "memcheck: clean" || { echo "memcheck: FAILED"; tail -30 "$OUT/sanitize.log"; status=1; } ;;
    tune) "$PY" -m ci.tune_attention --out "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log" | tail -40 ;;
    dispatch) "$PY" -m ci.dispatch_profile 2>&1 | tee "$OUT/dispatch.log" ;;
    tune-linear) "$PY" -m benchmarks.report_linear --out "$OUT/report_linear.json" --peers ours,ours_chained,torch 2>&1 \
                   | tee "$OUT/report_linear.log" | tail -45
                 "$PY" -m ci.tune_linear --out "$OUT/tune_linear.json" --table "$OUT/tune_linear_table.py" --budget-s 240 \
                   2>&1 | tee "$OUT/tune_linear.log" | tail -70 ;;
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
    tome-peer) "$PY" -m benchmarks.tome_peer --batches 1,4,64 --adaptive-batches "" --r 13 --out "$OUT/tome_peer.json" \
                 2>&1 | grep -v Warning | tee "$OUT/tome_peer.log" | tail -40 ;;
    tome-adaptive) "$PY" -m benchmarks.tome_peer --batches 64 --adaptive-batches 64 --r 13 \
                     --rows ours,ours_adaptive,ours_adaptive_sync_free,ours_adaptive_lagged \
                     --out "$OUT/tome_peer_adaptive.json" 2>&1 | grep -v Warning | tee "$OUT/tome_adaptive.log" | tail -20 ;;
    rope-models) for spec in ${ROPE_MODELS:-vit_base_patch16_dinov3:224 eva02_base_patch14_224:224 vit_base_patch16_dinov3:512}; do
                   "$PY" -m benchmarks.default_call --model "${spec%:*}" --img-size "${spec#*:}" --batches 1,4,64 \
                     --workloads l2:0.5,evit:0.7 --rows timm_compiled,default --out "$OUT/" 2>&1 | grep -v Warning \
                     | tee -a "$OUT/rope_models.log" | tail -14
                 done ;;
    rope-profile) for model in ${ROPE_PROFILE_MODELS:-vit_base_patch16_dinov3 eva02_base_patch14_224} deit_base_patch16_224; do
                    "$PY" -m ci.forward_profile --model "$model" --batches "${ROPE_PROFILE_BATCHES:-4,64}" \
                      --workloads l2_calibrated:0.5,evit:0.7 --compile-blocks --out "$OUT/forward_profile_$model.json" \
                      2>&1 | grep -E "^(\||NVIDIA)"
                  done ;;
    issue41) "$PY" -m benchmarks.default_call --workloads l2_ratio:0.5,l2_calibrated:0.5,ats:0.5,dynamicvit:0.7,evit:0.7,tome:13 \
               --rows "${ISSUE41_ROWS:-timm_compiled,timm_max_autotune,default}" --batches "${ISSUE41_BATCHES:-1,4,64,256}" \
               --out "$OUT/default_call_latency.json" --append 2>&1 \
               | grep -v Warning | tee "$OUT/issue41.log" | tail -30 ;;
    naflex) "$PY" -m benchmarks.naflex --batches "${NAFLEX_BATCHES:-64,8,1}" --out "$OUT/naflex.json" \
              --compile-modes "${NAFLEX_MODES:-default,reduce-overhead,max-autotune-no-cudagraphs}" 2>&1 \
              | tee "$OUT/naflex.log" | grep -E "^B=" ;;
    families) "$PY" -m ci.model_families --speed --max-minutes 8.2 --out "$OUT/families.json" 2>&1 | tail -20 ;;
    validate-ranks) "$PY" -m ci.validate_ranks --out "$OUT/validate_ranks" 2>&1 | tail -12 || status=1 ;;
    *) echo "unknown step: $step"; status=2 ;;
  esac
done
exit $status
