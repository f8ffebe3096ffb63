"""K1 version 4: version 3's register tile on Hopper's warpgroup MMA (``wgmma``).

Over version 3 (``mma.sync`` per warp, K and V fragments by ``ldmatrix``): each 4-warp group of
a 64-row tile is one warpgroup; ``S = Q Kᵀ`` is ``KS`` ``wgmma.m64n{Bk}k16`` with Q's A
fragments in registers (``ldmatrix``) and K read by the tensor cores straight from shared
memory, ``O = P V`` is ``KP`` ``wgmma.m64n{D/parts}k16`` with P in registers and V from shared
memory (``msa.cuda._core.wgmma``); K and V are stored as 8 x 8 core matrices (no ``ldmatrix``
for them at all). The fragment layouts are those of ``mma.sync``, so the mask, the softmax, the
stores and the warp groups are version 3's (``_tile``), and so are the results (bitwise, on the
paper configuration at 128K).

Compute capability 9.0 on a GPU (the simulator runs the ``wgmma`` twins, not by default);
64-row tiles; fp16/bf16, D and Bk multiples of 16 up to 128. Masking by selection inside the block is version 3's (``_tile.clean_v`` on the
core-matrix layout before the async-proxy fence and the ``syncthreads_or`` barrier, ``fix_o``
after a flagged block's stores), so the results stay version 3's on non-finite values too.

Where it runs: the default on compute capability 9.0 (H100, H200). Verdict (H200, paper
configuration at 128K): K1 3.9-4.2 ms a 16K-query chunk against 4.6-5.0 for version 3; the
sparse attention 41.4 ms (204 TFLOP/s) end to end.
"""

from __future__ import annotations

import functools

from numba import cuda, float32, int32, uint32, uint64

from .._core import wgmma as _wgmma
from .._core.memops import dynamic_smem_u32
from .._core.packed import check_entry, item_reader, load_entry
from ._tile import tile as tile_functions
from .._core.diskcache import kernel_jit


