"""Non-finite inputs and masking by selection (docs/design.md §3).

A tensor-core tile multiplies whole blocks: ``O = P V`` adds ``P[q, c] * V[c, d]`` for every key
``c`` of the block, and a key that row ``q`` cannot see has ``P[q, c] = 0``. IEEE arithmetic
makes ``0 * NaN`` and ``0 * inf`` NaN, so a non-finite value at an invisible key would reach
``q``. The kernels therefore keep non-finite 16-bit values out of their shared-memory tiles
(``clean_bf16x2`` / ``clean_f16x2`` replace them by +0 as the tile is loaded and report that they
did), and a tile that had one restores, in its epilogue, what the reference gives for the rows
that do see it (the non-finite values of the visible keys, summed in fp32: NaN, +inf or -inf).
A tile without non-finite values computes exactly what it computed before.

=============================  ===============================================================
``clean_bf16x2(word)``          ``(clean, bad)``: the two bf16 halves of a uint32 word, each
                                non-finite half (exponent all ones) replaced by +0; ``bad``
                                uint32 1 if one was, else 0
``clean_f16x2(word)``           the same for two fp16 halves
``is_nonfinite_bf16(bits)``     bool: the bf16 ``bits`` (low 16 bits) are an inf or a NaN
``is_nonfinite_f16(bits)``      the same for fp16
``block_checks(bf16)``          the block-level functions of one 16-bit format (below), for the
                                kernels that load a K/V block once and serve many rows with it
=============================  ===============================================================

``block_checks(bf16)`` returns a namespace of device functions:

* ``nonfinite_bits(word)``: uint32, nonzero iff a half of ``word`` is non-finite (two ands and
  an add, no branch: ``(word & exponents) + lowest exponent bits`` carries into a half's sign
  bit exactly when its exponent is all ones); the OR of several words' tests one branch;
* ``clean(word)``: ``clean_bf16x2`` or ``clean_f16x2``;
* ``clean4(smem, at)``: the four words ``smem[at:at+4]`` cleaned in place; uint32 1 if one had
  a non-finite half (one test for the four in the common case, no store);
* ``first_nonfinite(first, v, key0, nk, h, tid, nthreads)``: with every thread of the CTA,
  ``first[d]`` (int32 shared, ``D`` entries) = the smallest ``c < nk`` with ``V[key0 + c, h,
  d]`` non-finite, else ``nk`` (``v`` the uint32 word view ``[T, H, D/2]``); two CTA barriers
  and one pass over the block in global memory (the rare path: only a block that has one);
* ``nonfinite_sum(v, key0, h, d, first, last)``: the fp32 sum of the non-finite
  ``V[key0 + c, h, d]``, ``first <= c < last``: NaN if one is a NaN or both infinities occur,
  else the infinity (what ``sum_c P[q, c] V[c, d]`` gives for a row that sees them with
  ``P > 0``; the finite values add nothing to it).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

from numba import cuda, float32, int32, uint32

_BF16_EXP = 0x7F80
_F16_EXP = 0x7C00
_SIGNS = 0x80008000
_INF = float32(math.inf)
_NAN = float32(math.nan)


@cuda.jit(device=True, inline=True)
def is_nonfinite_bf16(bits):
    return (uint32(bits) & uint32(_BF16_EXP)) == uint32(_BF16_EXP)


@cuda.jit(device=True, inline=True)
def is_nonfinite_f16(bits):
    return (uint32(bits) & uint32(_F16_EXP)) == uint32(_F16_EXP)


@cuda.jit(device=True, inline=True)
def clean_bf16x2(word):
    w = uint32(word)
    bad = uint32(0)
    if (w & uint32(_BF16_EXP)) == uint32(_BF16_EXP):
        w = w & uint32(0xFFFF0000)
        bad = uint32(1)
    if ((w >> uint32(16)) & uint32(_BF16_EXP)) == uint32(_BF16_EXP):
        w = w & uint32(0x0000FFFF)
        bad = uint32(1)
    return w, bad


@cuda.jit(device=True, inline=True)
def clean_f16x2(word):
    w = uint32(word)
    bad = uint32(0)
    if (w & uint32(_F16_EXP)) == uint32(_F16_EXP):
        w = w & uint32(0xFFFF0000)
        bad = uint32(1)
    if ((w >> uint32(16)) & uint32(_F16_EXP)) == uint32(_F16_EXP):
        w = w & uint32(0x0000FFFF)
        bad = uint32(1)
    return w, bad


@functools.lru_cache(maxsize=None)
def block_checks(bf16: bool) -> SimpleNamespace:
    """The block-level device functions of bf16 (``bf16``) or fp16 values (module docstring)."""
    EXP = _BF16_EXP if bf16 else _F16_EXP
    EXPS = EXP | (EXP << 16)  # both halves' exponent fields
    CARRY = (EXP & -EXP) * 0x00010001  # the lowest exponent bit of both halves
    MANT = (EXP & -EXP) - 1  # the mantissa bits of a half
    is_bad = is_nonfinite_bf16 if bf16 else is_nonfinite_f16
    clean = clean_bf16x2 if bf16 else clean_f16x2

    @cuda.jit(device=True, inline=True)
    def nonfinite_bits(word):
        return ((uint32(word) & uint32(EXPS)) + uint32(CARRY)) & uint32(_SIGNS)

    @cuda.jit(device=True, inline=True)
    def clean4(smem, at):
        if (nonfinite_bits(smem[at]) | nonfinite_bits(smem[at + 1])
                | nonfinite_bits(smem[at + 2]) | nonfinite_bits(smem[at + 3])) == uint32(0):
            return uint32(0)
        for u in range(4):  # the rare path: a non-finite half among the four words
            w, _ = clean(smem[at + u])
            smem[at + u] = w
        return uint32(1)

    @cuda.jit(device=True, inline=True)
    def first_nonfinite(first, v, key0, nk, h, tid, nthreads):
        dw = v.shape[2]
        for d in range(tid, 2 * dw, nthreads):
            first[d] = int32(nk)
        cuda.syncthreads()
        for i in range(tid, nk * dw, nthreads):
            c = i // dw
            w = i % dw
            word = uint32(v[key0 + c, h, w])
            if nonfinite_bits(word) != uint32(0):
                if is_bad(word & uint32(0xFFFF)):
                    cuda.atomic.min(first, 2 * w, int32(c))
                if is_bad(word >> uint32(16)):
                    cuda.atomic.min(first, 2 * w + 1, int32(c))
        cuda.syncthreads()

    @cuda.jit(device=True, inline=True)
    def nonfinite_sum(v, key0, h, d, first, last):
        shift = uint32(16 * (d % 2))
        acc = float32(0.0)
        for c in range(first, last):
            bits = (uint32(v[key0 + c, h, d // 2]) >> shift) & uint32(0xFFFF)
            if is_bad(bits):
                x = _INF if (bits & uint32(0x8000)) == uint32(0) else -_INF
                if (bits & uint32(MANT)) != uint32(0):
                    x = _NAN
                acc += x
        return acc

    return SimpleNamespace(nonfinite_bits=nonfinite_bits, clean=clean, clean4=clean4,
                           first_nonfinite=first_nonfinite, nonfinite_sum=nonfinite_sum)
