"""Paper §4.2, K2 on the GPU: exact log-sum-exp combine of the KV-outer partials.

Same function and arguments as ``msa.reference.combine`` (read its docstring for the math):

.. math::  L = a + \\log \\sum_s e^{L_s - a},\\ a = \\max_s L_s, \\qquad O = \\sum_s e^{L_s - L} O_s

The weights are computed as ``e^{L_s - a} / \\sum_t e^{L_t - a}``, as the reference does, not as
``e^{L_s - L}``: ``L`` rounded to float32 is off by up to half an ulp of ``|L|`` (5e-7 at
``L`` = 13), and ``e^{L_s - L}`` turns that absolute error into a relative error of every
weight. The quotient's error does not grow with ``|L|``.

Versions:

===  =========================================================================================
v    idea
===  =========================================================================================
v1   one warp per (query, head): every lane reduces the K slot LSEs itself (K broadcast loads,
     no shuffles), then the lanes split ``D`` and accumulate ``w_s * O_s`` slot by slot in
     registers, in slot order (deterministic, no atomics); unused slots (``L_s = -inf``) are
     skipped, so whatever their ``O_s`` holds (NaN, garbage) never reaches the output.
v2   memory bound done right (the default on a GPU; the simulator's default is v1, whose 4
     lanes a row are 8x fewer Python threads than v2's warp): one warp per (query, head). The
     LSE part once per row: lane ``s`` holds ``L_s`` (and ``L_{s+32}`` for K > 32), max and
     sum by ``shfl_xor`` butterflies, ``w_s = exp(L_s - a) / sum`` broadcast from lane ``s``.
     The partials move in 16-byte loads
     (``ld.global.nc.v4``: 8 bf16 or 4 float32 values a lane): a slot row of ``D`` values
     takes ``lps = D/8`` (bf16) or ``D/4`` lanes (rounded up to a power of two, at most 32),
     so the warp works on ``32/lps`` slots at once (bf16, D=128: lanes 0-15 take the even
     slots, 16-31 the odd ones), each lane issuing the loads of ``UNROLL`` slots before its
     first FMA; the first such batch goes out with the LSE loads, before the weights are known
     (``_V2_EARLY``: one memory round trip a row, its unused slots read but never summed).
     The groups' sums meet in a fixed ``shfl_xor`` butterfly (commutative pairs, so every
     lane gets the same bits). Deterministic; differs from v1 only in the order of
     the float32 sums. Needs ``D * itemsize`` a multiple of 16, 16-byte aligned partials,
     4-byte aligned outputs and ``K <= 64``; otherwise the launcher runs v1.
===  =========================================================================================

K2 is memory bound: it reads ``K*Tq*Hq*D`` partial values once (4 bytes each, 2 with bf16
partials) and writes ``Tq*Hq*D`` outputs. A (query, head) whose slots are all ``-inf`` gets
``O = 0`` and ``LSE = -inf``, never NaN.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, uint32

from .._checks import check_array, dtype_of
from ._core.arrays import SIMULATOR, ArrayContext, is_bf16
from ._core.memops import data_address, is_aligned16, load_f32x4, load_u32x4
from ._core.mma import bf16_to_f32, f32_to_bf16, pack_bf16x2, pack_f16x2
from ._core.warp import FULL_MASK, warp_max, warp_sum

VERSIONS = (1, 2)
# The simulator runs v1 by default: v2 needs a warp of 32 Python threads a row there (v1: 4),
# about 8x slower; tests/cuda/test_combine.py runs both versions explicitly.
DEFAULT_VERSION = 1 if SIMULATOR else 2
# Lanes per (query, head) and rows per CTA. The simulator runs every thread as a Python thread,
# so it gets fewer, wider lanes (the kernel is the same; only the constants change).
_LANES = 4 if SIMULATOR else 32
_ROWS_PER_CTA = 4
_NEG_INF = float32(-math.inf)
# v2: warps (rows) per CTA, slots whose loads a lane issues before using them, most slots
_V2_WARPS = 2 if SIMULATOR else 4
# at least 6 CTAs (24 warps) per SM: caps ptxas at 80 registers (8 bytes spilled; at 8 CTAs,
# 64 registers, the 8-slot batches spill 168 bytes). Measured on the H200 with 16K queries of
# bf16 partials (benchmarks/results/k2_early_loads_ab_2026-12-01_*.json): 1.46-1.50 ms against
# 1.72-2.00 ms for 4-slot batches, issued after the weights, at 8 CTAs an SM.
_V2_MIN_CTAS = 6
_V2_JIT = {} if SIMULATOR else {"launch_bounds": (32 * _V2_WARPS, _V2_MIN_CTAS)}
_V2_UNROLL = 8
# Issue the first batch of a row's O_s loads together with its LSE loads, before the weights
# are known (one memory round trip a row instead of two: with K = 16 bf16 slots of D = 128 the
# whole row is one batch); the batch's unused slots are read too (in bounds, never summed).
_V2_EARLY = True
_V2_MAX_SLOTS = 64
_UNUSED = float32(-1.0)  # a broadcast weight that marks an unused slot (real ones are >= 0)

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
            inv_total = float32(1.0) / total
            # O = sum_s exp(L_s - L) O_s, slot by slot in a fixed order, with
            # exp(L_s - L) = exp(L_s - a) / total (module docstring)
            for s in range(num_slots):
                l_s = lse_part[s, t, h]
                if l_s > _NEG_INF:
                    w = float32(math.exp(l_s - a)) * inv_total
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


@cuda.jit(device=True)
def _fma_bf16x2(acc, at, w, word):
    """``acc[at:at+2] += w * (the two bf16 of word, low half first)``."""
    acc[at] += w * bf16_to_f32(word)
    acc[at + 1] += w * bf16_to_f32(word >> 16)


@cuda.jit(device=True)
def _fma_f32(acc, at, w, x):
    acc[at] += w * x


@cuda.jit(device=True)
def _store_f32(out, t, h, at, acc, k):
    """float32 outputs: ``out[t, h, at] = acc[k]`` (one value)."""
    out[t, h, at] = acc[k]


@cuda.jit(device=True)
def _store_bf16x2(out, t, h, at, acc, k):
    """bf16 outputs viewed as uint32 words: word ``at`` holds values ``acc[k], acc[k+1]``."""
    out[t, h, at] = pack_bf16x2(acc[k], acc[k + 1])


@cuda.jit(device=True)
def _store_f16x2(out, t, h, at, acc, k):
    out[t, h, at] = pack_f16x2(acc[k], acc[k + 1])


def _v2_layout(head_dim: int, bf16_part: bool):
    """``(vals, nvec, lps, groups, per_lane)``: values per 16-byte vector, vectors per slot row,
    lanes per slot (power of two <= 32), slots in flight per warp, vectors per lane."""
    vals = 8 if bf16_part else 4
    nvec = head_dim // vals
    lps = 1
    while lps < min(nvec, 32):
        lps *= 2
    return vals, nvec, lps, 32 // lps, -(-nvec // lps)


@functools.cache
def _combine_kernel_vec(head_dim: int, bf16_part: bool, out_code: str, two_lse: bool,
                        warps_per_cta: int, unroll: int, early: bool = False):
    """K2 v2 specialised for ``D``, the partials' and outputs' types and ``K > 32``.

    ``o_vec`` is ``o_part`` as uint32 words (bf16) or float32; ``out`` is float32 or, for
    16-bit outputs (``out_code`` ``"bf16"``/``"f16"``), viewed as uint32 pairs.
    """
    vals, nvec, lps, groups, per_lane = _v2_layout(head_dim, bf16_part)
    words = 4  # elements of o_vec per 16-byte vector
    row_elems = head_dim // 2 if bf16_part else head_dim
    nacc = per_lane * vals
    nbuf = unroll * per_lane * words
    buf_t = uint32 if bf16_part else float32
    load16 = load_u32x4 if bf16_part else load_f32x4
    fma = _fma_bf16x2 if bf16_part else _fma_f32
    per_word = 2 if bf16_part else 1  # values per element of o_vec
    store = {"f32": _store_f32, "bf16": _store_bf16x2, "f16": _store_f16x2}[out_code]
    out_per_elem = 1 if out_code == "f32" else 2
    out_elems = vals // out_per_elem  # elements of out per vector

    @cuda.jit(device=True, inline=True)
    def load_slot(o_vec, buf, u, start, sub):
        """This lane's 16-byte loads of the slot row at word ``start`` into batch ``u`` of buf."""
        for i in range(per_lane):
            j = sub + lps * i
            if j < nvec:
                x0, x1, x2, x3 = load16(o_vec, start + j * words)
                at = (u * per_lane + i) * words
                buf[at] = x0
                buf[at + 1] = x1
                buf[at + 2] = x2
                buf[at + 3] = x3

    @cuda.jit(**_V2_JIT)
    def _combine_kernel_v2(o_vec, lse_part, out, lse_out):
        num_slots = lse_part.shape[0]
        num_q = lse_part.shape[1]
        num_heads = lse_part.shape[2]
        lane = cuda.threadIdx.x % 32
        row = cuda.blockIdx.x * warps_per_cta + cuda.threadIdx.x // 32
        if row >= num_q * num_heads:
            return  # the whole warp: rows are warp-uniform
        t = row // num_heads
        h = row % num_heads
        sub = lane % lps
        g = lane // lps
        # LSE part, once per row: lane s holds L_s (and L_{s+32})
        l0 = _NEG_INF
        if lane < num_slots:
            l0 = lse_part[lane, t, h]
        l1 = _NEG_INF
        if two_lse and lane + 32 < num_slots:
            l1 = lse_part[lane + 32, t, h]
        slot_stride = num_q * num_heads * row_elems
        base = row * row_elems
        buf = cuda.local.array(nbuf, buf_t)
        if early:  # the first batch's loads fly with the LSE loads (see _V2_EARLY)
            for u in range(unroll):
                s = g + groups * u
                if s < num_slots:
                    load_slot(o_vec, buf, u, s * slot_stride + base, sub)
        a = warp_max(max(l0, l1))
        acc = cuda.local.array(nacc, float32)
        for i in range(nacc):
            acc[i] = float32(0.0)
        lse = _NEG_INF
        if a > _NEG_INF:  # warp-uniform
            e0 = float32(0.0)
            if l0 > _NEG_INF:
                e0 = float32(math.exp(l0 - a))
            e1 = float32(0.0)
            if l1 > _NEG_INF:
                e1 = float32(math.exp(l1 - a))
            # the sum is >= 1 (the max's own term), so the log is finite
            total = warp_sum(e0 + e1)
            lse = a + float32(math.log(total))
            # w_s = exp(L_s - L) = exp(L_s - a) / total (module docstring)
            inv_total = float32(1.0) / total
            w0 = _UNUSED
            if l0 > _NEG_INF:
                w0 = e0 * inv_total
            w1 = _UNUSED
            if l1 > _NEG_INF:
                w1 = e1 * inv_total
            ws = cuda.local.array(unroll, float32)
            rounds = (num_slots + groups - 1) // groups
            for r0 in range(0, rounds, unroll):
                # issue the loads of `unroll` slots first ...
                for u in range(unroll):
                    s = g + groups * (r0 + u)
                    w = cuda.shfl_sync(FULL_MASK, w0, s & 31)
                    if two_lse:
                        w_hi = cuda.shfl_sync(FULL_MASK, w1, s & 31)
                        if s >= 32:
                            w = w_hi
                    if s >= num_slots:
                        w = _UNUSED
                    ws[u] = w
                    # uniform over the slot's lanes; O_s of -inf is never read (early: never summed)
                    if w >= float32(0.0) and not (early and r0 == 0):
                        load_slot(o_vec, buf, u, s * slot_stride + base, sub)
                # ... then use them, slot by slot in this group's order
                for u in range(unroll):
                    w = ws[u]
                    if w >= float32(0.0):
                        for i in range(per_lane):
                            if sub + lps * i < nvec:
                                for k in range(words):
                                    fma(acc, (i * words + k) * per_word, w,
                                        buf[(u * per_lane + i) * words + k])
            # the groups' sums, in a fixed butterfly: every lane ends with the same bits
            off = lps
            while off < 32:
                for i in range(nacc):
                    acc[i] += cuda.shfl_xor_sync(FULL_MASK, acc[i], off)
                off *= 2
        if g == 0:
            for i in range(per_lane):
                j = sub + lps * i
                if j < nvec:
                    for k in range(out_elems):
                        store(out, t, h, j * out_elems + k, acc, i * vals + k * out_per_elem)
        if lane == 0:
            lse_out[t, h] = lse

    return _combine_kernel_v2


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

    ``out_arg``/``lse_arg`` may be views of larger outputs (a query chunk of them). Version 2
    runs its 16-byte-load kernel where ``vector_path_ok`` allows, v1 otherwise (same results up
    to the float32 summation order).
    """
    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    num_slots = int(lse_part_arg.shape[0])
    rows = int(lse_part_arg.shape[1]) * int(lse_part_arg.shape[2])
    if rows == 0:
        return
    if version == 2 and vector_path_ok(o_part_arg, out_arg, head_dim, bf16_part, num_slots):
        out_code = ("bf16" if bf16_out else
                    "f16" if np.dtype(out_arg.dtype) == np.float16 else "f32")
        kernel = _combine_kernel_vec(int(head_dim), bool(bf16_part), out_code,
                                     num_slots > 32, _V2_WARPS, _v2_unroll(head_dim, bf16_part),
                                     _V2_EARLY)
        o_vec = o_part_arg.view(np.uint32) if bf16_part else o_part_arg
        out_vec = out_arg if out_code == "f32" else out_arg.view(np.uint32)
        grid = -(-rows // _V2_WARPS)
        kernel[grid, 32 * _V2_WARPS](o_vec, lse_part_arg, out_vec, lse_arg)
        return
    kernel = _combine_kernel_warp(int(head_dim), _LANES, _ROWS_PER_CTA, bool(bf16_part),
                                  bool(bf16_out))
    grid = -(-rows // _ROWS_PER_CTA)
    kernel[grid, _LANES * _ROWS_PER_CTA](o_part_arg, lse_part_arg, out_arg, lse_arg)


def _v2_unroll(head_dim: int, bf16_part: bool) -> int:
    """Slots a lane loads before using them: ``_V2_UNROLL`` vectors' worth (at least 1 slot)."""
    return max(1, _V2_UNROLL // _v2_layout(head_dim, bf16_part)[4])


def vector_path_ok(o_part_arg, out_arg, head_dim, bf16_part, num_slots) -> bool:
    """Whether K2 v2's 16-byte loads apply: ``D * itemsize`` a multiple of 16 (D % 8 == 0 for
    bf16, D % 4 == 0 for float32 partials), 16-byte aligned partials, 4-byte aligned outputs
    (16-bit outputs are written as uint32 pairs) and ``1 <= K <= 64``. Else v2 runs v1."""
    itemsize = 2 if bf16_part else 4
    return (head_dim > 0 and (head_dim * itemsize) % 16 == 0 and 1 <= num_slots <= _V2_MAX_SLOTS
            and is_aligned16(o_part_arg) and data_address(out_arg) % 4 == 0)

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
