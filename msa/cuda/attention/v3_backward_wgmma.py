"""Backward version 3: version 2's tile on Hopper's warpgroup MMA (``wgmma``).

Version 2 (``v2_backward_tensor_cores``) gives each warp 16 keys of the block and has every warp
read the whole tile's Q and dO from shared memory by ``ldmatrix``, for each of the four products
that take them as B: ~0.74 MB of shared-memory reads a 64-row tile a CTA at the paper's sizes,
about half of the tile's time. Here the CTA's warps are ``Bk / 64`` warpgroups of 64 keys
(warp ``w`` still owns keys ``16w .. 16w + 15``: the register layouts, the masking, the softmax
and the stores are version 2's), and each product of a tile is a few ``wgmma`` whose B the
tensor cores read once a warpgroup (``msa.cuda._core.wgmma``):

* ``Sᵀ = K_g Qᵀ`` and ``dPᵀ = V_g dOᵀ``: ``wgmma.m64n{R}k16``, A (the group's 64 keys of K or V)
  and B (the tile's Q or dO, K-major) both from shared memory;
* ``dV_g += Pᵀ dO`` and ``dK_g += dSᵀ Q``: ``wgmma.m64n{D}k16``, A = the packed ``Pᵀ`` / ``dSᵀ``
  fragments in registers (version 2's), B = dO / Q N-major;
* ``dQ_tile = dS K``: each warpgroup the tile's 64 rows x ``D / groups`` dims,
  ``wgmma.m64n{D/groups}k16``, A = dS by ``ldmatrix.trans`` of the dSᵀ buffer (version 2's), B
  = K N-major; stored unscaled to the rows' partial slots, as in version 2.

So K, V, Q and dO live in shared memory as 8 x 8 core matrices (``core_word``), which
``cp.async`` writes directly; they are made visible to the tensor cores' async proxy by
``fence.proxy.async`` before the barrier that precedes their first read. A tile is 64 rows
(``R = 64``, ``P = 64 / G`` CSR entries) on the GPU and in the simulator (a ``wgmma`` is 64 rows).

Non-finite K (docs/design.md §3, version 2's rules): ``Sᵀ`` reads K as stored; ``dQ = dS K``
needs K with its non-finite halves made +0, which version 2 cleans in the B fragments. Here the
tensor cores read B from shared memory, so a block that holds a non-finite K (found once, as in
version 2) writes a cleaned copy of its K (``sKc``) and dQ reads that; the NaN patches of the
stores and of dSᵀ are version 2's. Every other block never touches ``sKc``.

Limits: float16/bfloat16; ``Bk`` 64 or 128 (warpgroups of 64 keys); ``D`` a multiple of 16 up
to 128 (dK, dV in registers); a GPU of compute capability 9.0 (the simulator runs the ``wgmma``
twins, where version 3 gives version 2's bits).
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32, int64, uint32, uint64

from .._core import wgmma as _wgmma
from .._core.arrays import SIMULATOR
from .._core.memops import dynamic_smem_u32, ldmatrix_x4_trans, store_f32x2, store_u32
from .._core.mma import pack_bf16x2
from ._backward_parts import bwd_part
from ._backward_tile import core_layout, tile
from .._core.diskcache import kernel_jit

TILE_ROWS = 64  # a wgmma's M (dQ's rows), so also in the simulator
MAX_HEAD_DIM = 128
BLOCK_SIZES = (64, 128)  # warpgroups of 64 keys
_NAN = float32(math.nan)


layout = core_layout  # (the launcher sizes version 3's shared memory by it)


@functools.lru_cache(maxsize=None)
def backward_kernel_v3(block_size: int, head_dim: int, group: int, bf16_in: bool,
                       use_async: bool, bf16_dq: bool = False):
    """The dK/dV/dQ kernel for (Bk, D, G, input kind, ``cp.async`` or plain loads, bf16 dQ
    partials), with version 2's arguments (``backward_kernel_v2``) and launch (``Bk / 16``
    warps a CTA)."""
    Bk, D, G, R = block_size, head_dim, group, TILE_ROWS
    assert Bk in BLOCK_SIZES and D % 16 == 0 and D <= MAX_HEAD_DIM and R % G == 0
    T = tile(Bk, D, G, R, bf16_in, use_async, core_matrices=True)
    NT, P, LDS, OFF_V, OFF_KC, OFF_Q = T.NT, T.P, T.LDS, T.OFF_V, T.OFF_KC, T.OFF_Q
    OFF_DO, OFF_DS, QB, DSB, NS, NO = T.OFF_DO, T.OFF_DS, T.QB, T.DSB, T.NS, T.NO
    NWG = Bk // 64  # warpgroups: 64 keys each
    KS = D // 16  # k-steps of Sᵀ, dPᵀ
    KR = R // 16  # k-steps of dV, dK (16 rows each)
    KB = Bk // 16  # k-steps of dQ (16 keys each)
    NDQ = D // NWG  # dims of dQ a warpgroup
    S_REGS, F_REGS, O_REGS, Q_REGS, A_REGS = 4 * NS, 2 * NS, 4 * NO, NDQ // 2, 4 * KB
    ab = "bf16" if bf16_in else "f16"
    wg_s = _wgmma.make_wgmma_ss(R, ab)  # Sᵀ, dPᵀ: A = K_g / V_g, B = Qᵀ / dOᵀ (K-major)
    wg_o = _wgmma.make_wgmma_rs(D, ab, 1)  # dV, dK: A = Pᵀ / dSᵀ fragments, B = dO / Q
    wg_q = _wgmma.make_wgmma_rs(NDQ, ab, 1)  # dQ: A = dS fragments, B = K (N-major)
    wait_s = _wgmma.make_wgmma_wait(S_REGS)
    wait_o = _wgmma.make_wgmma_wait(O_REGS)
    wait_q = _wgmma.make_wgmma_wait(Q_REGS)
    wait_all = T.wait_all
    stage_first, stage_next, row_limit = T.stage_first, T.stage_next, T.row_limit
    load_kv, find_bad_keys = T.load_kv, T.find_bad_keys
    nan_bad_ds, probabilities, store_dkdv = T.nan_bad_ds, T.probabilities, T.store_dkdv
    R3 = 3 * R  # rows of the three tiles' tables (staged, computed, its dQ pending)
    IDX3 = 6 * P  # three tiles' CSR entries: query index and slot each
    BK1 = Bk + 1
    # descriptors (byte offsets / 16): a [rows, D] core-matrix matrix is K-major with the next
    # 8 dims at +128 B and the next 8 rows at +16 D B, N-major the other way round
    ROW8 = 16 * D
    KSTEP = 256 >> 4  # Sᵀ, dPᵀ: the next 16 dims
    RSTEP = (2 * ROW8) >> 4  # dV, dK, dQ: the next 16 rows (keys)
    GROUP_A = (64 * 2 * D) >> 4  # the next warpgroup's 64 keys of K, V
    jit = {} if SIMULATOR else {"launch_bounds": (NT, 1)}
    BF16_DQ = bf16_dq

    @cuda.jit(device=True, inline=True)
    def dq_tile(smem, a_frag, q_acc, dq_part, s_off, s_lim, s_lse, s_kbad, s_kcol, row0,
                kdesc, m, n0, g4, t4, ds_lane):
        """``dQ_tile = dS K``: this warpgroup's dims ``n0 .. n0 + NDQ`` of the tile's 64 rows
        (the warp's m-tile ``m``), into the rows' partial slots; version 2's NaN patches where
        the block holds a non-finite K (``kdesc`` then names sKc)."""
        for kb in range(KB):
            a0, a1, a2, a3 = ldmatrix_x4_trans(smem, ds_lane + 16 * kb * LDS + 8 * m)
            a_frag[4 * kb] = a0
            a_frag[4 * kb + 1] = a1
            a_frag[4 * kb + 2] = a2
            a_frag[4 * kb + 3] = a3
        _wgmma.wgmma_fence()
        for kb in range(KB):
            wg_q(q_acc, a_frag[4 * kb], a_frag[4 * kb + 1], a_frag[4 * kb + 2],
                 a_frag[4 * kb + 3], kdesc + uint64(kb * RSTEP), int32(kb > 0))
        _wgmma.wgmma_commit()
        wait_q(q_acc)
        k_bad = s_kbad[Bk] != 0
        for half in range(2):  # rows 16 m + g4 and 16 m + g4 + 8
            w = uint32(row0) + uint32(16 * m + g4 + 8 * half)
            off = s_off[w]  # the row's dq partial (stage), -1: no query
            if off >= 0:
                lim = row_limit(s_lim, s_lse, w)
                for i in range(NDQ // 8):
                    dcol = uint32(n0 + 8 * i + 2 * t4)
                    x0 = q_acc[4 * i + 2 * half]
                    x1 = q_acc[4 * i + 2 * half + 1]
                    if k_bad:
                        if lim >= s_kcol[dcol]:
                            x0 = _NAN
                        if lim >= s_kcol[dcol + uint32(1)]:
                            x1 = _NAN
                    if BF16_DQ:  # (dims dcol, dcol + 1: one word of the uint32 view)
                        store_u32(dq_part, (uint64(off) + uint64(dcol)) >> uint64(1),
                                  pack_bf16x2(x0, x1))
                    else:
                        store_f32x2(dq_part, uint64(off) + uint64(dcol), x0, x1)

    @kernel_jit(**jit)
    def _attention_bwd_kernel_wgmma(q, k, v, do, lse, delta, row_ptr, q_indices, slots,
                                    row_offsets, cu_q, cu_k, scale, scale_log2, part_ptr,
                                    part_size, dk, dv, dk_part, dv_part, dq_part):
        smem = dynamic_smem_u32()
        s_off = cuda.shared.array(R3, int64)
        s_lim = cuda.shared.array(R3, int32)
        s_lse = cuda.shared.array(R3, float32)
        s_dl = cuda.shared.array(R3, float32)
        s_idx = cuda.shared.array(IDX3, int32)  # three tiles' CSR entries (fetch_entries)
        s_kbad = cuda.shared.array(BK1, int32)
        s_kcol = cuda.shared.array(D, int32)
        s_acc = cuda.local.array(S_REGS, float32)  # Sᵀ, then Pᵀ
        dp_acc = cuda.local.array(S_REGS, float32)  # dPᵀ, then dSᵀ
        p_frag = cuda.local.array(F_REGS, uint32)
        ds_frag = cuda.local.array(F_REGS, uint32)
        dk_acc = cuda.local.array(O_REGS, float32)
        dv_acc = cuda.local.array(O_REGS, float32)
        q_acc = cuda.local.array(Q_REGS, float32)  # dQ (dq_tile)
        a_frag = cuda.local.array(A_REGS, uint32)  # dS's A fragments (dq_tile)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g4 = lane // 4
        t4 = lane % 4
        grp = warp // 4  # this warp's warpgroup: keys 64 grp ..
        hkv = row_ptr.shape[0]
        r, row, part, nparts, b, j, lk, nk, e0, e1 = bwd_part(
            row_ptr, part_ptr, row_offsets, cu_k, part_size, q_indices.shape[1], Bk)
        if e1 <= e0:
            return  # this CTA adds nothing
        key_base = cu_k[b] + j * Bk
        topk = dq_part.shape[0]
        tq = dq_part.shape[1]
        q_lo = cu_q[b]
        q_hi = cu_q[b + 1]
        pos0 = lk - (q_hi - q_lo) - q_lo  # a query t of the sequence sits at key position pos0 + t
        key_pos0 = j * Bk

        load_kv(smem, k, v, key_base, nk, r, hkv, tid)
        for i in range(O_REGS):
            dk_acc[i] = float32(0.0)
            dv_acc[i] = float32(0.0)
        # ldmatrix.trans rows of this lane for dS's A fragments (version 2's)
        ds_lane = ((lane >> 4) * 8 + (lane & 7)) * LDS + ((lane >> 3) & 1) * 4
        key_top = 16 * warp + g4  # this lane's keys in the C layout of Sᵀ
        key_bot = key_top + 8
        k_desc = _wgmma.smem_desc(_wgmma.shared_address(smem, 0), 128, ROW8) \
            + uint64(grp * GROUP_A)
        v_desc = _wgmma.smem_desc(_wgmma.shared_address(smem, OFF_V), 128, ROW8) \
            + uint64(grp * GROUP_A)

        stage_first(smem, s_off, s_lim, s_lse, s_dl, s_idx, q, do, lse, delta, q_indices, slots,
                    tq, r, e0, e1, q_lo, q_hi, pos0, key_pos0, nk, topk, tid)
        # non-finite K: version 2's test, then (the slow path) also the cleaned copy sKc,
        # which dQ then reads instead of sK
        k_bad = find_bad_keys(smem, s_kbad, s_kcol, tid)
        # dQ's B: this warpgroup's dims of K (or sKc), N-major
        n0 = grp * NDQ
        kq_desc = _wgmma.smem_desc(_wgmma.shared_address(smem, OFF_KC if k_bad != 0 else 0),
                                   ROW8, 128) + uint64((n0 // 8 * 128) >> 4)
        m = warp % 4  # the warp's 16 rows of dQ
        for c0 in range(e0, e1, P):
            it = (c0 - e0) // P
            cur = it % 2
            wait_all()
            _wgmma.fence_proxy_async()  # this thread's copies (and sKc) for the tensor cores
            # (A) this tile's rows (and K/V) landed, and every warp is done with tile i - 1's
            # products (its Q/dO buffer) and tile i - 2's dQ (its dSᵀ buffer and table)
            cuda.syncthreads()
            stage_next(smem, s_off, s_lim, s_lse, s_dl, s_idx, q, do, lse, delta, q_indices,
                       slots, tq, r, c0, it, e1, q_lo, q_hi, pos0, key_pos0, nk, topk, tid)
            qo = OFF_Q + cur * QB
            doo = OFF_DO + cur * QB
            row0 = (it % 3) * R  # this tile's rows in the tables
            ds0 = OFF_DS + cur * DSB
            # Sᵀ = K_g Qᵀ, dPᵀ = V_g dOᵀ
            q_k = _wgmma.smem_desc(_wgmma.shared_address(smem, qo), 128, ROW8)
            do_k = _wgmma.smem_desc(_wgmma.shared_address(smem, doo), 128, ROW8)
            _wgmma.wgmma_fence()
            for ks in range(KS):
                wg_s(s_acc, k_desc + uint64(ks * KSTEP), q_k + uint64(ks * KSTEP),
                     int32(ks > 0))
            for ks in range(KS):
                wg_s(dp_acc, v_desc + uint64(ks * KSTEP), do_k + uint64(ks * KSTEP),
                     int32(ks > 0))
            _wgmma.wgmma_commit()
            wait_s(s_acc)
            wait_s(dp_acc)
            probabilities(smem, s_acc, dp_acc, p_frag, ds_frag, s_lim, s_lse, s_dl, row0, ds0,
                          key_top, key_bot, t4, scale_log2)
            # dV_g += Pᵀ dO, dK_g += dSᵀ Q
            q_n = _wgmma.smem_desc(_wgmma.shared_address(smem, qo), ROW8, 128)
            do_n = _wgmma.smem_desc(_wgmma.shared_address(smem, doo), ROW8, 128)
            _wgmma.wgmma_fence()
            for kr in range(KR):
                wg_o(dv_acc, p_frag[4 * kr], p_frag[4 * kr + 1], p_frag[4 * kr + 2],
                     p_frag[4 * kr + 3], do_n + uint64(kr * RSTEP), int32(1))
            for kr in range(KR):
                wg_o(dk_acc, ds_frag[4 * kr], ds_frag[4 * kr + 1], ds_frag[4 * kr + 2],
                     ds_frag[4 * kr + 3], q_n + uint64(kr * RSTEP), int32(1))
            _wgmma.wgmma_commit()
            wait_o(dv_acc)
            wait_o(dk_acc)
            if s_kbad[Bk] != 0:  # CTA-uniform: the block holds a non-finite K
                nan_bad_ds(smem, s_kbad, ds0, warp, lane)
            if it > 0:  # the previous tile's dQ
                dq_tile(smem, a_frag, q_acc, dq_part, s_off, s_lim, s_lse, s_kbad, s_kcol,
                        ((it + 2) % 3) * R, kq_desc, m, n0, g4, t4,
                        OFF_DS + (1 - cur) * DSB + ds_lane)
        last = (e1 - 1 - e0) // P
        cuda.syncthreads()  # the last tile's dSᵀ complete
        dq_tile(smem, a_frag, q_acc, dq_part, s_off, s_lim, s_lse, s_kbad, s_kcol,
                (last % 3) * R, kq_desc, m, n0, g4, t4, OFF_DS + (last % 2) * DSB + ds_lane)
        store_dkdv(dk, dv, dk_part, dv_part, dk_acc, dv_acc, part_ptr, hkv, r, row, part,
                   nparts, key_base, key_top, key_bot, nk, t4, scale)

    return _attention_bwd_kernel_wgmma
