"""Hopper bulk copies (the TMA's one-dimensional form) and the shared-memory barriers they signal.

A bulk copy moves a contiguous run of global memory into shared memory in one instruction of
one thread, without registers and without a thread per 16 bytes (``cp.async``): the copy
engine counts the bytes it lands on an ``mbarrier`` in shared memory, and the threads that need
the data wait on that barrier's phase. A pipeline of ``n`` buffers keeps ``n`` copies in
flight for the price of one issuing lane. Compute capability 9.0; each function has a
pure-Python twin of the same contract for ``NUMBA_ENABLE_CUDASIM=1``, where a copy lands at
once and a wait returns at once.

=========================================  =====================================================
``mbar_init(bars, i, count)``              ``mbarrier.init``: barrier ``bars[i]`` (a shared
                                           uint64 array) expects ``count`` arrivals a phase
``mbar_fence_init()``                      makes the inits visible to the copy engine (then a
                                           ``syncthreads`` before any thread uses them)
``mbar_arrive_expect_tx(bars, i, nbytes)``  one arrival, and ``nbytes`` more bytes to land,
                                           on ``bars[i]``'s current phase
``mbar_arrive(bars, i)``                    one arrival (a phase with no copy: nothing to land)
``mbar_try_wait(bars, i, parity)``          1 once the phase of parity ``parity`` (0 or 1)
                                           of ``bars[i]`` has completed, else 0 (after a
                                           bounded wait); loop on it. Completion makes the
                                           landed bytes visible to the waiting thread
``bulk_copy(dst, d, src, s, nbytes, bars, i)``  ``cp.async.bulk.shared.global``: ``nbytes``
                                           (a multiple of 16) of the global uint32 array
                                           ``src`` from flat word ``s`` into the shared uint32
                                           array ``dst`` from word ``d`` (both 16-byte aligned),
                                           counted on ``bars[i]``
``fence_proxy_async()``                     orders this thread's earlier shared-memory accesses
                                           before its later bulk copies (a buffer re-filled
                                           after the warp read it)
``lds_u32x4(a, flat)``                      the four uint32 ``a.flat[flat:flat+4]`` of a shared
                                           array in one ``ld.shared.v4.u32`` (``flat`` a
                                           multiple of 4)
=========================================  =====================================================
"""

from __future__ import annotations

from numba import cuda, types

from .arrays import SIMULATOR

