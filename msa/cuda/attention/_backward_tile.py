"""What backward versions 2 and 3 share: a tile's staging, its masks and probabilities, the
non-finite K rules and the dK/dV stores (``tile``).

Both versions are one CTA of ``Bk/16`` warps per part of a k2q CSR row, warp ``w`` owning keys
``16w .. 16w + 15`` with their dK, dV in the ``mma.sync`` C layout, and tiles of ``R = P*G`` rows
(``P`` CSR entries x the G heads). They differ in how the five products are multiplied
(``v2_backward_tensor_cores``: ``mma.sync`` with ``ldmatrix`` fragments; ``v3_backward_wgmma``:
``wgmma`` reading K, V, Q and dO from shared memory) and so in how K, V, Q and dO sit there:
rows of ``D/2 + 4`` words (``padded_layout``, conflict-free ``ldmatrix``) or 8 x 8 core
matrices (``core_layout``, the tensor cores' operand layout, ``msa.cuda._core.wgmma``). ``tile``
builds the shared device functions for one of the two layouts; everything else (the dSᵀ
buffers, the tables of a tile's rows, the register layouts) is the same.

The staging pipeline (``stage_first``, then ``stage_next`` once a tile after its barrier):
tile ``i + 2``'s CSR entries (query index, dQ slot) are copied into a ring of three slots
(``fetch_entries``) while tile ``i + 1``'s rows are staged from theirs: each row's table entry
(dq partial offset, mask limit) by plain stores, its LSE and D and its Q and dO by ``cp.async``.
So no thread waits on a global load inside the loop; the tile barrier after ``wait_all`` makes
everything visible.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

from numba import cuda, float32, int32, int64, uint32, uint64

from .._core.finite import clean_bf16x2, clean_f16x2, is_nonfinite_bf16, is_nonfinite_f16
from .._core.memops import (copy4_plain2, copy16_plain3, cp_async4, cp_async16, cp_async_commit,
                            cp_async_wait_all, no_op)
from .._core.mma import exp2, pack_bf16x2, pack_f16x2
from .._core.packed import LOG2E
from .._core.wgmma import core_word
from ._backward_parts import split_slot

_NEG_INF = float32(-math.inf)


def padded_layout(block_size: int, head_dim: int, rows: int):
    """Version 2's dynamic shared memory: sK, sV [Bk rows], two sQ and two sdO buffers [R rows]
    of ``D/2 + 4`` words (as K1 v3: 16-byte aligned rows, conflict-free ``ldmatrix``; tile i+1
    lands while tile i computes), then two dSᵀ buffers [Bk rows] of ``R/2 + 4`` words (16-bit
    pairs; tile i's dQ is computed while tile i+1 writes the other).

    Returns ``(ld, ld_ds, off_v, off_q, off_do, off_ds, total_bytes)``; buffer ``b`` of sQ
    starts at ``off_q + b R ld``, of sdO at ``off_do + b R ld``, of dSᵀ at ``off_ds + b Bk
    ld_ds``."""
    ld = head_dim // 2 + 4
    ld_ds = rows // 2 + 4
    off_v = block_size * ld
    off_q = 2 * block_size * ld
    off_do = off_q + 2 * rows * ld
    off_ds = off_do + 2 * rows * ld
    return ld, ld_ds, off_v, off_q, off_do, off_ds, 4 * (off_ds + 2 * block_size * ld_ds)


def core_layout(block_size: int, head_dim: int, rows: int):
    """Version 3's: sK, sV and sKc (K with its non-finite halves +0, written only in a block
    that holds one) ``[Bk, D]``, two sQ and two sdO buffers ``[R, D]``, all as core matrices
    (``core_word``); then version 2's two dSᵀ buffers (read by ``ldmatrix.trans``).

    Returns ``(ld_ds, off_v, off_kc, off_q, off_do, off_ds, total_bytes)``; buffer ``b`` of sQ
    starts at ``off_q + b R D / 2``, of dSᵀ at ``off_ds + b Bk ld_ds``."""
    kv = block_size * head_dim // 2
    qb = rows * head_dim // 2
    ld_ds = rows // 2 + 4
    off_v, off_kc, off_q = kv, 2 * kv, 3 * kv
    off_do = off_q + 2 * qb
    off_ds = off_do + 2 * qb
    return ld_ds, off_v, off_kc, off_q, off_do, off_ds, 4 * (off_ds + 2 * block_size * ld_ds)


def tile(block_size: int, head_dim: int, group: int, rows: int, bf16_in: bool, use_async: bool,
         core_matrices: bool):
    """The shared device functions and constants of a backward tile for (Bk, D, G, R, input
    kind, ``cp.async`` or plain loads, version 3's core matrices or version 2's padded rows):
    a ``SimpleNamespace`` (the functions are documented where they are defined)."""
    Bk, D, G, R = block_size, head_dim, group, rows
    CORE = core_matrices
    NW = Bk // 16  # warps: 16 keys each
    NT = 32 * NW
    P = R // G  # CSR entries (query positions) per tile
    FETCH_ROUNDS = -(-2 * P // NT)  # rounds of the CTA's threads over a tile's 2 P entry words
    if CORE:
        LDS, OFF_V, OFF_KC, OFF_Q, OFF_DO, OFF_DS, _ = core_layout(Bk, D, R)
        LD = D // 2  # (rows are not padded: only the sizes of the buffers use it)
    else:
        LD, LDS, OFF_V, OFF_Q, OFF_DO, OFF_DS, _ = padded_layout(Bk, D, R)
        OFF_KC = 0
    DW = D // 2  # words per row of Q/K/V/dO
    PIECES = D // 8  # 16-byte pieces per row
    # threads a row of Q and dO in ``stage`` (each copies PPT pieces; PIECES is even)
    TPR = 4 if PIECES % 4 == 0 else 2
    PPT = PIECES // TPR
    # words from one of a row's pieces to its next (TPR pieces on) in sQ / sdO
    PIECE_STEP = 32 * TPR if CORE else 4 * TPR
    NS = R // 8  # n-tiles of Sᵀ, dPᵀ (8 rows each)
    NO = D // 8  # n-tiles of dK, dV (8 dims each)
    pack = pack_bf16x2 if bf16_in else pack_f16x2
    clean = clean_bf16x2 if bf16_in else clean_f16x2
    nonfinite = is_nonfinite_bf16 if bf16_in else is_nonfinite_f16
    # the exponent bits of both 16-bit halves of a word, and the carry that adding their lowest
    # bit gives out of an all-ones exponent (inf or NaN: bits 15 and 31)
    EXP2 = uint32(0x7F807F80 if bf16_in else 0x7C007C00)
    EXP_LSB2 = uint32(0x00800080 if bf16_in else 0x04000400)
    EXP = uint32(0x7F80 if bf16_in else 0x7C00)
    QUIET = uint32(0x0040 if bf16_in else 0x0200)  # the quiet-NaN bit of a 16-bit half
    copy16 = cp_async16 if use_async else copy16_plain3
    copy4 = cp_async4 if use_async else copy4_plain2
    wait_all = cp_async_wait_all if use_async else no_op
    commit = cp_async_commit if use_async else no_op
    log2e = float32(LOG2E)
    QB = R * LD  # words per sQ / sdO buffer
    DSB = Bk * LDS  # words per dSᵀ buffer

    @cuda.jit(device=True, inline=True)
    def fetch_entries(s_idx, q_indices, slots, r, c0, e1, ring, tid):
        """Start copying the CSR entries ``c0 .. c0 + P - 1`` of row ``r`` (their query index and
        dQ slot; zeros past ``e1``) into ring slot ``ring`` of ``s_idx`` (``[3][2][P]`` int32):
        ``stage`` reads them two tiles later, after a wait and a barrier, so that no thread
        waits on a global load inside the loop."""
        for k in range(FETCH_ROUNDS):
            x = tid + k * NT
            if x >= 2 * P:
                break
            c = c0 + x % P
            ok = c < e1
            src = int32(r) * q_indices.shape[1] + (c if ok else 0)
            at = ring * 2 * P + x
            if x < P:
                copy4(s_idx, at, q_indices, src, 4 if ok else 0)
            else:
                copy4(s_idx, at, slots, src, 4 if ok else 0)

    @cuda.jit(device=True, inline=True)
    def stage(smem, s_off, s_lim, s_lse, s_dl, s_idx, q, do, lse, delta, tq, r, c0, e1, buf,
              tbuf, ring, q_lo, q_hi, pos0, key_pos0, nk, topk, tid):
        """Start loading the tile of CSR entries ``c0 ..`` (fetched into ring slot ``ring`` by
        ``fetch_entries``) into Q/dO buffer ``buf`` and table buffer ``tbuf``: ``TPR`` threads
        a row; the first of them writes the row's dq partial offset ``((slot Tq + t) Hq + h)
        D`` (-1 without a query) and mask limit by plain stores and starts the copies of its
        LSE and D (zeros without a query), and all of them start the row's Q and dO copies
        (zeros for rows without a query) by ``cp.async`` (the caller commits). A row whose LSE
        is -inf sees nothing (``row_limit``). Index arithmetic is unsigned where it can be
        (power-of-two divisions become shifts); t and the slot are checked before use."""
        hq = q.shape[1]
        for x in range(tid, R * TPR, NT):
            xu = uint32(x)
            w = xu // uint32(TPR)
            part = xu % uint32(TPR)
            e = int32(w // uint32(G))
            c = c0 + e
            h = r * G + int32(w % uint32(G))
            t = -1
            s = 0
            if c < e1:
                t = s_idx[ring * 2 * P + e]
                s = s_idx[ring * 2 * P + P + e]
                if t < q_lo or t >= q_hi or s < 0 or s >= topk:
                    t = -1  # not a query of this sequence (unvalidated input): skipped
            ok = t >= 0
            if part == 0:
                at = tbuf * R + int32(w)
                lim = -1
                off = int64(-1)
                if ok:
                    off = ((int64(s) * tq + t) * hq + h) * D
                    lim = min(pos0 + t - key_pos0, nk - 1)
                s_off[at] = off
                s_lim[at] = lim
                row = (t if ok else 0) * hq + h
                copy4(s_lse, at, lse, row, 4 if ok else 0)
                copy4(s_dl, at, delta, row, 4 if ok else 0)
            src = (uint64(t if ok else 0) * uint64(hq) + uint64(h)) * uint64(DW) \
                + uint64(part * uint32(4))
            if CORE:  # row w's 16-byte piece u at (w / 8) 4 D + u 32 + (w % 8) 4 words
                dst = uint32(buf * QB) + (w >> uint32(3)) * uint32(4 * D) \
                    + (w & uint32(7)) * uint32(4) + part * uint32(32)
            else:
                dst = uint32(buf * QB) + w * uint32(LD) + part * uint32(4)
            for i in range(PPT):
                copy16(smem, uint32(OFF_Q) + dst + uint32(PIECE_STEP * i), q,
                       src + uint64(4 * TPR * i), 16 if ok else 0)
                copy16(smem, uint32(OFF_DO) + dst + uint32(PIECE_STEP * i), do,
                       src + uint64(4 * TPR * i), 16 if ok else 0)

    @cuda.jit(device=True, inline=True)
    def stage_first(smem, s_off, s_lim, s_lse, s_dl, s_idx, q, do, lse, delta, q_indices, slots,
                    tq, r, e0, e1, q_lo, q_hi, pos0, key_pos0, nk, topk, tid):
        """The pipeline's start: the first two tiles' CSR entries (one wait, one barrier),
        then the first tile's rows into buffer 0 and table 0 (committed)."""
        fetch_entries(s_idx, q_indices, slots, r, e0, e1, 0, tid)
        fetch_entries(s_idx, q_indices, slots, r, e0 + P, e1, 1, tid)
        commit()
        wait_all()
        cuda.syncthreads()
        stage(smem, s_off, s_lim, s_lse, s_dl, s_idx, q, do, lse, delta, tq, r, e0, e1, 0, 0,
              0, q_lo, q_hi, pos0, key_pos0, nk, topk, tid)
        commit()

    @cuda.jit(device=True, inline=True)
    def stage_next(smem, s_off, s_lim, s_lse, s_dl, s_idx, q, do, lse, delta, q_indices, slots,
                   tq, r, c0, it, e1, q_lo, q_hi, pos0, key_pos0, nk, topk, tid):
        """In the iteration of tile ``it`` (entries ``c0 ..``), after its barrier: fetch tile
        ``it + 2``'s CSR entries and stage tile ``it + 1``'s rows into the other Q/dO buffer
        and the next table (committed together; the next iteration's wait and barrier make
        them visible)."""
        if c0 + 2 * P < e1:
            fetch_entries(s_idx, q_indices, slots, r, c0 + 2 * P, e1, (it + 2) % 3, tid)
        if c0 + P < e1:
            stage(smem, s_off, s_lim, s_lse, s_dl, s_idx, q, do, lse, delta, tq, r, c0 + P, e1,
                  1 - it % 2, (it + 1) % 3, (it + 1) % 3, q_lo, q_hi, pos0, key_pos0, nk, topk,
                  tid)
        commit()

    @cuda.jit(device=True, inline=True)
    def row_limit(s_lim, s_lse, w):
        """Row ``w``'s mask limit: the last key it sees (its position, the block's end), -1
        where it has no query or its LSE is -inf or NaN (it sees nothing)."""
        lim = s_lim[w]
        if not s_lse[w] > _NEG_INF:
            lim = -1
        return lim

    @cuda.jit(device=True, inline=True)
    def load_kv(smem, k, v, key_base, nk, r, hkv, tid):
        """Start copying the K/V block (keys past the sequence: zeros)."""
        for e in range(tid, Bk * PIECES, NT):
            c = e // PIECES
            w = (e % PIECES) * 4
            ok = c < nk
            src = ((key_base + (c if ok else 0)) * hkv + r) * DW + w
            if CORE:
                at = core_word(c, w, D)
                copy16(smem, at, k, src, 16 if ok else 0)
                copy16(smem, OFF_V + at, v, src, 16 if ok else 0)
            else:
                copy16(smem, c * LD + w, k, src, 16 if ok else 0)
                copy16(smem, OFF_V + c * LD + w, v, src, 16 if ok else 0)

    @cuda.jit(device=True, inline=True)
    def k_nonfinite(smem, tid):
        """Whether a 16-bit value of the K pieces this thread copied (``load_kv``'s loop, so its
        own copies: visible to it once they landed) is an inf or a NaN: per word an and, an add
        and an or (an all-ones exponent carries into the half's top bit)."""
        acc = uint32(0)
        for e in range(tid, Bk * PIECES, NT):
            if CORE:
                at = core_word(e // PIECES, (e % PIECES) * 4, D)
            else:
                at = (e // PIECES) * LD + (e % PIECES) * 4
            for x in range(4):
                acc |= (smem[at + x] & EXP2) + EXP_LSB2
        return (acc & uint32(0x80008000)) != 0

    @cuda.jit(device=True)
    def bad_keys(smem, s_kbad, s_kcol, tid):
        """``s_kbad[c]``: 1 where key ``c``'s row of the K block holds a non-finite value, else
        0; ``s_kcol[d]``: the smallest key ``c`` with a non-finite ``K[c, d]`` (Bk where there is
        none; keys past the sequence are zeros). With core matrices also sKc, the block's K with
        its non-finite halves +0, which version 3's dQ then reads (version 2 cleans its K
        fragments instead)."""
        for c in range(tid, Bk, NT):
            acc = uint32(0)
            for x in range(DW):
                if CORE:
                    acc |= (smem[core_word(c, x - x % 4, D) + x % 4] & EXP2) + EXP_LSB2
                else:
                    acc |= (smem[c * LD + x] & EXP2) + EXP_LSB2
            s_kbad[c] = 1 if (acc & uint32(0x80008000)) != 0 else 0
        for d in range(tid, D, NT):
            first = Bk
            x = d // 2
            for c in range(Bk):
                at = core_word(c, x - x % 4, D) + x % 4 if CORE else c * LD + d // 2
                if nonfinite(smem[at] >> uint32(16 * (d % 2))):
                    first = c
                    break
            s_kcol[d] = first
        if CORE:
            for e in range(tid, Bk * DW, NT):
                w, _ = clean(smem[e])
                smem[OFF_KC + e] = w

    @cuda.jit(device=True, inline=True)
    def find_bad_keys(smem, s_kbad, s_kcol, tid):
        """Masking by selection for dQ = dS K, once the K block's copies are issued: does the
        block hold an inf or a NaN? Each thread looks at the pieces it copied, one barrier makes
        the answer CTA-uniform (``s_kbad[Bk]``, and returned); only then are the bad keys and
        columns found (``bad_keys``, a slow path of its own). The answers stay in shared memory
        (read once a tile: no register held across the loop), and the loop's first barrier
        publishes them."""
        wait_all()
        k_bad = cuda.syncthreads_or(int32(1) if k_nonfinite(smem, tid) else int32(0))
        if tid == 0:
            s_kbad[Bk] = k_bad
        if k_bad != 0:
            cuda.syncthreads()  # every thread's K copies landed
            bad_keys(smem, s_kbad, s_kcol, tid)
        return k_bad

    @cuda.jit(device=True, inline=True)
    def inf_to_nan(word):
        """The two 16-bit halves of ``word``, each infinity made a NaN (its quiet bit set)."""
        w = uint32(word)
        if (w & uint32(0x7FFF)) == EXP:
            w |= QUIET
        if ((w >> uint32(16)) & uint32(0x7FFF)) == EXP:
            w |= QUIET << uint32(16)
        return w

    @cuda.jit(device=True)
    def nan_bad_ds(smem, s_kbad, ds0, warp, lane):
        """Where the block holds a non-finite K: in the dSᵀ rows of this warp's keys whose K
        row holds one, each infinity made a NaN. The reference multiplies dS by the key's
        zeroed row and then adds its product back (``_mask.attend``): inf * 0; dQ multiplies
        by K with its non-finite halves +0, so the NaN is set here."""
        cuda.syncwarp()  # the warp's lanes wrote these rows
        for x in range(lane, 16 * (R // 2), 32):
            c = 16 * warp + x // (R // 2)
            if s_kbad[c] != 0:
                at = ds0 + c * LDS + x % (R // 2)
                smem[at] = inf_to_nan(smem[at])

    @cuda.jit(device=True, inline=True)
    def probabilities(smem, s_acc, dp_acc, p_frag, ds_frag, s_lim, s_lse, s_dl, row0, ds0,
                      key_top, key_bot, t4, scale_log2):
        """Pᵀ and dSᵀ = Pᵀ (dPᵀ - D), packed to 16-bit A fragments, dSᵀ also into shared
        memory: lane element (key_top or key_bot, row 8 i + 2 t4 + e). A key past a row's
        limit (its position, the block's end, no query) gives P = 0 and dS = 0 by selection
        (not 0 times a dP that a non-finite V or D makes NaN)."""
        # unsigned table and sdSᵀ offsets (each access adds a constant, no negative-index
        # checks) and 32-bit keys against the int32 limits
        at_w = uint32(row0 + 2 * t4)
        at_top = uint32(ds0 + key_top * LDS + t4)
        at_bot = uint32(ds0 + key_bot * LDS + t4)
        k_top = int32(key_top)
        k_bot = int32(key_bot)
        for i in range(NS):
            for e in range(2):
                w = at_w + uint32(8 * i + e)
                lim = row_limit(s_lim, s_lse, w)
                l2 = s_lse[w] * log2e
                dl = s_dl[w]
                p0 = float32(0.0)
                p1 = float32(0.0)
                d0 = float32(0.0)
                d1 = float32(0.0)
                if k_top <= lim:
                    p0 = exp2(cuda.fma(s_acc[4 * i + e], scale_log2, -l2))
                    d0 = p0 * (dp_acc[4 * i + e] - dl)
                if k_bot <= lim:
                    p1 = exp2(cuda.fma(s_acc[4 * i + 2 + e], scale_log2, -l2))
                    d1 = p1 * (dp_acc[4 * i + 2 + e] - dl)
                s_acc[4 * i + e] = p0
                s_acc[4 * i + 2 + e] = p1
                dp_acc[4 * i + e] = d0
                dp_acc[4 * i + 2 + e] = d1
            p_frag[2 * i] = pack(s_acc[4 * i], s_acc[4 * i + 1])
            p_frag[2 * i + 1] = pack(s_acc[4 * i + 2], s_acc[4 * i + 3])
            ds_frag[2 * i] = pack(dp_acc[4 * i], dp_acc[4 * i + 1])
            ds_frag[2 * i + 1] = pack(dp_acc[4 * i + 2], dp_acc[4 * i + 3])
            # dSᵀ rows key_top / key_bot, the word of rows 8 i + 2 t4 and the next
            smem[at_top + uint32(4 * i)] = ds_frag[2 * i]
            smem[at_bot + uint32(4 * i)] = ds_frag[2 * i + 1]

    @cuda.jit(device=True, inline=True)
    def store_dkdv(dk, dv, dk_part, dv_part, dk_acc, dv_acc, part_ptr, hkv, r, row, part,
                   nparts, key_base, key_top, key_bot, nk, t4, scale):
        """dK = s dSᵀ Q, dV = Pᵀ dO of this part: lane element (key_top / key_bot, dim
        8 i + 2 t4 + e), added to dk, dv, or for a hot row into the part's scratch slot."""
        if nparts == 1:
            for i in range(NO):
                for e in range(2):
                    d = 8 * i + 2 * t4 + e
                    if key_top < nk:
                        dk[key_base + key_top, r, d] += dk_acc[4 * i + e] * scale
                        dv[key_base + key_top, r, d] += dv_acc[4 * i + e]
                    if key_bot < nk:
                        dk[key_base + key_bot, r, d] += dk_acc[4 * i + 2 + e] * scale
                        dv[key_base + key_bot, r, d] += dv_acc[4 * i + 2 + e]
        else:  # a hot row: this part's sums go to its scratch slot, added in part order
            slot = split_slot(part_ptr, hkv, r, row) + part
            for i in range(NO):
                for e in range(2):
                    d = 8 * i + 2 * t4 + e
                    if key_top < nk:
                        dk_part[slot, key_top * D + d] = dk_acc[4 * i + e] * scale
                        dv_part[slot, key_top * D + d] = dv_acc[4 * i + e]
                    if key_bot < nk:
                        dk_part[slot, key_bot * D + d] = dk_acc[4 * i + 2 + e] * scale
                        dv_part[slot, key_bot * D + d] = dv_acc[4 * i + 2 + e]

    return SimpleNamespace(
        NW=NW, NT=NT, P=P, LD=LD, LDS=LDS, OFF_V=OFF_V, OFF_KC=OFF_KC, OFF_Q=OFF_Q,
        OFF_DO=OFF_DO, OFF_DS=OFF_DS, NS=NS, NO=NO, QB=QB, DSB=DSB,
        wait_all=wait_all, clean=clean,
        stage_first=stage_first, stage_next=stage_next, row_limit=row_limit, load_kv=load_kv,
        find_bad_keys=find_bad_keys, nan_bad_ds=nan_bad_ds, probabilities=probabilities,
        store_dkdv=store_dkdv)
