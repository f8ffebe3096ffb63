"""Where a call's host time goes: cProfile of many calls of a launcher, and the cost of the
primitives every launch pays (GPU only).

``python3 -m benchmarks.dev.host_profile [--n 131072] [--reps 200] [--top 25] [--out FILE]``
(paper configuration, uniform selection, ``validate=False``). For ``build_csr``,
``build_schedule`` and ``sparse_attention`` it prints the Python time a call spends before the
GPU could run (launches queued, not waited for) and cProfile's functions by own time; then the
microseconds of each per-launch primitive (the launch stream, the device query, the free-memory
query, the argument wrappers). ``bench_csr``'s ``plan_ms`` and ``host_csr_ms`` say how much; this
says where.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats

os.environ.setdefault("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "0")

from benchmarks.bench_csr import host_ms, selection  # noqa: E402
from benchmarks.common import write_json  # noqa: E402

BK, TOPK, HKV, HQ, D = 128, 16, 4, 64, 128


def per_call_us(fn, reps):
    """Microseconds of Python per ``fn()``, its launches queued, not waited for."""
    for _ in range(3):
        fn()
    return host_ms(fn, reps) * 1e3


def profile(fn, reps, top):
    """cProfile's rows (own time first) over ``reps`` calls of ``fn``."""
    import torch

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    stats = pstats.Stats(prof).stats
    rows = sorted(((tt / reps * 1e6, ct / reps * 1e6, nc / reps, f"{f[0]}:{f[1]}({f[2]})")
                   for f, (_, nc, tt, ct, _) in stats.items()), reverse=True)[:top]
    return text.getvalue(), [dict(own_us=a, cum_us=b, calls=c, where=w) for a, b, c, w in rows]


def main(argv=None):
    import numpy as np
    import torch

    from msa.cuda import csr, schedule
    from msa.cuda._core import arrays, launch, streams
    from msa.cuda.attention import sparse_attention

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=131072)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    n = args.n
    I = selection(n, HKV, TOPK, BK, hot=0, seed=n)
    cu = np.array([0, n], np.int32)
    row_ptr = csr.build_csr(I, cu, cu, BK, validate=False)[0]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(n, HQ, D, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(n, HKV, D, device="cuda", generator=g).to(torch.bfloat16)
            for _ in range(2))
    calls = {
        "build_csr": lambda: csr.build_csr(I, cu, cu, BK, validate=False),
        "build_schedule": lambda: schedule.build_schedule(row_ptr, cu, BK, 2 * TOPK * BK,
                                                          max_edges=n * TOPK, validate=False),
        "sparse_attention": lambda: sparse_attention(q, k, v, I, cu, cu, BK, validate=False),
    }
    ctx = arrays.ArrayContext(block_indices=I)
    primitives = {
        "require_gpu": arrays.require_gpu,
        "launch_handle": streams.launch_handle,
        "stream": streams.stream,
        "torch.cuda.current_stream": torch.cuda.current_stream,
        "numba get_current_device": launch.cuda.get_current_device,
        "upload_ints (memoised)": lambda: launch.upload_ints(cu),
        "ArrayContext(one tensor)": lambda: arrays.ArrayContext(block_indices=I),
        "kinput": lambda: launch.kinput(ctx, "block_indices", I),
        "ctx.free_bytes": ctx.free_bytes,
        "ctx.empty (1 MiB int32)": lambda: ctx.empty((1 << 18,), np.int32),
    }
    result = dict(n=n, reps=args.reps, calls={}, primitives_us={})
    for name, fn in calls.items():
        # The attention's GPU time is ~100x its host time: few calls, so that its launches
        # never fill the launch queue (which would make the host wait and count the GPU's time).
        reps = min(args.reps, 10) if name == "sparse_attention" else args.reps
        us = per_call_us(fn, reps)
        text, rows = profile(fn, reps, args.top)
        result["calls"][name] = dict(host_us=us, top=rows)
        print(f"=== {name}: {us:.1f} us of Python a call\n{text}", flush=True)
    for name, fn in primitives.items():
        us = per_call_us(fn, 2000)
        result["primitives_us"][name] = us
        print(f"{name:<28} {us:8.2f} us", flush=True)
    if args.out:
        write_json(args.out, [dict(call=c, **r) for c, r in result["calls"].items()], n=n,
                   reps=args.reps, primitives_us=result["primitives_us"])


if __name__ == "__main__":
    main()
