"""Where the GPU waits during one ``sparse_attention`` call: host enqueue time against GPU time,
and the idle gaps between consecutive kernels (torch.profiler), largest first.

``python3 -m benchmarks.dev.idle_gaps --out FILE [--n 131072] [--host-cu]`` (paper configuration,
uniform). It found the host stalls that the memoised offset uploads removed (docs/performance.md);
last run on an H200 before the stage layout (426fbbf), through ``sparse_attention`` and
``benchmarks.bench_attention``'s ``_qkv`` / ``make_selection``.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "0")

from benchmarks.bench_attention import BK, _qkv, make_selection  # noqa: E402
from benchmarks.common import write_json  # noqa: E402


def main(argv=None):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from msa.cuda.attention import sparse_attention

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=131072)
    p.add_argument("--host-cu", action="store_true")
    args = p.parse_args(argv)
    n = args.n
    q, k, v = _qkv(n)
    I = make_selection("uniform", n)
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    if args.host_cu:  # the offsets on the host: no device-to-host read (and sync) per call
        cu = cu.cpu().numpy()

    def run():
        return sparse_attention(q, k, v, I, cu, cu, BK, validate=False)

    for _ in range(2):
        run()
    torch.cuda.synchronize()
    host = []
    for _ in range(5):
        t0 = time.perf_counter()
        run()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append(((t1 - t0) * 1e3, (t2 - t0) * 1e3))
    import cProfile
    import io
    import pstats

    cp = cProfile.Profile()
    cp.enable()
    run()
    cp.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(cp, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue()[:9000])
    text = io.StringIO()
    pstats.Stats(cp, stream=text).sort_stats("cumulative").print_stats(40)
    print(text.getvalue()[:9000])
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if str(getattr(e, "device_type", "")).endswith("CUDA")
                     and e.time_range.end > 0)
    gaps = []
    for (a0, a1, an), (b0, b1, bn) in zip(kernels, kernels[1:]):
        if b0 > a1:
            gaps.append(((b0 - a1) / 1e3, an[:60], bn[:60]))
    gaps.sort(reverse=True)
    busy = sum(b - a for a, b, _ in kernels) / 1e3
    span = (kernels[-1][1] - kernels[0][0]) / 1e3
    res = dict(n=n, host_cu=args.host_cu, host_enqueue_ms=[h[0] for h in host], host_total_ms=[h[1] for h in host],
               kernels=len(kernels), gpu_busy_ms=busy, first_to_last_ms=span,
               idle_ms=sum(g[0] for g in gaps), largest_gaps=gaps[:25])
    print({k: v for k, v in res.items() if k != "largest_gaps"})
    for g in gaps[:25]:
        print(f"{g[0]:8.3f} ms  after {g[1]}  before {g[2]}")
    write_json(args.out, [res])


if __name__ == "__main__":
    main()
