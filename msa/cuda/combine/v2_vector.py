"""K2 version 2: memory bound done right, 16-byte loads of several slots in flight.

One warp per (query, head). The LSE part once per row: lane ``s`` holds ``L_s`` (and
``L_{s+32}`` for K > 32), max and sum by ``shfl_xor`` butterflies, ``w_s = exp(L_s - a) / sum``
broadcast from lane ``s``. The partials move in 16-byte loads (``ld.global.nc.v4``: 8 bf16 or 4
float32 values a lane): a slot row of ``D`` values takes ``lps = D/8`` (bf16) or ``D/4`` lanes
(rounded up to a power of two, at most 32), so the warp works on ``32/lps`` slots at once (bf16,
D = 128: lanes 0-15 take the even slots, 16-31 the odd ones), each lane issuing the loads of
``slots_per_batch`` slots (8 vectors' worth) before its first FMA; the first batch goes out with
the LSE loads, before the weights are known (one memory round trip a row: with K = 16 bf16
slots of D = 128 the whole row is one batch; its unused slots are read but never summed). The
groups' sums meet in a fixed ``shfl_xor`` butterfly (commutative pairs, so every lane gets the
same bits). Deterministic; differs from version 1 only in the order of the float32 sums.

Needs ``D * itemsize`` a multiple of 16, 16-byte aligned partials, 4-byte aligned outputs and
``K <= 64`` (``vector_path_ok``); elsewhere the launcher runs version 1.

Where it runs: the GPU default. Verdict (H200, paper configuration, 16K queries of bf16
partials, 4.6 GB moved): 1.46-1.50 ms, ~3 TB/s (version 1: 5.8 ms, 0.78 TB/s); the early first
batch of 8 slots at 6 CTAs an SM against 4-slot batches after the weights at 8 CTAs: 1.46-1.50
against 1.72-2.00 ms.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, uint32

from .._core.arrays import SIMULATOR
from .._core.memops import data_address, is_aligned16, load_f32x4, load_u32x4
from .._core.mma import bf16_to_f32, pack_bf16x2, pack_f16x2
from .._core.warp import FULL_MASK, warp_max, warp_sum
from .._core.diskcache import kernel_jit
from .._core.streams import stream

_NEG_INF = float32(-math.inf)
_POS_INF = float32(math.inf)
_NAN = float32(math.nan)
# Warps (rows) per CTA.
WARPS = 2 if SIMULATOR else 4
# At least 6 CTAs (24 warps) per SM: caps ptxas at 80 registers (8 bytes spilled; at 8 CTAs,
# 64 registers, the 8-slot batches spill 168 bytes).
MIN_CTAS_PER_SM = 6
_JIT = {} if SIMULATOR else {"launch_bounds": (32 * WARPS, MIN_CTAS_PER_SM)}
# 16-byte vectors a lane loads before using them (``slots_per_batch`` slots of its vectors).
BATCH_VECTORS = 8
MAX_SLOTS = 64
_UNUSED = float32(-1.0)  # a broadcast weight that marks an unused slot (real ones are >= 0)


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


def layout(head_dim: int, bf16_part: bool):
    """``(vals, nvec, lps, groups, per_lane)``: values per 16-byte vector, vectors per slot row,
    lanes per slot (power of two <= 32), slots in flight per warp, vectors per lane."""
    vals = 8 if bf16_part else 4
    nvec = head_dim // vals
    lps = 1
    while lps < min(nvec, 32):
        lps *= 2
    return vals, nvec, lps, 32 // lps, -(-nvec // lps)


@functools.cache
def combine_kernel_v2(head_dim: int, bf16_part: bool, out_code: str, two_lse: bool,
                      warps_per_cta: int, unroll: int):
    """K2 v2 specialised for ``D``, the partials' and outputs' types, ``K > 32`` and the slots
    a lane loads before using them (``unroll``: ``slots_per_batch``).

    ``o_vec`` is ``o_part`` as uint32 words (bf16) or float32; ``out`` is float32 or, for
    16-bit outputs (``out_code`` ``"bf16"``/``"f16"``), viewed as uint32 pairs.
    """
    vals, nvec, lps, groups, per_lane = layout(head_dim, bf16_part)
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

    @kernel_jit(**_JIT)
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
        # the first batch's loads fly with the LSE loads, before the weights are known (its
        # unused slots are read too, in bounds, and never summed)
        for u in range(unroll):
            s = g + groups * u
            if s < num_slots:
                load_slot(o_vec, buf, u, s * slot_stride + base, sub)
        a = warp_max(max(l0, l1))
        acc = cuda.local.array(nacc, float32)
        for i in range(nacc):
            acc[i] = float32(0.0)
        lse = _NEG_INF
        # a NaN or +inf slot (warp-uniform): O = NaN, L = NaN or +inf, as eq 8 gives
        any_nan = cuda.any_sync(FULL_MASK, (l0 != l0) | (l1 != l1))
        any_inf = cuda.any_sync(FULL_MASK, (l0 == _POS_INF) | (l1 == _POS_INF))
        if any_nan or any_inf:
            for i in range(nacc):
                acc[i] = _NAN
            lse = _NAN if any_nan else _POS_INF
        elif a > _NEG_INF:  # warp-uniform
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
                    # uniform over the slot's lanes; O_s of -inf is never summed (the first
                    # batch is already loading)
                    if w >= float32(0.0) and r0 != 0:
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


def slots_per_batch(head_dim: int, bf16_part: bool) -> int:
    """Slots a lane loads before using them: ``BATCH_VECTORS`` vectors' worth (at least 1)."""
    return max(1, BATCH_VECTORS // layout(head_dim, bf16_part)[4])


def vector_path_ok(o_part, out, head_dim, bf16_part, num_slots) -> bool:
    """Whether K2 v2's 16-byte loads apply: ``D * itemsize`` a multiple of 16 (D % 8 == 0 for
    bf16, D % 4 == 0 for float32 partials), 16-byte aligned partials, 4-byte aligned outputs
    (16-bit outputs are written as uint32 pairs) and ``1 <= K <= MAX_SLOTS``."""
    itemsize = 2 if bf16_part else 4
    return (head_dim > 0 and (head_dim * itemsize) % 16 == 0 and 1 <= num_slots <= MAX_SLOTS
            and is_aligned16(o_part) and data_address(out) % 4 == 0)


def launch_v2(o_part, lse_part, out, lse_out, *, head_dim, bf16_part, out_code):
    """K2 v2 over every (query, head) row of ``lse_part``, where ``vector_path_ok``; checks
    nothing. ``out_code``: ``"f32"``, ``"bf16"`` or ``"f16"``, the outputs' type."""
    rows = int(lse_part.shape[1]) * int(lse_part.shape[2])
    num_slots = int(lse_part.shape[0])
    kernel = combine_kernel_v2(int(head_dim), bool(bf16_part), out_code, num_slots > 32, WARPS,
                               slots_per_batch(head_dim, bf16_part))
    o_vec = o_part.view(np.uint32) if bf16_part else o_part
    out_vec = out if out_code == "f32" else out.view(np.uint32)
    kernel[-(-rows // WARPS), 32 * WARPS, stream()](o_vec, lse_part, out_vec, lse_out)
