"""Index v1: one CUDA thread per ``M[r, t, b]``, the simple rung of paper eq 6.

Thread ``(r, t, b)`` walks the keys of block ``b`` that query ``t`` can see (``j <= pos_t``),
takes each dot product ``q_idx[t, r] . k_idx[j]`` from global memory and keeps their maximum
(or sum, for the mean pool); nothing is shared between threads. A key the query cannot see is
never read (docs/design.md §3); a NaN score is skipped by the max and kept by the mean, as in
the reference. Any dtype (float64 computes in float64) and any size: the default for float32
and float64 inputs, and for bf16/fp16 where no tensor-core rung applies. Not timed at the
paper's sizes: every score reads ``2 Didx`` values from global memory, so it is the rung to
read, not to run at 128K tokens.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, float64, types

from .._core.arrays import SIMULATOR
from .._core.mma import bf16_to_f32
from .._core.packed import query_position
from .._core.diskcache import kernel_jit
from .._core.streams import stream

THREADS = 128

# -- element loads: bf16 bits, fp16, fp32, fp64 -> the compute type -----------------------------

if SIMULATOR:
    def _as_float(x):
        """An element of q_idx/k_idx in the compute type: bf16 bits (int16/uint16) and fp16 to
        float32; float32 and float64 unchanged."""
        if isinstance(x, (np.uint16, np.int16)):
            return bf16_to_f32(x)
        if isinstance(x, np.float16):
            return np.float32(x)
        return x
else:
    from numba.cuda.extending import overload

    def _as_float(x):
        """An element of q_idx/k_idx in the compute type (see the simulator twin above)."""

    @overload(_as_float, target="cuda")
    def _as_float_overload(x):
        if isinstance(x, types.Integer):  # bf16 bits: the high half of a float32
            return lambda x: bf16_to_f32(x)
        if x == types.float16:
            return lambda x: float32(x)
        return lambda x: x


@functools.lru_cache(maxsize=None)
def block_scores_kernel(wide: bool, mean: bool):
    """One thread per M[r, i, b] (query t_begin + i); ``wide``: float64 compute."""
    F = float64 if wide else float32

    @kernel_jit
    def kernel(q, k, cu_q, cu_k, t_begin, block_size, scale, M):
        idx = cuda.grid(1)
        hkv = M.shape[0]
        c = M.shape[1]
        nb = M.shape[2]
        if idx >= hkv * c * nb:
            return
        b = idx % nb
        rest = idx // nb
        i = rest % c
        r = rest // c
        t = t_begin + i
        seq, pos = query_position(cu_q, cu_k, t)
        k0 = cu_k[seq]
        j_lo = b * block_size
        j_hi = min(j_lo + block_size - 1, pos)  # keys past pos (and past Lk > pos) are hidden
        best = F(-math.inf)
        total = F(0.0)
        for j in range(j_lo, j_hi + 1):
            # s = q_idx[t, r] . k_idx[j]
            s = F(0.0)
            for d in range(q.shape[2]):
                s += F(_as_float(q[t, r, d])) * F(_as_float(k[k0 + j, d]))
            if s > best:  # fmax from -inf: a NaN score is skipped, as in the reference
                best = s
            total += s
        if j_hi < j_lo:
            M[r, i, b] = F(-math.inf)
        elif mean:
            M[r, i, b] = total * scale / F(j_hi - j_lo + 1)
        else:
            M[r, i, b] = best * scale

    return kernel


def launch(p, M, t0: int, t1: int):
    """M [Hkv, t1 - t0, NB] (a kernel argument) of queries [t0, t1) by the v1 kernel."""
    kernel = block_scores_kernel(p.out_dtype == np.float64, p.mean)
    n = p.hkv * (t1 - t0) * p.nb
    kernel[(n + THREADS - 1) // THREADS, THREADS, stream()](p.q, p.k, p.cu_q, p.cu_k, t0,
                                                            p.block_size, p.scale, M)
