"""K1 version 3: tensor cores with S, P and O in registers (FlashAttention-2 style).

Over version 2 (scores and probabilities through shared memory, CTA barriers around the
softmax): warp ``w`` owns rows ``16w .. 16w+15`` of the tile and keeps their scores (``Bk/2``
fp32 a lane), computes the causal mask, the row max and sum (``shfl_xor`` over the quad that
holds a row) and ``P = 2**(S scale log2 e - m)`` in registers; P packed to 16-bit pairs is
already the A fragment of ``O = P V`` (``_tile``: the C layout of two n-tiles of S is the A
layout of one k-step). K and V row-major in shared memory (B fragments by ``ldmatrix.x4``, V's
by ``ldmatrix.x4.trans``), Q tiles gathered by ``cp.async`` into two buffers (tile i+1 lands
while tile i computes; A fragments by ``ldmatrix.x4``); a warp copies and reads only its own 16
rows of each tile, so after one CTA barrier for K/V a tile needs only the warp's own
``cp.async`` wait and a ``syncwarp``. O in registers, in two column halves at D = 128.
``groups`` > 1 makes the CTA that many independent groups of tile warps over one shared K/V
block (each group its own Q buffers), so that more warps share each load of K/V.

fp16/bf16, D and Bk multiples of 16 up to 128. 136 KB of dynamic shared memory at
D = Bk = 128, R = 128; 168 registers, no spills (every D, Bk in {16, 32, 64, 128}; sm_90,
offline ptxas). Inputs that are not 16-byte aligned are copied by plain loads.

Masking by selection inside the block (docs/design.md §3; ``_tile.clean_v`` / ``fix_o``): before
the K/V barrier each thread replaces the non-finite 16-bit values of the V words it copied by
+0 (four shared loads and about fifteen integer instructions per 16 bytes, once per CTA, which
serves all of its tiles), and the barrier becomes a ``syncthreads_or`` that flags the block.
Only a flagged block (the rare path) finds each column's first non-finite key (a pass over V in
global memory) and, after each tile's stores, adds to the elements whose row sees one the fp32
sum of the visible non-finite values (NaN, or the infinity the reference gives). An unflagged
block runs the same mma, softmax and stores as before (bitwise the same results; one
predicated branch a tile).

Where it runs: the default on GPUs without ``wgmma`` (and in the simulator), for 64-row tiles
and 3 warp groups where a CTA stays at 12 warps. Verdict (H200, paper configuration): 64-row
tiles 7.32 against 8.16 ms a 16K-query chunk for 128 rows; 3 groups of 4 warps 3-4% faster
than 1 group in K1, 2-6% in the whole sparse attention at 128K; K1 alone 177-182 TFLOP/s with
the 16-byte stores of bf16 partials.
"""

from __future__ import annotations

import functools

from numba import cuda, float32, int32, uint32, uint64

from .._core.memops import dynamic_smem_u32, ldmatrix_x4, ldmatrix_x4_trans
from .._core.mma import make_mma_pair, mma_bf16_m16n8k16, mma_f16_m16n8k16
from .._core.packed import check_entry, item_reader, load_entry
from ._tile import tile as tile_functions
from .._core.diskcache import kernel_jit


