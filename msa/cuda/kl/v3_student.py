"""KL v3, the student pass (``kl_kernel_student``): ``LSE^idx``, the index branch's softmax
normaliser of every (query, slot), on tensor cores.

One of the three passes of the KL v3 rung (``v3_tensor_cores`` has the rung's docstring and the
grad pass, ``v3_dk_idx`` the ``dk_idx`` pass). Per work item of the hot-row schedule (at most
``2 K Bk`` queries of one key block), one CTA loads the block's ``K_idx`` once and walks the
item's queries in tiles of 16 index queries a warp (``STUDENT_WARPS`` warps: 64 queries on the
GPU): ``S^idx = Q_idx K_idxᵀ`` in mma accumulators, masked causally, the row maximum and sum by
quad shuffles. Shapes (uint32 words of two fp16/bf16 values): ``q_idx`` [Tq, Hkv, Didx/2],
``k_idx`` [Tk, Didx/2]; ``part`` [4, K, Tq, Hkv] float32 gets ``(m, l, 0, 0)`` per (slot,
query, KV head), merged in slot order (``msa.cuda.kl._common``).
"""

from __future__ import annotations

import functools

from numba import cuda, float32

from .._core import mma as _mma
from .._core.arrays import SIMULATOR
from .._core.diskcache import kernel_jit
from .._core.memops import (copy16_plain2, copy16_plain3, cp_async16, cp_async_commit,
                            cp_async_wait_all, dynamic_smem_u32, ldmatrix_x4, no_op)
from .._core.mma import exp2, make_mma_pair, mma_bf16_m16n8k16, mma_f16_m16n8k16
from .._core.packed import LN2, check_entry, item_fields, load_entry
from ._state import FULL_MASK, NEG_INF

STUDENT_WARPS = 1 if SIMULATOR else 4  # 16 query positions per warp


def student_layout(block_size, index_dim, positions):
    """The student kernel: sKi [Bk rows] and two buffers of ``positions`` index query rows."""
    ldi = index_dim // 2 + 4
    return ldi, block_size * ldi, 4 * (block_size + 2 * positions) * ldi


