"""KL v3's dk_idx pass on tensor cores (bf16): ``dk_idx = s_idx dSᵀ Q_idx`` per key block, from
the ``dS`` buffer of the grad pass (``msa.cuda.kl.v3_tensor_cores``), in CSR order.

``dS`` is split into three bf16 planes (``hi + mid + lo``: 3 x 8 significand bits, exact), so
the mma's products are those of fp32; each step's 32 entries (6 mma deep) are folded into a
Kahan-compensated total, as v2 folds its runs. fp16 planes would underflow (``dS`` is ``coef``
times a probability difference): fp16 inputs, and blocks over 128 keys, take v2's kernel.

A CTA takes a part of a key block's CSR row (the row's groups' entries one after another, at
most ``KEYS_PART_ENTRIES``) and every dim (``keys_layout``: 16 warps at the paper's Bk = Didx =
128, 8 along the keys x 2 of 64 dims), so each ``dS`` row is read and split once. A row of one
part adds into ``dk_idx``; the parts of a longer row (a sink block that every query picks holds
``Tq Hkv`` entries) run side by side and write scratch slots that ``keys_sum_kernel`` adds in
part order (``keys_parts_kernel`` and a scan find the parts on the device). Against a CTA a
whole row and 64 dims (two CTAs of 8 warps an SM), ``kl_loss_and_backward`` on an H200
(``benchmarks.dev.kl_tiles``, one call; the parts then summed a CTA a row): 52.34 -> 51.90 ms at
128K and 16.08 -> 14.56 at 32K on ``bench_kl``'s uniform selection; on ``bench_attention``'s
sink+local+random (in a tree that also held a student-pass change with bitwise the same
outputs) 95.08 -> 53.64 and 25.19 -> 14.66: the sink row on one CTA outlasted the whole pass.
"""

from __future__ import annotations

import functools

from numba import cuda, float32, int64, uint32, uint64

from .._core import mma as _mma
from .._core.memops import (copy16_plain3, cp_async16, cp_async_commit, cp_async_wait_all,
                            dynamic_smem_u32, ldmatrix_x4_trans, load_f32x4, no_op)
from .._core.mma import bf16_to_f32, make_mma_pair, mma_bf16_m16n8k16, pack_bf16x2
from .._core.arrays import SIMULATOR
from ._state import kahan_add, sequence_of
from .._core.diskcache import kernel_jit

KEYS_ENTRIES = 32  # CSR entries staged per step (two k-steps of 16)
KEYS_DIMS = 64  # dims of dk_idx per warp: 3 x 32 accumulators per lane
KEYS_WARPS = 16  # warps a CTA at most (128 registers a thread)
# CSR entries a CTA at most (a part of a row; the rows' entries over every group): a hot row
# (a sink block every query picks: Tq Hkv entries) is cut into parts that run side by side and
# write scratch slots, which keys_sum_kernel adds in part order. A multiple of KEYS_ENTRIES;
# small in the simulator, so that its tests cut rows too.
KEYS_PART_ENTRIES = 64 if SIMULATOR else 4096
SUM_THREADS = 32 if SIMULATOR else 128  # keys_sum_kernel's CTA