if SIMULATOR:
    # The twins count completed phases in the barrier word itself, for barriers of one arrival
    # a phase carrying at most one copy (how msa uses them): the copy lands when issued and
    # completes the phase; a plain arrival completes it too; a wait on parity ``p`` returns 1
    # once the count's parity is no longer ``p``. So a lane that waits does wait for the lane
    # that copies (the simulator runs the lanes as threads).
    @cuda.jit(device=True)
    def mbar_init(bars, i, count):
        """Simulator twin: no phase completed yet (one arrival a phase)."""
        if count != 1:
            raise AssertionError("the simulator's mbarrier takes one arrival a phase")
        bars[i] = 0

    @cuda.jit(device=True)
    def mbar_fence_init():
        """Simulator twin."""

    @cuda.jit(device=True)
    def mbar_arrive_expect_tx(bars, i, nbytes):
        """Simulator twin: the phase completes when the copy lands (``bulk_copy``)."""

    @cuda.jit(device=True)
    def mbar_arrive(bars, i):
        """Simulator twin: the phase completes."""
        bars[i] += 1

    @cuda.jit(device=True)
    def mbar_try_wait(bars, i, parity):
        """Simulator twin: 1 once the phase of parity ``parity`` has completed."""
        return 1 if (int(bars[i]) & 1) != parity else 0

    @cuda.jit(device=True)
    def bulk_copy(dst, d, src, s, nbytes, bars, i):
        """Simulator twin: an immediate copy of ``nbytes // 4`` words, then the phase
        completes."""
        if nbytes % 16 or d % 4 or s % 4:
            raise AssertionError("bulk_copy: sizes and offsets must be multiples of 16 bytes")
        fd = dst.reshape(-1)
        fs = src.reshape(-1)
        for e in range(nbytes // 4):
            fd[d + e] = fs[s + e]
        bars[i] += 1

    @cuda.jit(device=True)
    def fence_proxy_async():
        """Simulator twin."""

    @cuda.jit(device=True)
    def lds_u32x4(a, flat):
        """Simulator twin: the four words."""
        if flat % 4:
            raise AssertionError(f"lds_u32x4: word {flat} is not on a 16-byte boundary")
        f = a.reshape(-1)
        return f[flat], f[flat + 1], f[flat + 2], f[flat + 3]

else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    _I32 = ir.IntType(32)
    _I64 = ir.IntType(64)
    _I8P = ir.IntType(8).as_pointer()

    def _pointer(context, builder, aryty, ary, index, index_ty):
        arr = context.make_array(aryty)(context, builder, ary)
        idx = context.cast(builder, index, index_ty, types.intp)
        return builder.bitcast(builder.gep(arr.data, [idx]), _I8P)

    def _shared(builder, ptr):
        """32-bit shared-window address of a generic pointer into shared memory."""
        return builder.ptrtoint(builder.addrspacecast(ptr, ir.IntType(8).as_pointer(3)), _I32)

    def _global(builder, ptr):
        return builder.ptrtoint(builder.addrspacecast(ptr, ir.IntType(8).as_pointer(1)), _I64)

    def _array(a, dtype):
        return isinstance(a, types.Array) and a.dtype == dtype and a.layout == "C"

    def _ints(*xs):
        return all(isinstance(x, types.Integer) for x in xs)

    def _asm(builder, text, constraints, args, ret=None):
        fnty = ir.FunctionType(ret or ir.VoidType(), [a.type for a in args])
        return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), args)

    def _i32(context, builder, value, ty):
        return context.cast(builder, value, ty, types.int32)

    def _bar(context, builder, sig, args, k=0):
        """Shared address of ``bars[i]`` (arguments ``k``, ``k + 1``)."""
        return _shared(builder, _pointer(context, builder, sig.args[k], args[k], args[k + 1],
                                         sig.args[k + 1]))

    @intrinsic
    def mbar_init(typingctx, bars, i, count):
        if not (_array(bars, types.uint64) and _ints(i, count)):
            return None

        def codegen(context, builder, sig, args):
            _asm(builder, "mbarrier.init.shared::cta.b64 [$0], $1;", "r,r,~{memory}",
                 [_bar(context, builder, sig, args), _i32(context, builder, args[2], sig.args[2])])
            return context.get_dummy_value()

        return types.void(bars, i, count), codegen

    @intrinsic
    def mbar_fence_init(typingctx):
        def codegen(context, builder, sig, args):
            _asm(builder, "fence.mbarrier_init.release.cluster;", "~{memory}", [])
            return context.get_dummy_value()

        return types.void(), codegen

    @intrinsic
    def mbar_arrive_expect_tx(typingctx, bars, i, nbytes):
        if not (_array(bars, types.uint64) and _ints(i, nbytes)):
            return None

        def codegen(context, builder, sig, args):
            _asm(builder, "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;",
                 "r,r,~{memory}",
                 [_bar(context, builder, sig, args), _i32(context, builder, args[2], sig.args[2])])
            return context.get_dummy_value()

        return types.void(bars, i, nbytes), codegen

    @intrinsic
    def mbar_arrive(typingctx, bars, i):
        if not (_array(bars, types.uint64) and _ints(i)):
            return None

        def codegen(context, builder, sig, args):
            _asm(builder, "mbarrier.arrive.shared::cta.b64 _, [$0];", "r,~{memory}",
                 [_bar(context, builder, sig, args)])
            return context.get_dummy_value()

        return types.void(bars, i), codegen

    @intrinsic
    def mbar_try_wait(typingctx, bars, i, parity):
        if not (_array(bars, types.uint64) and _ints(i, parity)):
            return None

        def codegen(context, builder, sig, args):
            text = ("{\n.reg .pred p;\n"
                    "mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2;\n"
                    "selp.u32 $0, 1, 0, p;\n}")
            return _asm(builder, text, "=r,r,r,~{memory}",
                        [_bar(context, builder, sig, args, 0),
                         _i32(context, builder, args[2], sig.args[2])], ret=_I32)

        return types.int32(bars, i, parity), codegen

    @intrinsic
    def bulk_copy(typingctx, dst, d, src, s, nbytes, bars, i):
        if not (_array(dst, types.uint32) and _array(src, types.uint32)
                and _array(bars, types.uint64) and _ints(d, s, nbytes, i)):
            return None

        def codegen(context, builder, sig, args):
            a = sig.args
            dptr = _shared(builder, _pointer(context, builder, a[0], args[0], args[1], a[1]))
            sptr = _global(builder, _pointer(context, builder, a[2], args[2], args[3], a[3]))
            bar = _shared(builder, _pointer(context, builder, a[5], args[5], args[6], a[6]))
            _asm(builder, "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                          " [$0], [$1], $2, [$3];", "r,l,r,r,~{memory}",
                 [dptr, sptr, _i32(context, builder, args[4], a[4]), bar])
            return context.get_dummy_value()

        return types.void(dst, d, src, s, nbytes, bars, i), codegen

    @intrinsic
    def fence_proxy_async(typingctx):
        def codegen(context, builder, sig, args):
            _asm(builder, "fence.proxy.async.shared::cta;", "~{memory}", [])
            return context.get_dummy_value()

        return types.void(), codegen

    @intrinsic
    def lds_u32x4(typingctx, a, flat):
        if not (_array(a, types.uint32) and _ints(flat)):
            return None
        sig = types.UniTuple(types.uint32, 4)(a, flat)

        def codegen(context, builder, signature, args):
            ptr = _shared(builder, _pointer(context, builder, signature.args[0], args[0],
                                            args[1], signature.args[1]))
            res = _asm(builder, "ld.shared.v4.u32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,r",
                       [ptr], ret=ir.LiteralStructType([_I32] * 4))
            outs = [builder.extract_value(res, k) for k in range(4)]
            return context.make_tuple(builder, signature.return_type, outs)

        return sig, codegen