@functools.lru_cache(maxsize=None)
def kl_kernel_student(bf16_in: bool, block_size: int, index_dim: int, warps: int,
                      use_async: bool = True):
    """The ``LSE^idx`` pass: per work item, the slot states ``(m, l, 0, 0)`` of its queries.

    One CTA per work item loads K_idx of the key block once; tiles of ``16 warps`` query
    positions (no heads: the index branch has one query per group), each warp 16 of them:
    ``S^idx`` in registers (fp32 mma accumulators), masked causally, the row's maximum and
    ``l = sum exp(S^idx - m)`` by quad shuffles. ``part[0..3, slot, t, h] = (m, l, 0, 0)``
    (``m`` natural-log units), merged in slot order by ``kl_kernel_combine_states``. Each key
    is its own column, masked by selection; a NaN or ``+inf`` logit of a visible key makes
    ``l`` NaN, which the state keeps (``msa.cuda.kl._state``): ``LSE^idx`` NaN."""
    Bk, DI = block_size, index_dim
    NW = warps
    PS = 16 * NW  # positions per tile
    NT = 32 * NW
    assert DI % 16 == 0 and Bk % 16 == 0 and NW <= _mma.MAX_WARPS
    LDI, OFF_Q, _ = student_layout(Bk, DI, PS)
    DIW = DI // 2
    PIECES = DIW // 4
    HALF = PIECES // 2 if PIECES >= 2 else 1
    HALVES = PIECES // HALF  # threads per row: NT = 2 PS threads, two per row
    QBUF = PS * LDI
    NS = Bk // 8
    S_REGS = 4 * NS  # (a local array's size must be a plain constant)
    KS = DI // 16
    mma_pair = make_mma_pair(mma_bf16_m16n8k16 if bf16_in else mma_f16_m16n8k16)
    copy16 = cp_async16 if use_async else copy16_plain3
    copy16_2d = cp_async16 if use_async else copy16_plain2
    commit = cp_async_commit if use_async else no_op
    wait_all = cp_async_wait_all if use_async else no_op

    @kernel_jit
    def _kl_kernel_student_v3(q_idx, k_idx, work, q_indices, slots, cu_q, cu_k,
                              index_scale_log2, part):
        smem = dynamic_smem_u32()
        s_acc = cuda.local.array(S_REGS, float32)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g4 = lane // 4
        t4 = lane % 4
        topk = part.shape[1]
        hkv = q_idx.shape[1]
        h, q_begin, q_count, b, j, key0, nk = item_fields(
            work, cuda.blockIdx.x, q_indices, cu_k, hkv, Bk)
        if q_count <= 0:
            return
        key_pos0 = j * Bk
        q_lo = int(cu_q[b])
        q_hi = int(cu_q[b + 1])
        pos0 = (int(cu_k[b + 1]) - int(cu_k[b])) - (q_hi - q_lo)
        num_tiles = (q_count + PS - 1) // PS
        for e in range(tid, Bk * PIECES, NT):
            c = e // PIECES
            w = (e % PIECES) * 4
            ok = c < nk
            copy16_2d(smem, c * LDI + w, k_idx, (key0 + (c if ok else 0)) * DIW + w,
                      16 if ok else 0)
        g_row = tid // 2
        g_half = tid % 2
        t_raw, s_raw = load_entry(q_indices, slots, h, q_begin, q_count, 0, PS, 1, g_row, PS)
        t_g, _, _ = check_entry(t_raw, s_raw, q_lo, q_hi, pos0, topk)
        if g_half < HALVES:
            src = ((t_g if t_g >= 0 else 0) * hkv + h) * DIW + g_half * HALF * 4
            for u in range(HALF):
                copy16(smem, OFF_Q + g_row * LDI + g_half * HALF * 4 + 4 * u, q_idx,
                       src + 4 * u, 16 if t_g >= 0 else 0)
        commit()
        t_raw, s_raw = load_entry(q_indices, slots, h, q_begin, q_count, 1, PS, 1, g_row, PS)
        r_top = 16 * warp + g4
        r_bot = r_top + 8
        tt_raw, st_raw = load_entry(q_indices, slots, h, q_begin, q_count, 0, PS, 1, r_top, PS)
        tb_raw, sb_raw = load_entry(q_indices, slots, h, q_begin, q_count, 0, PS, 1, r_bot, PS)
        l_rows = ((lane >> 3) & 1) * 8 + (lane & 7)
        a_lane = (16 * warp + l_rows) * LDI + (lane >> 4) * 4
        k_lane = ((lane >> 4) * 8 + (lane & 7)) * LDI + ((lane >> 3) & 1) * 4

        for tile in range(num_tiles):
            buf = tile % 2
            wait_all()
            cuda.syncthreads()
            if tile + 1 < num_tiles:
                t_g, _, _ = check_entry(t_raw, s_raw, q_lo, q_hi, pos0, topk)
                if g_half < HALVES:
                    src = ((t_g if t_g >= 0 else 0) * hkv + h) * DIW + g_half * HALF * 4
                    dst = OFF_Q + (1 - buf) * QBUF + g_row * LDI + g_half * HALF * 4
                    for u in range(HALF):
                        copy16(smem, dst + 4 * u, q_idx, src + 4 * u, 16 if t_g >= 0 else 0)
            commit()
            t_raw, s_raw = load_entry(q_indices, slots, h, q_begin, q_count, tile + 2, PS, 1,
                                       g_row, PS)
            t_top, s_top, pos_top = check_entry(tt_raw, st_raw, q_lo, q_hi, pos0, topk)
            t_bot, s_bot, pos_bot = check_entry(tb_raw, sb_raw, q_lo, q_hi, pos0, topk)
            tt_raw, st_raw = load_entry(q_indices, slots, h, q_begin, q_count, tile + 1, PS, 1,
                                         r_top, PS)
            tb_raw, sb_raw = load_entry(q_indices, slots, h, q_begin, q_count, tile + 1, PS, 1,
                                         r_bot, PS)
            for i in range(4 * NS):
                s_acc[i] = float32(0.0)
            qa = OFF_Q + buf * QBUF + a_lane
            for ks in range(KS):
                a0, a1, a2, a3 = ldmatrix_x4(smem, qa + 8 * ks)
                for n2 in range(NS // 2):
                    b0, b1, b2, b3 = ldmatrix_x4(smem, k_lane + 16 * n2 * LDI + 8 * ks)
                    n = 8 * n2
                    mma_pair(s_acc, n, a0, a1, a2, a3, b0, b1, b2, b3)
            lim_top = min(pos_top - key_pos0, nk - 1)
            lim_bot = min(pos_bot - key_pos0, nk - 1)
            m_top = NEG_INF
            m_bot = NEG_INF
            for i in range(NS):
                for e in range(2):
                    c = 8 * i + 2 * t4 + e
                    x_top = s_acc[4 * i + e] * index_scale_log2
                    x_bot = s_acc[4 * i + 2 + e] * index_scale_log2
                    if c > lim_top:
                        x_top = NEG_INF
                    if c > lim_bot:
                        x_bot = NEG_INF
                    s_acc[4 * i + e] = x_top
                    s_acc[4 * i + 2 + e] = x_bot
                    m_top = max(m_top, x_top)
                    m_bot = max(m_bot, x_bot)
            m_top = max(m_top, cuda.shfl_xor_sync(FULL_MASK, m_top, 1))
            m_bot = max(m_bot, cuda.shfl_xor_sync(FULL_MASK, m_bot, 1))
            m_top = max(m_top, cuda.shfl_xor_sync(FULL_MASK, m_top, 2))
            m_bot = max(m_bot, cuda.shfl_xor_sync(FULL_MASK, m_bot, 2))
            mb_top = m_top if m_top > NEG_INF else float32(0.0)
            mb_bot = m_bot if m_bot > NEG_INF else float32(0.0)
            l_top = float32(0.0)
            l_bot = float32(0.0)
            for i in range(NS):
                for e in range(2):
                    l_top += exp2(s_acc[4 * i + e] - mb_top)
                    l_bot += exp2(s_acc[4 * i + 2 + e] - mb_bot)
            l_top += cuda.shfl_xor_sync(FULL_MASK, l_top, 1)
            l_bot += cuda.shfl_xor_sync(FULL_MASK, l_bot, 1)
            l_top += cuda.shfl_xor_sync(FULL_MASK, l_top, 2)
            l_bot += cuda.shfl_xor_sync(FULL_MASK, l_bot, 2)
            if t4 == 0:
                if t_top >= 0:
                    part[0, s_top, t_top, h] = (m_top * float32(LN2) if not (l_top <= 0)
                                                 else NEG_INF)
                    part[1, s_top, t_top, h] = l_top
                    part[2, s_top, t_top, h] = float32(0.0)
                    part[3, s_top, t_top, h] = float32(0.0)
                if t_bot >= 0:
                    part[0, s_bot, t_bot, h] = (m_bot * float32(LN2) if not (l_bot <= 0)
                                                 else NEG_INF)
                    part[1, s_bot, t_bot, h] = l_bot
                    part[2, s_bot, t_bot, h] = float32(0.0)
                    part[3, s_bot, t_bot, h] = float32(0.0)

    return _kl_kernel_student_v3
