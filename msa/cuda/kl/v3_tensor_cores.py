"""KL v3 (was v4): KV-outer on tensor cores with the work in registers, the paper's K1 order.

Per query chunk the launcher builds the k2q CSR of the selection and the hot-row schedule (work
items of at most ``2 K Bk`` queries of one key block, ``msa.cuda.schedule``); one CTA per work
item loads the key block once and walks the item's queries in tiles. Three passes, one a file:

* ``LSE^idx`` (``kl_kernel_student``, ``msa.cuda.kl.v3_student``): the index branch's row
  normalisers, the slot states ``(m, l, 0, 0)`` merged in slot order.
* the grad pass (``kl_kernel_grad``, here): ``S = Q Kᵀ`` in registers as K1 v3 (tiles of ``P``
  positions x ``G`` heads, at least 64 rows and 8 positions, ``ldmatrix``; the paper's G = 16:
  128 rows, 8 warps; on compute capability 9.0 by ``wgmma`` as K1 v4, each 4 warps a
  warpgroup reading K once from shared memory, ``TEACHER_WGMMA``), the heads' ``exp(S - LSE_h)``
  summed by a reduce-scatter of shuffles over the lanes of a position, each lane ``dS`` and the
  KL term on the keys it keeps, the slot's ``dq_idx`` partial on tensor cores (``dS`` as three
  exact 16-bit planes); two Q buffers, the next tile's rows in flight for the whole of a tile
  (161 KB at the paper's sizes: one CTA per SM). Without gradients it is ``kl_loss``'s pass (the
  KL terms only), so ``kl_loss`` and ``kl_loss_and_backward`` give the same ``kl`` bitwise.
* ``dk_idx`` (``msa.cuda.kl.v3_dk_idx``, bf16 and ``Bk <= 128``; else v2's kernel): per part
  of a key block's CSR row (a hot row cut into parts summed in order after), every dim, the
  ``dS`` rows split into three bf16 planes (exact), ``dSᵀ Q_idx`` by mma (``ldmatrix.trans``),
  32 entries a step folded into a Kahan sum, the next step staged while one computes.

Non-finite keys (docs/design.md §3: a query's ``kl`` and ``dq_idx`` never depend on a key it
cannot see). The scores ``S = Q Kᵀ`` and ``S^idx = Q_idx K_idxᵀ`` give each key its own column,
masked by selection, and the student pass needs nothing more; only ``dq_idx = dS K_idx`` sums
over the keys of a tile, where a hidden key's ``dS = 0`` times a NaN or infinite ``K_idx`` would
be NaN. So the grad pass scans its key block once when it lands (every 16-bit value of sK and
sKi of the block's ``nk`` keys, ``Bk (D + Didx) / 2`` words a CTA, then one
``syncthreads_or``): ``c_bad``, the first key with a non-finite K or K_idx value, ``Bk`` when
there is none. A block with one (the CTA takes the branch as a whole) cleans the K_idx
fragments of ``dq_idx`` (non-finite halves +0, ``msa.cuda._core.finite``), treats ``-inf``
and NaN logits of keys its rows see as visible (``dS = -P`` or NaN, a KL term of ``+inf`` or
NaN), and the positions that see key ``c_bad`` get their ``dq_idx`` partial on CUDA cores from
``dS`` and the unclean K_idx in key order: NaN, +inf and -inf where the reference has them
(``tests/cuda/test_kl.py``). Without non-finite keys every result is bitwise what it was; the
cost is the scan and a barrier per work item (at the paper's sizes 128 words a thread, against
thousands of instructions in each of the item's tiles) and a few predicated instructions per
``dS`` element and per stored ``dq_idx`` row; to be measured (``bench_kl``).

Over v2: tensor cores, and every key block read once per work item instead of once per query.
The default for fp16/bf16 with a selection, ``D``, ``Didx``, ``Bk`` multiples of 16,
``Bk <= 256`` and ``G`` in 1, 2, 4, 8, 16 whose tiles fit shared memory. Its times, and what
each of its steps gained: docs/performance.md (Sparse KL).
"""

from __future__ import annotations

import functools

from numba import cuda, float32, int32, uint32, uint64

from ..._checks import GQA_GROUP_SIZES
from .._core import mma as _mma
from .._core import wgmma as _wgmma
from .._core.arrays import SIMULATOR
from .._core.finite import (clean_bf16x2, clean_f16x2, is_nonfinite_bf16,
                            is_nonfinite_f16)
from .._core.memops import (copy16_plain2, copy16_plain3, cp_async16, cp_async_commit,
                            cp_async_wait_all, dynamic_smem_f32, dynamic_smem_u32, ldmatrix_x4,
                            ldmatrix_x4_trans, no_op, store_f32x2)
from .._core.mma import (_deal, bf16_to_f32, exp2, f16_bits_to_f32, log2, make_mma_pair,
                         mma_bf16_m16n8k16, mma_f16_m16n8k16, pack_bf16x2, pack_f16x2)
from .._core.packed import LN2, LOG2E, check_entry, item_fields, load_entry
from ._state import FULL_MASK, NEG_INF, finite_or_zero
from .._core.diskcache import kernel_jit

MAX_BLOCK_SIZE = 256
# grad tile rows R = P x G: at least TILE_ROWS (the simulator's smallest) and MIN_POSITIONS
# positions, since the student's scores and dq_idx pad the P positions to 16-row m-tiles. At
# the paper's G = 16, 8 positions (128 rows, 8 warps) against 4: kl_loss_and_backward 20.6 /
# 77.2 ms against 24.2 / 82.1 at 32K / 128K, bitwise the same (H100; benchmarks.dev.kl_tiles
# --rows 64,128 --min-positions 1)
TILE_ROWS = 16 if SIMULATOR else 64
MIN_POSITIONS = 1 if SIMULATOR else 8
# The teacher's S = Q Kᵀ on wgmma (kl_kernel_grad's teacher_wgmma), where the tile's warps form
# warpgroups (rows a multiple of 64): None (the default) runs it wherever wgmma runs (compute
# capability 9.0), mma.sync elsewhere and in the simulator; True forces it (the simulator's
# twins), False keeps mma.sync. Read per call (tests; benchmarks.dev.kl_tiles --teacher
# mma,wgmma). Bitwise the mma.sync path's; on an H100, kl_loss_and_backward 18.72 ms against
# 20.22 at 32K and 64.19 against 69.37 at 128K (196 registers, no spills; mma.sync: 174).
TEACHER_WGMMA = None


