#!/usr/bin/env bash
# One GPU session (device tool, carry [".gpu"]), from the project root:
#     source .gpu/env.sh && bash benchmarks/gpu_session.sh [tests|bench|all] [test paths...]
#     source .gpu/env.sh && bash benchmarks/gpu_session.sh tests-part 1|2|3
#     source .gpu/env.sh && bash benchmarks/gpu_session.sh layer [bench_layer options...]
#     source .gpu/env.sh && bash benchmarks/gpu_session.sh targets 1|2
# Runs the same test suite as CI on the real GPU(s) (big shapes included; by default the files
# that touch the GPU: tests/cuda, tests/torch and the notebooks, as tests/reference is NumPy only),
# then every benchmark (benchmarks/bench_<stage>.py), writing logs and JSON under $OUT (default
# /tmp/msa_out); copy a JSON to benchmarks/results/ to make it the stage's latest.
# Tests: with pytest-xdist, MSA_TEST_WORKERS workers (default: CPU count - 2) spread over every
# visible GPU (benchmarks/pytest_gpu_split.py) with work stealing; one line per finished test,
# timestamped, in tests.log. MSA_TEST_TIMEOUT (seconds, default 540) interrupts pytest, which
# still prints its summary and the slowest tests, so a cut run says what passed and failed.
# The suite is mostly kernel compiles and NumPy oracles: 30 workers on 2 H200s (32 cores) ran 788
# of its 813 tests in 533 s, so within the 10-minute limit of one device call it runs in three
# parts, `tests-part 1|2|3` (on one H100, 14 workers, run O27: about 310, 230 and 215 s):
# 1 decode, notebooks, examples and the top-level files that run a GPU; 2 the prefill and
# backward stages (attention, CSR, schedule, select, index, combine, hostile selections); 3 the
# KL, the core helpers and msa.torch. A test file in tests/cuda, tests/torch or tests/ that no
# part lists is named before the run; the sm_90 PTX/SASS checks (test_ptx_*, test_sass) and
# tests/distributed (CPU processes) are in no part.
# `layer` runs only the training layer's benchmark (every target of benchmarks/bench_layer.py in
# one process, its progress lines printed as they come) within MSA_LAYER_BUDGET_S seconds
# (default 400; the process is killed 80 s after that, and its JSON is rewritten after every
# measurement, so a cut run keeps what it measured); extra arguments go to bench_layer.
# About 6-7 minutes; bench_layer.json, its figure and log land in $OUT (python -m benchmarks.plot
# redraws the figure from the JSON).
# The device tool brings back at most 8 files, so everything is also packed into
# $OUT/session.tar.gz and the loose files are removed at the end (MSA_KEEP_FILES=1 keeps them).
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/msa_out}
# The results' headers name the tree's commit (benchmarks/common.py's header: git describe,
# "-dirty" for uncommitted changes); only a copy without its history reads .gpu/commit (a file
# written before an earlier call is stale once HEAD moves).
if [[ -z ${MSA_COMMIT:-} && -f .gpu/commit ]] && ! git rev-parse --verify -q HEAD >/dev/null 2>&1
then export MSA_COMMIT=$(cat .gpu/commit); fi
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
if [[ $what == tests-part ]]; then
  part1=(tests/cuda/test_decode.py tests/cuda/test_decode_cupy_graph.py tests/torch/test_cache.py
         tests/test_notebooks.py tests/test_examples.py tests/test_readme.py
         tests/test_bench_layer.py tests/test_partials_precision.py)
  part2=(tests/cuda/test_attention_{backward,paged,partials,prefill,sparse}.py
         tests/cuda/test_{combine,csr,schedule,select,index,hostile_indices}.py)
  part3=(tests/cuda/test_{kl,mma,wgmma,streams,arrays,diskcache,finite,scan,simwarp}.py
         tests/torch/test_{bad_input,compile,functional,layer}.py
         tests/test_{masked_keys,batch,invalid_inputs,sanitize_smoke}.py)
  for f in tests/cuda/test_*.py tests/torch/test_*.py tests/test_*.py; do
    case $f in tests/cuda/test_ptx_*|tests/cuda/test_sass.py) continue ;; esac
    case " ${part1[*]} ${part2[*]} ${part3[*]} " in
      *" $f "*) ;;
      *) echo "not in any tests-part: $f" >&2 ;;
    esac
  done
  case ${1:-1} in
    1) set -- "${part1[@]}" ;;
    2) set -- "${part2[@]}" ;;
    3) set -- "${part3[@]}" ;;
    *) echo "tests-part takes 1, 2 or 3, not $1" >&2; exit 2 ;;
  esac
  what=tests
