"""K1 version 2: tensor cores (``mma.sync.m16n8k16``), S and P through shared memory.

Over version 1 (one thread per dot product): bf16/fp16 in, fp32 accumulate
(``msa.cuda._core.mma``) on 16-row warp tiles: ``R = P*G`` rows (a multiple of 16, at most 128;
8 warps at R = 128) x ``Bk`` keys. K row-major and V transposed in shared memory (loaded once
per item), S (fp32) and P (16-bit, unnormalised ``2**(S - m)``) through shared memory, the
softmax in base 2 (``ex2.approx``) by two threads per row, ``1/l`` applied to the fp32
accumulators. Pipelined across tiles: the CSR entries of tile i+2 load into registers and the
query rows of tile i+1 are prefetched into L1 while tile i computes. fp16/bf16 only, ``D`` and
``Bk`` multiples of 16 (up to 256). About 168 KB of dynamic shared memory at D = Bk = 128,
R = 128 (one CTA of 8 warps per SM); 168 registers, no spills (sm_90, offline ptxas).

Masking by selection inside the block (docs/design.md §3; ``msa.cuda._core.finite``): ``P V``
multiplies ``P = 0`` by V at the keys a row cannot see, so V's non-finite 16-bit values are
stored into sVt as +0 as the block is loaded (four integer instructions a word in registers,
once per CTA) and a ``syncthreads_or`` after the load (one more CTA barrier per item) says
whether the block had one. Only then (the rare path) the CTA finds each column's first such key (one
pass over V in global memory, two barriers) and, after each tile's stores, the elements whose
row sees one get the fp32 sum of the visible non-finite values added (NaN, or the infinity the
reference gives). A block without one gives bitwise the results it gave without the pass.

Where it runs: the tensor-core default where version 3 does not fit (D or Bk above 128: S or O
would not fit in registers). Verdict (H200, paper configuration): the sparse attention at 128K
took 216 ms against version 3's 51.8 in the same run, whose scores and probabilities stay in
registers, with no CTA barrier around the softmax.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32, uint16, uint32

from .._core import mma as _mma
from .._core.finite import block_checks
from .._core.mma import (bf16_to_f32, exp2, load_a_frag, load_b_frag, mma_bf16_m16n8k16,
                         mma_f16_m16n8k16, pack_bf16x2, pack_f16x2, prefetch_l1)
from .._core.packed import LN2, check_entry, item_reader, load_entry
from .._core.diskcache import kernel_jit

MAX_BLOCK_SIZE = 256
_NEG_INF = float32(-math.inf)
_POS_INF = float32(math.inf)


def layout(block_size, head_dim, rows):
    """Word offsets and row strides (32-bit words) of sK, sVt, sQ/P, sS; total bytes.

    sK [Bk rows of D/2 words] (row-major K: the B operand of S = Q Kᵀ, stored as Bᵀ),
    sVt [D rows of Bk/2 words] (V transposed: the B operand of O = P V stored as Bᵀ),
    sQP [R rows]: Q for the score mma, then P (16-bit) for the value mma,
    sS [R rows of Bk fp32 scores].
    Strides of ``n/2 + 4`` words make the 8 rows x 4 words of a fragment load hit 32 banks.
    """
    ld_k = head_dim // 2 + 4
    ld_v = block_size // 2 + 4
    ld_qp = max(head_dim, block_size) // 2 + 4
    ld_s = block_size + 4
    off_v = block_size * ld_k
    off_qp = off_v + head_dim * ld_v
    off_s = off_qp + rows * ld_qp
    total = off_s + rows * ld_s
    return (ld_k, ld_v, ld_qp, ld_s), (off_v, off_qp, off_s), 4 * total


@functools.lru_cache(maxsize=None)
def k1_kernel_v2(block_size: int, head_dim: int, group: int, positions: int, bf16_in: bool,
                 bf16_partials: bool = False, paged: bool = False):
    """K1 v2 specialised for (Bk, D, G, P, bf16 or fp16 in, fp32 or bf16 partials out, K/V
    packed or in pages: ``paged`` as version 1's).

    Arguments as version 1's kernel, except q, k, v: uint32 views ``[T, H, D/2]`` of the 16-bit
    inputs, ``scale`` times log2(e), with ``bf16_partials`` ``o_part`` a uint32 view ``[K, Tq,
    Hq, D/2]`` of bf16 partials (a lane's two neighbouring outputs are one word), and two more:
    ``keys_rt = Bk`` and ``dw_rt = D/2``, two constants as run-time values: as loop bounds they
    stop the compiler from unrolling the outer mma loops completely (which spills registers)."""
    Bk, D, G, P = block_size, head_dim, group, positions
    R = P * G
    NW = R // 16
    NT = 32 * NW
    R2 = 2 * R  # softmax: two threads per row
    assert R % 16 == 0 and NW <= _mma.MAX_WARPS and D % 16 == 0 and Bk % 16 == 0
    (LDK, LDV, LDQP, LDS), (OFF_V, OFF_QP, OFF_S), _ = layout(Bk, D, R)
    DW = D // 2  # words per row of Q/K/V
    NG_S = 4 if Bk % 32 == 0 else 2  # n-tiles (8 keys each) per A-fragment load in S = Q Kᵀ
    NG_O = 4 if D % 32 == 0 else 2  # n-tiles (8 dims each) per A-fragment load in O = P V
    ACC_S = 4 * NG_S  # accumulator registers per lane
    ACC_O = 4 * NG_O
    QW = D // 4  # Q words per thread and tile: R rows x D/2 words over 2R threads
    Q_BATCH = 4 if QW % 8 else 8
    KV_BATCH = 8
    mma = mma_bf16_m16n8k16 if bf16_in else mma_f16_m16n8k16
    pack = pack_bf16x2 if bf16_in else pack_f16x2
    BF16_PARTIALS = bf16_partials
    checks = block_checks(bf16_in)
    nonfinite_bits, clean = checks.nonfinite_bits, checks.clean
    first_nonfinite, nonfinite_sum = checks.first_nonfinite, checks.nonfinite_sum
    read_item = item_reader(paged)

    @cuda.jit(device=True, inline=True)
    def load_kv(smem, sh, k, v, kv_k, kv_v, key0, nk, h, tid):
        """The K/V block, once: K row-major, V transposed (keys past the sequence: zero).
        KV_BATCH loads are issued before the first store, so that they are in flight together.
        Every non-finite half of V is stored as +0 (masking by selection: ``P = 0`` at a key a
        row cannot see then multiplies a zero); returns uint32 1 if this thread met one."""
        bad = uint32(0)
        for base in range(0, Bk * DW, NT * KV_BATCH):
            for u in range(KV_BATCH):
                i = base + u * NT + tid
                kv_k[u] = uint32(0)
                kv_v[u] = uint32(0)
                if i < Bk * DW and i // DW < nk:
                    kv_k[u] = uint32(k[key0 + i // DW, h, i % DW])
                    kv_v[u] = uint32(v[key0 + i // DW, h, i % DW])
            for u in range(KV_BATCH):
                i = base + u * NT + tid
                if i < Bk * DW:
                    c = i // DW
                    w = i % DW
                    smem[c * LDK + w] = kv_k[u]
                    vw = kv_v[u]
                    if nonfinite_bits(vw) != uint32(0):  # the rare path
                        vw, _ = clean(vw)
                        bad = uint32(1)
                    # V[c, 2w], V[c, 2w+1] go to rows 2w, 2w+1 of Vᵀ, column c (16-bit halves)
                    sh[2 * (OFF_V + 2 * w * LDV) + c] = uint16(vw & uint32(0xFFFF))
                    sh[2 * (OFF_V + (2 * w + 1) * LDV) + c] = uint16(vw >> uint32(16))
        return bad

    @cuda.jit(device=True, inline=True)
    def gather_q(smem, q, row_t, cur, h, tid, q_words):
        """The tile's queries into sQP (the G heads of a position are contiguous in q), in
        batches of loads issued before their stores."""
        for base in range(0, QW, Q_BATCH):
            for u in range(Q_BATCH):
                i = (base + u) * NT + tid
                r = i // DW
                t = row_t[cur + r]
                q_words[u] = uint32(q[t, h * G + r % G, i % DW]) if t >= 0 else uint32(0)
            for u in range(Q_BATCH):
                i = (base + u) * NT + tid
                smem[OFF_QP + (i // DW) * LDQP + i % DW] = q_words[u]

    @cuda.jit(device=True, inline=True)
    def scores(smem, sf, a_base, r_top, r_bot, pos_top, pos_bot, key_pos0, nk, scale_log2, t4,
               keys_rt, dw_rt):
        """S = Q Kᵀ on tensor cores for the warp's 16 rows, scaled to base 2 and causally
        masked, into sS."""
        for n0 in range(0, keys_rt, 8 * NG_S):
            acc = cuda.local.array(ACC_S, float32)
            for i in range(ACC_S):
                acc[i] = float32(0.0)
            for kk in range(0, dw_rt, 8):
                a0, a1, a2, a3 = load_a_frag(smem, a_base + kk, LDQP)
                for i in range(NG_S):
                    b0, b1 = load_b_frag(smem, (n0 + 8 * i) * LDK + kk, LDK)
                    d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1, acc[4 * i], acc[4 * i + 1],
                                         acc[4 * i + 2], acc[4 * i + 3])
                    acc[4 * i] = d0
                    acc[4 * i + 1] = d1
                    acc[4 * i + 2] = d2
                    acc[4 * i + 3] = d3
            # scale to base 2 and apply the token-level causal mask
            for i in range(NG_S):
                c = n0 + 8 * i + 2 * t4
                for e in range(2):
                    cc = c + e
                    visible = cc < nk
                    score_top = _NEG_INF
                    score_bot = _NEG_INF
                    if visible and key_pos0 + cc <= pos_top:
                        score_top = acc[4 * i + e] * scale_log2
                    if visible and key_pos0 + cc <= pos_bot:
                        score_bot = acc[4 * i + 2 + e] * scale_log2
                    sf[OFF_S + r_top * LDS + cc] = score_top
                    sf[OFF_S + r_bot * LDS + cc] = score_bot

    @cuda.jit(device=True, inline=True)
    def softmax(smem, sf, half_m, half_l, row_m, tid):
        """Two threads per row (halves of the words of the row, interleaved): m = rowmax(S);
        P = 2**(S - m) as 16-bit into sQP (Q is no longer needed); l = rowsum(P) by halves."""
        r = tid // 2
        half = tid % 2
        m_local = _NEG_INF
        for w in range(half, Bk // 2, 2):
            m_local = max(m_local, max(sf[OFF_S + r * LDS + 2 * w],
                                       sf[OFF_S + r * LDS + 2 * w + 1]))
        half_m[tid] = m_local
        cuda.syncthreads()
        m = max(half_m[2 * r], half_m[2 * r + 1])
        # a row with nothing visible uses m = 0, so S - m stays -inf and P = 0 (no NaN); so
        # does a row with a +inf score, as the reference (P = inf there: l = L_s = +inf)
        m_use = m if m > _NEG_INF and m < _POS_INF else float32(0.0)
        l_local = float32(0.0)
        for w in range(half, Bk // 2, 2):
            p0 = exp2(sf[OFF_S + r * LDS + 2 * w] - m_use)
            p1 = exp2(sf[OFF_S + r * LDS + 2 * w + 1] - m_use)
            l_local += p0 + p1
            smem[OFF_QP + r * LDQP + w] = pack(p0, p1)
        half_l[tid] = l_local
        if half == 0:
            row_m[r] = m

    @cuda.jit(device=True, inline=True)
    def store_o(o_part, acc, i, d, t_top, s_top, hq_top, inv_top, t_bot, s_bot, hq_bot,
                inv_bot):
        """O_s = O / l of n-tile ``i`` of a group (columns ``d``, ``d + 1``) of both rows."""
        if BF16_PARTIALS:
            if t_top >= 0:
                o_part[s_top, t_top, hq_top, d // 2] = pack_bf16x2(
                    acc[4 * i] * inv_top, acc[4 * i + 1] * inv_top)
            if t_bot >= 0:
                o_part[s_bot, t_bot, hq_bot, d // 2] = pack_bf16x2(
                    acc[4 * i + 2] * inv_bot, acc[4 * i + 3] * inv_bot)
        else:
            if t_top >= 0:
                o_part[s_top, t_top, hq_top, d] = acc[4 * i] * inv_top
                o_part[s_top, t_top, hq_top, d + 1] = acc[4 * i + 1] * inv_top
            if t_bot >= 0:
                o_part[s_bot, t_bot, hq_bot, d] = acc[4 * i + 2] * inv_bot
                o_part[s_bot, t_bot, hq_bot, d + 1] = acc[4 * i + 3] * inv_bot

    @cuda.jit(device=True, inline=True)
    def values(smem, o_part, a_base, t4, t_top, s_top, hq_top, inv_top, t_bot, s_bot, hq_bot,
               inv_bot, keys_rt, dw_rt):
        """O = P V on tensor cores, divided by l, into the rows' slots."""
        for n0 in range(0, 2 * dw_rt, 8 * NG_O):
            acc = cuda.local.array(ACC_O, float32)
            for i in range(ACC_O):
                acc[i] = float32(0.0)
            for kk in range(0, keys_rt // 2, 8):
                a0, a1, a2, a3 = load_a_frag(smem, a_base + kk, LDQP)
                for i in range(NG_O):
                    b0, b1 = load_b_frag(smem, OFF_V + (n0 + 8 * i) * LDV + kk, LDV)
                    d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1, acc[4 * i], acc[4 * i + 1],
                                         acc[4 * i + 2], acc[4 * i + 3])
                    acc[4 * i] = d0
                    acc[4 * i + 1] = d1
                    acc[4 * i + 2] = d2
                    acc[4 * i + 3] = d3
            for i in range(NG_O):
                store_o(o_part, acc, i, n0 + 8 * i + 2 * t4, t_top, s_top, hq_top, inv_top,
                        t_bot, s_bot, hq_bot, inv_bot)

    @cuda.jit(device=True, inline=True)
    def fix_row(o_part, v, first, t4, t, s, hq, nvis, key0, h):
        """One row's elements that see a non-finite V (``first[d] < nvis``): + the sum of the
        visible non-finite ``V[c, d]`` (NaN or the infinity). Lane ``t4`` of the quad takes
        words (bf16 partials) or columns ``t4, t4 + 4, ...``."""
        if BF16_PARTIALS:
            for w in range(t4, DW, 4):
                f0 = first[2 * w]
                f1 = first[2 * w + 1]
                if f0 < nvis or f1 < nvis:
                    word = o_part[s, t, hq, w]
                    lo = bf16_to_f32(word & uint32(0xFFFF))
                    hi = bf16_to_f32(word >> uint32(16))
                    if f0 < nvis:
                        lo += nonfinite_sum(v, key0, h, 2 * w, f0, nvis)
                    if f1 < nvis:
                        hi += nonfinite_sum(v, key0, h, 2 * w + 1, f1, nvis)
                    o_part[s, t, hq, w] = pack_bf16x2(lo, hi)
        else:
            for d in range(t4, D, 4):
                f = first[d]
                if f < nvis:
                    o_part[s, t, hq, d] += nonfinite_sum(v, key0, h, d, f, nvis)

    @cuda.jit(device=True, inline=True)
    def fix_o(o_part, v, first, t4, t_top, s_top, hq_top, pos_top, t_bot, s_bot, hq_bot,
              pos_bot, key_pos0, key0, nk, h):
        """The rare path of a block with a non-finite V, after ``values``: the elements of
        this lane's two rows that see one get the reference's NaN or infinity, added to what
        ``values`` stored (a NaN it computed from a NaN score stays NaN). Rows that see none
        keep their stored values. Every lane of the warp calls it."""
        cuda.syncwarp()  # the quad's stores of the two rows are visible to its lanes
        if t_top >= 0:
            fix_row(o_part, v, first, t4, t_top, s_top, hq_top,
                    min(nk, pos_top - key_pos0 + 1), key0, h)
        if t_bot >= 0:
            fix_row(o_part, v, first, t4, t_bot, s_bot, hq_bot,
                    min(nk, pos_bot - key_pos0 + 1), key0, h)

    @cuda.jit(device=True, inline=True)
    def store_lse(lse_part, row_m, r, t, s, hq, l):
        """L_s = ln 2 * (m + log2 l) (natural log; -inf when nothing is visible, NaN or +inf
        where l is: a NaN or +inf score, which K2 then propagates)."""
        if t >= 0:
            lse = _NEG_INF
            if l != float32(0.0):
                lse = (row_m[r] + math.log2(l)) * float32(LN2)
            lse_part[s, t, hq] = lse

    @kernel_jit
    def _k1_kernel_v2(q, k, v, work, q_indices, slots, cu_q, cu_k, scale, o_part, lse_part,
                      keys_rt, dw_rt):
        smem = cuda.shared.array(0, uint32)
        sf = cuda.shared.array(0, float32)  # the same bytes, as float32 (for sS)
        sh = cuda.shared.array(0, uint16)  # the same bytes, as 16-bit halves (for sVt)
        # Row tables of two consecutive tiles (tile parity picks the half).
        row_t = cuda.shared.array(R2, int32)
        row_slot = cuda.shared.array(R2, int32)
        row_pos = cuda.shared.array(R2, int32)
        row_m = cuda.shared.array(R, float32)
        half_m = cuda.shared.array(R2, float32)
        half_l = cuda.shared.array(R2, float32)
        kv_k = cuda.local.array(KV_BATCH, uint32)
        kv_v = cuda.local.array(KV_BATCH, uint32)
        q_words = cuda.local.array(Q_BATCH, uint32)
        first_bad = cuda.shared.array(D, int32)  # per column: the block's first non-finite V
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g4 = lane // 4
        t4 = lane % 4
        topk = o_part.shape[0]
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

        # The K/V block, its non-finite V values stored as +0; the barrier ORs whether a thread
        # met one (then, the rare path, first_bad[d]: the block's first key with V[c, d]
        # non-finite, for fix_o).
        bad_v = cuda.syncthreads_or(int32(load_kv(smem, sh, k, v, kv_k, kv_v, key0, nk, kv_h,
                                                  tid)))
        if bad_v:
            first_nonfinite(first_bad, v, key0, nk, kv_h, tid, NT)

        # Pipeline: while tile i computes, the CSR entries of tile i+2 load into registers (row r
        # of the table is thread r's) and tile i+1's query rows are prefetched into L1.
        t_raw, s_raw = load_entry(q_indices, slots, h, q_begin, q_count, 0, P, G, tid, R)
        if tid < R:
            t, s, pos = check_entry(t_raw, s_raw, q_lo, q_hi, pos0, topk)
            row_t[tid] = t  # tile 0's table: the half its "cur" points to
            row_slot[tid] = s
            row_pos[tid] = pos
        t_raw, s_raw = load_entry(q_indices, slots, h, q_begin, q_count, 1, P, G, tid, R)

        for tile in range(num_tiles):
            cur = (tile % 2) * R
            nxt = R - cur
            cuda.syncthreads()  # (A) the previous tile is done with sQP, sS and its row table
            gather_q(smem, q, row_t, cur, h, tid, q_words)
            if tid < R:
                t, s, pos = check_entry(t_raw, s_raw, q_lo, q_hi, pos0, topk)
                row_t[nxt + tid] = t
                row_slot[nxt + tid] = s
                row_pos[nxt + tid] = pos
            cuda.syncthreads()  # (B)
            t_raw, s_raw = load_entry(q_indices, slots, h, q_begin, q_count, tile + 2, P, G,
                                      tid, R)
            # two threads per row of the next tile, one half-row (D words / 2) each
            t_next = row_t[nxt + tid // 2]
            if t_next >= 0:
                prefetch_l1(q, t_next, h * G + (tid // 2) % G, (tid % 2) * (DW // 2))

            # S = Q Kᵀ on tensor cores; warp w owns rows 16w .. 16w+15.
            r_top = 16 * warp + g4
            r_bot = r_top + 8
            pos_top = row_pos[cur + r_top]
            pos_bot = row_pos[cur + r_bot]
            a_base = OFF_QP + 16 * warp * LDQP
            scores(smem, sf, a_base, r_top, r_bot, pos_top, pos_bot, key_pos0, nk, scale_log2,
                   t4, keys_rt, dw_rt)
            cuda.syncthreads()
            softmax(smem, sf, half_m, half_l, row_m, tid)
            cuda.syncthreads()

            # O = P V on tensor cores, divided by l; write O_s and L_s into the row's slot.
            t_top = row_t[cur + r_top]
            t_bot = row_t[cur + r_bot]
            l_top = half_l[2 * r_top] + half_l[2 * r_top + 1]
            l_bot = half_l[2 * r_bot] + half_l[2 * r_bot + 1]
            inv_top = float32(1.0) / l_top if l_top > float32(0.0) else float32(0.0)
            inv_bot = float32(1.0) / l_bot if l_bot > float32(0.0) else float32(0.0)
            hq_top = h * G + r_top % G
            hq_bot = h * G + r_bot % G
            s_top = row_slot[cur + r_top]
            s_bot = row_slot[cur + r_bot]
            values(smem, o_part, a_base, t4, t_top, s_top, hq_top, inv_top, t_bot, s_bot,
                   hq_bot, inv_bot, keys_rt, dw_rt)
            if bad_v:  # the rows that see a non-finite V get the reference's NaN or inf
                fix_o(o_part, v, first_bad, t4, t_top, s_top, hq_top, pos_top, t_bot, s_bot,
                      hq_bot, pos_bot, key_pos0, key0, nk, kv_h)
            if t4 == 0:
                store_lse(lse_part, row_m, r_top, t_top, s_top, hq_top, l_top)
                store_lse(lse_part, row_m, r_bot, t_bot, s_bot, hq_bot, l_bot)

    return _k1_kernel_v2
