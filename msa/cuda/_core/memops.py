"""Memory primitives of the kernels (``msa.cuda.select``, ``index``, ``attention``, ``kl``,
``decode``).

Numba has no vector loads, no ``cp.async`` and no ``ldmatrix``. The few the kernels need
are here, each with a pure-Python twin of the same contract for ``NUMBA_ENABLE_CUDASIM=1``
(tensor-core helpers shared with other stages live in ``msa.cuda._core.mma``):

=================================  =============================================================
``load_f32x4(a, flat)``            the four float32 ``a.flat[flat:flat+4]`` of a C-contiguous
                                   array in one 128-bit ``ld.global.nc.v4.f32``; ``flat`` must
                                   be a multiple of 4 and ``a``'s data 16-byte aligned (the
                                   launcher checks ``is_aligned16``); the array is read-only for
                                   the whole kernel
``load_u32x4(a, flat)``            the same for the four uint32 ``a.flat[flat:flat+4]``
                                   (``ld.global.nc.v4.u32``), e.g. eight bf16 values viewed
                                   as uint32 words; same alignment and read-only contract
``store_u32x4(a, flat, w0..w3)``    the four uint32 ``a.flat[flat:flat+4] = w0..w3`` in one
                                   128-bit ``st.global.v4.u32``; ``flat`` a multiple of 4 and
                                   ``a``'s data 16-byte aligned
``store_f32x2(a, flat, x0, x1)``    the two float32 ``a.flat[flat:flat+2] = x0, x1`` of a
                                   C-contiguous array in one 64-bit ``st.global.v2.f32``;
                                   ``flat`` even and ``a``'s data 8-byte aligned
``store_u32(a, flat, w)``          the uint32 ``a.flat[flat] = w`` of a C-contiguous array of
                                   any rank (one ``st.global.u32``), e.g. two bf16 values
``cp_async16(dst, d, src, s, n)``  ``cp.async.cg.shared.global``: 16 bytes (four uint32) of the
                                   global ``src.flat[s:s+4]`` into the shared ``dst.flat[d:d+4]``
                                   without passing through registers; ``n`` (0 or 16) bytes are
                                   read and the rest zero-filled; ``d``/``s`` multiples of 4,
                                   both 16-byte aligned. Visible after ``cp_async_wait_all()``
                                   in the issuing thread and, after a ``syncthreads`` (or a
                                   ``syncwarp`` for the lanes of its warp), to the others
``cp_async4(dst, d, src, s, n)``   ``cp.async.ca.shared.global`` of one 4-byte element: the
                                   global ``src.flat[s]`` into the shared ``dst[d]`` (``n`` 4
                                   or 0: zero-filled); both of a 4-byte dtype (int32, uint32,
                                   float32), ``src`` C-contiguous; visible as ``cp_async16``'s
``cp_async_commit()``              closes the group of copies issued so far
``cp_async_wait_all()``            waits for every committed group of this thread
``cp_async_wait_group(n)``         waits until at most ``n`` (a literal) of this thread's
                                   committed groups are pending: a pipeline of ``n + 2`` stages
``copy16_plain3/2``, ``no_op``     ``cp_async16``'s contract (same arguments) by ordinary
                                   loads and stores, for a [T, H, W] / [T, W] ``src`` whose
                                   data is not 16-byte aligned; ``no_op`` stands in for commit
                                   and wait on that path
``copy4_plain2``                   ``cp_async4``'s contract for a [T, W] ``src``, by a load and
                                   a store
``ldmatrix_x4(a, flat)``           ``ldmatrix.sync.aligned.m8n8.x4.shared.b16``: lane ``l``
                                   names, in ``flat`` (a uint32 index into the shared ``a``,
                                   16-byte aligned), row ``l % 8`` of 8x8 16-bit matrix ``l //
                                   8``; lane ``4 g + t`` receives word ``t`` of row ``g`` of the
                                   four matrices (the mma B/A fragment layout). Called by all
                                   32 lanes together
``ldmatrix_x4_trans(a, flat)``     ``ldmatrix...x4.trans``: the same four matrices, transposed:
                                   lane ``4 g + t`` receives, from each matrix, the 16-bit
                                   elements ``[2t][g]`` (low half) and ``[2t+1][g]`` (high
                                   half), i.e. the mma B fragment of a matrix stored with its
                                   ``k`` index along the rows (V of ``P V`` stored row-major)
``dynamic_smem_u32()``             the kernel's dynamic shared memory (the bytes the launch
                                   asks for, ``launch_smem``) as a uint32 array, 16-byte
                                   aligned on the GPU (``cp_async16``, ``ldmatrix_x4``)
``dynamic_smem_f32()``             the same bytes as float32
=================================  =============================================================

Under the simulator ``cp_async16`` copies at once and ``ldmatrix_x4``/``ldmatrix_x4_trans``
gather the row addresses with ``shfl_sync`` (``msa.cuda._core.simwarp``).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, types

from .arrays import SIMULATOR


def data_address(arr) -> int:
    """Address of ``arr``'s first element (device pointer, or host pointer under the simulator)."""
    if isinstance(arr, np.ndarray):
        return int(arr.ctypes.data)
    iface = getattr(arr, "__cuda_array_interface__", None)
    if iface is not None:
        return int(iface["data"][0])
    return int(arr.device_ctypes_pointer.value or 0)


