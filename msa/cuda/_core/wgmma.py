"""Hopper's warpgroup MMA (``wgmma.mma_async``) for msa's kernels, through inline PTX.

Four consecutive warps (a *warpgroup*, 128 threads whose first warp index is a multiple of 4)
multiply a 64-row A by an N-column B together, asynchronously, with B read straight from
shared memory (no ``ldmatrix``)::

    D[64 x N] (+)= A[64 x 16] B[16 x N]          (bf16/fp16 in, fp32 accumulate)

``make_wgmma_rs`` takes A in registers (K1 v4: Q's fragments by ``ldmatrix``, P from the
softmax), ``make_wgmma_ss`` from shared memory too (the index kernel's queries, loaded once).

Register layouts (PTX ISA, "Register Fragments", ``wgmma.mma_async.m64nNk16``): warp ``w`` of
the warpgroup holds rows ``16w .. 16w + 15``; inside a warp A is exactly the A fragment of
``mma.sync.m16n8k16`` (``msa.cuda._core.mma``'s table, four uint32 registers), and the ``N/2``
fp32 accumulators are the m16n8 C fragments of the ``N/8`` n-tiles one after the other
(``d[4i .. 4i+3]``: n-tile ``i``, rows ``g`` and ``g + 8``, columns ``8i + 2t``, ``+1``).
So a kernel written for ``mma.sync`` keeps its fragment bookkeeping.

B in shared memory is named by a 64-bit *matrix descriptor* (``smem_desc``): start address,
leading and stride byte offsets, no swizzle. msa stores a ``[rows, D]`` 16-bit matrix (K or V
of a block) as 8 x 8 *core matrices* of 128 contiguous bytes (8 rows of 16 bytes):
``core_word(r, w, D)`` is the uint32 word of row ``r``, word ``w`` (a multiple of 4) of that
layout. The same bytes serve both uses:

* ``S = Q Kᵀ``, B = Kᵀ (K-major, ``trans_b = 0``): next core matrix along k (the next 8
  dims) at +128 bytes (leading offset), along n (the next 8 keys) at +16 D bytes (stride).
* ``O = P V``, B = V (N-major, ``trans_b = 1``): along k (the next 8 keys) +16 D bytes
  (leading), along n (the next 8 dims) +128 bytes (stride).

Ordering (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Operation"):
``wgmma_fence()`` before the first ``wgmma`` that reads registers written by other
instructions (A fragments, zeroed accumulators); ``wgmma_commit()`` after the batch;
``wgmma_wait(acc)`` before the accumulators are read: the accumulators are in-out operands of
the wait's ``asm``, so that no read of them can be scheduled above it. Shared memory written through the
generic proxy (``st.shared``, ``cp.async``) must be followed by ``fence_proxy_async()`` and
a barrier before a ``wgmma`` reads it.

On a GPU these need compute capability 9.0 (``sm_90a``), and a launcher asks
``why_not_available()`` first. In the simulator (no inline PTX) each has a twin with the same
call: a ``wgmma`` meets its warp's lanes once (``simwarp.exchange``: their 16 rows of A and their
accumulators), reads B (and A of ``make_wgmma_ss``) from the block's dynamic shared memory by
decoding the descriptor with the addressing above, and computes the warp's D at issue, k in
order with each product and sum rounded to float32, as the ``mma.sync`` twin does: a kernel on
``wgmma`` and its ``mma.sync`` sibling give the same bits there. The fences, the commit and the
wait do nothing (a twin is complete when it returns), so the simulator cannot catch a read of
the accumulators before the wait or a shared-memory write that misses its proxy fence; the GPU
tests do. A descriptor that points past the shared memory raises ``IndexError``.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from .arrays import SIMULATOR, require_gpu


def why_not_available():
    """Why ``wgmma`` cannot run on the current device, or None: on a GPU it needs compute
    capability 9.0; the simulator runs the twins."""
    if SIMULATOR:
        return None  # the twins
    require_gpu()
    return _why_not_on(cuda.get_current_device().id)


@functools.lru_cache(maxsize=None)
def _why_not_on(device_id: int):
    cc = cuda.get_current_device().compute_capability
    if cc != (9, 0):
        return f"compute capability {cc[0]}.{cc[1]} (wgmma is sm_90a's)"
    return None


@cuda.jit(device=True, inline=True)
def core_word(r, w, d):
    """Word (uint32) offset of row ``r``, word ``w`` (a multiple of 4) of a ``[rows, d]``
    16-bit matrix stored as 8 x 8 core matrices (8 rows of 16 bytes each, 128 bytes)."""
    return (r >> 3) * (4 * d) + (w >> 2) * 32 + (r & 7) * 4


if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    _F32 = ir.FloatType()
    _I32 = ir.IntType(32)
    _I64 = ir.IntType(64)

    @intrinsic
    def shared_address(typingctx, a, flat):
        """32-bit shared-window address of the shared uint32 ``a.flat[flat]``."""
        if not (isinstance(a, types.Array) and a.dtype == types.uint32
                and isinstance(flat, types.Integer)):
            return None
        sig = types.uint32(a, flat)

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            idx = context.cast(builder, args[1], signature.args[1], types.intp)
            ptr = builder.bitcast(builder.gep(ary.data, [idx]), ir.IntType(8).as_pointer())
            return builder.ptrtoint(builder.addrspacecast(ptr, ir.IntType(8).as_pointer(3)),
                                    _I32)

        return sig, codegen

    def _statement(text):
        @intrinsic
        def _stmt(typingctx):
            def codegen(context, builder, signature, args):
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}",
                                   side_effect=True)
                builder.call(asm, [])
                return context.get_dummy_value()

            return types.void(), codegen

        return _stmt

    wgmma_fence = _statement("wgmma.fence.sync.aligned;")
    wgmma_commit = _statement("wgmma.commit_group.sync.aligned;")
    fence_proxy_async = _statement("fence.proxy.async.shared::cta;")

    def _acc_pointers(context, builder, aryty, ary, n, offset=0):
        arr = context.make_array(aryty)(context, builder, ary)
        return [builder.gep(arr.data, [ir.Constant(_I64, offset + i)]) for i in range(n)]

    @functools.lru_cache(maxsize=None)
    def make_wgmma_wait(nacc: int):
        """``wgmma_wait(acc)``: ``wgmma.wait_group 0`` with ``acc[0:nacc]`` passed through it
        (in and out), so that reads of the accumulators stay below the wait."""

        @intrinsic
        def _wait(typingctx, acc):
            if not (isinstance(acc, types.Array) and acc.dtype == types.float32):
                return None

            def codegen(context, builder, signature, args):
                ptrs = _acc_pointers(context, builder, signature.args[0], args[0], nacc)
                vals = [builder.load(p) for p in ptrs]
                cons = ",".join(["=f"] * nacc + [str(i) for i in range(nacc)]) + ",~{memory}"
                fnty = ir.FunctionType(ir.LiteralStructType([_F32] * nacc), [_F32] * nacc)
                asm = ir.InlineAsm(fnty, "wgmma.wait_group.sync.aligned 0;", cons,
                                   side_effect=True)
                res = builder.call(asm, vals)
                for i, p in enumerate(ptrs):
                    builder.store(builder.extract_value(res, i), p)
                return context.get_dummy_value()

            return types.void(acc), codegen

        return _wait

    @functools.lru_cache(maxsize=None)
    def make_wgmma_rs(n: int, ab_type: str, trans_b: int):
        """``wgmma_rs(acc, a0, a1, a2, a3, desc_b, accumulate)``: ``wgmma.mma_async.sync.aligned
        .m64n{n}k16.f32.{ab_type}.{ab_type}`` with A in registers and B named by ``desc_b``;
        ``acc[0:n/2]`` += A B, or = A B where ``accumulate`` is 0. Issues only: results are
        there after ``wgmma_commit()`` and ``make_wgmma_wait(n // 2)(acc)``."""
        assert n % 8 == 0 and 8 <= n <= 256 and ab_type in ("bf16", "f16") and trans_b in (0, 1)
        nacc = n // 2

        @intrinsic
        def _wgmma(typingctx, acc, a0, a1, a2, a3, desc_b, accumulate):
            if not (isinstance(acc, types.Array) and acc.dtype == types.float32):
                return None
            sig = types.void(acc, types.uint32, types.uint32, types.uint32, types.uint32,
                             types.uint64, types.int32)

            def codegen(context, builder, signature, args):
                ptrs = _acc_pointers(context, builder, signature.args[0], args[0], nacc)
                vals = [builder.load(p) for p in ptrs]
                d = ",".join(f"${i}" for i in range(nacc))
                a = ",".join(f"${2 * nacc + i}" for i in range(4))
                text = ("{ .reg .pred p; setp.ne.b32 p, $%d, 0; "
                        "wgmma.mma_async.sync.aligned.m64n%dk16.f32.%s.%s {%s}, {%s}, $%d, p, "
                        "1, 1, %d; }" % (2 * nacc + 5, n, ab_type, ab_type, d, a,
                                         2 * nacc + 4, trans_b))
                cons = ",".join(["=f"] * nacc + [str(i) for i in range(nacc)]
                                + ["r"] * 4 + ["l", "r"]) + ",~{memory}"
                fnty = ir.FunctionType(ir.LiteralStructType([_F32] * nacc),
                                       [_F32] * nacc + [_I32] * 4 + [_I64, _I32])
                asm = ir.InlineAsm(fnty, text, cons, side_effect=True)
                res = builder.call(asm, vals + list(args[1:5]) + [args[5], args[6]])
                for i, p in enumerate(ptrs):
                    builder.store(builder.extract_value(res, i), p)
                return context.get_dummy_value()

            return sig, codegen

        return _wgmma

    @functools.lru_cache(maxsize=None)
    def make_wgmma_ss(n: int, ab_type: str, acc_offset: int = 0):
        """``wgmma_ss(acc, desc_a, desc_b, accumulate)``: as ``make_wgmma_rs`` (B K-major) with
        A (64 x 16, K-major) read from shared memory too, named by ``desc_a``; the
        accumulators are ``acc.flat[acc_offset : acc_offset + n/2]``."""
        assert n % 8 == 0 and 8 <= n <= 256 and ab_type in ("bf16", "f16")
        nacc = n // 2

        @intrinsic
        def _wgmma(typingctx, acc, desc_a, desc_b, accumulate):
            if not (isinstance(acc, types.Array) and acc.dtype == types.float32):
                return None
            sig = types.void(acc, types.uint64, types.uint64, types.int32)

            def codegen(context, builder, signature, args):
                ptrs = _acc_pointers(context, builder, signature.args[0], args[0], nacc,
                                     acc_offset)
                vals = [builder.load(p) for p in ptrs]
                d = ",".join(f"${i}" for i in range(nacc))
                text = ("{ .reg .pred p; setp.ne.b32 p, $%d, 0; "
                        "wgmma.mma_async.sync.aligned.m64n%dk16.f32.%s.%s {%s}, $%d, $%d, p, "
                        "1, 1, 0, 0; }" % (2 * nacc + 2, n, ab_type, ab_type, d, 2 * nacc,
                                           2 * nacc + 1))
                cons = ",".join(["=f"] * nacc + [str(i) for i in range(nacc)]
                                + ["l", "l", "r"]) + ",~{memory}"
                fnty = ir.FunctionType(ir.LiteralStructType([_F32] * nacc),
                                       [_F32] * nacc + [_I64, _I64, _I32])
                asm = ir.InlineAsm(fnty, text, cons, side_effect=True)
                res = builder.call(asm, vals + [args[1], args[2], args[3]])
                for i, p in enumerate(ptrs):
                    builder.store(builder.extract_value(res, i), p)
                return context.get_dummy_value()

            return sig, codegen

        return _wgmma

else:  # the simulator's twins: the same calls, computed at issue in NumPy
    from . import simwarp as _simwarp
    from .memops import no_op
    from .mma import _A_LANE, _A_REG, _HALF_SHIFT

    def _to_f32(bits, is_bf16):
        if is_bf16:
            return (bits.astype(np.uint32) << 16).view(np.float32)
        return bits.astype(np.uint16).view(np.float16).astype(np.float32)

    def _operand(words, desc, count, trans, is_bf16):
        """``[16, count]`` float32: k x (n of B, or m of A) of the 16-bit operand that ``desc``
        names in ``words`` (the block's dynamic shared memory), by the kernels' core-matrix
        addressing (module docstring): K-major (``trans`` 0) ``(k//8) LBO + (x//8) SBO + (x%8) 16 +
        (k%8) 2`` bytes from the start, MN-major (1) ``(k//8) LBO + (x//8) SBO + (k%8) 16 +
        (x%8) 2``."""
        desc = int(desc)
        start = (desc & 0x3FFF) << 4
        lbo = ((desc >> 16) & 0x3FFF) << 4
        sbo = ((desc >> 32) & 0x3FFF) << 4
        k = np.arange(16)[:, None]
        x = np.arange(count)[None, :]
        inner = (x % 8) * 16 + (k % 8) * 2 if trans == 0 else (k % 8) * 16 + (x % 8) * 2
        at = start + (k // 8) * lbo + (x // 8) * sbo + inner
        if at.max() + 2 > 4 * words.size:
            raise IndexError(f"wgmma operand past the dynamic shared memory ({words.size} "
                             f"words): descriptor {desc:#x}")
        bits = (words[at // 4] >> (16 * ((at % 4) // 2)).astype(np.uint32)) & 0xFFFF
        return _to_f32(bits, is_bf16)

    def _warp_product(lanes, a, b, n, accumulate):
        """The warp's ``D [16, n]`` = C (its lanes' accumulators, or 0) + ``a [16, 16] b [16,
        n]``, k in order, each product and sum rounded to float32 (as the ``mma.sync``
        twin, so that a kernel on either gives the same bits here)."""
        d = np.zeros((16, n), np.float32)
        if accumulate:  # lane 4 g + t holds rows g, g + 8, columns 8 i + 2 t, + 1 of n-tile i
            cs = np.array([lane[4:] for lane in lanes[:32]], dtype=np.float32)
            c = cs.reshape(8, 4, n // 8, 2, 2)  # [g, t, i, row half, e]
            d[:] = c.transpose(3, 0, 2, 1, 4).reshape(16, n)
        for kk in range(16):
            d = d + a[:, kk:kk + 1] * b[kk:kk + 1, :]
        return d

    def _a_of_lanes(lanes, is_bf16):
        regs = np.array([lane[:4] for lane in lanes[:32]], dtype=np.uint32)
        return _to_f32((regs[_A_LANE, _A_REG] >> _HALF_SHIFT[None, :]) & 0xFFFF, is_bf16)

    @cuda.jit(device=True)
    def _scatter(acc, d, nacc, offset):
        lane = cuda.threadIdx.x % 32
        g = lane // 4
        t = lane % 4
        for i in range(nacc // 4):
            acc.flat[offset + 4 * i] = d[g, 8 * i + 2 * t]
            acc.flat[offset + 4 * i + 1] = d[g, 8 * i + 2 * t + 1]
            acc.flat[offset + 4 * i + 2] = d[g + 8, 8 * i + 2 * t]
            acc.flat[offset + 4 * i + 3] = d[g + 8, 8 * i + 2 * t + 1]

    @cuda.jit(device=True)
    def shared_address(a, flat):
        """Here the byte offset of ``a.flat[flat]`` in the dynamic shared memory (``a`` is it:
        ``dynamic_smem_u32()``)."""
        return np.uint32(4 * int(flat))

    wgmma_fence = wgmma_commit = fence_proxy_async = no_op

    @functools.lru_cache(maxsize=None)
    def make_wgmma_wait(nacc):
        @cuda.jit(device=True)
        def _wait(acc):  # the twins complete at issue
            pass

        return _wait

    @functools.lru_cache(maxsize=None)
    def make_wgmma_rs(n: int, ab_type: str, trans_b: int):
        """The twin of the GPU's ``make_wgmma_rs``: one rendezvous of the warp (its 16 rows'
        A fragments and accumulators), B read from shared memory through ``desc_b``."""
        assert n % 8 == 0 and 8 <= n <= 256 and ab_type in ("bf16", "f16") and trans_b in (0, 1)
        nacc = n // 2
        is_bf16 = ab_type == "bf16"

        @cuda.jit(device=True)
        def _wgmma(acc, a0, a1, a2, a3, desc_b, accumulate):
            lanes = _simwarp.exchange((int(a0), int(a1), int(a2), int(a3))
                                      + tuple(float(acc.flat[i]) for i in range(nacc)))
            if len(lanes) == 32:  # the first lane here computes D for all
                b = _operand(cuda.shared.array(0, types.uint32), desc_b, n, trans_b, is_bf16)
                lanes.append(_warp_product(lanes, _a_of_lanes(lanes, is_bf16), b, n,
                                           int(accumulate) != 0))
            _scatter(acc, lanes[32], nacc, 0)

        return _wgmma

    @functools.lru_cache(maxsize=None)
    def make_wgmma_ss(n: int, ab_type: str, acc_offset: int = 0):
        """The twin of the GPU's ``make_wgmma_ss``: A (K-major) and B from shared memory, the
        warp's 16 rows of A those of its place in the warpgroup."""
        assert n % 8 == 0 and 8 <= n <= 256 and ab_type in ("bf16", "f16")
        nacc = n // 2
        is_bf16 = ab_type == "bf16"

        @cuda.jit(device=True)
        def _wgmma(acc, desc_a, desc_b, accumulate):
            lanes = _simwarp.exchange(
                (0, 0, 0, 0) + tuple(float(acc.flat[acc_offset + i]) for i in range(nacc)))
            if len(lanes) == 32:
                rows = 16 * ((cuda.threadIdx.x // 32) % 4)
                words = cuda.shared.array(0, types.uint32)
                a = _operand(words, desc_a, 64, 0, is_bf16)[:, rows:rows + 16].T
                b = _operand(words, desc_b, n, 0, is_bf16)
                lanes.append(_warp_product(lanes, a, b, n, int(accumulate) != 0))
            _scatter(acc, lanes[32], nacc, acc_offset)

        return _wgmma


@cuda.jit(device=True, inline=True)
def smem_desc(address, leading_bytes, stride_bytes):
    """Matrix descriptor (no swizzle) of the core-matrix layout starting at shared ``address``
    (16-byte aligned): bits 0-13 address / 16, 16-29 leading byte offset / 16, 32-45 stride
    byte offset / 16."""
    return (types.uint64((address & 0x3FFFF) >> 4)
            | (types.uint64(leading_bytes >> 4) << types.uint64(16))
            | (types.uint64(stride_bytes >> 4) << types.uint64(32)))


@functools.lru_cache(maxsize=None)
def make_scores_rs(n: int, ab_type: str, ksteps: int):
    """``scores(smem, a_frag, acc, a_word, desc_b)``: ``acc[0:n/2] = A B`` of the warpgroup's
    64 rows over ``16 ksteps`` k, A (a 64-row tile of the dynamic shared memory ``smem``) read
    into ``a_frag`` (``4 ksteps`` uint32) by ``ldmatrix`` from this lane's word ``a_word``
    (+8 words a k-step), B K-major in core matrices named by ``desc_b`` (+256 bytes a k-step):
    K1 v4's ``S = Q Kᵀ`` and the KL teacher's. Issues, commits and waits."""
    from .memops import ldmatrix_x4

    wg = make_wgmma_rs(n, ab_type, 0)
    wait = make_wgmma_wait(n // 2)

    @cuda.jit(device=True, inline=True)
    def scores(smem, a_frag, acc, a_word, desc_b):
        for ks in range(ksteps):
            a0, a1, a2, a3 = ldmatrix_x4(smem, a_word + 8 * ks)
            a_frag[4 * ks] = a0
            a_frag[4 * ks + 1] = a1
            a_frag[4 * ks + 2] = a2
            a_frag[4 * ks + 3] = a3
        wgmma_fence()
        for ks in range(ksteps):
            wg(acc, a_frag[4 * ks], a_frag[4 * ks + 1], a_frag[4 * ks + 2], a_frag[4 * ks + 3],
               desc_b + types.uint64(16 * ks), types.int32(ks > 0))
        wgmma_commit()
        wait(acc)

    return scores
