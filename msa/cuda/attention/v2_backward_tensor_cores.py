"""Backward version 2: tensor cores, one kernel for all five products of a tile.

Over version 1 (scalar FMAs, dQ in a kernel of its own): one CTA of ``Bk/16`` warps per part of
a k2q CSR row (``_backward_parts``); warp ``w`` owns keys ``16w .. 16w+15`` of the block and
keeps their dK and dV (16 x D fp32) in registers across the part's query tiles. A tile is
``R = P*G`` rows (``P`` CSR entries x the G heads of the KV head); per tile, all with
``mma.sync.m16n8k16`` (fp32 accumulate):

* ``Sᵀ = K_w Qᵀ`` and ``dPᵀ = V_w dOᵀ`` (16 keys x R rows in registers),
* ``Pᵀ = 2**(Sᵀ s log2 e - LSE log2 e)`` under the causal mask, ``dSᵀ = Pᵀ (dPᵀ - D)``; both
  packed to 16-bit pairs are the A fragments of the next two products (the C layout of two
  n-tiles is the A layout of one k-step, as in K1 v3),
* ``dV_w += Pᵀ dO`` and ``dK_w += dSᵀ Q`` (B fragments by ``ldmatrix.trans``),
* dSᵀ goes to shared memory, and ``dQ_tile = dS K`` (A by ``ldmatrix.trans`` of dSᵀ, B by
  ``ldmatrix.trans`` of K) is written, unscaled, to the rows' partial slots ``dq_part[slot, t,
  h, :]`` (each (query, head, slot) has one writer: no atomics), which ``dq_sum_kernel`` adds
  in slot order (as K2 adds the forward's partials). A tile's dQ runs in the next tile's
  iteration, from the other of two dSᵀ buffers (tables of the tiles' rows: three), so that a
  tile takes one CTA barrier, the one before it reads its staged rows.

The bookkeeping is lean, since it runs once a tile beside ~320 ``mma`` a warp: ``TPR`` threads a
row stage its Q and dO, the table keeps each row's dq partial offset (one 64-bit add a store),
and indices are unsigned 32-bit where they can be. No thread waits on a global load inside the
loop: a tile's CSR entries are copied into shared memory two tiles ahead, and its rows' LSE and
D by ``cp.async`` with their Q and dO (``_backward_tile.stage_next``); waiting on those loads
had been ~30% of version 3's stall samples (ncu, 32K, an H100). On an H100 (ncu, 32K) integer
instructions had been half of those executed, the dQ stores a quarter.

Masking by selection (docs/design.md §3): dSᵀ is 0 by selection at a key a row cannot see
(not ``0 * dPᵀ``, which a non-finite V or D makes NaN); Sᵀ, dPᵀ, dV and dK never mix keys, and
rows only mix in ``dQ = dS K``, where a row's 0 at an invisible key times a non-finite K would
be NaN. So, once per CTA after the K block lands, each thread checks the K words it copied (an
and, an add and an or per word) and one ``bar.red.or`` makes the answer CTA-uniform. A block
without a non-finite K (the common path) computes what it computed before, bit for bit; its
cost is that pass and barrier, and a few shared loads and uniform branches per tile. A block with
one (the slow path) records per key whether its K row holds one and per dim the first key whose
K there does; per tile, the K fragments of ``dQ = dS K`` have their non-finite halves made +0
(``_core.finite.clean_*``), the infinite dS of the keys with a non-finite K row become NaN in
dSᵀ (the reference multiplies dS by such a key's zeroed row: its dq row is NaN), and a row that
sees a non-finite ``K[c, d]`` gets NaN in column d (``0 * inf`` there when dS = 0). Its dq has
the reference's NaNs; the rows that see no non-finite key keep their bits.

The part's dK, dV (times ``scale``) are added to ``dk``, ``dv`` (a row of one part: several
query chunks add in turn) or, for a hot row cut into parts, written to the part's scratch slot,
which ``_backward_parts.dkdv_sum_kernel`` adds in part order. P and dS are rounded to the
inputs' 16-bit type before their products, as in FlashAttention's backward. float16/bfloat16,
D and Bk multiples of 16 up to 128 (dK, dV live in registers; a warp per 16 keys).

Where it runs: the default where it applies and version 3 (``v3_backward_wgmma``, the same
tile on ``wgmma``) does not: GPUs other than compute capability 9.0, ``Bk`` other than 64 or
128, the simulator. Verdict (paper configuration, bf16): on an H100
(09fb84d) 32K 37.59 ms, 128K 150.8 ms (140.3 TFLOP/s), 1.21x / 1.26x fla-core's
``parallel_nsa_bwd`` and 2.21x / 8.71x dense SDPA's backward on that card, against 44.24 / 170.4
ms for the kernel before (two barriers a tile, 64-bit offsets per store); on an H200 (1d9bdca,
the kernel before) 42.34 / 159.6 ms, 1.09x / 1.16x fla-core's.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32, int64, uint32, uint64

from .._core import mma as _mma
from .._core.arrays import SIMULATOR
from .._core.memops import (dynamic_smem_u32, ldmatrix_x4, ldmatrix_x4_trans, load_f32x4,
                            load_u32x4, store_f32x2, store_u32)
from .._core.mma import (bf16_to_f32, make_mma_pair, mma_bf16_m16n8k16, mma_f16_m16n8k16,
                         pack_bf16x2)
from ..csr import is_entry
from ._backward_parts import bwd_part
from ._backward_tile import padded_layout, tile
from .._core.diskcache import kernel_jit

# Tile rows (query positions x G heads): 64 on a GPU (S^T and dP^T of a warp's 16 keys x 64 rows
# are 32 fp32 registers each, beside 128 of dK and dV); the simulator runs every thread in
# Python, so its tiles are as small as the mma allows.
TILE_ROWS = 16 if SIMULATOR else 64
MAX_HEAD_DIM = 128
MAX_BLOCK_SIZE = 128
_NAN = float32(math.nan)


layout = padded_layout  # (the launcher sizes version 2's shared memory by it)


@functools.lru_cache(maxsize=None)
def backward_kernel_v2(block_size: int, head_dim: int, group: int, rows: int, bf16_in: bool,
                       use_async: bool, bf16_dq: bool = False):
    """The dK/dV/dQ kernel for (Bk, D, G, R, input kind, ``cp.async`` or plain loads); see
    the module docstring. Arguments: q, k, v, do as uint32 views [T, H, D/2]; lse, delta
    float32 [Tq, Hq]; the CSR (``row_ptr``, ``q_indices``, ``slots``), ``row_offsets``,
    ``cu_q``, ``cu_k``; ``scale`` and ``scale log2 e``; ``part_ptr``, ``part_size``; dk, dv
    float32 [Tk, Hkv, D]; the scratch ``dk_part``, ``dv_part`` [slots, Bk*D]; ``dq_part``
    float32 [K, Tq, Hq, D], or with ``bf16_dq`` its bf16 values in pairs, uint32 [K, Tq, Hq,
    D/2] (round to nearest even)."""
    Bk, D, G, R = block_size, head_dim, group, rows
    assert Bk % 16 == 0 and D % 16 == 0 and R % 16 == 0 and R % G == 0
    T = tile(Bk, D, G, R, bf16_in, use_async, core_matrices=False)
    NW, NT, P, LD, LDS, OFF_V, OFF_DS = T.NW, T.NT, T.P, T.LD, T.LDS, T.OFF_V, T.OFF_DS
    OFF_Q, OFF_DO, QB, DSB, NS, NO = T.OFF_Q, T.OFF_DO, T.QB, T.DSB, T.NS, T.NO
    assert NW <= _mma.MAX_WARPS
    KS = D // 16  # k-steps of Sᵀ, dPᵀ
    KR = R // 16  # k-steps of dV, dK (16 rows each); also the m-tiles of dQ
    KB = Bk // 16  # k-steps of dQ (16 keys each)
    PAIRS = KR * (NO // 2)  # (m-tile, n-tile pair) units of dQ, spread over the warps
    ROUNDS = -(-PAIRS // NW)
    # a warp's dQ units share their n-tile pair (so one K fragment a k-step) when the units
    # of one round fill whole rows of pairs
    SHARED_B = NW % (NO // 2) == 0
    Q_REGS = 8 * ROUNDS
    S_REGS, F_REGS, O_REGS = 4 * NS, 2 * NS, 4 * NO
    mma = mma_bf16_m16n8k16 if bf16_in else mma_f16_m16n8k16
    mma_pair = make_mma_pair(mma)
    clean = T.clean
    wait_all = T.wait_all
    stage_first, stage_next, row_limit = T.stage_first, T.stage_next, T.row_limit
    load_kv, find_bad_keys = T.load_kv, T.find_bad_keys
    nan_bad_ds, probabilities, store_dkdv = T.nan_bad_ds, T.probabilities, T.store_dkdv
    R3 = 3 * R  # rows of the three tiles' tables (staged, computed, its dQ pending)
    IDX3 = 6 * P  # three tiles' CSR entries: query index and slot each
    BK1 = Bk + 1  # the per-key flags of non-finite K, and the block's
    jit = {} if SIMULATOR else {"launch_bounds": (NT, 1)}
    BF16_DQ = bf16_dq

    @cuda.jit(device=True, inline=True)
    def scores(smem, s_acc, dp_acc, a_lane, b_lane, qo, doo):
        """Sᵀ = K_w Qᵀ and dPᵀ = V_w dOᵀ (16 keys x R rows, fp32 registers)."""
        for i in range(S_REGS):
            s_acc[i] = float32(0.0)
            dp_acc[i] = float32(0.0)
        for ks in range(KS):
            a0, a1, a2, a3 = ldmatrix_x4(smem, a_lane + 8 * ks)
            c0_, c1_, c2_, c3_ = ldmatrix_x4(smem, OFF_V + a_lane + 8 * ks)
            for n2 in range(NS // 2):
                n = 8 * n2
                b0, b1, b2, b3 = ldmatrix_x4(smem, qo + b_lane + 16 * n2 * LD + 8 * ks)
                mma_pair(s_acc, n, a0, a1, a2, a3, b0, b1, b2, b3)
                b0, b1, b2, b3 = ldmatrix_x4(smem, doo + b_lane + 16 * n2 * LD + 8 * ks)
                mma_pair(dp_acc, n, c0_, c1_, c2_, c3_, b0, b1, b2, b3)

    @cuda.jit(device=True, inline=True)
    def accumulate(smem, dk_acc, dv_acc, p_frag, ds_frag, qo, doo, t_lane):
        """dV_w += Pᵀ dO, dK_w += dSᵀ Q (B fragments of dO and Q by ldmatrix.trans)."""
        for kr in range(KR):
            for n2 in range(NO // 2):
                n = 8 * n2
                b0, b1, b2, b3 = ldmatrix_x4_trans(smem, doo + t_lane + 16 * kr * LD
                                                   + 8 * n2)
                mma_pair(dv_acc, n, p_frag[4 * kr], p_frag[4 * kr + 1],
                         p_frag[4 * kr + 2], p_frag[4 * kr + 3], b0, b1, b2, b3)
                b0, b1, b2, b3 = ldmatrix_x4_trans(smem, qo + t_lane + 16 * kr * LD
                                                   + 8 * n2)
                mma_pair(dk_acc, n, ds_frag[4 * kr], ds_frag[4 * kr + 1],
                         ds_frag[4 * kr + 2], ds_frag[4 * kr + 3], b0, b1, b2, b3)

    @cuda.jit(device=True, inline=True)
    def unit(warp, rnd):
        """``_core.mma._deal`` of the dQ units in 32-bit unsigned arithmetic: ``(real, m-tile,
        n-tile pair)`` of the warp's unit ``rnd``, unit 0 again past the last."""
        item = uint32(warp) + uint32(rnd * NW)
        real = item < uint32(PAIRS)
        if not real:
            item = uint32(0)
        return real, item // uint32(NO // 2), item % uint32(NO // 2)

    @cuda.jit(device=True, inline=True)
    def dq_tile(smem, q_acc, dq_part, s_off, s_lim, s_lse, s_kbad, s_kcol, row0, warp,
                g4, t4, ds_lane, t_lane):
        """dQ_tile = dS K into the rows' partial slots: units (m-tile, n-tile pair) dealt to
        the warps, ROUNDS each, all of a warp's units at once (``q_acc``: 8 accumulators a
        unit, so that 2 ROUNDS mma chains are in flight, and where the warp's units share their
        n-tile pair, one K fragment load a k-step serves them all); a unit past the last
        computes unit 0 again and stores nothing. Each unit sums its k-steps in order, so its
        values do not depend on how the units interleave. Where the block holds a non-finite K
        (``s_kbad[Bk]``, CTA-uniform) the K fragments are cleaned (non-finite halves +0: a
        row's dS = 0 at a key it cannot see then gives 0), and a row that sees a non-finite
        ``K[c, d]`` (``s_kcol[d]`` within its limit) gets NaN in column d, the reference's
        ``dS K[c, d]`` there (0 * inf, or a non-finite dS)."""
        k_bad = s_kbad[Bk] != 0
        for i in range(8 * ROUNDS):
            q_acc[i] = float32(0.0)
        for kb in range(KB):
            b0 = b1 = b2 = b3 = uint32(0)
            for rnd in range(ROUNDS):
                _, m, n2 = unit(warp, rnd)
                a0, a1, a2, a3 = ldmatrix_x4_trans(smem, ds_lane + 16 * kb * LDS + 8 * m)
                if rnd == 0 or not SHARED_B:
                    b0, b1, b2, b3 = ldmatrix_x4_trans(smem, t_lane + 16 * kb * LD + 8 * n2)
                    if k_bad:
                        b0, _ = clean(b0)
                        b1, _ = clean(b1)
                        b2, _ = clean(b2)
                        b3, _ = clean(b3)
                u = 8 * rnd
                x0, x1, x2, x3 = mma(a0, a1, a2, a3, b0, b1, q_acc[u], q_acc[u + 1],
                                     q_acc[u + 2], q_acc[u + 3])
                q_acc[u] = x0
                q_acc[u + 1] = x1
                q_acc[u + 2] = x2
                q_acc[u + 3] = x3
                x0, x1, x2, x3 = mma(a0, a1, a2, a3, b2, b3, q_acc[u + 4], q_acc[u + 5],
                                     q_acc[u + 6], q_acc[u + 7])
                q_acc[u + 4] = x0
                q_acc[u + 5] = x1
                q_acc[u + 6] = x2
                q_acc[u + 7] = x3
        # the stores in unsigned arithmetic (no negative-index checks, shifts for the
        # power-of-two divisions): one 64-bit add a row from its offset in the table
        for rnd in range(ROUNDS):
            real, m, n2 = unit(warp, rnd)
            if real:
                u = 8 * rnd
                dcol = uint32(16) * n2 + uint32(2 * t4)
                for half in range(2):  # rows 16 m + g4 and 16 m + g4 + 8
                    w = uint32(row0) + uint32(16) * m + uint32(g4 + 8 * half)
                    off = s_off[w]  # the row's dq partial (stage), -1: no query
                    if off >= 0:
                        x0 = q_acc[u + 2 * half]
                        x1 = q_acc[u + 2 * half + 1]
                        x8 = q_acc[u + 4 + 2 * half]
                        x9 = q_acc[u + 5 + 2 * half]
                        if k_bad:
                            lim = row_limit(s_lim, s_lse, w)
                            if lim >= s_kcol[dcol]:
                                x0 = _NAN
                            if lim >= s_kcol[dcol + uint32(1)]:
                                x1 = _NAN
                            if lim >= s_kcol[dcol + uint32(8)]:
                                x8 = _NAN
                            if lim >= s_kcol[dcol + uint32(9)]:
                                x9 = _NAN
                        at = uint64(off) + uint64(dcol)
                        if BF16_DQ:  # one word of the uint32 view a pair of dims
                            store_u32(dq_part, at >> uint64(1), pack_bf16x2(x0, x1))
                            store_u32(dq_part, (at + uint64(8)) >> uint64(1),
                                      pack_bf16x2(x8, x9))
                        else:
                            store_f32x2(dq_part, at, x0, x1)
                            store_f32x2(dq_part, at + uint64(8), x8, x9)

    @kernel_jit(**jit)
    def _attention_bwd_kernel_tc(q, k, v, do, lse, delta, row_ptr, q_indices, slots,
                                 row_offsets, cu_q, cu_k, scale, scale_log2, part_ptr,
                                 part_size, dk, dv, dk_part, dv_part, dq_part):
        smem = dynamic_smem_u32()
        # three tiles' rows: dq partial offset (or -1), mask limit, LSE, D = rowsum(dO O)
        s_off = cuda.shared.array(R3, int64)
        s_lim = cuda.shared.array(R3, int32)
        s_lse = cuda.shared.array(R3, float32)
        s_dl = cuda.shared.array(R3, float32)
        s_idx = cuda.shared.array(IDX3, int32)  # three tiles' CSR entries (fetch_entries)
        # non-finite K values: per key, does its row hold one (and at Bk: does the block),
        # per dim, the first key that holds one there
        s_kbad = cuda.shared.array(BK1, int32)
        s_kcol = cuda.shared.array(D, int32)
        s_acc = cuda.local.array(S_REGS, float32)  # Sᵀ, then Pᵀ
        dp_acc = cuda.local.array(S_REGS, float32)  # dPᵀ, then dSᵀ
        p_frag = cuda.local.array(F_REGS, uint32)
        ds_frag = cuda.local.array(F_REGS, uint32)
        dk_acc = cuda.local.array(O_REGS, float32)
        dv_acc = cuda.local.array(O_REGS, float32)
        q_acc = cuda.local.array(Q_REGS, float32)  # the warp's dQ units (dq_tile)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g4 = lane // 4
        t4 = lane % 4
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
        # ldmatrix row addresses of this lane (matrix lane // 8, row lane % 8 of it):
        # A of K_w / V_w: (rows 0-7, 8-15) x (words 0-3, 4-7); B of Qᵀ / dOᵀ: (words 0-3, 4-7) x
        # (rows 0-7, 8-15), two n-tiles a load; B of dO, Q, K by .trans: (rows 0-7, 8-15) x
        # (words 0-3, 4-7); A of dS from dSᵀ by .trans: (keys 0-7, 8-15) x (words 0-3, 4-7).
        l_rows = ((lane >> 3) & 1) * 8 + (lane & 7)
        a_lane = (16 * warp + l_rows) * LD + (lane >> 4) * 4
        b_lane = ((lane >> 4) * 8 + (lane & 7)) * LD + ((lane >> 3) & 1) * 4
        t_lane = l_rows * LD + (lane >> 4) * 4
        ds_lane = ((lane >> 4) * 8 + (lane & 7)) * LDS + ((lane >> 3) & 1) * 4
        key_top = 16 * warp + g4  # this lane's keys in the C layout of Sᵀ
        key_bot = key_top + 8

        stage_first(smem, s_off, s_lim, s_lse, s_dl, s_idx, q, do, lse, delta, q_indices, slots,
                    tq, r, e0, e1, q_lo, q_hi, pos0, key_pos0, nk, topk, tid)
        find_bad_keys(smem, s_kbad, s_kcol, tid)  # masking by selection for dQ = dS K
        # One barrier a tile: tile i's dQ (which reads every warp's dSᵀ) runs in iteration
        # i + 1, after that iteration's barrier, from the other dSᵀ buffer and a third table.
        for c0 in range(e0, e1, P):
            it = (c0 - e0) // P
            cur = it % 2
            wait_all()
            # (A) this tile's rows (and K/V) landed, and every warp is done with tile i - 1's
            # scores (its Q/dO buffer) and tile i - 2's dQ (its dSᵀ buffer and table); tile
            # i - 1's dSᵀ is complete
            cuda.syncthreads()
            stage_next(smem, s_off, s_lim, s_lse, s_dl, s_idx, q, do, lse, delta, q_indices,
                       slots, tq, r, c0, it, e1, q_lo, q_hi, pos0, key_pos0, nk, topk, tid)
            qo = OFF_Q + cur * QB
            doo = OFF_DO + cur * QB
            row0 = (it % 3) * R  # this tile's rows in the tables
            ds0 = OFF_DS + cur * DSB
            scores(smem, s_acc, dp_acc, a_lane, b_lane, qo, doo)
            probabilities(smem, s_acc, dp_acc, p_frag, ds_frag, s_lim, s_lse, s_dl, row0, ds0,
                          key_top, key_bot, t4, scale_log2)
            accumulate(smem, dk_acc, dv_acc, p_frag, ds_frag, qo, doo, t_lane)
            if s_kbad[Bk] != 0:  # CTA-uniform: the block holds a non-finite K
                nan_bad_ds(smem, s_kbad, ds0, warp, lane)
            if it > 0:  # the previous tile's dQ
                dq_tile(smem, q_acc, dq_part, s_off, s_lim, s_lse, s_kbad, s_kcol,
                        ((it + 2) % 3) * R, warp, g4, t4, OFF_DS + (1 - cur) * DSB + ds_lane,
                        t_lane)
        last = (e1 - 1 - e0) // P
        cuda.syncthreads()  # the last tile's dSᵀ complete
        dq_tile(smem, q_acc, dq_part, s_off, s_lim, s_lse, s_kbad, s_kcol, (last % 3) * R,
                warp, g4, t4, OFF_DS + (last % 2) * DSB + ds_lane, t_lane)
        store_dkdv(dk, dv, dk_part, dv_part, dk_acc, dv_acc, part_ptr, hkv, r, row, part,
                   nparts, key_base, key_top, key_bot, nk, t4, scale)

    return _attention_bwd_kernel_tc


