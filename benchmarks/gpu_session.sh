#!/usr/bin/env bash
# One GPU session (device tool, carry [".gpu"]), from the project root:
#     source .gpu/env.sh && bash benchmarks/gpu_session.sh [tests|bench|all] [pytest args...]
# Runs the same test suite as CI on the real GPU (big shapes included; pytest-xdist workers if it
# is installed: MSA_TEST_WORKERS, default 8), then every benchmark, writing logs and JSON under
# $OUT (default /tmp/msa_out). The device tool brings back at most 8 files, so everything is
# also packed into $OUT/session.tar.gz and the loose files are removed at the end
# (MSA_KEEP_FILES=1 keeps them).
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/msa_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
if [[ $what == tests || $what == all ]]; then
  workers=()
  if python3 -c "import xdist" 2>/dev/null; then workers=(-n "${MSA_TEST_WORKERS:-8}"); fi
  python3 -m pytest -q -rf -p no:cacheprovider "${workers[@]}" \
      -W ignore::numba.core.errors.NumbaPerformanceWarning tests "$@" 2>&1 \
    | tee "$OUT/tests.log" | grep -E "passed|failed|^FAILED|^ERROR" | tail -40
  status=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all ]]; then
  for b in select csr attention kl; do
    [[ -f benchmarks/bench_$b.py ]] || continue
    echo "=== bench_$b"
    timeout 300 python3 -m benchmarks.bench_$b --out "$OUT/bench_$b.json" > "$OUT/bench_$b.log" 2>&1
    grep -v "Warning\|warn(" "$OUT/bench_$b.log" | tail -30
  done
fi
if [[ ${MSA_KEEP_FILES:-0} != 1 ]]; then
  (cd "$OUT" && tar czf session.tar.gz --exclude session.tar.gz . && \
    find . -maxdepth 1 -type f ! -name session.tar.gz -delete)
fi
exit $status