def keys_layout(block_size, index_dim):
    """The dk_idx kernel's geometry: ``(LDE, LDQ, OFF_Q, bytes, dims, threads)``.

    A warp owns 16 keys and ``KEYS_DIMS`` dims; a CTA the whole key block and as many warps of
    dims as ``KEYS_WARPS`` allow (``dims`` dims: all of them at the paper's Bk = Didx = 128, 16
    warps), so that each ``dS`` row is read and split once; more dims are a grid axis. Shared
    memory (words): three bf16 planes (hi, mid, lo) x two buffers of E entries x ``Bk/2 + 4``,
    then two buffers of E index query rows of the CTA's ``dims`` dims (``dims/2 + 4`` words
    each)."""
    warp_dims = min(KEYS_DIMS, index_dim)
    key_warps = block_size // 16
    parts = max(1, index_dim // warp_dims)
    per_cta = max(c for c in range(1, parts + 1)
                  if parts % c == 0 and (c == 1 or c * key_warps <= KEYS_WARPS))
    dims = per_cta * warp_dims
    lde = block_size // 2 + 4
    ldq = dims // 2 + 4
    off_q = 6 * KEYS_ENTRIES * lde
    return lde, ldq, off_q, 4 * (off_q + 2 * KEYS_ENTRIES * ldq), dims, 32 * key_warps * per_cta


def keys_supported(kind, block_size, index_dim):
    """The kernel needs bf16 (fp16 planes would underflow: ``dS`` is ``coef`` times
    a probability difference), at most 8 warps of 16 keys and whole warps of dims."""
    dims = min(KEYS_DIMS, index_dim)
    return (kind == "bfloat16" and block_size % 16 == 0 and block_size <= 128
            and index_dim % 16 == 0 and index_dim % dims == 0)


@functools.lru_cache(maxsize=None)
def kl_kernel_keys(block_size: int, index_dim: int, use_async: bool = True):
    """Backward pass 2: ``dk_idx[key, d] += s_idx sum_{r, (t, s)} dS[t, r, s, key]
    q_idx[t, r, d]`` for one key block and ``dims`` dims per CTA (``keys_layout``), on tensor
    cores.

    The row's CSR entries of every group, in order, 32 at a time: their ``dS`` rows (fp32,
    from the buffer) are split into ``hi + mid + lo`` bf16 planes (exact: 3 x 8 significand
    bits) stored entry-major, their index queries copied by ``cp.async``; warp ``w`` owns keys
    ``16 (w % NW) .. 16 (w % NW) + 15`` and the ``KEYS_DIMS`` dims from ``KEYS_DIMS (w // NW)``
    of the CTA's: ``A = dSᵀ`` and ``B = Q_idx`` both by ``ldmatrix.trans``, three mma per
    product. Each step's sum (6 mma deep) is folded into a Kahan-compensated total, as v2 folds
    its runs. The next step's ``dS`` rows are loaded into registers and its queries copied while
    this step computes. The CTA takes part ``pid`` of ``part_ptr[0]`` (``keys_parts_kernel``):
    the row's entries ``pid_in_row * part_size ..`` over its groups in order; a row of one part
    adds its sums into ``dk``, a row of several writes its scratch slot of ``dk_part``."""
    mma_pair_bf16 = make_mma_pair(mma_bf16_m16n8k16)
    Bk, DI = block_size, index_dim
    NW = Bk // 16  # warps along the keys
    E = KEYS_ENTRIES
    LDE, LDQ, OFF_Q, _, DPC, NT = keys_layout(Bk, DI)
    WD = min(KEYS_DIMS, DI)  # dims a warp
    assert Bk % 16 == 0 and NW <= _mma.MAX_WARPS and WD % 16 == 0 and DPC % WD == 0
    NN = WD // 8
    ACC = 4 * NN
    PLANE = E * LDE  # words per plane buffer
    QB = E * LDQ
    DSP = E * (Bk // 4)  # 16-byte pieces of a step's dS rows
    DSPT = -(-DSP // NT)  # per thread
    DSR = 4 * DSPT
    QP = E * (DPC // 8)  # 16-byte pieces of a step's index queries
    DIW = DI // 2
    copy16 = cp_async16 if use_async else copy16_plain3
    commit = cp_async_commit if use_async else no_op
    wait_all = cp_async_wait_all if use_async else no_op
    # 16 warps an SM (the paper's Bk = Didx = 128: one CTA; 129 registers uncapped)
    options = {} if SIMULATOR else {"max_registers": 65536 // (32 * KEYS_WARPS)}

    @cuda.jit(device=True, inline=True)
    def entry(q_indices, slots, r, first, count, e, tq, topk):
        """``(t, slot)`` of entry ``e`` (unsigned, as ``r`` and ``first``) of the row of group
        ``r``; ``t = -1`` past the row or for an entry outside the chunk (never out of bounds,
        even for a foreign CSR). Unsigned indices: no negative-index checks."""
        t = int64(-1)
        s = int64(0)
        if e < count:
            t = int64(q_indices[r, first + e])
            s = int64(slots[r, first + e])
            if t < 0 or t >= tq or s < 0 or s >= topk:
                t = -1
        return t, s

    @kernel_jit(**options)
    def _kl_kernel_keys_v3(q_idx, ds, row_ptr, q_indices, slots, cu_k, row_offsets,
                           part_ptr, part_size, index_scale, dk, dk_part):
        smem = dynamic_smem_u32()
        acc = cuda.local.array(ACC, float32)
        tot = cuda.local.array(ACC, float32)
        comp = cuda.local.array(ACC, float32)
        dsr = cuda.local.array(DSR, float32)
        afr = cuda.local.array(12, uint32)  # A fragments of the three planes
        tid = cuda.threadIdx.x
        kw = (tid // 32) % NW  # the warp's 16 keys
        dw = (tid // 32) // NW * WD  # and its dims, from the CTA's d0
        lane = tid % 32
        g4 = lane // 4
        t4 = lane % 4
        hkv = q_idx.shape[1]
        tq = q_idx.shape[0]
        topk = ds.shape[2]
        nd = DI // DPC
        pid = cuda.blockIdx.x // nd  # the part of a row (keys_parts_kernel) this CTA takes
        d0 = (cuda.blockIdx.x % nd) * DPC
        rows = part_ptr.shape[1] - 1
        if pid >= part_ptr[0, rows]:
            return  # past the last part (the grid is sized by a bound)
        row = sequence_of(part_ptr[0], pid)
        part = pid - part_ptr[0, row]
        nparts = part_ptr[0, row + 1] - part_ptr[0, row]
        lo = part * part_size  # the part: entries lo .. lo + part_size - 1 of the row, its
        # groups' entries one after the other
        b = sequence_of(row_offsets, row)
        kk0 = (row - int(row_offsets[b])) * Bk
        key0 = int(cu_k[b])
        nk = min(Bk, int(cu_k[b + 1]) - key0 - kk0)
        for i in range(ACC):
            tot[i] = float32(0.0)
            comp[i] = float32(0.0)
        # ldmatrix row addresses: A = dSᵀ from the entry-major planes (matrices: entries 0-7 /
        # 8-15 x keys 0-7 / 8-15 of the warp's 16), B = Q_idx as K1's V (.trans)
        a_lane = ((lane & 7) + 8 * (lane >> 4)) * LDE + 4 * ((lane >> 3) & 1) + 8 * kw
        l_rows = ((lane >> 3) & 1) * 8 + (lane & 7)
        b_lane = OFF_Q + l_rows * LDQ + (lane >> 4) * 4 + dw // 2
        before = 0  # entries of the row's groups before r
        for r in range(hkv):
            first = int(row_ptr[r, row])
            count = max(int(row_ptr[r, row + 1]) - first, 0)
            e0 = min(max(lo - before, 0), count)  # the part's entries in group r
            e1 = min(max(lo + part_size - before, 0), count)
            before += count
            first += e0
            count = e1 - e0
            if count <= 0:
                continue  # (uniform over the CTA: no barrier skipped by some threads only)
            steps = (count + E - 1) // E
            ru = uint64(r)
            fu = uint64(first)
            cu = uint64(count)
            for st in range(steps + 1):
                # step st - 1 computes from buffer (st - 1) % 2 while step st is staged into
                # st % 2: its index queries by cp.async, its dS rows into registers
                buf = st % 2
                if st < steps:
                    for i in range(tid, QP, NT):
                        iu = uint32(i)
                        e = iu // uint32(DPC // 8)
                        w = uint32(4) * (iu % uint32(DPC // 8))
                        t, _ = entry(q_indices, slots, ru, fu, cu, uint64(st * E) + uint64(e),
                                     tq, topk)
                        ok = t >= 0
                        copy16(smem, uint32(OFF_Q + buf * QB) + e * uint32(LDQ) + w, q_idx,
                               (uint64(t if ok else 0) * uint64(hkv) + ru) * uint64(DIW)
                               + uint64(d0 // 2) + uint64(w), 16 if ok else 0)
                    commit()
                    for u in range(DSPT):
                        i = tid + u * NT
                        x0 = x1 = x2 = x3 = float32(0.0)
                        if i < DSP:
                            iu = uint32(i)
                            e = iu // uint32(Bk // 4)
                            c = uint32(4) * (iu % uint32(Bk // 4))
                            t, s = entry(q_indices, slots, ru, fu, cu,
                                         uint64(st * E) + uint64(e), tq, topk)
                            if t >= 0:
                                x0, x1, x2, x3 = load_f32x4(
                                    ds, ((uint64(t) * uint64(hkv) + ru) * uint64(topk)
                                         + uint64(s)) * uint64(Bk) + uint64(c))
                        dsr[4 * u] = x0
                        dsr[4 * u + 1] = x1
                        dsr[4 * u + 2] = x2
                        dsr[4 * u + 3] = x3
                if st > 0:
                    pb = 1 - buf
                    for i in range(ACC):
                        acc[i] = float32(0.0)
                    for ks in range(E // 16):
                        for plane in range(3):
                            a0, a1, a2, a3 = ldmatrix_x4_trans(
                                smem, plane * 2 * PLANE + pb * PLANE + a_lane + 16 * ks * LDE)
                            afr[4 * plane] = a0
                            afr[4 * plane + 1] = a1
                            afr[4 * plane + 2] = a2
                            afr[4 * plane + 3] = a3
                        for n2 in range(NN // 2):
                            b0, b1, b2, b3 = ldmatrix_x4_trans(
                                smem, b_lane + pb * QB + 16 * ks * LDQ + 8 * n2)
                            n = 8 * n2
                            for plane in range(3):
                                a0 = afr[4 * plane]
                                a1 = afr[4 * plane + 1]
                                a2 = afr[4 * plane + 2]
                                a3 = afr[4 * plane + 3]
                                mma_pair_bf16(acc, n, a0, a1, a2, a3, b0, b1, b2, b3)
                    for i in range(ACC):
                        tot[i], comp[i] = kahan_add(tot[i], comp[i], acc[i])
                if st < steps:
                    # split the staged dS rows into hi + mid + lo, entry-major, into buffer buf
                    for u in range(DSPT):
                        i = tid + u * NT
                        if i < DSP:
                            iu = uint32(i)
                            w = (iu // uint32(Bk // 4)) * uint32(LDE) \
                                + uint32(2) * (iu % uint32(Bk // 4)) + uint32(buf * PLANE)
                            for half in range(2):
                                xa = dsr[4 * u + 2 * half]
                                xb = dsr[4 * u + 2 * half + 1]
                                for plane in range(3):
                                    word = pack_bf16x2(xa, xb)
                                    smem[uint32(plane * 2 * PLANE + half) + w] = word
                                    xa = xa - bf16_to_f32(word & uint32(0xFFFF))
                                    xb = xb - bf16_to_f32(word >> uint32(16))
                wait_all()
                cuda.syncthreads()
        # C layout: keys 16 kw + g4 (+8), dims dw + 8n + 2t4 (+1); a row of several parts
        # writes its scratch slot (keys_sum_kernel adds them in part order)
        slot = part_ptr[1, row] + part
        for n in range(NN):
            for e in range(4):
                key = 16 * kw + g4 + 8 * (e // 2)
                d = d0 + dw + 8 * n + 2 * t4 + e % 2
                if key < nk:
                    x = (tot[4 * n + e] - comp[4 * n + e]) * index_scale
                    if nparts == 1:
                        dk[key0 + kk0 + key, d] += x
                    else:
                        dk_part[slot, key * DI + d] = x

    return _kl_kernel_keys_v3


@kernel_jit
def keys_parts_kernel(row_ptr, part_size, parts):
    """``parts [2, rows]``: ``parts[0, row] = ceil(n / part_size)`` for the row's ``n`` CSR
    entries over every group, and ``parts[1, row]`` the same where it is above 1 (the row's
    scratch slots), else 0; a thread a row."""
    row = cuda.grid(1)
    rows = row_ptr.shape[1] - 1
    if row >= rows:
        return
    n = 0
    for r in range(row_ptr.shape[0]):
        n += max(0, row_ptr[r, row + 1] - row_ptr[r, row])
    count = (n + part_size - 1) // part_size
    parts[0, row] = count
    parts[1, row] = count if count > 1 else 0


@functools.lru_cache(maxsize=None)
def keys_sum_kernel(block_size: int, index_dim: int):
    """``dk_idx`` of the rows cut into several parts: the parts' scratch slots ``dk_part
    [slots, Bk * Didx]`` added in part order (a compensated sum, as the parts' own), a thread
    an element, ``Bk * Didx / SUM_THREADS`` CTAs a row (a hot row's thread walks its tens of
    parts; a CTA a row, each thread a hundred elements of a sink row, took 0.8 ms a chunk).
    Returns ``(kernel, CTAs a row)``."""
    Bk, DI = block_size, index_dim
    # a thread an element on a GPU; in the simulator, where a CTA costs a Python thread a
    # thread, a CTA a row walks the elements (the same additions)
    SLICES = 1 if SIMULATOR else -(-(Bk * DI) // SUM_THREADS)
    STRIDE = SLICES * SUM_THREADS

    @kernel_jit
    def _kl_kernel_keys_sum(part_ptr, row_offsets, cu_k, dk_part, dk):
        row = cuda.blockIdx.x // SLICES
        nparts = part_ptr[0, row + 1] - part_ptr[0, row]
        if nparts <= 1:
            return
        b = sequence_of(row_offsets, row)
        kk0 = (row - int(row_offsets[b])) * Bk
        key0 = int(cu_k[b]) + kk0
        nk = min(Bk, int(cu_k[b + 1]) - int(cu_k[b]) - kk0)
        slot0 = part_ptr[1, row]
        first = (cuda.blockIdx.x % SLICES) * SUM_THREADS + cuda.threadIdx.x
        for i in range(first, nk * DI, STRIDE):
            tot = float32(0.0)
            comp = float32(0.0)
            for part in range(nparts):
                tot, comp = kahan_add(tot, comp, dk_part[slot0 + part, i])
            dk[key0 + i // DI, i % DI] += tot - comp

    return _kl_kernel_keys_sum, SLICES