def is_aligned16(arr) -> bool:
    """Whether ``arr``'s data starts on a 16-byte boundary (what ``load_f32x4`` needs)."""
    return data_address(arr) % 16 == 0


if SIMULATOR:
    from . import simwarp as _simwarp

    _simwarp.install()

    def _flat16(a, flat, name):
        """``a`` flat, once ``flat`` is a multiple of 4 (the 16 bytes it starts are 16-byte
        aligned when ``a``'s data is, which the launchers check with ``is_aligned16``; on the
        GPU a wrong offset faults). The address itself is not read here: that costs ~30 us a
        call in the simulator."""
        if flat % 4:
            raise AssertionError(f"{name}: element {flat} is not on a 16-byte boundary")
        return a.reshape(-1)

    @cuda.jit(device=True)
    def load_f32x4(a, flat):
        """Simulator twin: the four elements as NumPy float32 scalars."""
        f = _flat16(a, flat, "load_f32x4")
        return f[flat], f[flat + 1], f[flat + 2], f[flat + 3]

    @cuda.jit(device=True)
    def load_u32x4(a, flat):
        """Simulator twin: the four elements as NumPy uint32 scalars."""
        f = _flat16(a, flat, "load_u32x4")
        return (np.uint32(f[flat]), np.uint32(f[flat + 1]), np.uint32(f[flat + 2]),
                np.uint32(f[flat + 3]))

    @cuda.jit(device=True)
    def store_u32x4(a, flat, w0, w1, w2, w3):
        """Simulator twin: four element stores."""
        f = _flat16(a, flat, "store_u32x4")
        f[flat] = w0
        f[flat + 1] = w1
        f[flat + 2] = w2
        f[flat + 3] = w3

    @cuda.jit(device=True)
    def store_f32x2(a, flat, x0, x1):
        """Simulator twin: two element stores, once ``flat`` is even."""
        if flat % 2:
            raise AssertionError(f"store_f32x2: element {flat} is not on an 8-byte boundary")
        f = a.reshape(-1)
        f[flat] = x0
        f[flat + 1] = x1

    @cuda.jit(device=True)
    def store_u32(a, flat, w):
        """Simulator twin: one element store."""
        a.reshape(-1)[flat] = w

    @cuda.jit(device=True)
    def cp_async16(dst, d, src, s, nbytes):
        """Simulator twin: an immediate copy (zeros where ``nbytes`` is 0)."""
        fd = _flat16(dst, d, "cp_async16 dst")
        fs = _flat16(src, s, "cp_async16 src") if nbytes > 0 else src.reshape(-1)
        for e in range(4):
            fd[d + e] = fs[s + e] if nbytes > 0 else 0

    @cuda.jit(device=True)
    def cp_async4(dst, d, src, s, nbytes):
        """Simulator twin: an immediate copy (zero where ``nbytes`` is 0)."""
        dst[d] = src.reshape(-1)[s] if nbytes > 0 else 0

    @cuda.jit(device=True)
    def cp_async_commit():
        pass

    @cuda.jit(device=True)
    def cp_async_wait_all():
        pass

    @cuda.jit(device=True)
    def cp_async_wait_group(n):
        """Simulator twin: ``cp_async16`` copies at once, nothing to wait for."""

    @cuda.jit(device=True)
    def ldmatrix_x4(a, flat):
        """Simulator twin: each lane fetches row ``g`` of every matrix from its owner lane
        (every lane's row address in one warp rendezvous, ``_simwarp.exchange``)."""
        lane = cuda.threadIdx.x & 31
        g = lane >> 2
        t = lane & 3
        f = a.reshape(-1)
        rows = _simwarp.exchange(flat)
        return f[rows[g] + t], f[rows[8 + g] + t], f[rows[16 + g] + t], f[rows[24 + g] + t]

    def _trans_word(f, rows, m, g, t):
        """Elements ``[2t][g]`` and ``[2t+1][g]`` of matrix ``m`` as one word (low, high)."""
        lo_row = rows[8 * m + 2 * t]
        hi_row = rows[8 * m + 2 * t + 1]
        shift = 16 * (g & 1)
        lo = (int(f[lo_row + (g >> 1)]) >> shift) & 0xFFFF
        hi = (int(f[hi_row + (g >> 1)]) >> shift) & 0xFFFF
        return np.uint32(lo | (hi << 16))

    @cuda.jit(device=True)
    def ldmatrix_x4_trans(a, flat):
        """Simulator twin: column ``g`` of every matrix, fetched from the lanes owning its rows."""
        lane = cuda.threadIdx.x & 31
        g = lane >> 2
        t = lane & 3
        f = a.reshape(-1)
        rows = _simwarp.exchange(flat)
        return (_trans_word(f, rows, 0, g, t), _trans_word(f, rows, 1, g, t),
                _trans_word(f, rows, 2, g, t), _trans_word(f, rows, 3, g, t))

