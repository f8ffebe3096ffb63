"""Tensor-core and bit-level device helpers for msa's kernels, each with a pure-Numba twin.

Numba has no tensor-core intrinsic and no bf16 arrays. This module gives kernels the few
instructions they need, chosen **here and only here** between two backends with one contract:

* ``"ptx"`` (default on a GPU): inline PTX through ``numba.cuda.extending.intrinsic`` and
  ``llvmlite.ir.InlineAsm`` (``mma.sync.aligned.m16n8k16``, ``cvt.rn.bf16x2.f32``,
  ``ex2.approx``, ``lg2.approx``) and plain LLVM bit casts.
* ``"twin"`` (always under ``NUMBA_ENABLE_CUDASIM=1``): Python/Numba code with the same inputs,
  outputs and fragment layout. In the simulator the bit casts go through NumPy; on a GPU
  (``MSA_MMA=twin``) the twin ``mma`` runs as ordinary Numba code, which is slow but lets a
  failing tensor-core kernel be bisected: if the twin passes and ``ptx`` fails, the fault is in
  the shim, not in the kernel's fragment bookkeeping.

``MMA_BACKEND`` says which one is active; set ``MSA_MMA=ptx|twin`` before importing msa to choose.

Fragment layout of ``mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32``
(PTX ISA, "Matrix fragments for mma.m16n8k16"), for lane ``l`` with ``g = l // 4``,
``t = l % 4``; every ``a``/``b`` register is a uint32 holding two 16-bit values, the lower
column (A) or row (B) index in the low half:

=========  =========================================  ===========================
register   A (16 x 16, row-major)                      B (16 x 8, "col": stored as Bᵀ)
=========  =========================================  ===========================
a0 / b0    A[g,   2t:2t+2]                             B[2t:2t+2,   g]
a1 / b1    A[g+8, 2t:2t+2]                             B[2t+8:2t+10, g]
a2         A[g,   2t+8:2t+10]
a3         A[g+8, 2t+8:2t+10]
=========  =========================================  ===========================

C and D (16 x 8 float32): ``c0, c1 = C[g, 2t], C[g, 2t+1]``; ``c2, c3 = C[g+8, 2t], C[g+8, 2t+1]``.

``load_a_frag`` / ``load_b_frag`` read these registers from a uint32 view of shared memory
(tiles stored row-major with a row stride ``ld`` in 32-bit words; B stored as Bᵀ, i.e. ``n``
rows of ``k`` values), and are the same code for both backends.

The twin ``mma`` needs every lane's registers. In the simulator the warp's lanes meet once
(``_simwarp.exchange``) and the first lane computes the whole 16 x 8 tile in NumPy for all
(the simulator runs every device-function call through a costly module swap, so 64 scalar
conversions a lane were most of a kernel's time). On a GPU (``MSA_MMA=twin``) the lanes exchange
their registers through a small static shared array and call ``cuda.syncthreads()`` twice: a
kernel that uses it must be launched with a 1D block of at most ``MAX_WARPS`` warps and call it
the same number of times in every thread (block-uniform control flow), which msa's kernels do
anyway (mma.sync needs a converged warp). The simulator's twin rounds each product and each
sum to float32, k in order (the compiled GPU twin may fuse them into FMAs).

``launch`` wraps the one driver call needed for more than 48 KB of dynamic shared memory.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
from numba import cuda, float32, types, uint16, uint32

from .arrays import SIMULATOR

MAX_WARPS = 16
STATIC_SMEM_LIMIT = 48 * 1024
# Hopper (sm_90) allows 227 KB of shared memory per block (opt-in), static + dynamic; kernels
# keep STATIC_RESERVE of it for their static arrays (row tables, the twin's register exchange).
DEVICE_SMEM_LIMIT = 227 * 1024
STATIC_RESERVE = 16 * 1024
DYNAMIC_SMEM_LIMIT = DEVICE_SMEM_LIMIT - STATIC_RESERVE  # what a kernel's plan may ask for

_requested = os.environ.get("MSA_MMA", "").strip().lower()
if _requested not in ("", "ptx", "twin"):
    raise ValueError(f"MSA_MMA must be 'ptx' or 'twin', got {_requested!r}")
if SIMULATOR and _requested == "ptx":
    raise ValueError("MSA_MMA=ptx needs a GPU: the simulator cannot run inline PTX")
MMA_BACKEND = "twin" if SIMULATOR else (_requested or "ptx")


# GPU implementations: LLVM bit casts and inline PTX. Only built off the simulator.
if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    _F32 = ir.FloatType()
    _I16 = ir.IntType(16)
    _I32 = ir.IntType(32)

    def _as_i32(builder, value, ty):
        """Truncate or extend an integer argument to i32 (zero extension: these are bit patterns)."""
        width = ty.bitwidth
        if width == 32:
            return value
        if width > 32:
            return builder.trunc(value, _I32)
        return builder.zext(value, _I32)

    @intrinsic
    def _bf16_to_f32_ir(typingctx, bits):
        """float32 whose top 16 bits are ``bits`` (bf16 -> fp32 is exact)."""
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            word = builder.shl(_as_i32(builder, args[0], sig.args[0]), ir.Constant(_I32, 16))
            return builder.bitcast(word, _F32)

        return float32(bits), codegen

    @intrinsic
    def _f16_to_f32_ir(typingctx, bits):
        """float32 value of the IEEE half whose bits are the low 16 bits of ``bits``."""
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            h16 = builder.trunc(_as_i32(builder, args[0], sig.args[0]), _I16)
            return builder.fpext(builder.bitcast(h16, ir.HalfType()), _F32)

        return float32(bits), codegen

    @intrinsic
    def _f32_to_f16_ir(typingctx, x):
        """IEEE half bits of ``x``, round to nearest even."""
        if x != types.float32:
            return None

        def codegen(context, builder, sig, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), _I16)

        return uint16(x), codegen

    def _make_pack(ptx_type):
        @intrinsic
        def _pack(typingctx, lo, hi):
            if lo != types.float32 or hi != types.float32:
                return None

            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(_I32, [_F32, _F32])
                # cvt.rn.{bf16x2,f16x2}.f32 d, a, b puts a in the upper half, b in the lower.
                asm = ir.InlineAsm(fnty, f"cvt.rn.{ptx_type}.f32 $0, $1, $2;", "=r,f,f",
                                   side_effect=False)
                return builder.call(asm, [args[1], args[0]])

            return uint32(lo, hi), codegen

        return _pack

    _pack_bf16x2_ir = _make_pack("bf16x2")
    _pack_f16x2_ir = _make_pack("f16x2")

    def _make_f32_asm(text, result, constraints, doc):
        """An intrinsic of one float32 operand by the one PTX instruction ``text`` (``$0`` its
        result, of LLVM type ``result``, ``$1`` the operand; inline-asm ``constraints``)."""
        nb_result = uint16 if result is _I16 else float32

        def op(typingctx, x):
            if x != types.float32:
                return None

            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(result, [_F32])
                asm = ir.InlineAsm(fnty, text, constraints, side_effect=False)
                return builder.call(asm, args)

            return nb_result(x), codegen

        op.__name__ = "_" + text.split()[0].replace(".", "_")  # e.g. _ex2_approx_ftz_f32
        op.__doc__ = doc
        return intrinsic(op)

    _f32_to_bf16_ir = _make_f32_asm(
        "cvt.rn.bf16.f32 $0, $1;", _I16, "=h,f",
        "bf16 bits of ``x``, round to nearest even (``cvt.rn.bf16.f32``).")
    _exp2_ir = _make_f32_asm(
        "ex2.approx.ftz.f32 $0, $1;", _F32, "=f,f",
        "``2**x`` by ``ex2.approx.ftz.f32`` (2 ulp; ``-inf`` gives +0).")
    _log2_ir = _make_f32_asm(
        "lg2.approx.f32 $0, $1;", _F32, "=f,f",
        "``log2(x)`` by ``lg2.approx.f32`` (absolute error ~2**-22 on the mantissa's log; "
        "subnormal ``x`` kept, not flushed; ``+0`` gives ``-inf``, a negative ``x`` or NaN "
        "gives NaN, ``+inf`` gives ``+inf``).")

    @intrinsic
    def _fmax_ir(typingctx, m, x):
        """``max.f32``: one instruction (FMNMX) where ``x if x > m else m`` takes two; a NaN
        operand gives the other one, as that does for a NaN ``x``. (Zeros of either sign count
        as equal there, and ``max.f32`` may return either: callers that store the result, not
        only compare it, keep the two-instruction form.)"""
        if m != types.float32 or x != types.float32:
            return None

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(_F32, [_F32, _F32])
            asm = ir.InlineAsm(fnty, "max.f32 $0, $1, $2;", "=f,f,f", side_effect=False)
            return builder.call(asm, args)

        return float32(m, x), codegen

    def _make_mma(ab_type):
        @intrinsic
        def _mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            ret = types.UniTuple(float32, 4)
            sig = ret(uint32, uint32, uint32, uint32, uint32, uint32,
                      float32, float32, float32, float32)

            def codegen(context, builder, signature, args):
                regs = [builder.zext(a, _I32) if a.type.width < 32 else a for a in args[:6]]
                fnty = ir.FunctionType(ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4)
                asm = ir.InlineAsm(
                    fnty,
                    f"mma.sync.aligned.m16n8k16.row.col.f32.{ab_type}.{ab_type}.f32 "
                    "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                    "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
                    side_effect=True)  # like CUDA's asm volatile: never moved into divergent code
                res = builder.call(asm, regs + list(args[6:]))
                outs = [builder.extract_value(res, i) for i in range(4)]
                return context.make_tuple(builder, signature.return_type, outs)

            return sig, codegen

        return _mma

    _mma_bf16_ptx = _make_mma("bf16")
    _mma_f16_ptx = _make_mma("f16")

    @intrinsic
    def _prefetch_l1_ir(typingctx, arr, i, j, w):
        """``prefetch.L1`` of the line holding ``arr[i, j, w]`` (a hint: no register, no fault)."""
        if not (isinstance(arr, types.Array) and arr.ndim == 3):
            return None
        from numba.cuda import cgutils

        def codegen(context, builder, sig, args):
            aryty = sig.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            idx = [context.cast(builder, a, t, types.intp) for a, t in zip(args[1:], sig.args[1:])]
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, idx)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ptr.type]), "prefetch.L1 [$0];",
                               "l", side_effect=True)
            builder.call(asm, [ptr])
            return context.get_dummy_value()

        return types.void(arr, i, j, w), codegen

    bf16_to_f32 = _bf16_to_f32_ir
    f16_bits_to_f32 = _f16_to_f32_ir
    prefetch_l1 = _prefetch_l1_ir
    f32_to_bf16 = _f32_to_bf16_ir
    f32_to_f16_bits = _f32_to_f16_ir
    pack_bf16x2 = _pack_bf16x2_ir
    pack_f16x2 = _pack_f16x2_ir
    exp2 = _exp2_ir
    log2 = _log2_ir
    fmax_f32 = _fmax_ir

# Simulator twins of the bit-level helpers (NumPy does the bit casts).
else:

    @cuda.jit(device=True)
    def bf16_to_f32(bits):
        return np.uint32((int(bits) & 0xFFFF) << 16).view(np.float32)

    @cuda.jit(device=True)
    def f16_bits_to_f32(bits):
        return np.float32(np.uint16(int(bits) & 0xFFFF).view(np.float16))

    @cuda.jit(device=True)
    def f32_to_bf16(x):
        u = int(np.float32(x).view(np.uint32))
        if (u & 0x7FFFFFFF) > 0x7F800000:  # NaN stays a (quiet) NaN
            return np.uint16((u >> 16) | 0x40)
        return np.uint16(((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF)

    @cuda.jit(device=True)
    def f32_to_f16_bits(x):
        with np.errstate(over="ignore"):
            return np.float16(np.float32(x)).view(np.uint16)

    @cuda.jit(device=True)
    def pack_bf16x2(lo, hi):
        return np.uint32(int(f32_to_bf16(lo)) | (int(f32_to_bf16(hi)) << 16))

    @cuda.jit(device=True)
    def pack_f16x2(lo, hi):
        return np.uint32(int(f32_to_f16_bits(lo)) | (int(f32_to_f16_bits(hi)) << 16))

    @cuda.jit(device=True)
    def prefetch_l1(arr, i, j, w):
        """A cache hint: nothing to do in the simulator (the index is still bounds-checked)."""
        arr[i, j, w]

    @cuda.jit(device=True)
    def fmax_f32(m, x):
        return x if x > m else m

    @cuda.jit(device=True)
    def exp2(x):
        x = float(x)
        if x == -math.inf:
            return np.float32(0.0)
        if x != x:  # NaN stays NaN (ex2.approx)
            return np.float32(math.nan)
        return np.float32(2.0 ** x) if x < 128.0 else np.float32(math.inf)

    @cuda.jit(device=True)
    def log2(x):
        x = float(x)
        if x == 0.0:
            return np.float32(-math.inf)
        if not x >= 0.0:  # negative or NaN (lg2.approx)
            return np.float32(math.nan)
        return np.float32(math.log2(x))


# The twin mma: same registers in, same registers out, computed from every lane's operands.
@cuda.jit(device=True)
def _half_of(word, k):
    """The 16-bit element of ``word`` for fragment index ``k`` (even k: low half)."""
    return (word >> (16 * (k % 2))) & 0xFFFF


# Where each A [16, 16] / B [16, 8] element lives: lane, register (a0-a3 = 0-3, b0/b1 = 4/5) and
# 16-bit half of the word (see the layout table in the module docstring).
_K = np.arange(16)
_A_ROW = np.arange(16)[:, None]
_A_LANE = 4 * (_A_ROW % 8) + (_K[None, :] % 8) // 2
_A_REG = np.where(_K[None, :] < 8, 0, 2) + (_A_ROW >= 8)
_B_LANE = 4 * np.arange(8)[None, :] + (_K[:, None] % 8) // 2
_B_REG = np.where(_K[:, None] < 8, 4, 5) + 0 * _B_LANE
_HALF_SHIFT = 16 * (_K % 2)


def _warp_mma_numpy(lanes, is_bf16):
    """The simulator twin's D [16, 8] float32 from the 32 lanes' ``(a0-a3, b0, b1, c0-c3)``:
    ``D = C + sum_k A[:, k] B[k, :]``, k in order, each product and each sum rounded to float32
    (NumPy does not fuse them)."""
    regs = np.array([lane[:6] for lane in lanes[:32]], dtype=np.uint32)
    cs = np.array([lane[6:] for lane in lanes[:32]], dtype=np.float32)  # [32, 4]
    a_bits = (regs[_A_LANE, _A_REG] >> _HALF_SHIFT[None, :]) & 0xFFFF
    b_bits = (regs[_B_LANE, _B_REG] >> _HALF_SHIFT[:, None]) & 0xFFFF
    if is_bf16:
        a = (a_bits.astype(np.uint32) << 16).view(np.float32)
        b = (b_bits.astype(np.uint32) << 16).view(np.float32)
    else:
        a = a_bits.astype(np.uint16).view(np.float16).astype(np.float32)
        b = b_bits.astype(np.uint16).view(np.float16).astype(np.float32)
    d = np.empty((16, 8), np.float32)
    lane_of = 4 * np.arange(8)[:, None] + np.arange(4)[None, :]  # [g, t]
    d[:8, 0::2] = cs[lane_of, 0]
    d[:8, 1::2] = cs[lane_of, 1]
    d[8:, 0::2] = cs[lane_of, 2]
    d[8:, 1::2] = cs[lane_of, 3]
    for k in range(16):
        d = d + a[:, k:k + 1] * b[k:k + 1, :]
    return d


def _make_mma_twin(is_bf16):
    if SIMULATOR:  # one rendezvous of the warp, then the warp's whole D at once in NumPy
        from . import simwarp as _simwarp

        @cuda.jit(device=True)
        def _mma_twin(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            lanes = _simwarp.exchange((int(a0), int(a1), int(a2), int(a3), int(b0), int(b1),
                                       float(c0), float(c1), float(c2), float(c3)))
            if len(lanes) == 32:  # the first lane here computes D for all (a twin does the same)
                lanes.append(_warp_mma_numpy(lanes, is_bf16))
            d = lanes[32]
            lane = cuda.threadIdx.x % 32
            g = lane // 4
            t = lane % 4
            return d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]

        return _mma_twin

    to_f32 = bf16_to_f32 if is_bf16 else f16_bits_to_f32

    @cuda.jit(device=True)
    def _mma_twin(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        regs = cuda.shared.array((MAX_WARPS, 32, 6), uint32)
        tid = cuda.threadIdx.x
        w = tid // 32
        lane = tid % 32
        regs[w, lane, 0] = a0
        regs[w, lane, 1] = a1
        regs[w, lane, 2] = a2
        regs[w, lane, 3] = a3
        regs[w, lane, 4] = b0
        regs[w, lane, 5] = b1
        cuda.syncthreads()
        g = lane // 4
        t = lane % 4
        d0 = float32(c0)
        d1 = float32(c1)
        d2 = float32(c2)
        d3 = float32(c3)
        for k in range(16):
            # A[g, k] and A[g+8, k] live in lane 4g + (k % 8) // 2, registers a0/a1 (k < 8) or a2/a3.
            src = 4 * g + (k % 8) // 2
            reg = 0 if k < 8 else 2
            a_top = to_f32(_half_of(regs[w, src, reg], k))
            a_bot = to_f32(_half_of(regs[w, src, reg + 1], k))
            # B[k, n] lives in lane 4n + (k % 8) // 2, register b0 (k < 8) or b1.
            breg = 4 if k < 8 else 5
            b_n0 = to_f32(_half_of(regs[w, 4 * (2 * t) + (k % 8) // 2, breg], k))
            b_n1 = to_f32(_half_of(regs[w, 4 * (2 * t + 1) + (k % 8) // 2, breg], k))
            d0 = float32(d0 + a_top * b_n0)
            d1 = float32(d1 + a_top * b_n1)
            d2 = float32(d2 + a_bot * b_n0)
            d3 = float32(d3 + a_bot * b_n1)
        cuda.syncthreads()  # nobody overwrites regs before every lane has read them
        return d0, d1, d2, d3

    return _mma_twin


_mma_bf16_twin = _make_mma_twin(True)
_mma_f16_twin = _make_mma_twin(False)

if MMA_BACKEND == "ptx":
    mma_bf16_m16n8k16 = _mma_bf16_ptx
    mma_f16_m16n8k16 = _mma_f16_ptx
else:
    mma_bf16_m16n8k16 = _mma_bf16_twin
    mma_f16_m16n8k16 = _mma_f16_twin


@functools.lru_cache(maxsize=None)
def make_mma_pair(mma):
    """``mma_pair(acc, n, a0, a1, a2, a3, b0, b1, b2, b3)``: the two mma of one ``ldmatrix_x4``
    B load, n-tiles ``(b0, b1)`` and ``(b2, b3)``, accumulating into ``acc[n:n+4]`` and
    ``acc[n+4:n+8]`` (the fp32 C/D fragments in a local array); ``mma`` is the 16-bit type's
    mma. Inlined into the kernel, so the accumulators stay in registers."""

    @cuda.jit(device=True, inline=True)
    def mma_pair(acc, n, a0, a1, a2, a3, b0, b1, b2, b3):
        d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1, acc[n], acc[n + 1], acc[n + 2],
                             acc[n + 3])
        acc[n] = d0
        acc[n + 1] = d1
        acc[n + 2] = d2
        acc[n + 3] = d3
        d0, d1, d2, d3 = mma(a0, a1, a2, a3, b2, b3, acc[n + 4], acc[n + 5], acc[n + 6],
                             acc[n + 7])
        acc[n + 4] = d0
        acc[n + 5] = d1
        acc[n + 6] = d2
        acc[n + 7] = d3

    return mma_pair


# Fragment loads from shared memory (plain Numba, shared by both backends).
@cuda.jit(device=True)
def load_a_frag(smem, base, ld):
    """A fragment of a 16x16 tile at word ``base`` of ``smem`` (uint32), row stride ``ld`` words.

    Returns ``(a0, a1, a2, a3)`` of this lane (see the module's layout table).
    """
    lane = cuda.threadIdx.x % 32
    g = lane // 4
    t = lane % 4
    top = base + g * ld + t
    bot = top + 8 * ld
    return smem[top], smem[bot], smem[top + 4], smem[bot + 4]


@cuda.jit(device=True)
def load_b_frag(smem, base, ld):
    """B fragment of a 16(k) x 8(n) tile stored as Bᵀ (8 rows of 16 k) at word ``base``.

    Returns ``(b0, b1)`` of this lane.
    """
    lane = cuda.threadIdx.x % 32
    at = base + (lane // 4) * ld + lane % 4
    return smem[at], smem[at + 4]


@cuda.jit(device=True, inline=True)
def _deal(warp, it, nw, total, per_row):
    """Work item ``warp + it * nw`` of ``total`` dealt round-robin to the warps, as ``(real,
    row, col)`` with ``per_row`` items a row; past the end item 0 again with ``real`` False, so
    that every warp runs the same mma count (the twin mma is a CTA-wide step)."""
    item = warp + it * nw
    real = item < total
    if not real:
        item = 0
    return real, item // per_row, item % per_row