@functools.lru_cache(maxsize=None)
def k1_kernel_v4(block_size: int, head_dim: int, group: int, positions: int, bf16_in: bool,
                 bf16_partials: bool = False, use_async: bool = True, o_parts: int = 1,
                 groups: int = 1, vector_stores: bool = False, paged: bool = False):
    """K1 v4 specialised as ``k1_kernel_v3`` (same arguments and kernel arguments), for tiles
    of ``positions * group = 64`` rows: a warp group is one warpgroup."""
    T = tile_functions(block_size, head_dim, group, positions, bf16_in, bf16_partials,
                       use_async, o_parts, groups, vector_stores, core_matrices=True)
    Bk, D, G, P = block_size, head_dim, group, positions
    R, NT, NG, LD, OFF_V, OFF_Q = T.R, T.NT, T.NG, T.LD, T.OFF_V, T.OFF_Q
    QBUF, KS, KP, NO_PART = T.QBUF, T.KS, T.KP, T.NO_PART
    S_REGS, P_REGS, O_REGS, CTA_THREADS, UNIFORM = (T.S_REGS, T.P_REGS, T.O_REGS,
                                                    T.CTA_THREADS, T.UNIFORM)
    assert R == 64
    O_PARTS = o_parts
    Q_REGS = 4 * KS
    commit, wait_all, gather, load_kv, clean_v = (T.commit, T.wait_all, T.gather, T.load_kv,
                                                   T.clean_v)
    softmax, o_offsets, store_o, store_lse = T.softmax, T.o_offsets, T.store_o, T.store_lse
    first_nonfinite, fix_o = T.first_nonfinite, T.fix_o
    BF16_PARTIALS = bf16_partials
    ab = "bf16" if bf16_in else "f16"
    scores = _wgmma.make_scores_rs(Bk, ab, KS)  # S: B = Kᵀ, K-major
    wg_o = _wgmma.make_wgmma_rs(8 * NO_PART, ab, 1)  # O: B = V, N-major
    wait_o = _wgmma.make_wgmma_wait(O_REGS)
    # core-matrix descriptors of K (k: next 8 dims +128 B, n: next 8 keys +16 D B) and V (k:
    # next 8 keys, n: next 8 dims); a k-step of S moves 256 B, of O 32 D B (/16: descriptor)
    KV_GROUP_BYTES = 16 * D
    read_item = item_reader(paged)

    @kernel_jit(**T.JIT)
    def _k1_kernel_v4(q, k, v, work, q_indices, slots, cu_q, cu_k, scale, o_part, lse_part):
        smem = dynamic_smem_u32()
        s_acc = cuda.local.array(S_REGS, float32)
        p_frag = cuda.local.array(P_REGS, uint32)  # P as the A fragments of the P V wgmma
        o_acc = cuda.local.array(O_REGS, float32)
        q_frag = cuda.local.array(Q_REGS, uint32)  # Q's A fragments
        first_bad = cuda.shared.array(D, int32)  # per column: the block's first non-finite V
        cta_tid = cuda.threadIdx.x
        grp = cta_tid // NT  # this thread's warpgroup ...
        tid = cta_tid % NT  # ... and its index in it
        warp = tid // 32
        lane = tid % 32
        g4 = lane // 4
        t4 = lane % 4
        q_buf0 = OFF_Q + 2 * grp * QBUF  # the group's two Q buffers
        topk = lse_part.shape[0]
        q_total = lse_part.shape[1]
        hq_total = lse_part.shape[2]
        col = int32(2 * t4)  # this lane's first key (S) or output column (O) in an n-tile
        lane_col = uint64(t4) if BF16_PARTIALS else uint64(col)  # ... as an o_part offset
        h, q_begin, q_count, b, j, key0, nk, kv_h = read_item(
            work, cuda.blockIdx.x, q_indices, cu_k, k, Bk)
        if q_count <= 0:
            return  # the whole CTA: padding item
        key_pos0 = j * Bk
        scale_log2 = scale  # the launcher passes scale * log2(e): exp(x) = 2**(x log2 e)
        q_lo = int(cu_q[b])
        q_hi = int(cu_q[b + 1])
        pos0 = (int(cu_k[b + 1]) - int(cu_k[b])) - (q_hi - q_lo)  # Lk - Lq: bottom-right
        num_tiles = (q_count + P - 1) // P
        hkv = k.shape[1]
        # the group's tiles: grp, grp + NG, ... (with UNIFORM every group walks as many steps)
        num_steps = (num_tiles + NG - 1 - (0 if UNIFORM else grp)) // NG

        load_kv(smem, k, v, cta_tid, key0, nk, kv_h, hkv)
        # The group's first tile; thread tid holds the entry of row tid // 2 of every tile
        # (its warp's rows: gather).
        g_row = tid // 2
        t_raw, s_raw = load_entry(q_indices, slots, h, q_begin, q_count, grp, P, G, g_row, R)
        t_g, _, _ = check_entry(t_raw, s_raw, q_lo, q_hi, pos0, topk)
        gather(smem, q, h, tid, t_g, q_buf0)
        commit()
        t_raw, s_raw = load_entry(q_indices, slots, h, q_begin, q_count, grp + NG, P, G, g_row,
                                  R)
        # One CTA barrier for K/V (as version 3), which also ORs whether a thread cleaned a
        # non-finite V (_tile.clean_v, before the fence: the cleaned words are generic-proxy
        # stores too); K/V came through the generic proxy, and wgmma reads them through the
        # async one.
        wait_all()
        bad = clean_v(smem, cta_tid)
        _wgmma.fence_proxy_async()
        bad_v = cuda.syncthreads_or(int32(bad))
        if bad_v:  # the rare path: where the block's non-finite values are, per column
            first_nonfinite(first_bad, v, key0, nk, kv_h, cta_tid, CTA_THREADS)
        k_desc = _wgmma.smem_desc(_wgmma.shared_address(smem, 0), 128, KV_GROUP_BYTES)
        v_desc = _wgmma.smem_desc(_wgmma.shared_address(smem, OFF_V), KV_GROUP_BYTES, 128)

        # This lane's rows in the accumulator layout: r_top = 16 warp + g4, r_bot = r_top + 8.
        r_top = 16 * warp + g4
        r_bot = r_top + 8
        tt_raw, st_raw = load_entry(q_indices, slots, h, q_begin, q_count, grp, P, G, r_top, R)
        tb_raw, sb_raw = load_entry(q_indices, slots, h, q_begin, q_count, grp, P, G, r_bot, R)
        # ldmatrix row addresses of this lane for Q's A fragments: matrices (rows 0-7, 8-15) x
        # (words 0-3, 4-7)
        l_rows = ((lane >> 3) & 1) * 8 + (lane & 7)
        a_lane = (16 * warp + l_rows) * LD + (lane >> 4) * 4

        for step in range(num_steps):
            tile = step * NG + grp
            buf = step % 2
            wait_all()
            # the warp's rows of the tile landed, and its lanes are past their previous tile
            # (whose buffer the gather below overwrites)
            cuda.syncwarp()
            # The entries of the tiles ahead are loaded before the gather's copies (version 3).
            t_g, _, _ = check_entry(t_raw, s_raw, q_lo, q_hi, pos0, topk)
            t_top, s_top, pos_top = check_entry(tt_raw, st_raw, q_lo, q_hi, pos0, topk)
            t_bot, s_bot, pos_bot = check_entry(tb_raw, sb_raw, q_lo, q_hi, pos0, topk)
            t_raw, s_raw = load_entry(q_indices, slots, h, q_begin, q_count, tile + 2 * NG, P,
                                      G, g_row, R)
            tt_raw, st_raw = load_entry(q_indices, slots, h, q_begin, q_count, tile + NG, P, G,
                                        r_top, R)
            tb_raw, sb_raw = load_entry(q_indices, slots, h, q_begin, q_count, tile + NG, P, G,
                                        r_bot, R)
            if tile + NG < num_tiles:  # the buffer of the last tile is free: gather the next
                gather(smem, q, h, tid, t_g, q_buf0 + (1 - buf) * QBUF)
            commit()

            # S = Q Kᵀ: the warpgroup's 64 x Bk scores in KS wgmma, K from shared memory.
            scores(smem, q_frag, s_acc, q_buf0 + buf * QBUF + a_lane, k_desc)
            mb_top, mb_bot, l_top, l_bot = softmax(s_acc, p_frag, pos_top, pos_bot, key_pos0,
                                                   nk, col, scale_log2)

            # O = P V: each column part's 64 x 8 NO_PART outputs in KP wgmma, V from shared
            # memory; O_s = O / l into the rows' slots.
            inv_top = float32(1.0) / l_top if l_top > float32(0.0) else float32(0.0)
            inv_bot = float32(1.0) / l_bot if l_bot > float32(0.0) else float32(0.0)
            hq_top = h * G + r_top % G
            hq_bot = h * G + r_bot % G
            at_top, at_bot = o_offsets(lane_col, t_top, s_top, hq_top, t_bot, s_bot, hq_bot,
                                       q_total, hq_total)
            for part in range(O_PARTS):
                _wgmma.wgmma_fence()
                for kp in range(KP):
                    wg_o(o_acc, p_frag[4 * kp], p_frag[4 * kp + 1], p_frag[4 * kp + 2],
                         p_frag[4 * kp + 3],
                         v_desc + uint64((2 * kp * KV_GROUP_BYTES + part * NO_PART * 128)
                                         >> 4), int32(kp > 0))
                _wgmma.wgmma_commit()
                wait_o(o_acc)
                store_o(o_part, o_acc, part, t4, t_top, t_bot, at_top, at_bot, inv_top,
                        inv_bot)
            if bad_v:  # the rows that see a non-finite V get the reference's NaN or inf
                fix_o(o_part, v, first_bad, t4, t_top, t_bot, at_top, at_bot, pos_top, pos_bot,
                      key_pos0, key0, nk, kv_h)
            store_lse(lse_part, t4, t_top, s_top, hq_top, t_bot, s_bot, hq_bot, mb_top, mb_bot,
                      l_top, l_bot)

    return _k1_kernel_v4