else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    def _vec4_load(dtype, ir_type):
        """An intrinsic ``(a, flat)`` -> the four ``dtype`` values ``a.flat[flat:flat+4]`` of a
        C-contiguous array in one 128-bit global load."""

        @intrinsic
        def _load(typingctx, a, flat):
            if not (isinstance(a, types.Array) and a.dtype == dtype and a.layout == "C"
                    and isinstance(flat, types.Integer)):
                return None
            sig = types.UniTuple(dtype, 4)(a, flat)

            def codegen(context, builder, signature, args):
                ary = context.make_array(signature.args[0])(context, builder, args[0])
                index = context.cast(builder, args[1], signature.args[1], types.intp)
                ptr = builder.gep(ary.data, [index])
                vec = ir.VectorType(ir_type, 4)
                gptr = builder.addrspacecast(builder.bitcast(ptr, ir.PointerType(vec)),
                                             ir.PointerType(vec, addrspace=1))
                load = builder.load(gptr, align=16)
                # read-only for the kernel's lifetime: lets NVPTX use the non-coherent path (LDG)
                load.set_metadata("invariant.load", builder.module.add_metadata([]))
                outs = [builder.extract_element(load, ir.Constant(ir.IntType(32), k))
                        for k in range(4)]
                return context.make_tuple(builder, signature.return_type, outs)

            return sig, codegen

        return _load

    load_f32x4 = _vec4_load(types.float32, ir.FloatType())
    load_u32x4 = _vec4_load(types.uint32, ir.IntType(32))

    def _vector_store(ir_elem, align):
        """The codegen of ``a.flat[flat:flat+n] = x0..`` (``n`` = the values passed) in one
        ``n``-wide global store of ``ir_elem`` values, ``align`` bytes aligned."""

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            index = context.cast(builder, args[1], signature.args[1], types.intp)
            ptr = builder.gep(ary.data, [index])
            n = len(args) - 2
            vec_t = ir.VectorType(ir_elem, n)
            gptr = builder.addrspacecast(builder.bitcast(ptr, ir.PointerType(vec_t)),
                                         ir.PointerType(vec_t, addrspace=1))
            vec = ir.Constant(vec_t, ir.Undefined)
            for k in range(n):
                x = context.cast(builder, args[2 + k], signature.args[2 + k],
                                 signature.args[0].dtype)
                vec = builder.insert_element(vec, x, ir.Constant(ir.IntType(32), k))
            builder.store(vec, gptr, align=align)
            return context.get_dummy_value()

        return codegen

    def _c_array_of(a, dtype):
        return isinstance(a, types.Array) and a.dtype == dtype and a.layout == "C"

    @intrinsic
    def store_u32x4(typingctx, a, flat, w0, w1, w2, w3):
        """``a.flat[flat:flat+4] = w0..w3`` of a C-contiguous uint32 array in one 128-bit
        global store (``st.global.v4.u32``)."""
        if not (_c_array_of(a, types.uint32) and isinstance(flat, types.Integer)
                and all(isinstance(w, types.Integer) for w in (w0, w1, w2, w3))):
            return None
        return types.void(a, flat, w0, w1, w2, w3), _vector_store(ir.IntType(32), 16)

    @intrinsic
    def store_f32x2(typingctx, a, flat, x0, x1):
        """``a.flat[flat:flat+2] = x0, x1`` of a C-contiguous float32 array in one 64-bit
        global store (``st.global.v2.f32``)."""
        if not (_c_array_of(a, types.float32) and isinstance(flat, types.Integer)
                and all(isinstance(x, types.Float) for x in (x0, x1))):
            return None
        return types.void(a, flat, x0, x1), _vector_store(ir.FloatType(), 8)

    @intrinsic
    def store_u32(typingctx, a, flat, w):
        """``a.flat[flat] = w`` of a C-contiguous uint32 array (``st.global.u32``)."""
        if not (_c_array_of(a, types.uint32) and isinstance(flat, types.Integer)
                and isinstance(w, types.Integer)):
            return None
        return types.void(a, flat, w), _vector_store(ir.IntType(32), 4)

    _I32 = ir.IntType(32)
    _I64 = ir.IntType(64)
    _I8P = ir.IntType(8).as_pointer()

    def _element_pointer(context, builder, aryty, ary, index, index_ty):
        arr = context.make_array(aryty)(context, builder, ary)
        idx = context.cast(builder, index, index_ty, types.intp)
        return builder.bitcast(builder.gep(arr.data, [idx]), _I8P)

    def _shared_address(builder, ptr):
        """32-bit shared-window address of a generic pointer into shared memory."""
        return builder.ptrtoint(builder.addrspacecast(ptr, ir.IntType(8).as_pointer(3)), _I32)

    def _u32_array(a):
        return isinstance(a, types.Array) and a.dtype == types.uint32 and a.layout == "C"

    def _word_array(a):
        return (isinstance(a, types.Array) and a.layout == "C"
                and a.dtype in (types.int32, types.uint32, types.float32))

    def _cp_async(size, qualifier, accepts):
        """The ``cp.async.{qualifier}`` intrinsic of ``size`` bytes: ``(dst, d, src, s,
        nbytes)``, ``dst``/``src`` arrays that ``accepts``, flat element indices ``d``/``s``."""

        @intrinsic
        def _copy(typingctx, dst, d, src, s, nbytes):
            if not (accepts(dst) and accepts(src) and isinstance(d, types.Integer)
                    and isinstance(s, types.Integer) and isinstance(nbytes, types.Integer)):
                return None
            sig = types.void(dst, d, src, s, nbytes)

            def codegen(context, builder, signature, args):
                a = signature.args
                dptr = _element_pointer(context, builder, a[0], args[0], args[1], a[1])
                sptr = _element_pointer(context, builder, a[2], args[2], args[3], a[3])
                gaddr = builder.ptrtoint(
                    builder.addrspacecast(sptr, ir.IntType(8).as_pointer(1)), _I64)
                n = context.cast(builder, args[4], a[4], types.int32)
                fnty = ir.FunctionType(ir.VoidType(), [_I32, _I64, _I32])
                asm = ir.InlineAsm(
                    fnty, f"cp.async.{qualifier}.shared.global [$0], [$1], {size}, $2;",
                    "r,l,r,~{memory}", side_effect=True)
                builder.call(asm, [_shared_address(builder, dptr), gaddr, n])
                return context.get_dummy_value()

            return sig, codegen

        return _copy

    # 16 bytes from global ``src.flat[s:]`` to shared ``dst.flat[d:]`` (uint32 arrays)
    cp_async16 = _cp_async(16, "cg", _u32_array)
    # one 4-byte element from global ``src.flat[s]`` to shared ``dst[d]``
    cp_async4 = _cp_async(4, "ca", _word_array)

    def _asm_statement(text):
        @intrinsic
        def _stmt(typingctx):
            sig = types.void()

            def codegen(context, builder, signature, args):
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}",
                                   side_effect=True)
                builder.call(asm, [])
                return context.get_dummy_value()

            return sig, codegen

        return _stmt

    cp_async_commit = _asm_statement("cp.async.commit_group;")
    cp_async_wait_all = _asm_statement("cp.async.wait_group 0;")

    @intrinsic
    def cp_async_wait_group(typingctx, n):
        """``cp.async.wait_group n`` (``n`` a compile-time constant): at most ``n`` of this
        thread's committed groups still pending."""
        if not isinstance(n, types.IntegerLiteral):
            return None
        count = n.literal_value

        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []),
                               f"cp.async.wait_group {count};", "~{memory}", side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()

        return types.void(n), codegen

    def _ldmatrix(ptx):
        """An intrinsic ``(a, flat)`` -> the four words ``ptx`` (an ``ldmatrix ... .x4`` form)
        gives this lane from the shared ``a`` (row address ``flat`` per lane)."""

        @intrinsic
        def _load(typingctx, a, flat):
            if not (_u32_array(a) and isinstance(flat, types.Integer)):
                return None
            sig = types.UniTuple(types.uint32, 4)(a, flat)

            def codegen(context, builder, signature, args):
                ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1],
                                       signature.args[1])
                fnty = ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I32])
                asm = ir.InlineAsm(fnty, ptx + " {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,r",
                                   side_effect=True)
                res = builder.call(asm, [_shared_address(builder, ptr)])
                outs = [builder.extract_value(res, k) for k in range(4)]
                return context.make_tuple(builder, signature.return_type, outs)

            return sig, codegen

        return _load

    # Four 8x8 b16 matrices into the mma fragment layout; .trans: transposed (the B of P V).
    ldmatrix_x4 = _ldmatrix("ldmatrix.sync.aligned.m8n8.x4.shared.b16")
    ldmatrix_x4_trans = _ldmatrix("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16")


