"""Paper §4.2, K2 on the GPU: exact log-sum-exp combine of the KV-outer partials.

Same function and arguments as ``msa.reference.combine`` (read its docstring for the math):

.. math::  L = a + \\log \\sum_s e^{L_s - a},\\ a = \\max_s L_s, \\qquad O = \\sum_s e^{L_s - L} O_s

Versions:

===  =========================================================================================
v    idea
===  =========================================================================================
v1   one warp per (query, head): every lane reduces the K slot LSEs itself (K broadcast loads,
     no shuffles), then the lanes split ``D`` and accumulate ``w_s * O_s`` slot by slot in
     registers, in slot order (deterministic, no atomics); unused slots (``L_s = -inf``) are
     skipped, so whatever their ``O_s`` holds (NaN, garbage) never reaches the output.
===  =========================================================================================

K2 is memory bound: it reads ``K*Tq*Hq*D`` partial values once (4 bytes each, 2 with bf16
partials) and writes ``Tq*Hq*D`` outputs. A (query, head) whose slots are all ``-inf`` gets
``O = 0`` and ``LSE = -inf``, never NaN.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from .._checks import check_array, dtype_of
from ._arrays import SIMULATOR, ArrayContext, is_bf16
from ._mma import bf16_to_f32, f32_to_bf16

VERSIONS = (1,)
DEFAULT_VERSION = 1
# Lanes per (query, head) and rows per CTA. The simulator runs every thread as a Python thread,
# so it gets fewer, wider lanes (the kernel is the same; only the constants change).
_LANES = 4 if SIMULATOR else 32
_ROWS_PER_CTA = 4
_NEG_INF = float32(-math.inf)

OUT_KINDS = ("float32", "float16", "bfloat16")


def out_kind(dtype) -> str:
    """``'float32' | 'float16' | 'bfloat16'`` for a NumPy/torch dtype or name; TypeError otherwise."""
    if dtype is None:
        raise TypeError("out_dtype must be given")
    name = str(dtype).replace("torch.", "")
    if name in ("bfloat16", "bf16"):
        return "bfloat16"
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"out_dtype must be float32, float16 or bfloat16, got {dtype!r}") from None
    if dt == np.float32:
        return "float32"
    if dt == np.float16:
        return "float16"
    raise TypeError(f"out_dtype must be float32, float16 or bfloat16, got {dt}")


def _identity_f32(x):
    return float32(x)


@functools.lru_cache(maxsize=None)
def _combine_kernel_warp(head_dim: int, lanes: int, rows_per_cta: int, bf16_part: bool,
                         bf16_out: bool):
    """K2 v1 specialised for ``D`` (so each lane's accumulators are a fixed register array)."""
    per_lane = -(-head_dim // lanes)
    load = cuda.jit(device=True)(_identity_f32) if not bf16_part else bf16_to_f32
    store = f32_to_bf16 if bf16_out else cuda.jit(device=True)(_identity_f32)

    @cuda.jit
    def _combine_kernel_v1(o_part, lse_part, out, lse_out):
        num_slots = lse_part.shape[0]
        num_q = lse_part.shape[1]
        num_heads = lse_part.shape[2]
        row = cuda.blockIdx.x * rows_per_cta + cuda.threadIdx.x // lanes
        lane = cuda.threadIdx.x % lanes
        if row >= num_q * num_heads:
            return
        t = row // num_heads
        h = row % num_heads
        # a = max_s L_s (unused slots are -inf and never win)
        a = _NEG_INF
        for s in range(num_slots):
            l_s = lse_part[s, t, h]
            if l_s > a:
                a = l_s
        acc = cuda.local.array(per_lane, float32)
        for i in range(per_lane):
            acc[i] = float32(0.0)
        lse = _NEG_INF
        if a > _NEG_INF:
            # L = a + log sum_s exp(L_s - a); the sum is >= 1, so the log is finite
            total = float32(0.0)
            for s in range(num_slots):
                l_s = lse_part[s, t, h]
                if l_s > _NEG_INF:
                    total += math.exp(l_s - a)
            lse = a + math.log(total)
            # O = sum_s exp(L_s - L) O_s, slot by slot in a fixed order
            for s in range(num_slots):
                l_s = lse_part[s, t, h]
                if l_s > _NEG_INF:
                    w = float32(math.exp(l_s - lse))
                    for i in range(per_lane):
                        d = lane + i * lanes
                        if d < head_dim:
                            acc[i] += w * load(o_part[s, t, h, d])
        for i in range(per_lane):
            d = lane + i * lanes
            if d < head_dim:
                out[t, h, d] = store(acc[i])
        if lane == 0:
            lse_out[t, h] = lse

    return _combine_kernel_v1


def _check_partials(o_part, lse_part):
    """Validate shapes and dtypes; return ``(K, Tq, Hq, D, bf16_partials)``."""
    check_array("o_part", o_part, ndim=4)
    bf16_part = is_bf16(o_part)
    if not bf16_part and dtype_of(o_part) != np.float32:
        raise TypeError(f"o_part must have dtype float32 or bfloat16 on the GPU, got {dtype_of(o_part)}")
    num_slots, tq, hq, d = (int(s) for s in o_part.shape)
    if num_slots < 1:
        raise ValueError(f"o_part must have K >= 1 slots on axis 0, got shape {tuple(o_part.shape)}")
    check_array("lse_part", lse_part, ndim=3, dtypes=(np.float32,), shape=(num_slots, tq, hq))
    return num_slots, tq, hq, d, bf16_part


def launch_combine(ctx, o_part_arg, lse_part_arg, out_arg, lse_arg, *, head_dim, bf16_part,
                   bf16_out, version=DEFAULT_VERSION):
    """Launch K2 on kernel-ready arrays (used by ``combine_partials`` and ``attention``).

    ``out_arg``/``lse_arg`` may be views of larger outputs (a query chunk of them).
    """
    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    rows = int(lse_part_arg.shape[1]) * int(lse_part_arg.shape[2])
    if rows == 0:
        return
    kernel = _combine_kernel_warp(int(head_dim), _LANES, _ROWS_PER_CTA, bool(bf16_part),
                                  bool(bf16_out))
    grid = -(-rows // _ROWS_PER_CTA)
    kernel[grid, _LANES * _ROWS_PER_CTA](o_part_arg, lse_part_arg, out_arg, lse_arg)


def combine_partials(o_part, lse_part, out_dtype=None, *, version: int = DEFAULT_VERSION):
    """Paper §4.2 K2: merge the ``K`` partial attentions of every (query, head) with their LSEs.

    .. math::  L = \\log \\sum_s e^{L_s}, \\qquad O = \\sum_s e^{L_s - L} O_s

    Args:
        o_part: [K, Tq, Hq, D] float32 (or bfloat16 partials), ``O_s``, K >= 1; a CuPy array,
            torch CUDA tensor, Numba device array or (copied) NumPy array.
        lse_part: float32 [K, Tq, Hq], ``L_s`` in natural log; ``-inf`` marks an unused slot (its
            ``O_s`` is never read, so it may hold anything).
        out_dtype: dtype of ``o``: float32, float16 or bfloat16 (a NumPy/torch dtype or the
            string ``"bfloat16"``); ``None`` keeps ``o_part``'s dtype.
        version: kernel version (see the module's table).

    Returns:
        ``(o [Tq, Hq, D] in out_dtype, lse float32 [Tq, Hq])`` in the caller's array library. A
        (query, head) whose slots are all ``-inf`` gets ``o = 0``, ``lse = -inf``. Bitwise
        deterministic (fixed slot order, no atomics).

    Raises:
        TypeError: ``o_part`` not float32/bfloat16, ``lse_part`` not float32, a bad ``out_dtype``,
        mixed array libraries. ValueError: wrong ranks, ``K < 1``, ``lse_part``'s shape not
        ``o_part.shape[:3]``, non-contiguous arrays.
    """
    _, tq, hq, d, bf16_part = _check_partials(o_part, lse_part)
    kind = out_kind(out_dtype) if out_dtype is not None else ("bfloat16" if bf16_part else "float32")
    ctx = ArrayContext(o_part, lse_part)
    o_arg = ctx.input("o_part", o_part)
    l_arg = ctx.input("lse_part", lse_part)
    out = ctx.empty((tq, hq, d), kind)
    lse = ctx.empty((tq, hq), np.float32)
    launch_combine(ctx, o_arg, l_arg, ctx.arg(out), ctx.arg(lse), head_dim=d,
                   bf16_part=bf16_part, bf16_out=kind == "bfloat16", version=version)
    return ctx.output(out), ctx.output(lse)
