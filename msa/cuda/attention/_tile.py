"""The register-resident query tile that K1 versions 3 and 4 share (FlashAttention-2 style).

Both rungs run the same tile: warp ``w`` owns rows ``16w .. 16w+15`` of a tile of ``R = P*G``
rows (``P`` query positions x the ``G`` heads of a KV head) and keeps their scores (``Bk/2``
fp32 a lane), the probabilities and the output in registers, in the accumulator layout of
``mma.sync.m16n8k16`` (which ``wgmma`` shares): lane ``(g4, t4)`` holds rows ``r_top = 16w +
g4`` and ``r_bot = r_top + 8``, columns ``8i + 2t4`` and the next of each n-tile ``i``. What
differs between the rungs is how ``S = Q Kᵀ`` and ``O = P V`` are multiplied and how K and V
sit in shared memory (their own mainloop files); this module holds the rest, by role:

* ``layout`` / ``o_parts``: the shared memory (``msa.cuda._core.memops.dynamic_smem_u32``) and
  the column parts of O;
* ``load_kv``: the K/V block into shared memory (``cp.async`` or plain loads), row-major
  (version 3) or as 8 x 8 core matrices (version 4, ``core_matrices``);
* ``clean_v``: masking by selection inside the block (docs/design.md §3): each thread, once its
  own copies of V have landed, replaces every non-finite 16-bit value of them by +0
  (``msa.cuda._core.finite``) and says whether it met one; the CTA ORs that into one flag at the
  barrier it needs anyway (``syncthreads_or``), so that ``P = 0`` at an invisible key multiplies
  a zero, never a NaN or an infinity. Common path: four shared loads and about fifteen integer
  instructions per 16 bytes of V, once per CTA (the block serves all of its tiles); a block
  without a non-finite V computes bitwise what it did without the pass;
* ``gather``: a thread's half of a query row into a Q buffer (``cp.async`` or plain loads);
* ``softmax``: the causal mask, the row max and sum over the quad, ``P = 2**(S s log2 e - m)``
  packed to 16-bit pairs (already the A fragments of ``O = P V``);
* ``o_offsets`` / ``store_o``: the rows' ``O_s = O / l`` into their slots (16-byte stores of bf16
  partials after a quad transpose, where a part of O has a multiple of 4 n-tiles);
* ``store_lse``: the rows' ``L_s = ln 2 (m + log2 l)``;
* ``fix_o``: only in a flagged block (the rare path), after a tile's stores: each element
  ``(row, d)`` whose row sees a non-finite ``V[c, d]`` (``first[d]``, the block's first such key,
  is visible to the row) gets the fp32 sum of those values, re-read from global memory, added
  to what the tile stored (NaN, or the infinity the reference gives; a NaN the tile computed
  from a NaN score stays NaN). Rows that see none keep the stored value.

``tile(...)`` builds them for one specialisation (compile-time sizes as closure constants).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

from numba import cuda, float32, int32, int64, uint32, uint64

from .._core import mma as _mma
from .._core.arrays import SIMULATOR
from .._core.finite import block_checks
from .._core.memops import (copy16_plain3, cp_async16, cp_async_commit, cp_async_wait_all,
                            no_op, store_u32x4)
from .._core.mma import bf16_to_f32, pack_bf16x2, pack_f16x2
from .._core.packed import LN2
from .._core.softmax import exp2_rows
from .._core.wgmma import core_word

MAX_HEAD_DIM = 128  # O lives in registers
MAX_BLOCK_SIZE = 128  # S lives in registers
_NEG_INF = float32(-math.inf)
_POS_INF = float32(math.inf)


@cuda.jit(device=True, inline=True)
def quad_transpose(t4, v0, v1, v2, v3):
    """4 x 4 transpose across the four lanes of a quad (``t4 = lane % 4``): lane ``t4`` gives
    ``v_j`` and receives, as ``u_k``, lane k's ``v_{t4}``. Two butterfly steps of two shuffles
    each; every lane of the warp must call it. Words travel as int32 (shuffles take no
    uint32)."""
    v0, v1, v2, v3 = int32(v0), int32(v1), int32(v2), int32(v3)
    odd = (t4 & 1) != 0
    r0 = cuda.shfl_xor_sync(0xFFFFFFFF, v0 if odd else v1, 1)
    r1 = cuda.shfl_xor_sync(0xFFFFFFFF, v2 if odd else v3, 1)
    w0 = r0 if odd else v0
    w1 = v1 if odd else r0
    w2 = r1 if odd else v2
    w3 = v3 if odd else r1
    high = (t4 & 2) != 0
    r0 = cuda.shfl_xor_sync(0xFFFFFFFF, w0 if high else w2, 2)
    r1 = cuda.shfl_xor_sync(0xFFFFFFFF, w1 if high else w3, 2)
    if high:
        return r0, r1, w2, w3
    return w0, w1, r0, r1


def layout(block_size, head_dim, rows, groups=1):
    """Row stride (32-bit words), word offsets of sV and sQ, and total bytes of the shared
    memory: sK [Bk rows] and sV [Bk rows] (row-major in version 3, 8 x 8 core matrices in
    version 4, the same bytes), then for each of the CTA's ``groups`` warp groups two sQ
    buffers of R rows (tile i+1 is gathered while tile i computes).
    Rows of ``D/2 + 4`` words: 16-byte aligned for ``cp.async``, and the 8 rows x 16 bytes of
    an ``ldmatrix`` phase hit 32 different banks."""
    ld = head_dim // 2 + 4
    off_v = block_size * ld
    off_q = 2 * block_size * ld
    total = off_q + groups * 2 * rows * ld
    return ld, off_v, off_q, 4 * total


def o_parts(head_dim):
    """Column parts of O: two above D = 64 (at D = 128 all 64 accumulators at once take 255
    registers on sm_90, in two parts of 32 the kernel takes 168; offline ptxas)."""
    return 2 if head_dim > 64 and (head_dim // 8) % 4 == 0 else 1


def tile(block_size, head_dim, group, positions, bf16_in, bf16_partials, use_async, parts,
         groups, vector_stores, core_matrices=False):
    """Sizes and device functions of one tile specialisation (see the module docstring);
    ``core_matrices``: K and V in shared memory as 8 x 8 core matrices (version 4), else
    row-major.

    Returns a namespace of the constants the mainloops use (``R``, ``NT``, ``NG``, ``LD``,
    ``OFF_V``, ``OFF_Q``, ``DW``, ``QBUF``, ``PIECES``, ``NS``, ``NO``, ``KS``, ``KP``,
    ``NO_PART``, ``S_REGS``, ``P_REGS``, ``O_REGS``, ``CTA_THREADS``, ``UNIFORM``, ``JIT``) and
    the functions ``copy16``, ``commit``, ``wait_all``, ``load_kv``, ``clean_v``,
    ``first_nonfinite``, ``gather``, ``softmax``, ``o_offsets``, ``store_o``, ``store_lse``,
    ``fix_o``."""
    Bk, D, G, P = block_size, head_dim, group, positions
    R = P * G
    NW = R // 16
    NT = 32 * NW
    NG = groups
    CTA_THREADS = NG * NT
    assert R % 16 == 0 and NW * NG <= _mma.MAX_WARPS and D % 16 == 0 and Bk % 16 == 0
    assert 1 <= NG <= 15
    LD, OFF_V, OFF_Q, _ = layout(Bk, D, R, NG)
    DW = D // 2  # words per row of Q/K/V
    PIECES = DW // 4  # 16-byte pieces per row
    HALF = PIECES // 2  # pieces a thread gathers (NT = 2R threads, R rows)
    RPU = 32 // PIECES if 32 % PIECES == 0 else 0  # rows one copy of a warp covers, or 0
    NS = Bk // 8  # n-tiles of S (8 keys each): 4 fp32 registers per lane each
    NO = D // 8  # n-tiles of O (8 dims each)
    NO_PART = NO // parts  # n-tiles of O per part (even: ldmatrix.x4.trans loads two)
    assert NO_PART % 2 == 0 and NO_PART * parts == NO
    pack = pack_bf16x2 if bf16_in else pack_f16x2
    p_rows = exp2_rows(NS, pack)
    copy16 = cp_async16 if use_async else copy16_plain3
    BF16_PARTIALS = bf16_partials
    O_ROW = DW if bf16_partials else D  # elements of one O_s row in o_part
    # bf16 partials: a quad's lanes hold words t4, 4 + t4, ... of a row; transposed across the
    # quad in groups of four n-tiles, each lane stores 16 contiguous bytes (one st.global.v4
    # instead of four 4-byte stores a lane: a quarter of the scattered store instructions).
    STORE_V4 = bf16_partials and vector_stores and NO_PART % 4 == 0
    CORE_MATRICES = core_matrices
    checks = block_checks(bf16_in)
    clean4, nonfinite_sum = checks.clean4, checks.nonfinite_sum

    @cuda.jit(device=True, inline=True)
    def kv_word(c, w):
        """Word offset of row ``c``, word ``w`` (a multiple of 4) of the K or the V tile."""
        if CORE_MATRICES:
            return core_word(c, w, D)
        return c * LD + w

    @cuda.jit(device=True, inline=True)
    def load_kv(smem, k, v, cta_tid, key0, nk, h, hkv):
        """Start copying the K/V block, 16 bytes a copy, ``CTA_THREADS`` apart (keys past the
        sequence: zeros, so that 0 * V stays 0)."""
        for e in range(cta_tid, Bk * PIECES, CTA_THREADS):
            c = e // PIECES
            w = (e % PIECES) * 4
            ok = c < nk
            src = ((key0 + (c if ok else 0)) * hkv + h) * DW + w
            dst = kv_word(c, w)
            copy16(smem, dst, k, src, 16 if ok else 0)
            copy16(smem, OFF_V + dst, v, src, 16 if ok else 0)

    @cuda.jit(device=True, inline=True)
    def clean_v(smem, cta_tid):
        """After ``wait_all``: the V words this thread copied in ``load_kv`` (its own copies,
        so no barrier first) with every non-finite half replaced by +0; uint32 1 if it met
        one."""
        bad = uint32(0)
        for e in range(cta_tid, Bk * PIECES, CTA_THREADS):
            bad |= clean4(smem, OFF_V + kv_word(e // PIECES, (e % PIECES) * 4))
        return bad

    @cuda.jit(device=True, inline=True)
    def gather(smem, q, h, tid, t, dst_buf):
        """Start copying the 16 query rows of thread ``tid``'s warp (rows ``16 w .. 16 w + 15``
        of the tile; ``t``: the token of row ``tid // 2``, as ``load_entry`` gives it, -1:
        zeros) into the Q buffer at word ``dst_buf``.

        At G = 16 the warp's rows are one position's heads, one run of ``q``: consecutive
        lanes copy consecutive 16-byte pieces, so that one copy of the warp is whole rows.
        Otherwise each thread copies half of row ``tid // 2`` (a copy of the warp touches 16
        rows; the same-row copies would need each row's token by a shuffle, which cost ~12
        registers at G = 8)."""
        if G == 16 and RPU:
            ok = t >= 0
            lane = int32(tid % 32)
            w_row = int32((tid // 32) * 16) + lane // PIECES  # then RPU rows further each copy
            w_src = (int64(t if ok else 0) * q.shape[1] + h * G + w_row % G) * DW \
                + 4 * (lane % PIECES)
            w_dst = dst_buf + w_row * LD + 4 * (lane % PIECES)
            for u in range(HALF):
                copy16(smem, w_dst + u * RPU * LD, q, w_src + u * RPU * DW, 16 if ok else 0)
        else:
            row = tid // 2
            half = tid % 2
            src = ((t if t >= 0 else 0) * q.shape[1] + h * G + row % G) * DW + half * HALF * 4
            dst = dst_buf + row * LD + half * HALF * 4
            for u in range(HALF):
                copy16(smem, dst + 4 * u, q, src + 4 * u, 16 if t >= 0 else 0)

    @cuda.jit(device=True, inline=True)
    def softmax(s_acc, p_frag, pos_top, pos_bot, key_pos0, nk, col, scale_log2):
        """Mask the raw scores ``s_acc``, then ``P = 2**(S scale_log2 - m)`` into ``p_frag``;
        returns the rows' base-2 maxima and sums ``(mb_top, mb_bot, l_top, l_bot)``."""
        # Token-level causal mask (and keys past the sequence): key c of the block is
        # visible to a row iff c <= lim; rows without a query have pos = -1: nothing.
        # Only a block that reaches past a row's position (its local block, or the last,
        # partial one) needs it: int32 compares, skipped when both rows see every key.
        lim_top = int32(min(pos_top - key_pos0, nk - 1))
        lim_bot = int32(min(pos_bot - key_pos0, nk - 1))
        if lim_top < Bk - 1 or lim_bot < Bk - 1:
            # key 8 i + e of this lane's n-tile i is col + 8 i + e: hidden iff
            # 8 i + e > lim - col, compared in float32 (exact: |lim - col| < 2**24)
            thr_top = float32(lim_top - col)
            thr_bot = float32(lim_bot - col)
            for i in range(NS):
                for e in range(2):
                    if float32(8 * i + e) > thr_top:
                        s_acc[4 * i + e] = _NEG_INF
                    if float32(8 * i + e) > thr_bot:
                        s_acc[4 * i + 2 + e] = _NEG_INF
        # m = rowmax(S)
        m_top = _NEG_INF
        m_bot = _NEG_INF
        for i in range(NS):
            for e in range(2):
                m_top = max(m_top, s_acc[4 * i + e])
                m_bot = max(m_bot, s_acc[4 * i + 2 + e])
        # the quad's four lanes hold the row: combine their maxima
        m_top = max(m_top, cuda.shfl_xor_sync(0xFFFFFFFF, m_top, 1))
        m_bot = max(m_bot, cuda.shfl_xor_sync(0xFFFFFFFF, m_bot, 1))
        m_top = max(m_top, cuda.shfl_xor_sync(0xFFFFFFFF, m_top, 2))
        m_bot = max(m_bot, cuda.shfl_xor_sync(0xFFFFFFFF, m_bot, 2))
        # base-2 max; a row with nothing visible uses 0, so that P = 2**-inf = 0 (no NaN); so
        # does a row with a +inf score, as the reference (P = inf there: l = L_s = +inf). The
        # max passes over a NaN score, whose P = NaN makes l and L_s NaN.
        mb_top = (m_top * scale_log2 if m_top > _NEG_INF and m_top < _POS_INF
                  else float32(0.0))
        mb_bot = (m_bot * scale_log2 if m_bot > _NEG_INF and m_bot < _POS_INF
                  else float32(0.0))
        # P = 2**(S scale_log2 - m), packed to 16-bit pairs: the C layout of n-tiles 2j and
        # 2j+1 is the A layout of k-step j of P V; l = rowsum(P)
        # (msa.cuda._core.softmax: the fused form, or where |mb| >= 2**24 the exact one)
        l_top, l_bot = p_rows(s_acc, p_frag, m_top, m_bot, mb_top, mb_bot, scale_log2,
                              float32(0.0), float32(0.0))
        l_top += cuda.shfl_xor_sync(0xFFFFFFFF, l_top, 1)
        l_bot += cuda.shfl_xor_sync(0xFFFFFFFF, l_bot, 1)
        l_top += cuda.shfl_xor_sync(0xFFFFFFFF, l_top, 2)
        l_bot += cuda.shfl_xor_sync(0xFFFFFFFF, l_bot, 2)
        return mb_top, mb_bot, l_top, l_bot

    @cuda.jit(device=True, inline=True)
    def o_offsets(lane_col, t_top, s_top, hq_top, t_bot, s_bot, hq_bot, q_total, hq_total):
        """First element of each row's O_s in the flat o_part (0 for a row without a query: not
        stored) plus this lane's first column (its word with bf16 partials), so that a store
        adds only a constant; unsigned, so no negative-index checks."""
        at_top = lane_col
        at_bot = lane_col
        if t_top >= 0:
            at_top += uint64(((s_top * q_total + t_top) * hq_total + hq_top) * O_ROW)
        if t_bot >= 0:
            at_bot += uint64(((s_bot * q_total + t_bot) * hq_total + hq_bot) * O_ROW)
        return at_top, at_bot

    @cuda.jit(device=True, inline=True)
    def store_o(o_part, o_acc, part, t4, t_top, t_bot, at_top, at_bot, inv_top, inv_bot):
        """O_s = O / l of part ``part`` of the columns (0 where nothing is visible)."""
        if STORE_V4:
            for i4 in range(NO_PART // 4):
                a = 16 * i4  # o_acc index of n-tile 4 i4 of this part
                x0, x1, x2, x3 = quad_transpose(
                    t4, pack_bf16x2(o_acc[a] * inv_top, o_acc[a + 1] * inv_top),
                    pack_bf16x2(o_acc[a + 4] * inv_top, o_acc[a + 5] * inv_top),
                    pack_bf16x2(o_acc[a + 8] * inv_top, o_acc[a + 9] * inv_top),
                    pack_bf16x2(o_acc[a + 12] * inv_top, o_acc[a + 13] * inv_top))
                y0, y1, y2, y3 = quad_transpose(
                    t4, pack_bf16x2(o_acc[a + 2] * inv_bot, o_acc[a + 3] * inv_bot),
                    pack_bf16x2(o_acc[a + 6] * inv_bot, o_acc[a + 7] * inv_bot),
                    pack_bf16x2(o_acc[a + 10] * inv_bot, o_acc[a + 11] * inv_bot),
                    pack_bf16x2(o_acc[a + 14] * inv_bot, o_acc[a + 15] * inv_bot))
                # lane t4 stores n-tile 4 i4 + t4 of the part: words 4 (that n-tile)
                # .. + 3 of the row, i.e. at_* - t4 + 4 (part NO_PART + 4 i4 + t4)
                d = uint64(3 * t4 + 4 * (part * NO_PART + 4 * i4))
                if t_top >= 0:
                    store_u32x4(o_part, at_top + d, x0, x1, x2, x3)
                if t_bot >= 0:
                    store_u32x4(o_part, at_bot + d, y0, y1, y2, y3)
            return
        for i in range(NO_PART):
            # output columns 8 (part NO_PART + i) + col and the next one
            if BF16_PARTIALS:  # one word (two bf16) per column pair
                d = uint64(4 * (part * NO_PART + i))
                if t_top >= 0:
                    o_part[at_top + d] = pack_bf16x2(o_acc[4 * i] * inv_top,
                                                     o_acc[4 * i + 1] * inv_top)
                if t_bot >= 0:
                    o_part[at_bot + d] = pack_bf16x2(o_acc[4 * i + 2] * inv_bot,
                                                     o_acc[4 * i + 3] * inv_bot)
            else:
                d = uint64(8 * (part * NO_PART + i))
                if t_top >= 0:
                    o_part[at_top + d] = o_acc[4 * i] * inv_top
                    o_part[at_top + d + uint64(1)] = o_acc[4 * i + 1] * inv_top
                if t_bot >= 0:
                    o_part[at_bot + d] = o_acc[4 * i + 2] * inv_bot
                    o_part[at_bot + d + uint64(1)] = o_acc[4 * i + 3] * inv_bot

    @cuda.jit(device=True, inline=True)
    def store_lse(lse_part, t4, t_top, s_top, hq_top, t_bot, s_bot, hq_bot, mb_top, mb_bot,
                  l_top, l_bot):
        """L_s = ln 2 (m + log2 l) (natural log; -inf when nothing is visible, NaN or +inf
        where l is: a NaN or +inf score, which K2 then propagates)."""
        if t4 == 0:
            if t_top >= 0:
                lse = _NEG_INF
                if l_top != float32(0.0):
                    lse = (mb_top + math.log2(l_top)) * float32(LN2)
                lse_part[s_top, t_top, hq_top] = lse
            if t_bot >= 0:
                lse = _NEG_INF
                if l_bot != float32(0.0):
                    lse = (mb_bot + math.log2(l_bot)) * float32(LN2)
                lse_part[s_bot, t_bot, hq_bot] = lse

    @cuda.jit(device=True, inline=True)
    def fix_row(o_part, v, first, t4, row0, nvis, key0, h):
        """One row's elements that see a non-finite V (``first[d] < nvis``): + the sum of the
        visible non-finite ``V[c, d]``. Lane ``t4`` of the quad takes words (bf16 partials) or
        columns ``t4, t4 + 4, ...`` of the row at ``row0``."""
        if BF16_PARTIALS:
            for w in range(t4, DW, 4):
                f0 = first[2 * w]
                f1 = first[2 * w + 1]
                if f0 < nvis or f1 < nvis:
                    word = o_part[row0 + uint64(w)]
                    lo = bf16_to_f32(word & uint32(0xFFFF))
                    hi = bf16_to_f32(word >> uint32(16))
                    if f0 < nvis:
                        lo += nonfinite_sum(v, key0, h, 2 * w, f0, nvis)
                    if f1 < nvis:
                        hi += nonfinite_sum(v, key0, h, 2 * w + 1, f1, nvis)
                    o_part[row0 + uint64(w)] = pack_bf16x2(lo, hi)
        else:
            for d in range(t4, D, 4):
                f = first[d]
                if f < nvis:
                    o_part[row0 + uint64(d)] += nonfinite_sum(v, key0, h, d, f, nvis)

    @cuda.jit(device=True, inline=True)
    def fix_o(o_part, v, first, t4, t_top, t_bot, at_top, at_bot, pos_top, pos_bot, key_pos0,
              key0, nk, h):
        """The rare path of a flagged block (``clean_v``), after every part of a tile is
        stored: the elements of this lane's two rows that see a non-finite V get the
        reference's NaN or infinity (the module docstring). Warp-uniform (every lane of the
        warp calls it: the stores it reads back came from the quad's four lanes)."""
        cuda.syncwarp()  # the quad's stores of the two rows are visible to its lanes
        back = uint64(t4) if BF16_PARTIALS else uint64(2 * t4)  # o_offsets' lane column
        if t_top >= 0:
            fix_row(o_part, v, first, t4, at_top - back, min(nk, pos_top - key_pos0 + 1),
                    key0, h)
        if t_bot >= 0:
            fix_row(o_part, v, first, t4, at_bot - back, min(nk, pos_bot - key_pos0 + 1),
                    key0, h)

    return SimpleNamespace(
        R=R, NT=NT, NG=NG, LD=LD, OFF_V=OFF_V, OFF_Q=OFF_Q, DW=DW, QBUF=R * LD, PIECES=PIECES,
        NS=NS, NO=NO, KS=D // 16, KP=Bk // 16, NO_PART=NO_PART, S_REGS=4 * NS, P_REGS=2 * NS,
        O_REGS=4 * NO_PART, CTA_THREADS=CTA_THREADS,
        # The twin mma on a GPU (MSA_MMA=twin) runs syncthreads inside: every group then walks
        # the same number of tiles (a group past the end computes on stale rows and stores
        # nothing); the simulator's twin, which meets only its warp, does the same so that both
        # twins run one path.
        UNIFORM=_mma.MMA_BACKEND == "twin",
        JIT={} if SIMULATOR or NG == 1 else {"launch_bounds": (NG * NT, 1)},
        copy16=copy16, commit=cp_async_commit if use_async else no_op,
        wait_all=cp_async_wait_all if use_async else no_op, load_kv=load_kv, clean_v=clean_v,
        first_nonfinite=checks.first_nonfinite, gather=gather, softmax=softmax,
        o_offsets=o_offsets, store_o=store_o, store_lse=store_lse, fix_o=fix_o)