@cuda.jit(device=True)
def copy16_plain3(dst, d, src, s, nbytes):
    """``cp_async16``'s contract by ordinary loads and stores, for a [T, H, W] ``src`` (inputs
    not 16-byte aligned)."""
    dw = src.shape[2]
    row = s // (src.shape[1] * dw)
    head = (s // dw) % src.shape[1]
    w = s % dw
    for e in range(4):
        dst[d + e] = src[row, head, w + e] if nbytes > 0 else np.uint32(0)


@cuda.jit(device=True)
def copy16_plain2(dst, d, src, s, nbytes):
    """As ``copy16_plain3`` for a [T, W] ``src``."""
    row = s // src.shape[1]
    w = s % src.shape[1]
    for e in range(4):
        dst[d + e] = src[row, w + e] if nbytes > 0 else np.uint32(0)


@cuda.jit(device=True)
def copy4_plain2(dst, d, src, s, nbytes):
    """``cp_async4``'s contract by a load and a store, for a [T, W] ``src``."""
    if nbytes > 0:
        dst[d] = src[s // src.shape[1], s % src.shape[1]]
    else:
        dst[d] = 0


@cuda.jit(device=True)
def no_op():
    """``cp_async_commit``/``cp_async_wait_all`` of the plain-copy path: nothing to wait for."""


if SIMULATOR:  # the simulator takes no alignment argument (and needs none)
    @cuda.jit(device=True)
    def dynamic_smem_u32():
        return cuda.shared.array(0, types.uint32)

    @cuda.jit(device=True)
    def dynamic_smem_f32():
        return cuda.shared.array(0, types.float32)
else:
    @cuda.jit(device=True, inline=True)
    def dynamic_smem_u32():
        """The dynamic shared memory as uint32, 16-byte aligned (``cp.async``, ``ldmatrix``)."""
        return cuda.shared.array(0, types.uint32, alignment=16)

    @cuda.jit(device=True, inline=True)
    def dynamic_smem_f32():
        """The same bytes as float32, 16-byte aligned."""
        return cuda.shared.array(0, types.float32, alignment=16)