@functools.lru_cache(maxsize=None)
def k1_kernel_v3(block_size: int, head_dim: int, group: int, positions: int, bf16_in: bool,
                 bf16_partials: bool = False, use_async: bool = True, o_parts: int = 1,
                 groups: int = 1, vector_stores: bool = False, paged: bool = False):
    """K1 v3 specialised for (Bk, D, G, P, bf16 or fp16 in, fp32 or bf16 partials out, inputs
    copied by ``cp.async`` or by plain loads when they are not 16-byte aligned, column parts
    of O, warp groups, bf16 partials stored 16 bytes a lane when ``vector_stores``: ``o_part``
    16-byte aligned, K/V packed or in pages: ``paged`` as version 1's).

    Arguments: q, k, v as uint32 word views ``[T, H, D/2]`` of the 16-bit inputs; ``work``,
    ``q_indices``, ``slots``, ``cu_q``, ``cu_k`` as version 1's; ``scale`` times log2(e);
    ``o_part`` flat: the C-order elements of ``[K, Tq, Hq, D]`` float32, or with
    ``bf16_partials`` of the uint32 view ``[K, Tq, Hq, D/2]`` (shape from ``lse_part [K, Tq,
    Hq]``: plain index arithmetic per row and one add per store). Every loop over fragments has
    a compile-time trip count and is unrolled, so that the accumulator arrays are registers.

    ``groups`` > 1: group ``g`` takes tiles ``g, g + groups, ...`` with its own two Q buffers;
    the CTA is launched with bounds that cap its registers (168 a thread for 3 groups of 4
    warps: 64K registers an SM)."""
    T = tile_functions(block_size, head_dim, group, positions, bf16_in, bf16_partials, use_async,
             o_parts, groups, vector_stores)
    Bk, G, P = block_size, group, positions
    R, NT, NG, LD, OFF_V, OFF_Q = T.R, T.NT, T.NG, T.LD, T.OFF_V, T.OFF_Q
    QBUF, NS, KS, KP, NO_PART = T.QBUF, T.NS, T.KS, T.KP, T.NO_PART
    S_REGS, P_REGS, O_REGS, CTA_THREADS, UNIFORM = (T.S_REGS, T.P_REGS, T.O_REGS,
                                                    T.CTA_THREADS, T.UNIFORM)
    O_PARTS = o_parts
    commit, wait_all, gather, load_kv, clean_v = (T.commit, T.wait_all, T.gather, T.load_kv,
                                                   T.clean_v)
    softmax, o_offsets, store_o, store_lse = T.softmax, T.o_offsets, T.store_o, T.store_lse
    first_nonfinite, fix_o = T.first_nonfinite, T.fix_o
    D = head_dim
    mma_pair = make_mma_pair(mma_bf16_m16n8k16 if bf16_in else mma_f16_m16n8k16)
    BF16_PARTIALS = bf16_partials
    read_item = item_reader(paged)

    @kernel_jit(**T.JIT)
    def _k1_kernel_v3(q, k, v, work, q_indices, slots, cu_q, cu_k, scale, o_part, lse_part):
        smem = dynamic_smem_u32()
        s_acc = cuda.local.array(S_REGS, float32)
        p_frag = cuda.local.array(P_REGS, uint32)  # P as the A fragments of the P V mma
        o_acc = cuda.local.array(O_REGS, float32)
        first_bad = cuda.shared.array(D, int32)  # per column: the block's first non-finite V
        cta_tid = cuda.threadIdx.x
        grp = cta_tid // NT  # this thread's warp group ...
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
        # K/V came from every thread of the CTA: one CTA barrier before the tiles. After it a
        # warp reads only Q rows it gathered itself (gather copies warp w's rows 16 w .. 16 w +
        # 15, and warp w's A fragments are those rows), so a tile needs no barrier
        # across warps: each warp waits for its own copies and syncs its lanes.
        # Before the barrier each thread cleans the V words it copied (non-finite -> +0) and
        # the barrier ORs whether any thread met one: masking by selection (_tile.clean_v).
        wait_all()
        bad_v = cuda.syncthreads_or(int32(clean_v(smem, cta_tid)))
        if bad_v:  # the rare path: where the block's non-finite values are, per column
            first_nonfinite(first_bad, v, key0, nk, kv_h, cta_tid, CTA_THREADS)

        # This lane's rows in the mma layouts: r_top = 16 warp + g4 and r_bot = r_top + 8.
        r_top = 16 * warp + g4
        r_bot = r_top + 8
        tt_raw, st_raw = load_entry(q_indices, slots, h, q_begin, q_count, grp, P, G, r_top, R)
        tb_raw, sb_raw = load_entry(q_indices, slots, h, q_begin, q_count, grp, P, G, r_bot, R)
        # ldmatrix row addresses of this lane (matrix lane // 8, row lane % 8 of it): A of Q and
        # B of V (.trans) take matrices (rows 0-7, 8-15) x (words 0-3, 4-7); B of K takes
        # (words 0-3, 4-7) x (keys 0-7, 8-15), i.e. two n-tiles a load.
        l_rows = ((lane >> 3) & 1) * 8 + (lane & 7)
        a_lane = (16 * warp + l_rows) * LD + (lane >> 4) * 4
        k_lane = ((lane >> 4) * 8 + (lane & 7)) * LD + ((lane >> 3) & 1) * 4
        v_lane = OFF_V + l_rows * LD + (lane >> 4) * 4

        for step in range(num_steps):
            tile = step * NG + grp
            buf = step % 2
            wait_all()
            # the warp's rows of the tile landed, and its lanes are past their previous tile
            # (whose buffer the gather below overwrites)
            cuda.syncwarp()
            # The entries of the tiles ahead are loaded before the gather's copies, so that
            # those loads do not queue behind the copies; nothing reads them until next step.
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

            # S = Q Kᵀ (raw scores, fp32 registers).
            qa = q_buf0 + buf * QBUF + a_lane
            for i in range(S_REGS):
                s_acc[i] = float32(0.0)
            for ks in range(KS):
                a0, a1, a2, a3 = ldmatrix_x4(smem, qa + 8 * ks)
                for n2 in range(NS // 2):
                    b0, b1, b2, b3 = ldmatrix_x4(smem, k_lane + 16 * n2 * LD + 8 * ks)
                    n = 8 * n2
                    mma_pair(s_acc, n, a0, a1, a2, a3, b0, b1, b2, b3)
            mb_top, mb_bot, l_top, l_bot = softmax(s_acc, p_frag, pos_top, pos_bot, key_pos0,
                                                   nk, col, scale_log2)

            # O = P V (fp32 registers), B fragments of V by ldmatrix.trans; O_s = O / l into
            # the rows' slots. In O_PARTS column parts of D / O_PARTS (fewer live
            # accumulators; each V fragment is still loaded once).
            inv_top = float32(1.0) / l_top if l_top > float32(0.0) else float32(0.0)
            inv_bot = float32(1.0) / l_bot if l_bot > float32(0.0) else float32(0.0)
            hq_top = h * G + r_top % G
            hq_bot = h * G + r_bot % G
            at_top, at_bot = o_offsets(lane_col, t_top, s_top, hq_top, t_bot, s_bot, hq_bot,
                                       q_total, hq_total)
            for part in range(O_PARTS):
                for i in range(O_REGS):
                    o_acc[i] = float32(0.0)
                for kp in range(KP):
                    a0 = p_frag[4 * kp]
                    a1 = p_frag[4 * kp + 1]
                    a2 = p_frag[4 * kp + 2]
                    a3 = p_frag[4 * kp + 3]
                    for n2 in range(NO_PART // 2):
                        b0, b1, b2, b3 = ldmatrix_x4_trans(
                            smem, v_lane + 16 * kp * LD + 8 * (part * (NO_PART // 2) + n2))
                        n = 8 * n2
                        mma_pair(o_acc, n, a0, a1, a2, a3, b0, b1, b2, b3)
                store_o(o_part, o_acc, part, t4, t_top, t_bot, at_top, at_bot, inv_top,
                        inv_bot)
            if bad_v:  # the rows that see a non-finite V get the reference's NaN or inf
                fix_o(o_part, v, first_bad, t4, t_top, t_bot, at_top, at_bot, pos_top, pos_bot,
                      key_pos0, key0, nk, kv_h)
            store_lse(lse_part, t4, t_top, s_top, hq_top, t_bot, s_bot, hq_bot, mb_top, mb_bot,
                      l_top, l_bot)

    return _k1_kernel_v3
