#!/usr/bin/env bash
# One GPU session (device tool, carry [".gpu"]), from the project root:
#     source .gpu/env.sh && bash benchmarks/gpu_session.sh [tests|bench|all] [pytest args...]
# Runs the same test suite as CI on the real GPU (big shapes included), then every benchmark,
# writing logs and JSON results under $OUT (default /tmp/msa_out).
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/msa_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/cuda "$@" 2>&1 | tee "$OUT/tests.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all ]]; then
  for b in select csr attention kl; do
    [[ -f benchmarks/bench_$b.py ]] || continue
    echo "=== bench_$b"
    timeout 300 python3 -m benchmarks.bench_$b --out "$OUT/bench_$b.json" 2>&1 | tee "$OUT/bench_$b.log" | tail -30
  done
fi
exit $status