def planes_regions(positions):
    """Regions of PP rows that sE's three ``dS`` planes take: with at most 8 positions two (hi
    in rows 0-7 and mid in rows 8-15 of the first, lo in rows 0-7 of the second: ``dq_idx``
    runs two mma a product in independent chains, where three ran in one chain, half their
    rows padding); else three, a plane a region."""
    return 2 if positions <= 8 else 3


def plane_offset(plane, positions, lde):
    """Words from sE's start to row 0 of ``dS`` plane ``plane`` (0 hi, 1 mid, 2 lo)."""
    if planes_regions(positions) == 2:  # PP = 16
        return (plane // 2) * 16 * lde + (plane % 2) * 8 * lde
    return plane * -(-positions // 16) * 16 * lde


def grad_layout(block_size, head_dim, index_dim, rows, positions):
    """The grad kernel's shared memory: ``(LD, LDI, LDT, LDE), (OFF_KI, OFF_Q, OFF_QI, OFF_X,
    OFF_T, OFF_E), bytes``.

    Words: sK [Bk rows of D/2 + 4] (K, the B operand of S = Q Kᵀ), sKi [Bk rows of Didx/2 + 4]
    (K_idx, the B operand of S^idx = Q_idx K_idxᵀ and of dq_idx = dS K_idx), sQ the R query
    rows of a tile in two buffers (tile i + 1 is gathered while tile i runs), sQi two buffers of
    PP = ceil16(P) index query rows (rows past P are zeros), sE the three 16-bit planes ``hi +
    mid + lo`` of each position's ``dS`` (exact), the A operand of dq_idx, in
    ``planes_regions(P)`` regions [PP rows of Bk/2 + 4] (zeros where no plane row is:
    ``plane_offset``).
    Floats: sX [Bk keys x LDT] key-major, LDT = 4 ceil(P/4), the student logits of the tile's
    positions; sT [Bk x LDT] the teacher ``P`` where a lane keeps more than two (n-tile, row
    half) pairs of it (the dS loop would index its registers at run time), each element written
    and read by the same lane."""
    ld = head_dim // 2 + 4
    ldi = index_dim // 2 + 4
    lde = block_size // 2 + 4
    pp = -(-positions // 16) * 16
    ldt = 4 * -(-positions // 4)
    off_ki = block_size * ld
    off_q = off_ki + block_size * ldi
    off_qi = off_q + 2 * rows * ld
    off_x = off_qi + 2 * pp * ldi
    off_t = off_x + block_size * ldt
    off_e = off_t + block_size * ldt
    total = off_e + planes_regions(positions) * pp * lde
    return (ld, ldi, ldt, lde), (off_ki, off_q, off_qi, off_x, off_t, off_e), 4 * total


@functools.lru_cache(maxsize=None)
def kl_kernel_grad(bf16_in: bool, block_size: int, head_dim: int, index_dim: int,
                   group: int, positions: int, use_async: bool = True, grads: bool = True,
                   teacher_wgmma: bool = False):
    """The grad pass, the teacher in registers (``grads=False``: the KL terms only,
    ``kl_loss``'s pass; ``ds`` and ``dq_part`` are not touched).

    Per tile of ``R = P G`` rows (``P`` query positions x ``G`` heads, row ``r`` = position
    ``r // G``, head ``r % G``), warp ``w`` owning rows ``16w .. 16w + 15``:

    1. the student logits ``S^idx`` of the P positions (one mma m-tile per 16 positions, the
       n-tiles dealt to the warps) into ``sX`` (key-major), ``-inf`` where hidden;
    2. ``S = Q Kᵀ`` in registers as K1 v3, each head's ``P_h = exp(S scale - LSE_h)``;
    3. the teacher ``P = mean_h P_h`` of each position, summed over the lanes holding the
       position's rows by a reduce-scatter of shuffles (``log2 min(G, 8)`` steps, each halving
       the keys a lane keeps; the two row halves added first at G = 16);
    4. each lane, for the keys it keeps, ``dS = P^idx - P`` (into the planes of step 5 and,
       times ``coef``, into the ``ds`` buffer for the ``dk_idx`` pass) and the slot's KL term
       ``sum P (log P - S^idx + LSE^idx)`` (shuffled to one lane per position);
    5. the slot's ``dq_idx`` partial ``coef s_idx sum_j dS_j k_idx_j`` on tensor cores:
       ``dS`` split into three 16-bit planes (``hi + mid + lo``, exact; fp16 planes scaled by
       2**14 so the residuals stay normal), three mma per product, fp32 accumulation.

    Before the first tile, ``first_bad_key`` and one ``syncthreads_or`` find ``c_bad`` (module
    docstring: non-finite keys); only where it is below ``Bk`` do steps 4-5 clean and
    ``dq_rows_seeing_bad_keys`` rewrite the rows that see it.

    Outputs: ``part[0, slot, t, h]``, ``ds[t, h, slot, :]``, ``dq_part[slot, t, h, :]``, merged
    in slot order by ``msa.cuda.kl._common``'s combines."""
    Bk, D, DI, G, P = block_size, head_dim, index_dim, group, positions
    R = P * G
    NW = R // 16
    NT = 32 * NW
    assert G in GQA_GROUP_SIZES and R % 16 == 0 and NW <= _mma.MAX_WARPS
    assert D % 16 == 0 and DI % 16 == 0 and Bk % 16 == 0
    (LD, LDI, LDT, LDE), (OFF_KI, OFF_Q, OFF_QI, OFF_X, OFF_T, OFF_E), _ = grad_layout(
        Bk, D, DI, R, P)
    PP = -(-P // 16) * 16
    DW = D // 2
    DIW = DI // 2
    PIECES = DW // 4
    PIECES_I = DIW // 4
    GATHER_ITERS = R * PIECES // NT  # NT = 2R: PIECES / 2 pieces a thread
    ROW_STEP = NT // PIECES  # rows between a thread's pieces, where NT is a multiple of PIECES
    SAME_HEAD = NT % PIECES == 0 and ROW_STEP % G == 0  # a thread's piece and head stay put
    GATHER_ITERS_I = -(-(P * PIECES_I) // NT)
    QIBUF = PP * LDI
    QBUF = R * LD
    NS = Bk // 8
    S_REGS = 4 * NS  # (a local array's size must be a plain constant)
    KSTEPS = D // 16
    KSTEPS_I = DI // 16
    GG = min(G, 8)  # lanes (g4 values) sharing a position's row within one row half
    STEPS = GG.bit_length() - 1  # lane bits to sum over (g4's low bits)
    BOTH = G == 16  # the two row halves of a lane are the same position
    # The head sum is a reduce-scatter over g4's high bits first (each step halves the n-tiles
    # a lane keeps), then, when the block has fewer n-tiles than lanes to share them (small
    # blocks), an all-reduce over the remaining low bits.
    SCATTER = min(STEPS, NS.bit_length() - 1)
    RB = STEPS - SCATTER
    LEN = NS >> SCATTER  # n-tiles a lane keeps
    LOW_MASK = (1 << RB) - 1
    HALVES_DS = 1 if BOTH else 2
    USE_ST = LEN * HALVES_DS > 2  # the teacher through sT (see grad_layout)
    H1, H2, H3 = NS >> 1, NS >> 2, NS >> 3  # halves of the scatter steps (while used)
    OFF1 = 4 << (STEPS - 1) if STEPS >= 1 else 0
    OFF2 = 4 << (STEPS - 2) if STEPS >= 2 else 0
    OFF3 = 4 << (STEPS - 3) if STEPS >= 3 else 0
    MT = PP // 16
    NPAIRS = Bk // 16
    STUDENT_ITERS = -(-(MT * NPAIRS) // NW)
    PLANE = PP * LDE  # words per region of sE
    NE = planes_regions(P)
    PACKED = NE == 2  # hi and mid share a region (rows 0-7, 8-15); lo the next
    PLANE_OFF = (plane_offset(0, P, LDE), plane_offset(1, P, LDE), plane_offset(2, P, LDE))
    ACC, AFR = 16 if PACKED else 8, 4 * NE  # dq_idx: accumulators (a set a region), A frags
    NPD = DI // 16  # n-tile pairs of dq_idx (16 dims), dealt to the warps
    DQ_ITERS = -(-(MT * NPD) // NW)
    KP = Bk // 16  # k-steps of dq_idx = dS K_idx
    pack = pack_bf16x2 if bf16_in else pack_f16x2
    # fp16 planes hold dS * 2**14 (|dS| <= 1): the residuals stay clear of fp16's subnormals
    ds_up = float32(1.0) if bf16_in else float32(2.0 ** 14)
    ds_down = float32(1.0) if bf16_in else float32(2.0 ** -14)
    GRADS = grads
    # The teacher's S = Q Kᵀ on Hopper's wgmma (teacher_wgmma): each 4 warps of the tile one
    # warpgroup, Q's A fragments in registers, K read by the tensor cores from shared memory
    # stored as 8 x 8 core matrices (sK has room: Bk D/2 words of its Bk LD); the accumulator
    # layout is mma.sync's, so steps 2-5 do not change (as K1 v4 over v3).
    WGMMA = teacher_wgmma
    assert not WGMMA or NW % 4 == 0
    scores = _wgmma.make_scores_rs(Bk, "bf16" if bf16_in else "f16", KSTEPS)  # B = Kᵀ
    Q_REGS = 4 * KSTEPS
    K_GROUP_BYTES = 16 * D  # core matrices: the next 8 dims +128 B, the next 8 keys +16 D B

    mma = mma_bf16_m16n8k16 if bf16_in else mma_f16_m16n8k16
    mma_pair = make_mma_pair(mma)
    half_to_f32 = bf16_to_f32 if bf16_in else f16_bits_to_f32
    nonfinite = is_nonfinite_bf16 if bf16_in else is_nonfinite_f16
    clean = clean_bf16x2 if bf16_in else clean_f16x2
    copy16 = cp_async16 if use_async else copy16_plain3
    copy16_2d = cp_async16 if use_async else copy16_plain2
    commit = cp_async_commit if use_async else no_op
    wait_all = cp_async_wait_all if use_async else no_op
    inv_g = float32(1.0 / G)
    log2e = float32(LOG2E)
    ln2 = float32(LN2)

    @cuda.jit(device=True, inline=True)
    def load_key_block(smem, k, k_idx, h, key0, nk, tid):
        """The key block into sK and sKi (K and K_idx; keys past the sequence are 0), and
        zeros into the pad rows of both sQi buffers and into sE (where no plane row is, never
        rewritten)."""
        hkv = k.shape[1]
        for e in range(tid, Bk * PIECES, NT):
            c = e // PIECES
            w = (e % PIECES) * 4
            ok = c < nk
            dst = _wgmma.core_word(c, w, D) if WGMMA else c * LD + w  # sK's layout
            copy16(smem, dst, k, ((key0 + (c if ok else 0)) * hkv + h) * DW + w,
                   16 if ok else 0)
        for e in range(tid, Bk * PIECES_I, NT):
            c = e // PIECES_I
            w = (e % PIECES_I) * 4
            ok = c < nk
            copy16_2d(smem, OFF_KI + c * LDI + w, k_idx, (key0 + (c if ok else 0)) * DIW + w,
                      16 if ok else 0)
        for e in range(tid, 2 * (PP - P) * PIECES_I, NT):
            bb = e // ((PP - P) * PIECES_I)
            rr = P + (e // PIECES_I) % (PP - P)
            copy16_2d(smem, OFF_QI + bb * QIBUF + rr * LDI + (e % PIECES_I) * 4, k_idx, 0, 0)
        for e in range(tid, NE * PLANE, NT):  # rows no plane holds stay zero
            smem[OFF_E + e] = uint32(0)

    @cuda.jit(device=True, inline=True)
    def first_bad_key(smem, nk, tid):
        """The smallest key ``c < nk`` of this thread's share of sK and sKi whose row holds a
        non-finite 16-bit value, else ``Bk`` (one pass over the landed key block)."""
        first = Bk
        for e in range(tid, nk * DW, NT):
            c = e // DW
            w = smem[_wgmma.core_word(c, e % DW, D) + e % 4 if WGMMA else c * LD + e % DW]
            if c < first and (nonfinite(w) or nonfinite(w >> uint32(16))):
                first = c
        for e in range(tid, nk * DIW, NT):
            c = e // DIW
            w = smem[OFF_KI + c * LDI + e % DIW]
            if c < first and (nonfinite(w) or nonfinite(w >> uint32(16))):
                first = c
        return first

    @cuda.jit(device=True, inline=True)
    def dq_rows_seeing_bad_keys(smem, sf, tid, tb, pos_t, pos_s, pos_q, h, key_pos0, nk,
                                c_bad, index_scale, dq_part):
        """Only for a key block with a non-finite key (``c_bad < Bk``): the ``dq_idx``
        partials of the positions that see key ``c_bad`` (hence a non-finite K or K_idx), on
        CUDA cores, ``index_scale sum_c dS_c K_idx[c, d]`` over the keys they see in key
        order, ``coef dS`` from sX (``ds_and_kl_terms``) and ``K_idx`` as loaded: NaN and
        infinities as the reference's sums have them. ``dq_partials`` left these rows out."""
        for e in range(tid, P * DI, NT):
            p = e // DI
            d = e % DI
            t = pos_t[tb, p]
            lim = min(pos_q[tb, p] - key_pos0, nk - 1)
            if t >= 0 and c_bad <= lim:
                acc = float32(0.0)
                for c in range(lim + 1):
                    w = smem[OFF_KI + c * LDI + d // 2] >> uint32(16 * (d % 2))
                    acc += sf[OFF_X + c * LDT + p] * half_to_f32(w & uint32(0xFFFF))
                dq_part[pos_s[tb, p], t, h, d] = acc * index_scale

    @cuda.jit(device=True, inline=True)
    def record(tid, t, s, pos, tb, pos_t, pos_s, pos_q):
        """Thread ``tid < P``: position ``tid``'s ``(t, slot, pos)`` into tables ``tb``."""
        if tid < P:
            pos_t[tb, tid] = t
            pos_s[tb, tid] = s
            pos_q[tb, tid] = pos

    @cuda.jit(device=True, inline=True)
    def gather(smem, q, q_idx, h, tid, buf, tb, pos_t):
        """Start copying the query rows of the positions in tables ``tb`` (``record``, a
        barrier before) into sQ and their index queries into sQi buffers ``buf``, zeros for
        ``t = -1``. Consecutive threads copy consecutive 16-byte pieces, so a warp's copy is
        whole rows (a position's G rows are one run of ``q``): ncu (H100, 32K) had 12% of the
        stall samples behind the copies when each thread took half a row, a warp's copy
        touching 32 rows."""
        hq = q.shape[1]
        hkv = q_idx.shape[1]
        if SAME_HEAD:  # the same piece of the same head in every row a thread copies
            row0 = tid // PIECES
            p0 = row0 // G
            at = OFF_Q + buf * QBUF + row0 * LD + 4 * (tid % PIECES)
            # unsigned 64-bit word offsets: one wide multiply-add a copy
            base = uint64((h * G + row0 % G) * DW + 4 * (tid % PIECES))
            stride = uint32(hq * DW)  # words of a query (t, every head): below 2**32
            for u in range(GATHER_ITERS):
                t = pos_t[tb, p0 + u * (ROW_STEP // G)]
                ok = t >= 0
                copy16(smem, at + u * ROW_STEP * LD, q,
                       uint64(uint32(t if ok else 0)) * uint64(stride) + base,
                       16 if ok else 0)
        else:
            for u in range(GATHER_ITERS):
                c = uint32(tid) + uint32(NT * u)
                row = int32(c // uint32(PIECES))
                piece = int32(c % uint32(PIECES))
                t = pos_t[tb, row // G]
                src = ((t if t >= 0 else 0) * hq + h * G + row % G) * DW + 4 * piece
                copy16(smem, OFF_Q + buf * QBUF + row * LD + 4 * piece, q, src,
                       16 if t >= 0 else 0)
        for u in range(GATHER_ITERS_I):
            c = uint32(tid) + uint32(NT * u)
            if c < uint32(P * PIECES_I):
                p = int32(c // uint32(PIECES_I))
                piece = int32(c % uint32(PIECES_I))
                t = pos_t[tb, p]
                src = ((t if t >= 0 else 0) * hkv + h) * DIW + 4 * piece
                copy16(smem, OFF_QI + buf * QIBUF + p * LDI + 4 * piece, q_idx, src,
                       16 if t >= 0 else 0)

    @cuda.jit(device=True, inline=True)
    def row_lses(lse, lse_idx, h, r_top, r_bot, t_top, t_bot):
        """``(LSE_top, LSE_bot, LSE^idx_top, LSE^idx_bot)`` of this lane's two rows as stored
        (0 for rows without a query). Only loads: the kernel issues them a tile before the
        tile that uses them and converts the heads' with ``lse_log2`` there, so that no warp
        waits on them (ncu, H100, 32K: ~9% of the grad kernel's stall samples were on these
        loads when they were issued in their own tile, right before the teacher's mma)."""
        lse_top = float32(0.0)
        lse_bot = float32(0.0)
        li_top = float32(0.0)
        li_bot = float32(0.0)
        if t_top >= 0:
            lse_top = lse[t_top, h * G + r_top % G]
            li_top = lse_idx[t_top, h]
        if t_bot >= 0:
            lse_bot = lse[t_bot, h * G + r_bot % G]
            li_bot = lse_idx[t_bot, h]
        return lse_top, lse_bot, li_top, li_bot

    @cuda.jit(device=True, inline=True)
    def lse_log2(x):
        """A head's LSE in log2 units, an empty support's (``-inf``) as 0."""
        return finite_or_zero(x) * log2e

    @cuda.jit(device=True, inline=True)
    def student_logits(smem, sf, warp, g4, t4, ai_lane, ki_lane, buf, tb, pos_q, nk, key_pos0,
                       index_scale):
        """Step 1: ``S^idx`` of the tile's positions into sX[key, position], ``-inf`` on
        hidden keys; the (m-tile, n-tile pair) units dealt to the warps, every warp running
        the same mma count."""
        for it in range(STUDENT_ITERS):
            real, mt, n2 = _deal(warp, it, NW, MT * NPAIRS, NPAIRS)
            c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = float32(0.0)
            qa = OFF_QI + buf * QIBUF + 16 * mt * LDI + ai_lane
            for ks in range(KSTEPS_I):
                a0, a1, a2, a3 = ldmatrix_x4(smem, qa + 8 * ks)
                b0, b1, b2, b3 = ldmatrix_x4(smem, ki_lane + 16 * n2 * LDI + 8 * ks)
                c0, c1, c2, c3 = mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
                c4, c5, c6, c7 = mma(a0, a1, a2, a3, b2, b3, c4, c5, c6, c7)
            if real:
                # key c = c_lane + 8 nn + e is visible to position p where it is at most
                # min(pos_q[p] - key_pos0, nk - 1); 32-bit limits relative to c_lane and one
                # unsigned sX offset a row, so each store adds only a constant
                pt = 16 * mt + g4
                c_lane = 16 * n2 + 2 * t4
                for r8 in range(2):
                    p = pt + 8 * r8
                    if p < P:
                        rel = int32(min(pos_q[tb, p] - key_pos0, nk - 1) - c_lane)
                        at = uint32(OFF_X + c_lane * LDT + p)
                        for nn in range(2):
                            for e in range(2):
                                if nn == 0:
                                    v = (c0 if e == 0 else c1) if r8 == 0 else \
                                        (c2 if e == 0 else c3)
                                else:
                                    v = (c4 if e == 0 else c5) if r8 == 0 else \
                                        (c6 if e == 0 else c7)
                                x = NEG_INF
                                if int32(8 * nn + e) <= rel:
                                    x = v * index_scale
                                sf[at + uint32((8 * nn + e) * LDT)] = x

    @cuda.jit(device=True, inline=True)
    def teacher_probs(smem, s_acc, q_frag, a_lane, k_lane, k_desc, t4, pos_top, pos_bot,
                      key_pos0, nk, scale_log2, lse_top, lse_bot, buf):
        """Step 2: ``S = Q Kᵀ`` of the warp's 16 rows in ``s_acc`` (mma accumulators), then
        each head's ``P_h = exp(S scale - LSE_h)`` on visible keys, 0 elsewhere (at G = 16
        the bottom row half added into the top: the same position)."""
        qa = OFF_Q + buf * QBUF + a_lane
        if WGMMA:  # the warpgroup's 64 x Bk scores in KSTEPS wgmma, K from shared memory
            scores(smem, q_frag, s_acc, qa, k_desc)
        else:
            for i in range(4 * NS):
                s_acc[i] = float32(0.0)
            for ks in range(KSTEPS):
                a0, a1, a2, a3 = ldmatrix_x4(smem, qa + 8 * ks)
                for n2 in range(NS // 2):
                    b0, b1, b2, b3 = ldmatrix_x4(smem, k_lane + 16 * n2 * LD + 8 * ks)
                    n = 8 * n2
                    mma_pair(s_acc, n, a0, a1, a2, a3, b0, b1, b2, b3)
        # key 8 i + 2 t4 + e is visible up to lim = min(pos - key_pos0, nk - 1). Only a block
        # that reaches past a row's position (its local block, or a sequence's last, partial
        # one) needs the compares, as in K1's softmax: skipped when both rows see every key
        # (at G = 16 a warp's rows are one position, so the branch is the warp's).
        lim_top = int32(min(pos_top - key_pos0, nk - 1))
        lim_bot = int32(min(pos_bot - key_pos0, nk - 1))
        if lim_top >= Bk - 1 and lim_bot >= Bk - 1:
            for i in range(NS):
                for e in range(2):
                    x_top = exp2(s_acc[4 * i + e] * scale_log2 - lse_top)
                    x_bot = exp2(s_acc[4 * i + 2 + e] * scale_log2 - lse_bot)
                    if BOTH:  # G = 16: both row halves are heads of the same position
                        x_top += x_bot
                    s_acc[4 * i + e] = x_top
                    s_acc[4 * i + 2 + e] = x_bot
        else:
            # 32-bit limits relative to the lane's first key, against constants once
            # unrolled; every exp2 runs (a hidden key's value, inf or NaN included, is then
            # dropped by the select)
            rel_top = lim_top - int32(2 * t4)
            rel_bot = lim_bot - int32(2 * t4)
            for i in range(NS):
                for e in range(2):
                    c = int32(8 * i + e)
                    x_top = exp2(s_acc[4 * i + e] * scale_log2 - lse_top)
                    x_bot = exp2(s_acc[4 * i + 2 + e] * scale_log2 - lse_bot)
                    v_top = x_top if c <= rel_top else float32(0.0)
                    v_bot = x_bot if c <= rel_bot else float32(0.0)
                    if BOTH:
                        v_top += v_bot
                    s_acc[4 * i + e] = v_top
                    s_acc[4 * i + 2 + e] = v_bot

    @cuda.jit(device=True, inline=True)
    def scatter_step(s_acc, half_len, off):
        """One reduce-scatter step over lane bit ``off``: n-tiles ``[0, 2 half_len)`` of both
        row halves -> this lane keeps the lower half (its bit 0) or the upper, summed with its
        partner's, in ``[0, half_len)``."""
        upper = (cuda.threadIdx.x & off) != 0
        for j in range(half_len):
            for x in range(4):  # top e = 0, 1; bottom e = 0, 1
                a = s_acc[4 * j + x]
                b = s_acc[4 * (j + half_len) + x]
                send = a if upper else b
                keep = b if upper else a
                if BOTH and x >= 2:
                    continue  # G = 16: the bottom half was added into the top
                s_acc[4 * j + x] = keep + cuda.shfl_xor_sync(FULL_MASK, send, off)

    @cuda.jit(device=True, inline=True)
    def head_sum(s_acc, sf, u_own, t4, p_top, p_bot):
        """Step 3: ``sum_h P_h`` over the lanes holding a position's rows, a reduce-scatter
        then an all-reduce (see SCATTER): n-tile ``j < LEN`` of ``s_acc`` becomes n-tile
        ``(u_own >> RB) LEN + j`` of the block; through sT where USE_ST."""
        if SCATTER >= 1:
            scatter_step(s_acc, H1, OFF1)
        if SCATTER >= 2:
            scatter_step(s_acc, H2, OFF2)
        if SCATTER >= 3:
            scatter_step(s_acc, H3, OFF3)
        off = 4
        for _ in range(RB):
            for j in range(LEN):
                for x in range(4):
                    if not (BOTH and x >= 2):
                        s_acc[4 * j + x] += cuda.shfl_xor_sync(FULL_MASK, s_acc[4 * j + x],
                                                               off)
            off *= 2
        if USE_ST:
            for j in range(LEN):
                c = 8 * ((u_own >> RB) * LEN + j) + 2 * t4
                for x in range(2 * HALVES_DS):
                    pp = p_top if x < 2 else p_bot
                    sf[OFF_T + (c + x % 2) * LDT + pp] = s_acc[4 * j + x]

    @cuda.jit(device=True, inline=True)
    def ds_and_kl_terms(smem, sf, s_acc, ds, part, h, coef, u_own, t4, p_top, p_bot, li_top,
                        li_bot, t_top, t_bot, s_top, s_bot, lim_top, lim_bot, c_bad):
        """Step 4: on this lane's share of the keys ``dS = P^idx - P`` (times ``coef`` into
        the ``ds`` buffer, and as ``hi + mid + lo`` 16-bit planes into sE for step 5) and the
        slot's KL term ``sum P (log P - S^idx + LSE^idx)``, summed over the lanes sharing a
        position into ``part[0, slot, t, h]``. Without GRADS the KL terms only.

        A key is visible where its logit is not ``-inf``; in a block with a non-finite key
        (``c_bad < Bk``) also where its position is (``c <= lim``): a visible ``-inf`` or NaN
        logit then gives the reference's ``dS = -P`` (or NaN) and KL term ``+inf`` (or NaN),
        and ``coef dS`` goes to sX for ``dq_rows_seeing_bad_keys``. A NaN teacher gives a NaN
        term (``not (P <= 0)``)."""
        kl_top = float32(0.0)
        kl_bot = float32(0.0)
        own = (u_own & LOW_MASK) == 0  # one lane of those holding the same sums
        c_lane = 8 * (u_own >> RB) * LEN + 2 * t4  # this lane's first key; n-tile j adds 8 j
        # unsigned offsets of the row halves' first elements in sX, sT, the planes and ds, so
        # that each access adds only a constant (t, slot, h are in range: no wrap-around)
        hkv = ds.shape[1]
        topk = ds.shape[2]
        for half in range(1 if BOTH else 2):
            pp = p_top if half == 0 else p_bot
            li = li_top if half == 0 else li_bot
            lim = lim_top if half == 0 else lim_bot
            t = t_top if half == 0 else t_bot
            sl = s_top if half == 0 else s_bot
            at_x = uint32(OFF_X + c_lane * LDT + pp)
            at_t = uint32(OFF_T + c_lane * LDT + pp)
            at_e = uint32(OFF_E + pp * LDE + c_lane // 2)
            at_ds = uint64(0)
            if t >= 0:
                at_ds = ((uint64(t) * uint64(hkv) + uint64(h)) * uint64(topk)
                         + uint64(sl)) * uint64(Bk) + uint64(c_lane)
            kl_acc = float32(0.0)
            for j in range(LEN):
                ds0 = float32(0.0)
                ds1 = float32(0.0)
                for e in range(2):
                    if USE_ST:
                        pj = sf[at_t + uint32((8 * j + e) * LDT)] * inv_g
                    else:
                        pj = s_acc[4 * j + 2 * half + e] * inv_g
                    x = sf[at_x + uint32((8 * j + e) * LDT)]
                    dsv = float32(0.0)
                    klv = float32(0.0)
                    visible = x > NEG_INF
                    if c_bad < Bk and not visible:
                        visible = c_lane + 8 * j + e <= lim
                    if own and visible:
                        # the student's log-probability r = x - li; exp and log by
                        # ex2.approx / lg2.approx: absolute errors ~1e-7 in P^idx and in
                        # log P, where libdevice's expf and logf cost ~10 and ~30
                        # instructions a key
                        r = x - li
                        if GRADS:
                            dsv = exp2(r * log2e) - pj
                        if not (pj <= float32(0.0)):
                            klv = pj * (log2(pj) * ln2 - r)
                    if own and GRADS and c_bad < Bk:
                        sf[at_x + uint32((8 * j + e) * LDT)] = coef * dsv
                    if e == 0:
                        ds0 = dsv
                    else:
                        ds1 = dsv
                    kl_acc += klv
                if own and GRADS:
                    if t >= 0:
                        store_f32x2(ds, at_ds + uint64(8 * j), coef * ds0, coef * ds1)
                    # dS (keys c, c + 1) as hi + mid + lo 16-bit pairs, row pp of the planes
                    xa = ds0 * ds_up
                    xb = ds1 * ds_up
                    for plane in range(3):
                        word = pack(xa, xb)
                        smem[at_e + uint32(PLANE_OFF[plane] + 4 * j)] = word
                        xa = xa - half_to_f32(word & uint32(0xFFFF))
                        xb = xb - half_to_f32(word >> uint32(16))
            if half == 0:
                kl_top = kl_acc
            else:
                kl_bot = kl_acc
        # over the lanes sharing a position: t4 (offsets 1, 2) and u_own (4 .. 2 GG)
        off = 1
        for _ in range(2 + STEPS):
            kl_top += cuda.shfl_xor_sync(FULL_MASK, kl_top, off)
            kl_bot += cuda.shfl_xor_sync(FULL_MASK, kl_bot, off)
            off *= 2
        if t4 == 0 and u_own == 0:
            if t_top >= 0:
                part[0, s_top, t_top, h] = kl_top
            if t_bot >= 0 and not BOTH:
                part[0, s_bot, t_bot, h] = kl_bot

    @cuda.jit(device=True, inline=True)
    def dq_partials(smem, acc, afr, warp, lane, g4, t4, l_rows, vi_lane, tb, pos_t, pos_s, h,
                    cqs, dq_part, pos_q, key_pos0, nk, c_bad):
        """Step 5: the slots' ``dq_idx`` partials ``coef s_idx dS K_idx`` on tensor cores, A =
        sE's regions (exact products; PACKED: hi and mid in one m-tile, lo in the next, two
        independent chains of mma summed at the end), B = K_idx by ``ldmatrix.trans`` (K1's V);
        (m-tile, n-tile pair) units dealt to the warps, every warp running the same mma
        count. ``acc``, ``afr``: the caller's register arrays.

        In a block with a non-finite key (``c_bad < Bk``) the B fragments are cleaned
        (non-finite halves +0), so that ``0 * NaN`` never reaches a row that does not see
        the key (its ``dS`` there is 0), and the rows that see key ``c_bad`` are not written
        (``dq_rows_seeing_bad_keys`` writes them)."""
        for it in range(DQ_ITERS):
            real, mt, n2 = _deal(warp, it, NW, MT * NPD, NPD)
            for i in range(ACC):
                acc[i] = float32(0.0)
            for kp in range(KP):
                for r in range(NE):
                    a0, a1, a2, a3 = ldmatrix_x4(
                        smem, OFF_E + r * PLANE + (16 * mt + l_rows) * LDE
                        + (lane >> 4) * 4 + 8 * kp)
                    afr[4 * r] = a0
                    afr[4 * r + 1] = a1
                    afr[4 * r + 2] = a2
                    afr[4 * r + 3] = a3
                b0, b1, b2, b3 = ldmatrix_x4_trans(smem, vi_lane + 16 * kp * LDI + 8 * n2)
                if c_bad < Bk:
                    b0, _ = clean(b0)
                    b1, _ = clean(b1)
                    b2, _ = clean(b2)
                    b3, _ = clean(b3)
                for r in range(NE):
                    o = 8 * r if PACKED else 0  # a chain a region, or one for the planes
                    c0, c1, c2, c3 = mma(afr[4 * r], afr[4 * r + 1], afr[4 * r + 2],
                                         afr[4 * r + 3], b0, b1,
                                         acc[o], acc[o + 1], acc[o + 2], acc[o + 3])
                    acc[o] = c0
                    acc[o + 1] = c1
                    acc[o + 2] = c2
                    acc[o + 3] = c3
                    c0, c1, c2, c3 = mma(afr[4 * r], afr[4 * r + 1], afr[4 * r + 2],
                                         afr[4 * r + 3], b2, b3,
                                         acc[o + 4], acc[o + 5], acc[o + 6], acc[o + 7])
                    acc[o + 4] = c0
                    acc[o + 5] = c1
                    acc[o + 6] = c2
                    acc[o + 7] = c3
            if real:
                # C layout: rows 16 mt + g4 (+8), dims 16 n2 + 8 nn + 2 t4 (+1); PACKED:
                # position g4's hi in row g4, mid in row g4 + 8, lo in row g4 of region 1
                for r8 in range(1 if PACKED else 2):
                    p = 16 * mt + g4 + 8 * r8
                    if p < P:
                        t = pos_t[tb, p]
                        if c_bad < Bk and c_bad <= min(pos_q[tb, p] - key_pos0, nk - 1):
                            t = -1  # written by dq_rows_seeing_bad_keys
                        if t >= 0:
                            # one unsigned row offset, two 64-bit stores (dims d, d + 1)
                            at = ((uint64(pos_s[tb, p]) * uint64(dq_part.shape[1])
                                   + uint64(t)) * uint64(dq_part.shape[2]) + uint64(h)) \
                                * uint64(DI) + uint64(16 * n2 + 2 * t4)
                            for nn in range(2):
                                if PACKED:
                                    v0 = acc[4 * nn] + acc[4 * nn + 2] + acc[8 + 4 * nn]
                                    v1 = acc[4 * nn + 1] + acc[4 * nn + 3] \
                                        + acc[8 + 4 * nn + 1]
                                else:
                                    v0 = acc[4 * nn + 2 * r8]
                                    v1 = acc[4 * nn + 2 * r8 + 1]
                                store_f32x2(dq_part, at + uint64(8 * nn), v0 * cqs, v1 * cqs)

    @kernel_jit
    def _kl_kernel_grad_v3(q, k, q_idx, k_idx, lse, lse_idx, work, q_indices, slots, cu_q,
                           cu_k, scale_log2, index_scale, coef, part, ds, dq_part):
        smem = dynamic_smem_u32()
        sf = dynamic_smem_f32()
        pos_t = cuda.shared.array((3, P), int32)  # tables of tiles i, i + 1, i + 2
        pos_s = cuda.shared.array((3, P), int32)
        pos_q = cuda.shared.array((3, P), int32)
        s_bad = cuda.shared.array(1, int32)
        s_acc = cuda.local.array(S_REGS, float32)
        q_frag = cuda.local.array(Q_REGS, uint32)  # Q's A fragments (teacher_wgmma)
        acc = cuda.local.array(ACC, float32)
        afr = cuda.local.array(AFR, uint32)  # A fragments of sE's regions
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g4 = lane // 4
        t4 = lane % 4
        topk = part.shape[1]  # (ds is a dummy without gradients)
        hkv = k.shape[1]
        h, q_begin, q_count, b, j, key0, nk = item_fields(
            work, cuda.blockIdx.x, q_indices, cu_k, hkv, Bk)
        if q_count <= 0:
            return
        key_pos0 = j * Bk
        q_lo = int(cu_q[b])
        q_hi = int(cu_q[b + 1])
        pos0 = (int(cu_k[b + 1]) - int(cu_k[b])) - (q_hi - q_lo)
        num_tiles = (q_count + P - 1) // P
        cqs = coef * index_scale * ds_down
        if tid == 0:
            s_bad[0] = Bk

        load_key_block(smem, k, k_idx, h, key0, nk, tid)
        # the tables of tiles 0 and 1 (thread p: position p), then tile 0's rows; tile 2's
        # entries
        for u in range(2):
            e_t, e_s = load_entry(q_indices, slots, h, q_begin, q_count, u, P, 1, tid, P)
            t_g, s_g, p_g = check_entry(e_t, e_s, q_lo, q_hi, pos0, topk)
            record(tid, t_g, s_g, p_g, u, pos_t, pos_s, pos_q)
        e_t, e_s = load_entry(q_indices, slots, h, q_begin, q_count, 2, P, 1, tid, P)
        cuda.syncthreads()
        gather(smem, q, q_idx, h, tid, 0, 0, pos_t)
        commit()

        r_top = 16 * warp + g4
        r_bot = r_top + 8
        p_top = r_top // G  # the rows' positions in the tile
        p_bot = r_bot // G
        tt_raw, st_raw = load_entry(q_indices, slots, h, q_begin, q_count, 0, P, G, r_top, R)
        tb_raw, sb_raw = load_entry(q_indices, slots, h, q_begin, q_count, 0, P, G, r_bot, R)
        t_top, _, _ = check_entry(tt_raw, st_raw, q_lo, q_hi, pos0, topk)
        t_bot, _, _ = check_entry(tb_raw, sb_raw, q_lo, q_hi, pos0, topk)
        lse_top, lse_bot, li_top, li_bot = row_lses(lse, lse_idx, h, r_top, r_bot, t_top, t_bot)
        l_rows = ((lane >> 3) & 1) * 8 + (lane & 7)
        a_lane = (16 * warp + l_rows) * LD + (lane >> 4) * 4
        k_lane = ((lane >> 4) * 8 + (lane & 7)) * LD + ((lane >> 3) & 1) * 4
        k_desc = uint64(0)
        if WGMMA:
            k_desc = _wgmma.smem_desc(_wgmma.shared_address(smem, 0), 128, K_GROUP_BYTES)
        ai_lane = l_rows * LDI + (lane >> 4) * 4
        ki_lane = OFF_KI + ((lane >> 4) * 8 + (lane & 7)) * LDI + ((lane >> 3) & 1) * 4
        vi_lane = OFF_KI + l_rows * LDI + (lane >> 4) * 4  # K_idx as the B of dq_idx (.trans)
        u_own = g4 % GG  # this lane among the GG holding a position's rows (one row half)

        # Masking by selection (docs/design.md §3): c_bad, the first key of the block with a
        # non-finite K or K_idx value (Bk: none, the common path), the same for the CTA
        wait_all()
        if WGMMA:  # sK came through the generic proxy; wgmma reads it through the async one
            _wgmma.fence_proxy_async()
        cuda.syncthreads()
        mine = first_bad_key(smem, nk, tid)
        c_bad = Bk
        if cuda.syncthreads_or(int32(1) if mine < Bk else int32(0)):
            if mine < Bk:
                cuda.atomic.min(s_bad, 0, int32(mine))
            cuda.syncthreads()
            c_bad = int(s_bad[0])

        for tile in range(num_tiles):
            buf = tile % 2  # the tile's sQ and sQi buffers
            tb = tile % 3  # its tables
            wait_all()
            cuda.syncthreads()  # tile's rows landed; every warp is past tile - 1
            # the next tile's rows (their tables recorded a tile ago; tile - 1 read those
            # buffers before its first barrier), in flight for a whole tile
            if tile + 1 < num_tiles:
                gather(smem, q, q_idx, h, tid, 1 - buf, (tile + 1) % 3, pos_t)
            commit()
            if tile + 2 < num_tiles:  # tile + 2's tables (tile - 1's, free)
                t_g, s_g, p_g = check_entry(e_t, e_s, q_lo, q_hi, pos0, topk)
                record(tid, t_g, s_g, p_g, (tile + 2) % 3, pos_t, pos_s, pos_q)
            e_t, e_s = load_entry(q_indices, slots, h, q_begin, q_count, tile + 3, P, 1, tid, P)
            t_top, s_top, pos_top = check_entry(tt_raw, st_raw, q_lo, q_hi, pos0, topk)
            t_bot, s_bot, pos_bot = check_entry(tb_raw, sb_raw, q_lo, q_hi, pos0, topk)
            tt_raw, st_raw = load_entry(q_indices, slots, h, q_begin, q_count, tile + 1, P, G,
                                         r_top, R)
            tb_raw, sb_raw = load_entry(q_indices, slots, h, q_begin, q_count, tile + 1, P, G,
                                         r_bot, R)

            # 1-3: S^idx into sX; P = mean_h exp(S scale - LSE_h), this lane's share of keys
            student_logits(smem, sf, warp, g4, t4, ai_lane, ki_lane, buf, tb, pos_q, nk,
                           key_pos0, index_scale)
            teacher_probs(smem, s_acc, q_frag, a_lane, k_lane, k_desc, t4, pos_top, pos_bot,
                          key_pos0, nk, scale_log2, lse_log2(lse_top), lse_log2(lse_bot), buf)
            head_sum(s_acc, sf, u_own, t4, p_top, p_bot)
            cuda.syncthreads()  # sX holds every position's student logits

            # 4-5: dS and the KL terms; dq_idx = dS K_idx
            ds_and_kl_terms(smem, sf, s_acc, ds, part, h, coef, u_own, t4, p_top, p_bot, li_top,
                            li_bot, t_top, t_bot, s_top, s_bot,
                            min(pos_top - key_pos0, nk - 1), min(pos_bot - key_pos0, nk - 1),
                            c_bad)
            # the next tile's rows' LSEs (its entries landed a while ago), used a tile later
            n_top, _, _ = check_entry(tt_raw, st_raw, q_lo, q_hi, pos0, topk)
            n_bot, _, _ = check_entry(tb_raw, sb_raw, q_lo, q_hi, pos0, topk)
            lse_top, lse_bot, li_top, li_bot = row_lses(lse, lse_idx, h, r_top, r_bot, n_top,
                                                        n_bot)
            if not GRADS:
                continue
            cuda.syncthreads()  # the planes hold dS of every position
            dq_partials(smem, acc, afr, warp, lane, g4, t4, l_rows, vi_lane, tb, pos_t, pos_s,
                        h, cqs, dq_part, pos_q, key_pos0, nk, c_bad)
            if c_bad < Bk:  # the same for the CTA
                dq_rows_seeing_bad_keys(smem, sf, tid, tb, pos_t, pos_s, pos_q, h, key_pos0, nk,
                                        c_bad, index_scale, dq_part)

    return _kl_kernel_grad_v3