fi
if [[ $what == tests || $what == all ]]; then
  paths=("$@"); [[ ${#paths[@]} -gt 0 ]] || paths=(tests/cuda tests/torch tests/test_notebooks.py)
  workers=()
  if python3 -c "import xdist" 2>/dev/null; then
    workers=(-n "${MSA_TEST_WORKERS:-$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))}" --dist worksteal
             -p benchmarks.pytest_gpu_split)
  fi
  # Many workers each running NumPy: one BLAS thread apiece.
  OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 \
  timeout -s INT -k 30 "${MSA_TEST_TIMEOUT:-540}" python3 -m pytest -v -rfEs --tb=short \
      --durations=30 -p no:cacheprovider "${workers[@]}" \
      -W ignore::numba.core.errors.NumbaPerformanceWarning "${paths[@]}" 2>&1 \
    | while IFS= read -r line; do printf '%s %s\n' "$(date +%s)" "$line"; done > "$OUT/tests.log"
  status=${PIPESTATUS[0]}
  grep -E "FAILED|ERROR|passed|failed" "$OUT/tests.log" | grep -v " \[gw" | tail -40
fi
if [[ $what == bench || $what == all ]]; then
  # One bench_<stage>.py per stage, in pipeline order; a stage without one is passed over.
  for b in index select csr schedule attention attention_backward combine kl decode layer; do
    [[ -f benchmarks/bench_$b.py ]] || continue
    echo "=== bench_$b"
    extra=()  # the layer's run is a time box of its own: 240 s of the 300
    [[ $b == layer ]] && extra=(--budget-s 240)
    timeout 300 python3 -m benchmarks.bench_$b "${extra[@]}" --out "$OUT/bench_$b.json" \
      > "$OUT/bench_$b.log" 2>&1
    grep -v "Warning\|warn(" "$OUT/bench_$b.log" | tail -30
  done
fi
if [[ $what == layer ]]; then
  budget=${MSA_LAYER_BUDGET_S:-400}
  echo "=== bench_layer (budget $budget s)"
  timeout -k 10 $(( budget + 80 )) python3 -m benchmarks.bench_layer --budget-s "$budget" "$@" \
      --out "$OUT/bench_layer.json" 2>&1 | tee "$OUT/bench_layer.log" \
    | grep --line-buffered -v "Warning\|warn("
  status=${PIPESTATUS[0]}
fi
if [[ $what == targets ]]; then
  # The open targets' measurements (docs/performance.md's Targets), each beside its baselines,
  # in two parts that each fit one 10-minute device call: `targets 1` the main backward and the
  # forward beside fla-core and SDPA at 32K and 128K; `targets 2` the KL against the forward,
  # the headline decode steps and the layer step against the dense layer.
  part=${1:-1}
  bench() {  # name, time limit (s), arguments
    local name=$1 limit=$2; shift 2
    echo "=== bench_$name $*"
    timeout -k 10 "$limit" python3 -m benchmarks.bench_$name "$@" --out "$OUT/bench_$name.json" \
      > "$OUT/bench_$name.log" 2>&1 || status=1
    grep -v "Warning\|warn(" "$OUT/bench_$name.log" | tail -16
  }
  if [[ $part == 1 ]]; then
    bench attention_backward 270 --sizes 32768,131072 --v1-max-n 0 --reps 2 --budget-s 210
    bench attention 270 --sizes 32768,131072 --patterns uniform --prefill-sizes 131072 \
      --versions 4 --k1-versions 4 --k1-sizes "" --skip-flex --no-breakdown --reps 3 --budget-s 210
  else
    bench kl 150 --torch-max-n 0 --v2-max-n 0 --reps 3
    bench decode 110 --quick --reps 5
    bench layer 280 --sizes 32768,131072 --dense-max-n 131072 --warmup-sizes "" --profile 0 \
      --no-cold-start --compile-check 0 --crossover-probes 0 --isolate-above 0 --reps 2 \
      --budget-s 200
  fi
fi
if [[ ${MSA_KEEP_FILES:-0} != 1 ]]; then
  # Packed outside $OUT first: tar reading the folder it writes into warns that the folder
  # changed and exits 1, which used to keep the loose files.
  pack=$(mktemp /tmp/msa_session.XXXXXX.tar.gz)
  tar czf "$pack" -C "$OUT" --exclude session.tar.gz . && mv "$pack" "$OUT/session.tar.gz" && \
    find "$OUT" -maxdepth 1 -type f ! -name session.tar.gz -delete
fi
exit $status