DQ_SUM_SLOTS = 4  # slots whose loads a thread has in flight at once


@functools.lru_cache(maxsize=None)
def dq_sum_kernel(head_dim: int, group: int, bf16_parts: bool = False):
    """``dq[t, h, :] = scale * sum_s dq_part[s, t, h, :]`` over the slots ``s`` that are CSR
    entries (bits of ``slot_mask`` [Tq, Hkv, words], ``msa.cuda.csr.launch_slot_mask``: the
    slots the tensor-core kernel wrote), in slot order.

    A thread per ``W`` dims of a (t, h) row, one 16-byte load a slot: four float32 partials
    (``W = 4``, ``D % 4 == 0``), or with ``bf16_parts`` eight bf16 ones, ``dq_part`` then a
    uint32 view [K, Tq, Hq, D/2] (``W = 8``, ``D % 8 == 0``); launch ``T Hq D / W`` threads.
    The slots go by in groups of ``DQ_SUM_SLOTS``, each group's loads issued before any of them
    is added, so that several are in flight (one at a time, the kernel ran at ~60% of the copy
    bandwidth). The additions keep slot order: the sum is bitwise the same."""

    D, G, U = head_dim, group, DQ_SUM_SLOTS
    if bf16_parts:
        return _dq_sum_bf16(D, G, U)
    NV = D // 4
    UV = 4 * U  # local array sizes must be plain constants on the GPU

    @kernel_jit
    def _attention_bwd_kernel_dq_sum(slot_mask, dq_part, scale, dq):
        vals = cuda.local.array(UV, float32)
        ok = cuda.local.array(U, int32)
        i = cuda.grid(1)
        tq = dq.shape[0]
        hq = dq.shape[1]
        row = i // NV
        if row >= tq * hq:
            return
        v = i % NV
        t = row // hq
        h = row % hq
        topk = dq_part.shape[0]
        stride = int64(tq) * hq * D  # elements from one slot to the next
        at = int64(row) * D + 4 * v
        a0 = float32(0.0)
        a1 = float32(0.0)
        a2 = float32(0.0)
        a3 = float32(0.0)
        for s0 in range(0, topk, U):
            for u in range(U):
                s = s0 + u
                ok[u] = 1 if s < topk and is_entry(slot_mask, t, h // G, s) else 0
                if ok[u]:
                    w0, w1, w2, w3 = load_f32x4(dq_part, s * stride + at)
                    vals[4 * u] = w0
                    vals[4 * u + 1] = w1
                    vals[4 * u + 2] = w2
                    vals[4 * u + 3] = w3
            for u in range(U):
                if ok[u]:
                    a0 += vals[4 * u]
                    a1 += vals[4 * u + 1]
                    a2 += vals[4 * u + 2]
                    a3 += vals[4 * u + 3]
        dq[t, h, 4 * v] = a0 * scale
        dq[t, h, 4 * v + 1] = a1 * scale
        dq[t, h, 4 * v + 2] = a2 * scale
        dq[t, h, 4 * v + 3] = a3 * scale

    return _attention_bwd_kernel_dq_sum


def _dq_sum_bf16(D, G, U):
    """``dq_sum_kernel`` of bf16 partials: eight a thread, ``dq_part`` uint32 [K, Tq, Hq, D/2]
    (two bf16 values a word, the lower dim in the low half)."""
    NV = D // 8
    UV = 8 * U
    DW = D // 2  # words of a partial row

    @kernel_jit
    def _attention_bwd_kernel_dq_sum_bf16(slot_mask, dq_part, scale, dq):
        vals = cuda.local.array(UV, float32)
        ok = cuda.local.array(U, int32)
        acc = cuda.local.array(8, float32)
        i = cuda.grid(1)
        tq = dq.shape[0]
        hq = dq.shape[1]
        row = i // NV
        if row >= tq * hq:
            return
        v = i % NV
        t = row // hq
        h = row % hq
        topk = dq_part.shape[0]
        stride = int64(tq) * hq * DW  # words from one slot to the next
        at = int64(row) * DW + 4 * v
        for x in range(8):
            acc[x] = float32(0.0)
        for s0 in range(0, topk, U):
            for u in range(U):
                s = s0 + u
                ok[u] = 1 if s < topk and is_entry(slot_mask, t, h // G, s) else 0
                if ok[u]:
                    w0, w1, w2, w3 = load_u32x4(dq_part, s * stride + at)
                    for y in range(4):
                        w = w0 if y == 0 else (w1 if y == 1 else (w2 if y == 2 else w3))
                        vals[8 * u + 2 * y] = bf16_to_f32(w & uint32(0xFFFF))
                        vals[8 * u + 2 * y + 1] = bf16_to_f32(w >> uint32(16))
            for u in range(U):
                if ok[u]:
                    for x in range(8):
                        acc[x] += vals[8 * u + x]
        for x in range(8):
            dq[t, h, 8 * v + x] = acc[x] * scale

    return _attention_bwd_kernel_dq_sum_bf16
