"""The MSA training layer's whole step on the GPU, against the same layer with dense attention.

    source .gpu/env.sh && python3 -m benchmarks.bench_layer --out FILE

Paper configuration (d_model 3072, Hq 64, Hkv 4, D = Didx = 128, Bk 128, K 16, bf16), one
sequence of N tokens. The step is what a training loop runs::

    out = layer(x, cu)                                   # Algorithm 1, lines 1-7
    (torch.sum(out.output * g) + out.loss_kl).backward()

against the dense layer: the same four projections (``x @ W_q``, ``W_k``, ``W_v``, ``W_o``)
around causal ``scaled_dot_product_attention(..., enable_gqa=True)``, forward and backward. Both
take ``x`` with ``requires_grad`` (a layer inside a model). Reported per N: step time of each
(median of CUDA-event timings after a warm-up step), their ratio, peak GPU memory, and for the
sparse layer its warmup variant (``layer.warmup = True``: dense main branch, KL on the full
causal support) where it runs.

Useful FLOPs (MiniMax MSA's convention): the sparse main branch forward ``2 (D + D) Hq S`` and
backward ``2 (3D + 2D) Hq S`` with ``S`` the (query, visible selected key) pairs; the dense
``S = N (N + 1) / 2``. The projections are ``2 N d_model (2 Hq D + 2 Hkv D + Hkv Didx + Didx)``
forward and twice that backward.

``--profile N`` records one step with torch.profiler: the GPU's busy share of the step (the sum
of the kernels' device time over the step's wall time; msa and torch launch on one stream, so
kernels do not overlap) and the ten host operations with the most self CPU time.
``--cold-start`` times the first step of two fresh processes at 32K (the second finds the
first's compiled kernels on disk where the kernels are cached).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

from benchmarks.common import cuda_time_ms, print_table, write_json

D_MODEL, HQ, HKV, D, DIDX, BK, TOPK = 3072, 64, 4, 128, 128, 128, 16


def _layers(n_seed=0):
    import torch

    from msa.torch import MSAAttention

    torch.manual_seed(n_seed)
    layer = MSAAttention(D_MODEL, HQ, HKV, D, DIDX, block_size=BK, topk=TOPK, device="cuda",
                         dtype=torch.bfloat16)
    dense = DenseLayer(layer)
    return layer, dense


class DenseLayer:
    """The MSA layer's main projections around causal SDPA (no index branch)."""

    def __init__(self, layer):
        self.w_q, self.w_k, self.w_v, self.w_o = layer.w_q, layer.w_k, layer.w_v, layer.w_o

    def __call__(self, x):
        import torch.nn.functional as F

        t = x.shape[0]
        q = (x @ self.w_q).view(t, HQ, D).transpose(0, 1)[None]  # [1, Hq, T, D]
        k = (x @ self.w_k).view(t, HKV, D).transpose(0, 1)[None]
        v = (x @ self.w_v).view(t, HKV, D).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1).reshape(t, HQ * D) @ self.w_o


def projection_flops(n):
    return 2 * n * D_MODEL * (2 * HQ * D + 2 * HKV * D + HKV * DIDX + DIDX)


def visible_pairs(I, n):
    """S: (query, visible selected key) pairs of a one-sequence selection I [N, Hkv, K]."""
    import torch

    pos = torch.arange(n, device=I.device).view(n, 1, 1)
    start = I.long() * BK
    keys = torch.clamp(torch.minimum(pos + 1, torch.full_like(start, n)) - start, 0, BK)
    return int(torch.where(I >= 0, keys, torch.zeros_like(keys)).sum()) // HKV


def _step(layer, x, cu, g):
    out = layer(x, cu)
    (out.output.float().mul(g).sum() + out.loss_kl).backward()
    return out


def _dense_step(dense, x, g):
    y = dense(x)
    y.float().mul(g).sum().backward()


