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
=============================  ===============================================================
"""

from __future__ import annotations

from numba import cuda, uint32

_BF16_EXP = 0x7F80
_F16_EXP = 0x7C00


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