def bench_n(n, args, rows, extra):
    import numpy as np
    import torch

    layer, dense = _layers()
    cu = np.array([0, n], dtype=np.int32)
    x = (torch.randn(n, D_MODEL, device="cuda", dtype=torch.bfloat16)).requires_grad_(True)
    g = torch.randn(n, D_MODEL, device="cuda") / math.sqrt(n * D_MODEL)
    case = f"N={n // 1024}K"
    t_first = time.perf_counter()
    out = _step(layer, x, cu, g)  # warm-up (and the first step's compiles)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t_first
    finite = bool(torch.isfinite(out.output).all() and torch.isfinite(out.loss_kl)
                  and all(torch.isfinite(w.grad).all() for w in layer.parameters()))
    S = visible_pairs(out.block_indices, n)
    sparse_flops = 2 * (D + D) * HQ * S + 2 * (3 * D + 2 * D) * HQ * S + 3 * projection_flops(n)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = cuda_time_ms(lambda: _step(layer, x, cu, g), warmup=0, reps=args.reps)
    peak = torch.cuda.max_memory_allocated() / 2**30
    rows.append(dict(case=case, impl="MSAAttention step", ms=ms,
                     tflops=sparse_flops / ms / 1e9, peak_gib=peak, pairs=S, first_step_s=first_s,
                     finite=finite, loss_kl=float(out.loss_kl)))
    print_table(rows[-1:], list(rows[-1]))
    sparse_ms = ms
    if n <= args.dense_max_n:
        dense_pairs = n * (n + 1) // 2
        dense_flops = 2 * (D + D) * HQ * dense_pairs + 2 * (3 * D + 2 * D) * HQ * dense_pairs
        dense_flops += 3 * (projection_flops(n) - 2 * n * D_MODEL * (HKV * DIDX + DIDX))
        _dense_step(dense, x, g)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ms = cuda_time_ms(lambda: _dense_step(dense, x, g), warmup=0, reps=args.reps)
        peak = torch.cuda.max_memory_allocated() / 2**30
        rows.append(dict(case=case, impl="dense layer step (SDPA)", ms=ms,
                         tflops=dense_flops / ms / 1e9, peak_gib=peak,
                         msa_speedup=ms / sparse_ms))
        print_table(rows[-1:], list(rows[-1]))
    if n <= args.warmup_max_n:
        layer.warmup = True
        try:
            _step(layer, x, cu, g)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            ms = cuda_time_ms(lambda: _step(layer, x, cu, g), warmup=0, reps=max(1, args.reps // 2))
            peak = torch.cuda.max_memory_allocated() / 2**30
            rows.append(dict(case=case, impl="MSAAttention warmup step", ms=ms, peak_gib=peak))
        except Exception as exc:  # reported, not fatal: the warmup's memory is a target
            rows.append(dict(case=case, impl="MSAAttention warmup step",
                             error=f"{type(exc).__name__}: {str(exc)[:200]}"))
        print_table(rows[-1:], list(rows[-1]))
        layer.warmup = False
    if n == args.profile:
        extra["profile"] = profile_step(layer, x, cu, g, n)
    del layer, dense, x, g, out
    torch.cuda.empty_cache()


def profile_step(layer, x, cu, g, n):
    import torch
    from torch.profiler import ProfilerActivity, profile

    _step(layer, x, cu, g)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        _step(layer, x, cu, g)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events
                 if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    summary = dict(
        n=n, wall_ms=wall_ms, gpu_busy_ms=gpu_us / 1e3, gpu_busy_share=gpu_us / 1e3 / wall_ms,
        top_host_ops=[dict(name=e.key, self_cpu_ms=e.self_cpu_time_total / 1e3, calls=e.count)
                      for e in host],
        top_kernels=[dict(name=e.key[:80], ms=e.self_device_time_total / 1e3, calls=e.count)
                     for e in sorted(events, key=lambda e: e.self_device_time_total,
                                     reverse=True)[:10]])
    print(json.dumps(summary, indent=1))
    return summary


_COLD = """
import time, numpy as np, torch
t0 = time.perf_counter()
from benchmarks.bench_layer import _layers, _step, D_MODEL
layer, _ = _layers()
n = {n}
x = torch.randn(n, D_MODEL, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
g = torch.randn(n, D_MODEL, device="cuda") / n
_step(layer, x, np.array([0, n], dtype=np.int32), g)
torch.cuda.synchronize()
print("FIRST_STEP_S", time.perf_counter() - t0)
"""


def cold_start(n=32768):
    """First-step seconds (import included) of two fresh processes, one after the other."""
    times = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _COLD.format(n=n)], capture_output=True,
                             text=True, env=os.environ.copy(), timeout=600)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("FIRST_STEP_S")]
        times.append(float(line[0].split()[1]) if line else None)
        if not line:
            print(out.stdout[-2000:], out.stderr[-2000:])
    print(f"cold start at {n // 1024}K: first process {times[0]} s, second {times[1]} s")
    return dict(n=n, first_process_s=times[0], second_process_s=times[1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/bench_layer.json")
    p.add_argument("--sizes", default="8192,32768,131072,524288")
    p.add_argument("--dense-max-n", type=int, default=131072)
    p.add_argument("--warmup-max-n", type=int, default=131072)
    p.add_argument("--profile", type=int, default=131072, help="N of the profiled step (0: none)")
    p.add_argument("--cold-start", action="store_true")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=400.0)
    args = p.parse_args(argv)
    rows, extra = [], {}
    t0 = time.perf_counter()
    if args.cold_start:
        extra["cold_start"] = cold_start()
    for n in (int(s) for s in args.sizes.split(",") if s):
        if time.perf_counter() - t0 > args.budget_s:
            rows.append(dict(case=f"N={n // 1024}K", impl="(skipped: time budget)"))
            continue
        try:
            bench_n(n, args, rows, extra)
        except Exception as exc:
            rows.append(dict(case=f"N={n // 1024}K", impl="MSAAttention step",
                             error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            print(rows[-1])
    write_json(args.out, rows, config=dict(d_model=D_MODEL, hq=HQ, hkv=HKV, d=D, d_idx=DIDX,
                                           block_size=BK, topk=TOPK, dtype="bfloat16"), **extra)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
