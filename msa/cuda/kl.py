"""Paper §3.2, eq 9-11 on the GPU: the sparse KL loss training the index branch, and its backward.

Same functions and arguments as ``msa.reference.kl`` (read its docstring for the math), plus
keyword-only knobs. Per query ``t`` and group ``r`` the support is the causally visible keys of
the blocks ``block_indices[t, r]`` (every visible key in the warmup, ``block_indices=None``):

.. math::

    P_j = \\frac1G \\sum_{h \\in H_r} e^{S^{(h)}_j - \\mathrm{LSE}^{(h)}}, \\qquad
    \\log P^{idx}_j = S^{idx}_j - \\mathrm{LSE}^{idx}

The teacher's normaliser is the main branch's LSE (given, from ``sparse_attention``: no second
softmax pass); the student's ``LSE^idx`` is computed online in the same pass over the keys. A
*run* of keys (one thread's or one slot's) keeps ``m`` (the running maximum of ``S^idx``),
``l = sum_j exp(S^idx_j - m)``, ``C = sum_j P_j`` and ``D = sum_j P_j (log P_j - (S^idx_j - m))``
(``D <- D + C (m' - m)`` when the maximum grows to ``m'``), and ends as the *state*
``(m, l, C, K)`` with ``K = D + C log l = sum_j P_j (log P_j - log P^{idx,run}_j)``: the run's KL
against its own student normaliser ``LSE_run = m + log l``. Two states merge exactly, in a fixed
tree or in slot order, since ``LSE - LSE_i = log1p(x_j / x_i)`` with ``x_i = l_i e^{m_i - m}``:

.. math::

    K = K_1 + K_2 + C_1 \\log(1 + x_2 / x_1) + C_2 \\log(1 + x_1 / x_2), \\quad
    l = x_1 + x_2, \\quad C = C_1 + C_2

and the KL of (query, group) is the ``K`` of the state of its whole support. ``P_j = 0`` (an
underflowed teacher) contributes nothing to ``D`` or ``C`` (``0 log 0 = 0``); an empty support
(``l = 0``, the merge's identity) gives ``KL = 0``. ``C`` is 1 up to rounding when ``lse`` is
the teacher's own LSE on this support.

Accuracy. The first GPU run (N = 8K selected / 2K warmup, Hq=16, Hkv=4, D=Didx=64, Bk=128,
K=16) had v1's ``kl`` at 25x the error of the float32 NumPy reference and v2's ``dk_idx`` at
7-10x. An emulation of the kernels' float32 order in NumPy reproduced both (23.9x and 7.9x on
the 2K warmup) and located them: one running ``(m, l, A = sum P log P, B = sum P (S^idx - m),
C)`` over all 2K keys with ``KL = A - B + C log l`` has terms of size ``log N`` (~7) cancelling
to a KL of ~0.7, and sequential float32 sums of ``n`` terms drift like ``sqrt(n)`` ulps (about
``1.8e-6`` relative at ``n`` = 2K); a key's ``dk_idx`` summed ``Tq Hkv`` (8K) terms in one
chain where the baseline's BLAS sums chains of a few hundred. Hence: runs of at most one slot
(v1) or ``Bk / NT`` keys (v2, v3) with Kahan-compensated ``l, D, C``; the state merge above
(whose terms are of the size of the KL, not of ``log N``); ``dk_idx`` summed in runs of
``_FOLD`` terms folded into a compensated sum. Emulated, ``kl`` is then 0.7x and ``dk_idx``
0.1x the baseline's error. The simulator cannot show this (``math.exp`` of a float32 returns
a Python float there, so its sums run in float64); the ``big`` GPU tests do.

Backward (eq 10-11): ``dS_j = g (P^idx_j - P_j) / (Tq Hkv)`` on the support,
``dq_idx = s_idx sum_j dS_j k_idx_j``, ``dk_idx_j = s_idx sum_{t, r} dS_{t,r,j} q_idx_{t,r}``.
``kl_backward`` needs ``LSE^idx`` before ``dS``, so it first finds it (index scores only, cheap),
then computes the teacher and ``dS`` once, writing ``dS`` of every selected block to a buffer
``[Tq, Hkv, K, Bk]`` (0 on hidden keys) and summing ``dq_idx``; ``dk_idx`` is then summed
KV-outer from the buffer: the k2q CSR of the selection (``msa.cuda.csr.build_csr``) lists the
queries that read a key block, and each ``dk_idx`` element is summed by one thread over the
groups and those queries in CSR order. In the warmup there is no selection and no buffer (the
support is the whole causal past, a buffer would be ``Tq x Tk``): a key visits every later
query of its sequence and recomputes ``dS``.

Every output element is written by one thread that sums in a fixed order, with no float atomics:
reruns are bitwise identical. The loss of eq 10 is the mean of ``kl`` by one CTA
(Kahan-compensated per-thread sums, then a fixed tree).

Versions (``version=None`` picks the fastest that supports the inputs: v4 for fp16/bf16 with
``D, Didx, Bk`` multiples of 16 and a selection, v2 otherwise):

===  =========================================================================================
v    idea
===  =========================================================================================
1    Q-outer, one thread per (query, group) for ``kl``, ``LSE^idx``, ``dq_idx`` and ``dS``; one
     thread per key for ``dk_idx``. Inputs read from global memory. The readable one, and the
     one the simulator runs fast (no barriers).
2    Q-outer, one CTA per (query, group): its ``G`` heads and index query staged in shared
     memory (fp32), one thread per key (``G`` dot products of ``D``, one of ``Didx``), states
     merged in a fixed tree; ``dq_idx`` from ``dS`` staged in shared memory. ``dk_idx``: one CTA
     per key block (CSR row), the row's queries and their ``dS`` staged 16 at a time, each
     thread a register tile of 8 keys x 8 dims. Any dtype and size; runs the warmup for v3.
3    KV-outer on tensor cores, the paper's K1 order (§4.2): per query chunk, the k2q CSR and
     the hot-row schedule (``msa.cuda.schedule``, items of at most ``2 K Bk`` queries); one CTA
     per work item loads the key block (K and K_idx) into shared memory once and walks its
     queries in tiles of ``P = ceil(128/G)`` positions x ``G`` heads (rows copied by 16-byte
     ``cp.async``, all in flight at once; plain loads for inputs not 16-byte aligned):
     ``S = Q Kᵀ`` and ``S^idx = Q_idx K_idxᵀ`` by ``mma.sync.m16n8k16`` (fp32 accumulate,
     ``msa.cuda._core.mma``), each head's ``exp(S - LSE)`` and the student logits in shared
     memory, then per position (``2G`` lanes) the slot's state ``(m, l, C, K)`` (forward),
     ``(m, l)`` (``LSE^idx``) or ``dS``, the slot's ``dq_idx`` partial and KL term
     (backward), into per-slot buffers that a Q-outer pass merges in slot order. ``dk_idx``
     as v2. fp16/bf16 only. ``kl_loss_and_backward`` skips the forward's teacher pass.
4    v3's plan; kernels that keep their work in registers. The forward is the backward's
     first two passes (``LSE^idx``, then the KL terms by the grad kernel without gradients).
     ``LSE^idx``: tiles of 64 index queries, ``S^idx`` in mma accumulators, row maximum and
     sum by quad shuffles. The grad pass: ``S = Q Kᵀ`` in registers as K1 v3 (tiles of 64 rows,
     ``ldmatrix``), the heads' ``exp(S - LSE_h)`` summed by a reduce-scatter of shuffles over
     the lanes of a position, each lane ``dS`` and the KL term on the keys it keeps, the
     slot's ``dq_idx`` partial on tensor cores (``dS`` as three exact 16-bit planes); one Q
     buffer refilled while ``dS`` and ``dq_idx`` run (110 KB at the paper's sizes: two CTAs
     per SM).
     ``dk_idx`` (bf16, ``Bk <= 128``; else v2's kernel): per key block and 64 dims, the
     CSR row's ``dS`` rows split into three bf16 planes (exact), ``dSᵀ Q_idx`` by mma
     (``ldmatrix.trans``), 32 entries a step folded into a Kahan sum, the next step staged
     while one computes. The default for fp16/bf16 with a selection.
===  =========================================================================================

All accumulate in fp32; inputs fp32/fp16/bf16 (bf16 as uint16 bits), any ``G`` (v3, v4: 1, 2,
4, 8, 16). ``lse=None`` (the teacher's LSE computed here, a convenience) adds one pass, one thread
per (query, head).

Memory: the ``dS`` buffer is ``Tq*Hkv*K*Bk`` float32 (4 GiB at 128K tokens in the paper
configuration; v3 adds the ``dq_idx`` partials, ``Tq*Hkv*K*Didx``). ``kl_backward`` processes
queries in chunks whose buffers fit ``max_ds_bytes`` (default 4 GiB): each chunk is a smaller
problem of the same kind (its queries against the keys they can see,
``msa.cuda.attention.query_chunks``) with its own CSR, and adds its ``dk_idx`` contribution to
the keys in chunk order.

Bad input raises before any launch. With ``validate=True`` (default) the launchers copy
``block_indices`` and ``lse`` to the host to check them like the reference does (indices in
range, unique, ``-1`` only at the tail; ``lse`` not NaN/+inf and finite wherever the support is
non-empty). ``validate=False`` skips those copies; the kernels still never read or write out of
bounds (invalid blocks and CSR entries are skipped), but the result for invalid indices or a
wrong ``lse`` is unspecified.
"""

from __future__ import annotations

import functools
import math
import numbers

import numpy as np
from numba import cuda, float32, int32, uint32

from .._checks import (GQA_GROUP_SIZES, check_array, check_cu_seqlens, check_gqa,
                       check_positive_int, check_scale, cu_to_host, dtype_of)
from ._core import mma as _mma
from ._core.arrays import SIMULATOR, ArrayContext, device_constant, is_bf16
from ._core.launch import device_copy as _device_copy
from ._core.launch import launch_smem as _launch_smem
from ._core.packed import LN2 as _LN2
from ._core.packed import LOG2E as _LOG2E
from ._core.packed import check_entry as _check_entry
from ._core.packed import item_fields as _item_fields
from ._core.packed import load_entry as _load_entry
from ._core.packed import row_query as _row_query
from ._core.memops import (copy16_plain2, copy16_plain3, cp_async16, cp_async_commit,
                      cp_async_wait_all, is_aligned16, ldmatrix_x4, ldmatrix_x4_trans,
                      load_f32x4, no_op)
from ._core.mma import (_deal, bf16_to_f32, exp2, f16_bits_to_f32, load_a_frag, load_b_frag,
                   make_mma_pair, mma_bf16_m16n8k16, mma_f16_m16n8k16, pack_bf16x2, pack_f16x2)

VERSIONS = (1, 2, 3, 4)
DEFAULT_VERSION = 4
MAX_BLOCK_SIZE_V3 = 256
# v3 tile rows R (query positions x G heads): the paper's 128 on a GPU, the smallest in the
# simulator (its mma twin pays two barriers per call).
DEFAULT_TILE_ROWS_V3 = 16 if SIMULATOR else 128
DTYPE_KINDS = ("float32", "float16", "bfloat16")
# Default budget of one query chunk's dS buffer in kl_backward (bytes).
MAX_DS_BYTES = 4 << 30
# Threads per CTA (powers of two). The simulator runs every thread as a Python thread and every
# barrier costs milliseconds there, so it gets fewer; the kernels are the same.
_THREADS_V1 = 32 if SIMULATOR else 128
_ROW_THREADS = 8 if SIMULATOR else 128
_KEY_TILE = (4, 4) if SIMULATOR else (8, 8)  # v2 dk: keys x dims per thread
_FOLD = 16  # dk_idx: terms summed plainly before a Kahan-compensated fold
_MEAN_THREADS = 32 if SIMULATOR else 512
# v2 dk: CSR entries (queries) staged in shared memory per step, and the float budget of the
# warmup's staged query heads (G*D floats per entry).
_KEY_ENTRIES = 16
_KEY_STAGE_FLOATS = 8192
_NEG_INF = float32(-math.inf)
_FULL_MASK = 0xFFFFFFFF


# =============================================================================================
# Device helpers shared by the versions
# =============================================================================================

def _identity_f32(x):
    return float32(x)


_to_f32_plain = cuda.jit(device=True)(_identity_f32)


def _loader(kind: str):
    """Device function turning one input element into float32 (bf16 arrives as uint16 bits)."""
    return bf16_to_f32 if kind == "bfloat16" else _to_f32_plain


@cuda.jit(device=True)
def _finite_or_zero(x):
    """An empty support's ``-inf`` LSE becomes 0 (its keys are never read), as in the reference."""
    return x if x > _NEG_INF else float32(0.0)


@cuda.jit(device=True)
def _last_le(offsets, x):
    """Largest ``b`` in ``[0, len(offsets) - 2]`` with ``offsets[b] <= x`` (an empty segment
    loses to the later one with the same offset)."""
    lo = 0
    hi = offsets.shape[0] - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if offsets[mid] <= x:
            lo = mid
        else:
            hi = mid - 1
    return lo


@cuda.jit(device=True)
def _query_row(cu_q, cu_k, t):
    """``(key0, pos, lk)`` of query ``t``: packed index of its sequence's first key, its key
    position (bottom-right: query ``i`` of ``Lq`` sits at ``Lk - Lq + i``) and ``Lk``."""
    b = _last_le(cu_q, t)
    key0 = int(cu_k[b])
    lk = int(cu_k[b + 1]) - key0
    lq = int(cu_q[b + 1]) - int(cu_q[b])
    return key0, lk - lq + (t - int(cu_q[b])), lk


@cuda.jit(device=True)
def _block_range(I, t, r, s, warmup, block_size, pos):
    """``(kk0, kk1)``: key positions of slot ``s`` of (query t, group r) that the query sees;
    ``kk1 <= kk0`` when the slot is empty (-1), invalid or wholly in the future."""
    blk = s if warmup else int(I[t, r, s])
    kk0 = blk * block_size
    if blk < 0 or kk0 > pos:
        return 0, 0
    return kk0, min(kk0 + block_size, pos + 1)


@cuda.jit(device=True)
def _kahan_add(s, e, x):
    """``(s, e) + x`` Kahan-compensated: the sum is ``s - e`` (``e`` the lost low-order part)."""
    y = x - e
    t = s + y
    return t, (t - s) - y


@cuda.jit(device=True)
def _accumulate(m, l, le, d, de, c, ce, p, s_idx):
    """Add one key (teacher ``P_j = p``, student logit ``S^idx_j = s_idx``) to a run's
    Kahan-compensated sums ``(m, l - le, D - de, C - ce)``, ``D = sum P (log P - (S^idx - m))``."""
    # m' = max(m, S_idx): l scales by exp(m - m'), D grows by C (m' - m)
    if s_idx > m:
        if m > _NEG_INF:
            f = math.exp(m - s_idx)
            l *= f
            le *= f
            d, de = _kahan_add(d, de, c * (s_idx - m))
        m = s_idx
    l, le = _kahan_add(l, le, math.exp(s_idx - m))
    if p > float32(0.0):  # 0 log 0 = 0: an underflowed teacher adds nothing
        d, de = _kahan_add(d, de, p * (math.log(p) - (s_idx - m)))
        c, ce = _kahan_add(c, ce, p)
    return m, l, le, d, de, c, ce


@cuda.jit(device=True)
def _finish(m, l, le, d, de, c, ce):
    """A run's sums as a state ``(m, l, C, K)``, ``K = D + C log l`` = the run's KL against
    its own student normaliser (module docstring); an empty run is ``(-inf, 0, 0, 0)``."""
    l -= le
    c -= ce
    d -= de
    if l > float32(0.0):
        return m, l, c, d + c * math.log(l)
    return _NEG_INF, float32(0.0), float32(0.0), float32(0.0)


@cuda.jit(device=True)
def _gap(m, m_self, x_self, l_self, x_other):
    """``LSE - LSE_self = log(1 + x_other / x_self) >= 0`` of a merge (``x = l e^{m_self - m}``);
    written out when ``x_self`` underflows (the maximum's side has ``x >= 1``)."""
    if x_self > float32(1e-30):
        return math.log1p(x_other / x_self)
    return (m - m_self) + (math.log(x_other) - math.log(l_self))


@cuda.jit(device=True)
def _merge(m1, l1, c1, k1, m2, l2, c2, k2):
    """Merge two states ``(m, l, C, K)``: ``K = K1 + K2 + C1 (LSE - LSE1) + C2 (LSE - LSE2)``
    (module docstring); an empty state (``l = 0``) is the identity."""
    if l2 <= float32(0.0):
        return m1, l1, c1, k1
    if l1 <= float32(0.0):
        return m2, l2, c2, k2
    m = max(m1, m2)
    x1 = l1 * math.exp(m1 - m)
    x2 = l2 * math.exp(m2 - m)
    k = (k1 + k2) + (c1 * _gap(m, m1, x1, l1, x2) + c2 * _gap(m, m2, x2, l2, x1))
    return m, x1 + x2, c1 + c2, k


@cuda.jit(device=True)
def _student_lse(m, l):
    """``LSE^idx = m + log l``; 0 for an empty support (then no key uses it)."""
    if l > float32(0.0):
        return m + math.log(l)
    return float32(0.0)


@cuda.jit(device=True)
def _fold_every(acc, comp, part, n):
    """After the ``n``-th term of a run, every ``_FOLD`` terms: ``acc - comp += part`` (Kahan,
    elementwise) and ``part = 0``; returns the count within the run. Long sums (``dk_idx``: up
    to ``Tq Hkv`` terms) so grow their rounding error like ``sqrt(n / _FOLD)`` ulps at most
    ``_FOLD`` deep, instead of ``sqrt(n)``."""
    if n < _FOLD:
        return n
    for i in range(acc.shape[0]):
        acc[i], comp[i] = _kahan_add(acc[i], comp[i], part[i])
        part[i] = float32(0.0)
    return 0


# =============================================================================================
# v1: one thread per (query, group) and per key
# =============================================================================================

@functools.lru_cache(maxsize=None)
def _global_score_fns(kind: str, group: int, head_dim: int, index_dim: int):
    """``teacher(q, t, r, lse, k, j, scale)`` = ``P_j`` and ``student(q_idx, t, r, k_idx, j,
    index_scale)`` = ``S^idx_j`` of one key for one (query, group), reading global memory."""
    G, D, DI = group, head_dim, index_dim
    to_f32 = _loader(kind)
    inv_g = float32(1.0 / G)

    @cuda.jit(device=True)
    def teacher(q, t, r, lse, k, j, scale):
        s = cuda.local.array(G, float32)
        for h in range(G):
            s[h] = float32(0.0)
        for d in range(D):
            kd = to_f32(k[j, r, d])
            for h in range(G):
                s[h] += to_f32(q[t, r * G + h, d]) * kd
        # P_j = (1/G) sum_h exp(S_h - LSE_h)
        p = float32(0.0)
        for h in range(G):
            p += math.exp(s[h] * scale - _finite_or_zero(lse[t, r * G + h]))
        return p * inv_g

    @cuda.jit(device=True)
    def student(q_idx, t, r, k_idx, j, index_scale):
        s = float32(0.0)
        for d in range(DI):
            s += to_f32(q_idx[t, r, d]) * to_f32(k_idx[j, d])
        return s * index_scale

    return teacher, student


@functools.lru_cache(maxsize=None)
def _kl_kernel_thread_rows(kind: str, group: int, head_dim: int, index_dim: int):
    """v1 forward: ``kl[t, r]``, one thread per (query, group)."""
    teacher, student = _global_score_fns(kind, group, head_dim, index_dim)

    @cuda.jit
    def _kl_kernel_thread_rows_v1(q, k, q_idx, k_idx, I, lse, cu_q, cu_k, block_size, warmup,
                                  scale, index_scale, kl):
        hkv = kl.shape[1]
        i = cuda.grid(1)
        if i >= kl.shape[0] * hkv:
            return
        t = i // hkv
        r = i % hkv
        key0, pos, _ = _query_row(cu_q, cu_k, t)
        zero = float32(0.0)
        # one state per slot (its keys in a Kahan-compensated run), merged in slot order
        mt, lt, ct, kt = _NEG_INF, zero, zero, zero
        nslots = pos // block_size + 1 if warmup else I.shape[2]
        for s in range(nslots):
            kk0, kk1 = _block_range(I, t, r, s, warmup, block_size, pos)
            m, l, le, d, de, c, ce = _NEG_INF, zero, zero, zero, zero, zero, zero
            for kp in range(kk0, kk1):
                j = key0 + kp
                m, l, le, d, de, c, ce = _accumulate(
                    m, l, le, d, de, c, ce, teacher(q, t, r, lse, k, j, scale),
                    student(q_idx, t, r, k_idx, j, index_scale))
            m, l, c, kk = _finish(m, l, le, d, de, c, ce)
            mt, lt, ct, kt = _merge(mt, lt, ct, kt, m, l, c, kk)
        kl[t, r] = kt

    return _kl_kernel_thread_rows_v1


@functools.lru_cache(maxsize=None)
def _kl_kernel_thread_rows_grad(kind: str, group: int, head_dim: int, index_dim: int):
    """v1 backward pass 1: ``lse_idx``, ``dq_idx`` and the dS buffer, one thread per (query,
    group) of queries ``[t0, t0 + count)``."""
    DI = index_dim
    teacher, student = _global_score_fns(kind, group, head_dim, index_dim)
    to_f32 = _loader(kind)

    @cuda.jit
    def _kl_kernel_thread_rows_grad_v1(q, k, q_idx, k_idx, I, lse, cu_q, cu_k, block_size,
                                       warmup, scale, index_scale, coef, t0, count, store_ds,
                                       lse_idx, dq, ds):
        hkv = dq.shape[1]
        i = cuda.grid(1)
        if i >= count * hkv:
            return
        t = t0 + i // hkv
        r = i % hkv
        key0, pos, lk = _query_row(cu_q, cu_k, t)
        nslots = pos // block_size + 1 if warmup else I.shape[2]
        # LSE^idx over the support (index scores only; l Kahan-compensated)
        m = _NEG_INF
        l = float32(0.0)
        le = float32(0.0)
        for s in range(nslots):
            kk0, kk1 = _block_range(I, t, r, s, warmup, block_size, pos)
            for kp in range(kk0, kk1):
                x = student(q_idx, t, r, k_idx, key0 + kp, index_scale)
                if x > m:
                    if m > _NEG_INF:
                        f = math.exp(m - x)
                        l *= f
                        le *= f
                    m = x
                l, le = _kahan_add(l, le, math.exp(x - m))
        lse_i = _student_lse(m, l - le)
        lse_idx[t, r] = lse_i
        # dS_j = coef (P_idx_j - P_j); dq_idx = index_scale sum_j dS_j k_idx_j, keys in order
        acc = cuda.local.array(DI, float32)
        for d in range(DI):
            acc[d] = float32(0.0)
        nblocks = (lk + block_size - 1) // block_size
        for s in range(nslots):
            kk0, kk1 = _block_range(I, t, r, s, warmup, block_size, pos)
            k_begin = kk0
            k_end = kk1
            write = False
            if store_ds:
                blk = int(I[t, r, s])
                # every valid block of the sequence is in the CSR: write all its Bk entries
                write = 0 <= blk < nblocks
                if write:
                    k_begin = blk * block_size
                    k_end = k_begin + block_size
            for kp in range(k_begin, k_end):
                dsv = float32(0.0)
                if kk0 <= kp < kk1:
                    j = key0 + kp
                    p = teacher(q, t, r, lse, k, j, scale)
                    dsv = coef * (math.exp(student(q_idx, t, r, k_idx, j, index_scale) - lse_i) - p)
                    for d in range(DI):
                        acc[d] += dsv * to_f32(k_idx[j, d])
                if write:
                    ds[t - t0, r, s, kp - k_begin] = dsv
        for d in range(DI):
            dq[t, r, d] = acc[d] * index_scale

    return _kl_kernel_thread_rows_grad_v1


@functools.lru_cache(maxsize=None)
def _kl_kernel_thread_keys(kind: str, group: int, head_dim: int, index_dim: int, warmup: bool):
    """v1 backward pass 2: ``dk_idx[j] += index_scale sum_{r, t} dS q_idx``, one thread per key.

    Selected: the queries of the key's CSR row (per group, in CSR order), ``dS`` from the buffer.
    Warmup: every query of the sequence that sees the key, ``dS`` recomputed.
    """
    DI = index_dim
    DC = min(DI, 16)  # dims per chunk
    teacher, student = _global_score_fns(kind, group, head_dim, index_dim)
    to_f32 = _loader(kind)

    @cuda.jit
    def _kl_kernel_thread_keys_v1(q, k, q_idx, k_idx, lse, lse_idx, row_ptr, q_indices, slots, ds,
                                  cu_q, cu_k, row_offsets, block_size, scale, index_scale, coef,
                                  dk):
        j = cuda.grid(1)
        if j >= dk.shape[0]:
            return
        hkv = q_idx.shape[1]
        b = _last_le(cu_k, j)
        key0 = int(cu_k[b])
        lk = int(cu_k[b + 1]) - key0
        kp = j - key0
        blk = kp // block_size
        jj = kp - blk * block_size
        row = int(row_offsets[b]) + blk
        q_lo = int(cu_q[b])
        q_hi = int(cu_q[b + 1])
        shift = lk - (q_hi - q_lo)  # query t sits at key position shift + t - q_lo
        # a key sums up to Tq Hkv terms: runs of _FOLD entries, folded into a Kahan sum; DC
        # dims at a time keep the three sums in registers (the warmup recomputes dS per chunk)
        acc = cuda.local.array(DC, float32)
        comp = cuda.local.array(DC, float32)
        part = cuda.local.array(DC, float32)
        for d0 in range(0, DI, DC):
            for dd in range(DC):
                acc[dd] = float32(0.0)
                comp[dd] = float32(0.0)
                part[dd] = float32(0.0)
            n = 0
            for r in range(hkv):
                if warmup:
                    for t in range(q_lo + max(0, kp - shift), q_hi):
                        p = teacher(q, t, r, lse, k, j, scale)
                        x = student(q_idx, t, r, k_idx, j, index_scale)
                        dsv = coef * (math.exp(x - lse_idx[t, r]) - p)
                        for dd in range(DC):
                            part[dd] += dsv * to_f32(q_idx[t, r, min(d0 + dd, DI - 1)])
                        n = _fold_every(acc, comp, part, n + 1)
                else:
                    for e in range(int(row_ptr[r, row]), int(row_ptr[r, row + 1])):
                        t = int(q_indices[r, e])
                        s = int(slots[r, e])
                        if 0 <= t < q_idx.shape[0] and 0 <= s < ds.shape[2]:
                            dsv = ds[t, r, s, jj]
                            for dd in range(DC):
                                part[dd] += dsv * to_f32(q_idx[t, r, min(d0 + dd, DI - 1)])
                            n = _fold_every(acc, comp, part, n + 1)
            _fold_every(acc, comp, part, _FOLD)
            for dd in range(DC):
                if d0 + dd < DI:
                    dk[j, d0 + dd] += (acc[dd] - comp[dd]) * index_scale

    return _kl_kernel_thread_keys_v1


# =============================================================================================
# v2: one CTA per (query, group) and per key block, queries staged in shared memory
# =============================================================================================

@functools.lru_cache(maxsize=None)
def _shared_score_fns(kind: str, group: int, head_dim: int, index_dim: int):
    """``teacher(sq, q_off, slse, l_off, k, j, r, scale)`` = ``P_j`` with the ``G`` query heads at
    ``sq[q_off + h*D + d]`` and their (finite) LSEs at ``slse[l_off + h]`` (float32, shared),
    and ``student(sqi, qi_off, k_idx, j, index_scale)`` = ``S^idx_j``."""
    G, D, DI = group, head_dim, index_dim
    to_f32 = _loader(kind)
    inv_g = float32(1.0 / G)

    @cuda.jit(device=True)
    def teacher(sq, q_off, slse, l_off, k, j, r, scale):
        s = cuda.local.array(G, float32)
        for h in range(G):
            s[h] = float32(0.0)
        for d in range(D):
            kd = to_f32(k[j, r, d])  # one load of K for the G heads
            for h in range(G):
                s[h] += sq[q_off + h * D + d] * kd
        p = float32(0.0)
        for h in range(G):
            p += math.exp(s[h] * scale - slse[l_off + h])
        return p * inv_g

    @cuda.jit(device=True)
    def student(sqi, qi_off, k_idx, j, index_scale):
        s = float32(0.0)
        for d in range(DI):
            s += sqi[qi_off + d] * to_f32(k_idx[j, d])
        return s * index_scale

    return teacher, student


@functools.lru_cache(maxsize=None)
def _row_loads(kind: str, group: int, head_dim: int, index_dim: int, threads: int):
    """Device function staging a (query, group)'s float32 heads, index query and finite LSEs."""
    G, D, DI, NT = group, head_dim, index_dim, threads
    to_f32 = _loader(kind)

    @cuda.jit(device=True)
    def load(q, q_idx, lse, t, r, tid, sq, sqi, slse):
        for i in range(tid, G * D, NT):
            sq[i] = to_f32(q[t, r * G + i // D, i % D])
        for d in range(tid, DI, NT):
            sqi[d] = to_f32(q_idx[t, r, d])
        for h in range(tid, G, NT):
            slse[h] = _finite_or_zero(lse[t, r * G + h])

    return load


@cuda.jit(device=True)
def _tree_merge(red, tid, nt, m, l, c, k):
    """Merge the CTA's per-thread states ``(m, l, C, K)`` in a fixed tree (``nt`` a power of
    two); every thread gets the total. ``red``: shared float32 [4, nt]."""
    red[0, tid] = m
    red[1, tid] = l
    red[2, tid] = c
    red[3, tid] = k
    cuda.syncthreads()
    stride = nt // 2
    while stride > 0:
        if tid < stride:
            m, l, c, k = _merge(red[0, tid], red[1, tid], red[2, tid], red[3, tid],
                                red[0, tid + stride], red[1, tid + stride],
                                red[2, tid + stride], red[3, tid + stride])
            red[0, tid] = m
            red[1, tid] = l
            red[2, tid] = c
            red[3, tid] = k
        cuda.syncthreads()
        stride //= 2
    m = red[0, 0]
    l = red[1, 0]
    c = red[2, 0]
    k = red[3, 0]
    cuda.syncthreads()  # red may be reused
    return m, l, c, k


@functools.lru_cache(maxsize=None)
def _kl_kernel_cta_rows(kind: str, group: int, head_dim: int, index_dim: int, threads: int):
    """v2 forward: ``kl[t, r]``, one CTA of ``threads`` per (query, group), one thread per key."""
    G, D, DI, NT = group, head_dim, index_dim, threads
    GD = G * D  # shared array sizes must be compile-time constants
    teacher, student = _shared_score_fns(kind, G, D, DI)
    load = _row_loads(kind, G, D, DI, NT)

    @cuda.jit
    def _kl_kernel_cta_rows_v2(q, k, q_idx, k_idx, I, lse, cu_q, cu_k, block_size, warmup, scale,
                               index_scale, kl):
        sq = cuda.shared.array(GD, float32)
        sqi = cuda.shared.array(DI, float32)
        slse = cuda.shared.array(G, float32)
        red = cuda.shared.array((4, NT), float32)
        tid = cuda.threadIdx.x
        hkv = kl.shape[1]
        t = cuda.blockIdx.x // hkv
        r = cuda.blockIdx.x % hkv
        key0, pos, _ = _query_row(cu_q, cu_k, t)
        load(q, q_idx, lse, t, r, tid, sq, sqi, slse)
        cuda.syncthreads()
        zero = float32(0.0)
        # each thread's keys in one Kahan-compensated run, then the states in a fixed tree
        m, l, le, d, de, c, ce = _NEG_INF, zero, zero, zero, zero, zero, zero
        nslots = pos // block_size + 1 if warmup else I.shape[2]
        for s in range(nslots):
            kk0, kk1 = _block_range(I, t, r, s, warmup, block_size, pos)
            for kp in range(kk0 + tid, kk1, NT):
                j = key0 + kp
                m, l, le, d, de, c, ce = _accumulate(
                    m, l, le, d, de, c, ce, teacher(sq, 0, slse, 0, k, j, r, scale),
                    student(sqi, 0, k_idx, j, index_scale))
        m, l, c, kk = _finish(m, l, le, d, de, c, ce)
        m, l, c, kk = _tree_merge(red, tid, NT, m, l, c, kk)
        if tid == 0:
            kl[t, r] = kk

    return _kl_kernel_cta_rows_v2


@functools.lru_cache(maxsize=None)
def _kl_kernel_cta_rows_grad(kind: str, group: int, head_dim: int, index_dim: int,
                             threads: int):
    """v2 backward pass 1: ``lse_idx``, ``dq_idx`` and the dS buffer, one CTA per (query, group)
    of queries ``[t0, t0 + count)``."""
    G, D, DI, NT = group, head_dim, index_dim, threads
    GD = G * D
    PER = -(-DI // NT)  # dq_idx dims per thread
    teacher, student = _shared_score_fns(kind, G, D, DI)
    load = _row_loads(kind, G, D, DI, NT)
    to_f32 = _loader(kind)

    @cuda.jit
    def _kl_kernel_cta_rows_grad_v2(q, k, q_idx, k_idx, I, lse, cu_q, cu_k, block_size, warmup,
                                    scale, index_scale, coef, t0, count, store_ds, lse_idx, dq,
                                    ds):
        sq = cuda.shared.array(GD, float32)
        sqi = cuda.shared.array(DI, float32)
        slse = cuda.shared.array(G, float32)
        red = cuda.shared.array((4, NT), float32)
        sds = cuda.shared.array(NT, float32)
        tid = cuda.threadIdx.x
        hkv = dq.shape[1]
        t = t0 + cuda.blockIdx.x // hkv
        r = cuda.blockIdx.x % hkv
        key0, pos, lk = _query_row(cu_q, cu_k, t)
        load(q, q_idx, lse, t, r, tid, sq, sqi, slse)
        cuda.syncthreads()
        nslots = pos // block_size + 1 if warmup else I.shape[2]
        zero = float32(0.0)

        # LSE^idx over the support (index scores only, l Kahan-compensated per thread)
        m = _NEG_INF
        l = zero
        le = zero
        for s in range(nslots):
            kk0, kk1 = _block_range(I, t, r, s, warmup, block_size, pos)
            for kp in range(kk0 + tid, kk1, NT):
                x = student(sqi, 0, k_idx, key0 + kp, index_scale)
                if x > m:
                    if m > _NEG_INF:
                        f = math.exp(m - x)
                        l *= f
                        le *= f
                    m = x
                l, le = _kahan_add(l, le, math.exp(x - m))
        m, l, _, _ = _tree_merge(red, tid, NT, m, l - le, zero, zero)
        lse_i = _student_lse(m, l)
        if tid == 0:
            lse_idx[t, r] = lse_i

        # dS_j = coef (P_idx_j - P_j), NT keys at a time through shared memory;
        # dq_idx += dS_j k_idx_j in key order, threads over Didx.
        acc = cuda.local.array(PER, float32)
        for i in range(PER):
            acc[i] = zero
        nblocks = (lk + block_size - 1) // block_size
        for s in range(nslots):
            kk0, kk1 = _block_range(I, t, r, s, warmup, block_size, pos)
            k_begin = kk0
            k_end = kk1
            write = False
            if store_ds:
                blk = int(I[t, r, s])
                # every valid block of the sequence is in the CSR: write all its Bk entries
                write = 0 <= blk < nblocks
                if write:
                    k_begin = blk * block_size
                    k_end = k_begin + block_size
            for c0 in range(k_begin, k_end, NT):
                kp = c0 + tid
                dsv = zero
                if kk0 <= kp < kk1:
                    j = key0 + kp
                    p = teacher(sq, 0, slse, 0, k, j, r, scale)
                    dsv = coef * (math.exp(student(sqi, 0, k_idx, j, index_scale) - lse_i) - p)
                if write and kp < k_end:
                    ds[t - t0, r, s, kp - k_begin] = dsv
                sds[tid] = dsv
                cuda.syncthreads()
                lo = max(kk0, c0)  # the chunk's visible keys: [lo, hi)
                hi = min(kk1, c0 + NT)
                for i in range(PER):
                    d = tid + i * NT
                    if d < DI:
                        x = acc[i]
                        for kp2 in range(lo, hi):
                            x += sds[kp2 - c0] * to_f32(k_idx[key0 + kp2, d])
                        acc[i] = x
                cuda.syncthreads()
        for i in range(PER):
            d = tid + i * NT
            if d < DI:
                dq[t, r, d] = acc[i] * index_scale

    return _kl_kernel_cta_rows_grad_v2


def _key_tiles(block_size: int, index_dim: int):
    """``(TJ, TD, threads)`` of the v2 dk kernel: each thread owns a register tile of ``TJ``
    keys x ``TD`` dims of the block's ``Bk x Didx`` outputs (8 x 8 on a GPU, 4 x 4 in the
    simulator; larger for huge blocks so that a CTA has at most 1024 threads)."""
    tj, td = _KEY_TILE
    while True:
        threads = -(-block_size // tj) * -(-index_dim // td)
        if threads <= 1024:
            return tj, td, threads
        tj, td = 2 * tj, 2 * td


@functools.lru_cache(maxsize=None)
def _kl_kernel_cta_keys(kind: str, group: int, head_dim: int, index_dim: int, block_size: int,
                        entries: int, warmup: bool):
    """v2 backward pass 2: ``dk_idx`` of one key block per CTA, a register tile of (keys, dims)
    per thread (``_key_tiles``).

    Selected: the row's CSR entries ``(t, slot)`` of every group, ``dS`` read from the buffer.
    Warmup: every query of the sequence at or after the block's first key, ``dS`` recomputed.
    ``entries`` queries are staged in shared memory per step.
    """
    G, D, DI, Bk, EB = group, head_dim, index_dim, block_size, entries
    TJ, TD, NT = _key_tiles(Bk, DI)
    NJ = -(-Bk // TJ)  # thread (a, c) owns keys a + NJ*u and dims c + ND*v
    ND = -(-DI // TD)
    TT = TJ * TD
    teacher, student = _shared_score_fns(kind, G, D, DI)
    to_f32 = _loader(kind)
    QW = G * D if warmup else 1  # staged query heads per entry (warmup only)
    GW = G if warmup else 1
    # shared array sizes must be compile-time constants
    E_DI, E_BK, E_QW, E_GW = EB * DI, EB * Bk, EB * QW, EB * GW
    # three register tiles (sum, compensation, batch partial): at 8 x 8 about 254 registers
    # (offline ptxas, sm_90), which 256 threads can have; more threads must spill to launch
    options = {}
    if NT > 256 and not SIMULATOR:
        options = {"max_registers": 65536 // NT // 8 * 8}

    @cuda.jit(**options)
    def _kl_kernel_cta_keys_v2(q, k, q_idx, k_idx, lse, lse_idx, row_ptr, q_indices, slots, ds,
                               cu_q, cu_k, row_offsets, block_size, scale, index_scale, coef, dk):
        sqi = cuda.shared.array(E_DI, float32)
        sds = cuda.shared.array(E_BK, float32)
        sq = cuda.shared.array(E_QW, float32)
        slse = cuda.shared.array(E_GW, float32)
        slse_i = cuda.shared.array(EB, float32)
        stok = cuda.shared.array(EB, int32)  # the entry's query (-1: none)
        saux = cuda.shared.array(EB, int32)  # its slot (selected) or key position (warmup)
        tid = cuda.threadIdx.x
        hkv = q_idx.shape[1]
        tq = q_idx.shape[0]
        topk = ds.shape[2]
        row = cuda.blockIdx.x
        b = _last_le(row_offsets, row)
        kk0 = (row - int(row_offsets[b])) * Bk
        key0 = int(cu_k[b])
        lk = int(cu_k[b + 1]) - key0
        nk = min(Bk, lk - kk0)
        q_lo = int(cu_q[b])
        q_hi = int(cu_q[b + 1])
        shift = lk - (q_hi - q_lo)  # query t sits at key position shift + t - q_lo
        zero = float32(0.0)
        ta = tid // ND
        tc = tid % ND
        acc = cuda.local.array(TT, float32)  # Kahan sum (acc - comp) of the batches' partials
        comp = cuda.local.array(TT, float32)
        part = cuda.local.array(TT, float32)
        for i in range(TT):
            acc[i] = zero
            comp[i] = zero
        sj = cuda.local.array(TJ, float32)
        sd = cuda.local.array(TD, float32)
        for r in range(hkv):
            if warmup:
                first = q_lo + max(0, kk0 - shift)
                count = q_hi - first
            else:
                first = int(row_ptr[r, row])
                count = int(row_ptr[r, row + 1]) - first
            for e0 in range(0, count, EB):
                ne = min(EB, count - e0)
                # stage the entries' queries (and, selected, their dS rows)
                for e in range(tid, EB, NT):
                    t = -1
                    aux = 0
                    if e < ne:
                        if warmup:
                            t = first + e0 + e
                            aux = shift + t - q_lo
                            slse_i[e] = lse_idx[t, r]
                        else:
                            t = int(q_indices[r, first + e0 + e])
                            aux = int(slots[r, first + e0 + e])
                            if t < 0 or t >= tq or aux < 0 or aux >= topk:
                                t = -1  # never out of bounds, even for a foreign CSR
                    stok[e] = t
                    saux[e] = aux
                cuda.syncthreads()
                for i in range(tid, EB * DI, NT):
                    t = stok[i // DI]
                    sqi[i] = to_f32(q_idx[t, r, i % DI]) if t >= 0 else zero
                if warmup:
                    for i in range(tid, EB * QW, NT):
                        t = stok[i // QW]
                        x = zero
                        if t >= 0:
                            x = to_f32(q[t, r * G + (i % QW) // D, i % D])
                        sq[i] = x
                    for i in range(tid, EB * GW, NT):
                        t = stok[i // GW]
                        x = zero
                        if t >= 0:
                            x = _finite_or_zero(lse[t, r * G + i % GW])
                        slse[i] = x
                else:
                    for i in range(tid, EB * Bk, NT):
                        e = i // Bk
                        t = stok[e]
                        x = zero
                        if t >= 0 and i % Bk < nk:
                            x = ds[t, r, saux[e], i % Bk]
                        sds[i] = x
                cuda.syncthreads()
                if warmup:
                    # dS of (entry, key), recomputed as in pass 1
                    for i in range(tid, EB * Bk, NT):
                        e = i // Bk
                        jj = i % Bk
                        t = stok[e]
                        x = zero
                        if t >= 0 and jj < nk and kk0 + jj <= saux[e]:
                            j = key0 + kk0 + jj
                            p = teacher(sq, e * QW, slse, e * GW, k, j, r, scale)
                            s_idx = student(sqi, e * DI, k_idx, j, index_scale)
                            x = coef * (math.exp(s_idx - slse_i[e]) - p)
                        sds[i] = x
                    cuda.syncthreads()
                # dk_idx[key, d] += dS[e, key] q_idx[e, d], entries in CSR order; the batch's
                # partial folded into the compensated sum (a key block may have Tq Hkv entries)
                for i in range(TT):
                    part[i] = zero
                for e in range(ne):
                    for u in range(TJ):
                        sj[u] = sds[e * Bk + min(ta + NJ * u, Bk - 1)]
                    for v in range(TD):
                        sd[v] = sqi[e * DI + min(tc + ND * v, DI - 1)]
                    for u in range(TJ):
                        for v in range(TD):
                            part[u * TD + v] += sj[u] * sd[v]
                for i in range(TT):
                    acc[i], comp[i] = _kahan_add(acc[i], comp[i], part[i])
                cuda.syncthreads()
        for u in range(TJ):
            jj = ta + NJ * u
            for v in range(TD):
                d = tc + ND * v
                if jj < nk and d < DI:
                    i = u * TD + v
                    dk[key0 + kk0 + jj, d] += (acc[i] - comp[i]) * index_scale

    return _kl_kernel_cta_keys_v2


# =============================================================================================
# v3: KV-outer on tensor cores (the paper's K1 order), per-slot partials combined in slot order
# =============================================================================================

def _v3_layout(block_size, head_dim, index_dim, rows, pad_positions, teacher):
    """Word offsets and strides of sK, sKi, sQ, sQi (16-bit pairs), sP, sSi (float32); bytes.

    sK [Bk rows of D/2 words] (K row-major, the B operand of S = Q Kᵀ stored as Bᵀ), sKi [Bk of
    Didx/2] (likewise for S_idx = Q_idx K_idxᵀ), sQ [R rows] the tile's queries, sQi [PP rows]
    its index queries (PP = positions rounded up to 16), sP [R x Bk] each head's teacher
    probabilities, sSi [PP x Bk] the student logits (then dS). Strides of ``n/2 + 4`` words make
    a fragment load's 8 rows x 4 words hit 32 banks. Without the teacher (the student-only pass)
    sK, sQ and sP are empty.
    """
    tw = 1 if teacher else 0
    ld_k = head_dim // 2 + 4
    ld_ki = index_dim // 2 + 4
    ld_p = block_size + 4
    off_ki = tw * block_size * ld_k
    off_q = off_ki + block_size * ld_ki
    off_qi = off_q + tw * rows * ld_k
    off_p = off_qi + pad_positions * ld_ki
    off_si = off_p + tw * rows * ld_p
    total = off_si + pad_positions * ld_p
    return (ld_k, ld_ki, ld_p), (off_ki, off_q, off_qi, off_p, off_si), 4 * total


@cuda.jit(device=True)
def _kv_item(work, item, q_indices, cu_k, num_kv_heads, block_size):
    """Work item ``[kv_head, row, q_begin, q_count, batch, kv_block]``, range-checked by K1's
    reader: ``(h, q_begin, q_count, b, key0, key_pos0, nk)``; ``q_count = 0`` for padding or a
    bad item."""
    h, q_begin, q_count, b, j, key0, nk = _item_fields(work, item, q_indices, cu_k, num_kv_heads,
                                                       block_size)
    return h, q_begin, q_count, b, key0, j * block_size, nk


if SIMULATOR:  # the simulator takes no alignment argument (and needs none)
    @cuda.jit(device=True)
    def _v3_smem_words():
        return cuda.shared.array(0, uint32)

    @cuda.jit(device=True)
    def _v3_smem_floats():
        return cuda.shared.array(0, float32)
else:
    @cuda.jit(device=True, inline=True)
    def _v3_smem_words():
        """The dynamic shared memory as uint32, 16-byte aligned (``cp.async``)."""
        return cuda.shared.array(0, uint32, alignment=16)

    @cuda.jit(device=True, inline=True)
    def _v3_smem_floats():
        """The same bytes as float32."""
        return cuda.shared.array(0, float32, alignment=16)


@functools.lru_cache(maxsize=None)
def _kl_kernel_mma(mode: str, bf16_in: bool, block_size: int, head_dim: int, index_dim: int,
                   group: int, positions: int, use_async: bool = False):
    """v3, one CTA per work item (a key block and up to ``chunk`` of the queries that chose it).

    Modes: ``"stats"`` writes each (query, slot)'s state ``(m, l, C, K)`` over the block's
    keys (forward); ``"student"`` only ``(m, l)`` (no teacher: the backward's ``LSE^idx``);
    ``"grad"`` writes ``dS`` of the block into the buffer, the slot's ``dq_idx`` partial
    ``sum_j dS_j k_idx_j`` and, into ``part[0]``, its KL term
    ``sum_j P_j (log P_j - S^idx_j + LSE^idx)`` (``kl_loss_and_backward``).
    """
    Bk, D, DI, G, P = block_size, head_dim, index_dim, group, positions
    R = P * G
    PP = -(-P // 16) * 16
    NW = R // 16
    NT = 32 * NW
    TP = NT // P  # threads per position in the per-position phases (2G, within one warp)
    teacher = mode != "student"
    assert R % 16 == 0 and NW <= _mma.MAX_WARPS and D % 16 == 0 and DI % 16 == 0
    assert Bk % 16 == 0 and TP <= 32 and PP // 16 <= NW
    (LDK, LDKI, LDP), (OFF_KI, OFF_Q, OFF_QI, OFF_P, OFF_SI), _ = _v3_layout(
        Bk, D, DI, R, PP, teacher)
    DW = D // 2
    DIW = DI // 2
    NG = 4 if Bk % 32 == 0 else 2  # n-tiles (8 keys) per A-fragment load of S = Q Kᵀ
    ACC = 4 * NG
    N_TILES_I = Bk // 8  # student n-tiles, spread over the warps
    STUDENT_ITERS = -(-((PP // 16) * N_TILES_I) // NW)
    PIECES = DW // 4  # 16-byte pieces of a row of Q / K (copied by cp.async, all in flight)
    PIECES_I = DIW // 4
    copy16 = cp_async16 if use_async else copy16_plain3
    copy16_2d = cp_async16 if use_async else copy16_plain2
    commit = cp_async_commit if use_async else no_op
    wait_all = cp_async_wait_all if use_async else no_op
    mma = mma_bf16_m16n8k16 if bf16_in else mma_f16_m16n8k16
    half_to_f32 = bf16_to_f32 if bf16_in else f16_bits_to_f32
    inv_g = float32(1.0 / G)

    # the student pass's 47 KB of shared memory (paper sizes) leaves room for two CTAs per SM
    # if each keeps to 128 registers (offline ptxas: 162 uncapped, 128 capped without spills)
    options = {"max_registers": 128} if mode == "student" and not SIMULATOR else {}

    @cuda.jit(**options)
    def _kl_kernel_mma_v3(q, k, q_idx, k_idx, lse, lse_idx, work, q_indices, slots, cu_q, cu_k,
                          scale, index_scale, coef, part, ds, dq_part):
        """q, k, q_idx, k_idx: uint32 views (two 16-bit values per word)."""
        smem = _v3_smem_words()
        sf = _v3_smem_floats()  # the same bytes as float32
        row_t = cuda.shared.array(R, int32)
        row_slot = cuda.shared.array(R, int32)
        row_pos = cuda.shared.array(R, int32)
        row_lse = cuda.shared.array(R, float32)
        pos_lse_i = cuda.shared.array(P, float32)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g4 = lane // 4
        t4 = lane % 4
        topk = ds.shape[2] if mode == "grad" else part.shape[1]
        h, q_begin, q_count, b, key0, key_pos0, nk = _kv_item(
            work, cuda.blockIdx.x, q_indices, cu_k, q_idx.shape[1], Bk)
        if q_count <= 0:
            return  # the whole CTA: a padding item

        # The key block, once: K (teacher) and K_idx row-major; keys past the sequence are 0.
        # 16-byte copies, all in flight at once (waited for with the first tile's).
        hkv = k.shape[1]
        if teacher:
            for i in range(tid, Bk * PIECES, NT):
                c = i // PIECES
                w = 4 * (i % PIECES)
                copy16(smem, c * LDK + w, k, ((key0 + min(c, nk - 1)) * hkv + h) * DW + w,
                       16 if c < nk else 0)
        for i in range(tid, Bk * PIECES_I, NT):
            c = i // PIECES_I
            w = 4 * (i % PIECES_I)
            copy16_2d(smem, OFF_KI + c * LDKI + w, k_idx, (key0 + min(c, nk - 1)) * DIW + w,
                      16 if c < nk else 0)
        commit()

        for tile in range((q_count + P - 1) // P):
            cuda.syncthreads()  # the previous tile is done with the row table and the tiles
            # row r = (position r // G, head r % G)
            for r in range(tid, R, NT):
                p = r // G
                t = -1
                s = 0
                pos = -1
                if tile * P + p < q_count:
                    t, s, pos = _row_query(q_indices, slots, cu_q, cu_k, h, b,
                                           q_begin + tile * P + p, topk)
                row_t[r] = t
                row_slot[r] = s
                row_pos[r] = pos
                x = float32(0.0)
                if teacher and t >= 0:
                    x = _finite_or_zero(lse[t, h * G + r % G])
                row_lse[r] = x
            cuda.syncthreads()
            if mode == "grad":
                for p in range(tid, P, NT):
                    t = row_t[p * G]
                    pos_lse_i[p] = lse_idx[t, h] if t >= 0 else float32(0.0)
            if teacher:
                hq = q.shape[1]
                for i in range(tid, R * PIECES, NT):
                    r = i // PIECES
                    w = 4 * (i % PIECES)
                    t = row_t[r]
                    copy16(smem, OFF_Q + r * LDK + w, q,
                           (max(t, 0) * hq + h * G + r % G) * DW + w, 16 if t >= 0 else 0)
            for i in range(tid, PP * PIECES_I, NT):
                p = i // PIECES_I
                w = 4 * (i % PIECES_I)
                t = row_t[p * G] if p < P else -1
                copy16(smem, OFF_QI + p * LDKI + w, q_idx, (max(t, 0) * hkv + h) * DIW + w,
                       16 if t >= 0 else 0)
            commit()
            wait_all()
            cuda.syncthreads()

            if teacher:
                # S = Q Kᵀ on tensor cores, warp w owns rows 16w..16w+15;
                # P_h = exp(S * scale - LSE_h) on visible keys, 0 elsewhere.
                r_top = 16 * warp + g4
                r_bot = r_top + 8
                a_base = OFF_Q + 16 * warp * LDK
                for n0 in range(0, Bk, 8 * NG):
                    acc = cuda.local.array(ACC, float32)
                    for i in range(ACC):
                        acc[i] = float32(0.0)
                    for kk in range(0, DW, 8):
                        a0, a1, a2, a3 = load_a_frag(smem, a_base + kk, LDK)
                        for i in range(NG):
                            b0, b1 = load_b_frag(smem, (n0 + 8 * i) * LDK + kk, LDK)
                            d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1, acc[4 * i],
                                                 acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3])
                            acc[4 * i] = d0
                            acc[4 * i + 1] = d1
                            acc[4 * i + 2] = d2
                            acc[4 * i + 3] = d3
                    for i in range(NG):
                        for e in range(2):
                            cc = n0 + 8 * i + 2 * t4 + e
                            p_top = float32(0.0)
                            p_bot = float32(0.0)
                            if cc < nk and key_pos0 + cc <= row_pos[r_top]:
                                p_top = math.exp(acc[4 * i + e] * scale - row_lse[r_top])
                            if cc < nk and key_pos0 + cc <= row_pos[r_bot]:
                                p_bot = math.exp(acc[4 * i + 2 + e] * scale - row_lse[r_bot])
                            sf[OFF_P + r_top * LDP + cc] = p_top
                            sf[OFF_P + r_bot * LDP + cc] = p_bot

            # S_idx = Q_idx K_idxᵀ: PP/16 x Bk/8 output tiles dealt to the warps round-robin
            # (every warp runs the same number of mma, as the simulator's twin requires).
            for it in range(STUDENT_ITERS):
                tile_id = warp + it * NW
                real = tile_id < (PP // 16) * N_TILES_I
                if not real:
                    tile_id = 0
                mt = tile_id // N_TILES_I
                nt = tile_id % N_TILES_I
                c0 = float32(0.0)
                c1 = float32(0.0)
                c2 = float32(0.0)
                c3 = float32(0.0)
                for kk in range(0, DIW, 8):
                    a0, a1, a2, a3 = load_a_frag(smem, OFF_QI + 16 * mt * LDKI + kk, LDKI)
                    b0, b1 = load_b_frag(smem, OFF_KI + 8 * nt * LDKI + kk, LDKI)
                    c0, c1, c2, c3 = mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
                if real:
                    p_top = 16 * mt + g4
                    p_bot = p_top + 8
                    pos_top = row_pos[p_top * G] if p_top < P else -1
                    pos_bot = row_pos[p_bot * G] if p_bot < P else -1
                    for e in range(2):
                        cc = 8 * nt + 2 * t4 + e
                        x_top = _NEG_INF
                        x_bot = _NEG_INF
                        if cc < nk and 0 <= key_pos0 + cc <= pos_top:
                            x_top = (c0 if e == 0 else c1) * index_scale
                        if cc < nk and 0 <= key_pos0 + cc <= pos_bot:
                            x_bot = (c2 if e == 0 else c3) * index_scale
                        sf[OFF_SI + p_top * LDP + cc] = x_top
                        sf[OFF_SI + p_bot * LDP + cc] = x_bot
            cuda.syncthreads()

            # Per position p: TP threads (one aligned lane group of a warp) share its Bk keys.
            p = tid // TP
            li = tid % TP
            t = row_t[p * G]
            slot = row_slot[p * G]
            if mode == "grad":
                lse_i = pos_lse_i[p]
                kl_run = float32(0.0)  # sum_j P_j (log P_j - S_idx_j + LSE_idx): LSE_idx is known
                for cc in range(li, Bk, TP):
                    x = sf[OFF_SI + p * LDP + cc]
                    dsv = float32(0.0)
                    if x > _NEG_INF:
                        pj = float32(0.0)
                        for gg in range(G):
                            pj += sf[OFF_P + (p * G + gg) * LDP + cc]
                        pj *= inv_g
                        dsv = coef * (math.exp(x - lse_i) - pj)
                        if pj > float32(0.0):
                            kl_run += pj * (math.log(pj) - (x - lse_i))
                    sf[OFF_SI + p * LDP + cc] = dsv
                    if t >= 0:
                        ds[t, h, slot, cc] = dsv
                # the slot's KL term over the TP lanes (a + b = b + a: partners agree bitwise)
                off = TP // 2
                while off > 0:
                    kl_run += cuda.shfl_xor_sync(_FULL_MASK, kl_run, off)
                    off //= 2
                if li == 0 and t >= 0:
                    part[0, slot, t, h] = kl_run
                cuda.syncthreads()
                # dq_idx partial of the slot: sum_j dS_j k_idx_j, keys in order; a thread owns
                # the two dims of a word of K_idx
                for w in range(li, DIW, TP):
                    acc_lo = float32(0.0)
                    acc_hi = float32(0.0)
                    for cc in range(Bk):
                        word = smem[OFF_KI + cc * LDKI + w]
                        dsv = sf[OFF_SI + p * LDP + cc]
                        acc_lo += dsv * half_to_f32(word & uint32(0xFFFF))
                        acc_hi += dsv * half_to_f32(word >> uint32(16))
                    if t >= 0:
                        dq_part[slot, t, h, 2 * w] = acc_lo * index_scale
                        dq_part[slot, t, h, 2 * w + 1] = acc_hi * index_scale
            else:
                zero = float32(0.0)
                m, l, le, d, de, c, ce = _NEG_INF, zero, zero, zero, zero, zero, zero
                for cc in range(li, Bk, TP):
                    x = sf[OFF_SI + p * LDP + cc]
                    if x > _NEG_INF:
                        pj = zero
                        if teacher:
                            for gg in range(G):
                                pj += sf[OFF_P + (p * G + gg) * LDP + cc]
                        m, l, le, d, de, c, ce = _accumulate(m, l, le, d, de, c, ce, pj * inv_g,
                                                             x)
                m, l, c, kk = _finish(m, l, le, d, de, c, ce)
                off = TP // 2
                while off > 0:
                    m2 = cuda.shfl_xor_sync(_FULL_MASK, m, off)
                    l2 = cuda.shfl_xor_sync(_FULL_MASK, l, off)
                    c2 = cuda.shfl_xor_sync(_FULL_MASK, c, off)
                    k2 = cuda.shfl_xor_sync(_FULL_MASK, kk, off)
                    # the lower lane's state first, so both partners hold the same bits
                    if li & off:
                        m, l, c, kk = _merge(m2, l2, c2, k2, m, l, c, kk)
                    else:
                        m, l, c, kk = _merge(m, l, c, kk, m2, l2, c2, k2)
                    off //= 2
                if li == 0 and t >= 0:
                    part[0, slot, t, h] = m
                    part[1, slot, t, h] = l
                    part[2, slot, t, h] = c
                    part[3, slot, t, h] = kk

    return _kl_kernel_mma_v3


# =============================================================================================
# v4: v3's backward with the teacher in registers (K1 v3's layout) and a register-resident
# student pass
# =============================================================================================

# v4 tile rows R = P x G of the grad kernel (64 as K1 v3's default; the simulator's smallest)
DEFAULT_TILE_ROWS_V4 = 16 if SIMULATOR else 64
_STUDENT_WARPS_V4 = 1 if SIMULATOR else 4  # student pass: 16 query positions per warp


def _v4_layout(block_size, head_dim, index_dim, rows, positions):
    """v4 grad kernel's shared memory: ``(LD, LDI, LDT, LDE), (OFF_KI, OFF_Q, OFF_QI, OFF_X,
    OFF_T, OFF_E), bytes``.

    Words: sK [Bk rows of D/2 + 4] (K, the B operand of S = Q Kᵀ), sKi [Bk rows of Didx/2 + 4]
    (K_idx, the B operand of S^idx = Q_idx K_idxᵀ and of dq_idx = dS K_idx), sQ the R query
    rows of a tile (one buffer: tile i + 1 is gathered once the scores of tile i are done,
    while its dS and dq_idx run; at the paper's sizes the footprint stays under half an SM's,
    two CTAs per SM), sQi two buffers of PP = ceil16(P) index query rows (rows past P are
    zeros), sE three planes [PP rows of Bk/2 + 4] of 16-bit values (``hi + mid + lo`` of each
    position's ``dS``, exact; rows past P zeros), the A operand of dq_idx. Floats: sX [Bk keys x
    LDT] key-major, LDT = 4 ceil(P/4), the student logits of the tile's positions; sT [Bk x
    LDT] the teacher ``P`` where a lane keeps more than two (n-tile, row half) pairs of it
    (the dS loop would index its registers at run time), each element written and read by the
    same lane."""
    ld = head_dim // 2 + 4
    ldi = index_dim // 2 + 4
    lde = block_size // 2 + 4
    pp = -(-positions // 16) * 16
    ldt = 4 * -(-positions // 4)
    off_ki = block_size * ld
    off_q = off_ki + block_size * ldi
    off_qi = off_q + rows * ld
    off_x = off_qi + 2 * pp * ldi
    off_t = off_x + block_size * ldt
    off_e = off_t + block_size * ldt
    total = off_e + 3 * pp * lde
    return (ld, ldi, ldt, lde), (off_ki, off_q, off_qi, off_x, off_t, off_e), 4 * total


def _v4_student_layout(block_size, index_dim, positions):
    """v4 student kernel: sKi [Bk rows] and two buffers of ``positions`` index query rows."""
    ldi = index_dim // 2 + 4
    return ldi, block_size * ldi, 4 * (block_size + 2 * positions) * ldi


@functools.lru_cache(maxsize=None)
def _kl_kernel_student_reg(bf16_in: bool, block_size: int, index_dim: int, warps: int,
                           use_async: bool = True):
    """v4 ``LSE^idx`` pass: per work item, the slot states ``(m, l, 0, 0)`` of its queries.

    One CTA per work item loads K_idx of the key block once; tiles of ``16 warps`` query
    positions (no heads: the index branch has one query per group), each warp 16 of them:
    ``S^idx`` in registers (fp32 mma accumulators), masked causally, the row's maximum and
    ``l = sum exp(S^idx - m)`` by quad shuffles. ``part[0..3, slot, t, h] = (m, l, 0, 0)``
    (``m`` natural-log units), merged in slot order by ``_kl_kernel_combine_states``."""
    Bk, DI = block_size, index_dim
    NW = warps
    PS = 16 * NW  # positions per tile
    NT = 32 * NW
    assert DI % 16 == 0 and Bk % 16 == 0 and NW <= _mma.MAX_WARPS
    LDI, OFF_Q, _ = _v4_student_layout(Bk, DI, PS)
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

    @cuda.jit
    def _kl_kernel_student_v4(q_idx, k_idx, work, q_indices, slots, cu_q, cu_k,
                              index_scale_log2, part):
        smem = _v3_smem_words()
        s_acc = cuda.local.array(S_REGS, float32)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g4 = lane // 4
        t4 = lane % 4
        topk = part.shape[1]
        hkv = q_idx.shape[1]
        h, q_begin, q_count, b, j, key0, nk = _item_fields(
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
        t_raw, s_raw = _load_entry(q_indices, slots, h, q_begin, q_count, 0, PS, 1, g_row, PS)
        t_g, _, _ = _check_entry(t_raw, s_raw, q_lo, q_hi, pos0, topk)
        if g_half < HALVES:
            src = ((t_g if t_g >= 0 else 0) * hkv + h) * DIW + g_half * HALF * 4
            for u in range(HALF):
                copy16(smem, OFF_Q + g_row * LDI + g_half * HALF * 4 + 4 * u, q_idx,
                       src + 4 * u, 16 if t_g >= 0 else 0)
        commit()
        t_raw, s_raw = _load_entry(q_indices, slots, h, q_begin, q_count, 1, PS, 1, g_row, PS)
        r_top = 16 * warp + g4
        r_bot = r_top + 8
        tt_raw, st_raw = _load_entry(q_indices, slots, h, q_begin, q_count, 0, PS, 1, r_top, PS)
        tb_raw, sb_raw = _load_entry(q_indices, slots, h, q_begin, q_count, 0, PS, 1, r_bot, PS)
        l_rows = ((lane >> 3) & 1) * 8 + (lane & 7)
        a_lane = (16 * warp + l_rows) * LDI + (lane >> 4) * 4
        k_lane = ((lane >> 4) * 8 + (lane & 7)) * LDI + ((lane >> 3) & 1) * 4

        for tile in range(num_tiles):
            buf = tile % 2
            wait_all()
            cuda.syncthreads()
            if tile + 1 < num_tiles:
                t_g, _, _ = _check_entry(t_raw, s_raw, q_lo, q_hi, pos0, topk)
                if g_half < HALVES:
                    src = ((t_g if t_g >= 0 else 0) * hkv + h) * DIW + g_half * HALF * 4
                    dst = OFF_Q + (1 - buf) * QBUF + g_row * LDI + g_half * HALF * 4
                    for u in range(HALF):
                        copy16(smem, dst + 4 * u, q_idx, src + 4 * u, 16 if t_g >= 0 else 0)
            commit()
            t_raw, s_raw = _load_entry(q_indices, slots, h, q_begin, q_count, tile + 2, PS, 1,
                                       g_row, PS)
            t_top, s_top, pos_top = _check_entry(tt_raw, st_raw, q_lo, q_hi, pos0, topk)
            t_bot, s_bot, pos_bot = _check_entry(tb_raw, sb_raw, q_lo, q_hi, pos0, topk)
            tt_raw, st_raw = _load_entry(q_indices, slots, h, q_begin, q_count, tile + 1, PS, 1,
                                         r_top, PS)
            tb_raw, sb_raw = _load_entry(q_indices, slots, h, q_begin, q_count, tile + 1, PS, 1,
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
            m_top = _NEG_INF
            m_bot = _NEG_INF
            for i in range(NS):
                for e in range(2):
                    c = 8 * i + 2 * t4 + e
                    x_top = s_acc[4 * i + e] * index_scale_log2
                    x_bot = s_acc[4 * i + 2 + e] * index_scale_log2
                    if c > lim_top:
                        x_top = _NEG_INF
                    if c > lim_bot:
                        x_bot = _NEG_INF
                    s_acc[4 * i + e] = x_top
                    s_acc[4 * i + 2 + e] = x_bot
                    m_top = max(m_top, x_top)
                    m_bot = max(m_bot, x_bot)
            m_top = max(m_top, cuda.shfl_xor_sync(_FULL_MASK, m_top, 1))
            m_bot = max(m_bot, cuda.shfl_xor_sync(_FULL_MASK, m_bot, 1))
            m_top = max(m_top, cuda.shfl_xor_sync(_FULL_MASK, m_top, 2))
            m_bot = max(m_bot, cuda.shfl_xor_sync(_FULL_MASK, m_bot, 2))
            mb_top = m_top if m_top > _NEG_INF else float32(0.0)
            mb_bot = m_bot if m_bot > _NEG_INF else float32(0.0)
            l_top = float32(0.0)
            l_bot = float32(0.0)
            for i in range(NS):
                for e in range(2):
                    l_top += exp2(s_acc[4 * i + e] - mb_top)
                    l_bot += exp2(s_acc[4 * i + 2 + e] - mb_bot)
            l_top += cuda.shfl_xor_sync(_FULL_MASK, l_top, 1)
            l_bot += cuda.shfl_xor_sync(_FULL_MASK, l_bot, 1)
            l_top += cuda.shfl_xor_sync(_FULL_MASK, l_top, 2)
            l_bot += cuda.shfl_xor_sync(_FULL_MASK, l_bot, 2)
            if t4 == 0:
                if t_top >= 0:
                    part[0, s_top, t_top, h] = m_top * float32(_LN2) if l_top > 0 else _NEG_INF
                    part[1, s_top, t_top, h] = l_top
                    part[2, s_top, t_top, h] = float32(0.0)
                    part[3, s_top, t_top, h] = float32(0.0)
                if t_bot >= 0:
                    part[0, s_bot, t_bot, h] = m_bot * float32(_LN2) if l_bot > 0 else _NEG_INF
                    part[1, s_bot, t_bot, h] = l_bot
                    part[2, s_bot, t_bot, h] = float32(0.0)
                    part[3, s_bot, t_bot, h] = float32(0.0)

    return _kl_kernel_student_v4


@functools.lru_cache(maxsize=None)
def _kl_kernel_grad_reg(bf16_in: bool, block_size: int, head_dim: int, index_dim: int,
                        group: int, positions: int, use_async: bool = True, grads: bool = True):
    """v4 grad pass: v3's ``"grad"`` mode with the teacher in registers (``grads=False``: the
    KL terms only, ``kl_loss``'s pass; ``ds`` and ``dq_part`` are not touched).

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

    Outputs as v3's grad mode: ``part[0, slot, t, h]``, ``ds[t, h, slot, :]``,
    ``dq_part[slot, t, h, :]``."""
    Bk, D, DI, G, P = block_size, head_dim, index_dim, group, positions
    R = P * G
    NW = R // 16
    NT = 32 * NW
    assert G in GQA_GROUP_SIZES and R % 16 == 0 and NW <= _mma.MAX_WARPS
    assert D % 16 == 0 and DI % 16 == 0 and Bk % 16 == 0
    (LD, LDI, LDT, LDE), (OFF_KI, OFF_Q, OFF_QI, OFF_X, OFF_T, OFF_E), _ = _v4_layout(
        Bk, D, DI, R, P)
    PP = -(-P // 16) * 16
    DW = D // 2
    DIW = DI // 2
    PIECES = DW // 4
    PIECES_I = DIW // 4
    HALF = PIECES // 2 if PIECES >= 2 else 1
    HALVES = PIECES // HALF
    QIBUF = PP * LDI
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
    USE_ST = LEN * HALVES_DS > 2  # the teacher through sT (see _v4_layout)
    H1, H2, H3 = NS >> 1, NS >> 2, NS >> 3  # halves of the scatter steps (while used)
    OFF1 = 4 << (STEPS - 1) if STEPS >= 1 else 0
    OFF2 = 4 << (STEPS - 2) if STEPS >= 2 else 0
    OFF3 = 4 << (STEPS - 3) if STEPS >= 3 else 0
    MT = PP // 16
    NPAIRS = Bk // 16
    STUDENT_ITERS = -(-(MT * NPAIRS) // NW)
    PLANE = PP * LDE  # words per dS plane
    NPD = DI // 16  # n-tile pairs of dq_idx (16 dims), dealt to the warps
    DQ_ITERS = -(-(MT * NPD) // NW)
    KP = Bk // 16  # k-steps of dq_idx = dS K_idx
    pack = pack_bf16x2 if bf16_in else pack_f16x2
    # fp16 planes hold dS * 2**14 (|dS| <= 1): the residuals stay clear of fp16's subnormals
    ds_up = float32(1.0) if bf16_in else float32(2.0 ** 14)
    ds_down = float32(1.0) if bf16_in else float32(2.0 ** -14)
    GRADS = grads
    mma = mma_bf16_m16n8k16 if bf16_in else mma_f16_m16n8k16
    mma_pair = make_mma_pair(mma)
    half_to_f32 = bf16_to_f32 if bf16_in else f16_bits_to_f32
    copy16 = cp_async16 if use_async else copy16_plain3
    copy16_2d = cp_async16 if use_async else copy16_plain2
    commit = cp_async_commit if use_async else no_op
    wait_all = cp_async_wait_all if use_async else no_op
    inv_g = float32(1.0 / G)

    @cuda.jit(device=True, inline=True)
    def gather(smem, q, q_idx, h, row, half, t, buf, pos_t, pos_s, pos_q, s, pos):
        """This thread's half of query row ``row`` of a tile into sQ (zeros if ``t = -1``);
        the thread with half 0 of a position's first row also copies the position's index
        query into sQi buffer ``buf`` and records ``(t, slot, pos)`` in tables ``buf``."""
        hkv = q_idx.shape[1]
        if half < HALVES:
            src = ((t if t >= 0 else 0) * q.shape[1] + h * G + row % G) * DW + half * HALF * 4
            dst = OFF_Q + row * LD + half * HALF * 4
            for u in range(HALF):
                copy16(smem, dst + 4 * u, q, src + 4 * u, 16 if t >= 0 else 0)
        if half == 0 and row % G == 0:
            p = row // G
            pos_t[buf, p] = t
            pos_s[buf, p] = s
            pos_q[buf, p] = pos
            src = ((t if t >= 0 else 0) * hkv + h) * DIW
            dst = OFF_QI + buf * QIBUF + p * LDI
            for u in range(PIECES_I):
                copy16(smem, dst + 4 * u, q_idx, src + 4 * u, 16 if t >= 0 else 0)

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
                s_acc[4 * j + x] = keep + cuda.shfl_xor_sync(_FULL_MASK, send, off)

    @cuda.jit
    def _kl_kernel_grad_v4(q, k, q_idx, k_idx, lse, lse_idx, work, q_indices, slots, cu_q,
                           cu_k, scale_log2, index_scale, coef, part, ds, dq_part):
        smem = _v3_smem_words()
        sf = _v3_smem_floats()
        pos_t = cuda.shared.array((2, P), int32)
        pos_s = cuda.shared.array((2, P), int32)
        pos_q = cuda.shared.array((2, P), int32)
        s_acc = cuda.local.array(S_REGS, float32)
        acc = cuda.local.array(8, float32)
        afr = cuda.local.array(12, uint32)  # A fragments of the three dS planes
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g4 = lane // 4
        t4 = lane % 4
        topk = part.shape[1]  # (ds is a dummy without gradients)
        hkv = k.shape[1]
        h, q_begin, q_count, b, j, key0, nk = _item_fields(
            work, cuda.blockIdx.x, q_indices, cu_k, hkv, Bk)
        if q_count <= 0:
            return
        key_pos0 = j * Bk
        q_lo = int(cu_q[b])
        q_hi = int(cu_q[b + 1])
        pos0 = (int(cu_k[b + 1]) - int(cu_k[b])) - (q_hi - q_lo)
        num_tiles = (q_count + P - 1) // P
        cqs = coef * index_scale * ds_down

        # The key block (K and K_idx; keys past the sequence are 0) and the pad rows of both
        # index query buffers (zeros, never rewritten).
        for e in range(tid, Bk * PIECES, NT):
            c = e // PIECES
            w = (e % PIECES) * 4
            ok = c < nk
            copy16(smem, c * LD + w, k, ((key0 + (c if ok else 0)) * hkv + h) * DW + w,
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
        for e in range(tid, 3 * (PP - P) * LDE, NT):
            smem[OFF_E + (e // ((PP - P) * LDE)) * PLANE + P * LDE + e % ((PP - P) * LDE)] = \
                uint32(0)
        g_row = tid // 2
        g_half = tid % 2
        t_raw, s_raw = _load_entry(q_indices, slots, h, q_begin, q_count, 0, P, G, g_row, R)
        t_g, s_g, p_g = _check_entry(t_raw, s_raw, q_lo, q_hi, pos0, topk)
        gather(smem, q, q_idx, h, g_row, g_half, t_g, 0, pos_t, pos_s, pos_q, s_g, p_g)
        commit()
        t_raw, s_raw = _load_entry(q_indices, slots, h, q_begin, q_count, 1, P, G, g_row, R)

        r_top = 16 * warp + g4
        r_bot = r_top + 8
        p_top = r_top // G  # the rows' positions in the tile
        p_bot = r_bot // G
        tt_raw, st_raw = _load_entry(q_indices, slots, h, q_begin, q_count, 0, P, G, r_top, R)
        tb_raw, sb_raw = _load_entry(q_indices, slots, h, q_begin, q_count, 0, P, G, r_bot, R)
        l_rows = ((lane >> 3) & 1) * 8 + (lane & 7)
        a_lane = (16 * warp + l_rows) * LD + (lane >> 4) * 4
        k_lane = ((lane >> 4) * 8 + (lane & 7)) * LD + ((lane >> 3) & 1) * 4
        ai_lane = l_rows * LDI + (lane >> 4) * 4
        ki_lane = OFF_KI + ((lane >> 4) * 8 + (lane & 7)) * LDI + ((lane >> 3) & 1) * 4
        vi_lane = OFF_KI + l_rows * LDI + (lane >> 4) * 4  # K_idx as the B of dq_idx (.trans)
        u_own = g4 % GG  # this lane among the GG holding a position's rows (one row half)

        for tile in range(num_tiles):
            buf = tile % 2
            wait_all()
            cuda.syncthreads()  # tile's rows landed; every warp is past tile - 1
            t_top, s_top, pos_top = _check_entry(tt_raw, st_raw, q_lo, q_hi, pos0, topk)
            t_bot, s_bot, pos_bot = _check_entry(tb_raw, sb_raw, q_lo, q_hi, pos0, topk)
            # the rows' LSEs, loaded early (used after the mma)
            lse_top = float32(0.0)
            lse_bot = float32(0.0)
            li_top = float32(0.0)
            li_bot = float32(0.0)
            if t_top >= 0:
                lse_top = _finite_or_zero(lse[t_top, h * G + r_top % G]) * float32(_LOG2E)
                li_top = lse_idx[t_top, h]
            if t_bot >= 0:
                lse_bot = _finite_or_zero(lse[t_bot, h * G + r_bot % G]) * float32(_LOG2E)
                li_bot = lse_idx[t_bot, h]
            tt_raw, st_raw = _load_entry(q_indices, slots, h, q_begin, q_count, tile + 1, P, G,
                                         r_top, R)
            tb_raw, sb_raw = _load_entry(q_indices, slots, h, q_begin, q_count, tile + 1, P, G,
                                         r_bot, R)

            # 1. Student logits into sX[key, position] (every warp runs the same mma count).
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
                    pt = 16 * mt + g4
                    pb = pt + 8
                    for nn in range(2):
                        for e in range(2):
                            c = 16 * n2 + 8 * nn + 2 * t4 + e
                            vt = (c0 if e == 0 else c1) if nn == 0 else (c4 if e == 0 else c5)
                            vb = (c2 if e == 0 else c3) if nn == 0 else (c6 if e == 0 else c7)
                            if pt < P:
                                x = _NEG_INF
                                if c < nk and key_pos0 + c <= pos_q[buf, pt]:
                                    x = vt * index_scale
                                sf[OFF_X + c * LDT + pt] = x
                            if pb < P:
                                x = _NEG_INF
                                if c < nk and key_pos0 + c <= pos_q[buf, pb]:
                                    x = vb * index_scale
                                sf[OFF_X + c * LDT + pb] = x

            # 2. S = Q Kᵀ in registers, then P_h = exp(S scale - LSE_h) on visible keys.
            for i in range(4 * NS):
                s_acc[i] = float32(0.0)
            qa = OFF_Q + a_lane
            for ks in range(KSTEPS):
                a0, a1, a2, a3 = ldmatrix_x4(smem, qa + 8 * ks)
                for n2 in range(NS // 2):
                    b0, b1, b2, b3 = ldmatrix_x4(smem, k_lane + 16 * n2 * LD + 8 * ks)
                    n = 8 * n2
                    mma_pair(s_acc, n, a0, a1, a2, a3, b0, b1, b2, b3)
            lim_top = min(pos_top - key_pos0, nk - 1)
            lim_bot = min(pos_bot - key_pos0, nk - 1)
            for i in range(NS):
                for e in range(2):
                    c = 8 * i + 2 * t4 + e
                    v_top = float32(0.0)
                    v_bot = float32(0.0)
                    if c <= lim_top:
                        v_top = exp2(s_acc[4 * i + e] * scale_log2 - lse_top)
                    if c <= lim_bot:
                        v_bot = exp2(s_acc[4 * i + 2 + e] * scale_log2 - lse_bot)
                    if BOTH:  # G = 16: both row halves are heads of the same position
                        v_top += v_bot
                    s_acc[4 * i + e] = v_top
                    s_acc[4 * i + 2 + e] = v_bot
            # 3. sum over the position's heads: reduce-scatter, then all-reduce (see above);
            # n-tile j < LEN of s_acc is now n-tile (u_own >> RB) LEN + j of the block
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
                            s_acc[4 * j + x] += cuda.shfl_xor_sync(_FULL_MASK, s_acc[4 * j + x],
                                                                   off)
                off *= 2
            if USE_ST:
                for j in range(LEN):
                    c = 8 * ((u_own >> RB) * LEN + j) + 2 * t4
                    for x in range(2 * HALVES_DS):
                        pp = p_top if x < 2 else p_bot
                        sf[OFF_T + (c + x % 2) * LDT + pp] = s_acc[4 * j + x]
            cuda.syncthreads()  # sX holds every position's student logits; sQ is free
            if tile + 1 < num_tiles:  # gather tile + 1 while this one finishes
                t_g, s_g, p_g = _check_entry(t_raw, s_raw, q_lo, q_hi, pos0, topk)
                gather(smem, q, q_idx, h, g_row, g_half, t_g, 1 - buf, pos_t, pos_s, pos_q,
                       s_g, p_g)
            commit()
            t_raw, s_raw = _load_entry(q_indices, slots, h, q_begin, q_count, tile + 2, P, G,
                                       g_row, R)

            # 4. dS = P^idx - P on this lane's share of keys; the slot's KL term.
            kl_top = float32(0.0)
            kl_bot = float32(0.0)
            own = (u_own & LOW_MASK) == 0  # one lane of those holding the same sums
            for j in range(LEN):
                c = 8 * ((u_own >> RB) * LEN + j) + 2 * t4
                for half in range(1 if BOTH else 2):
                    pp = p_top if half == 0 else p_bot
                    li = li_top if half == 0 else li_bot
                    t = t_top if half == 0 else t_bot
                    sl = s_top if half == 0 else s_bot
                    ds0 = float32(0.0)
                    ds1 = float32(0.0)
                    for e in range(2):
                        if USE_ST:
                            pj = sf[OFF_T + (c + e) * LDT + pp] * inv_g
                        else:
                            pj = s_acc[4 * j + 2 * half + e] * inv_g
                        x = sf[OFF_X + (c + e) * LDT + pp]
                        dsv = float32(0.0)
                        klv = float32(0.0)
                        if own and x > _NEG_INF:
                            if GRADS:
                                dsv = math.exp(x - li) - pj
                            if pj > float32(0.0):
                                klv = pj * (math.log(pj) - (x - li))
                        if e == 0:
                            ds0 = dsv
                        else:
                            ds1 = dsv
                        if half == 0:
                            kl_top += klv
                        else:
                            kl_bot += klv
                    if own and GRADS:
                        if t >= 0:
                            ds[t, h, sl, c] = coef * ds0
                            ds[t, h, sl, c + 1] = coef * ds1
                        # dS (keys c, c + 1) as hi + mid + lo 16-bit pairs, row pp of the planes
                        xa = ds0 * ds_up
                        xb = ds1 * ds_up
                        for plane in range(3):
                            word = pack(xa, xb)
                            smem[OFF_E + plane * PLANE + pp * LDE + c // 2] = word
                            xa = xa - half_to_f32(word & uint32(0xFFFF))
                            xb = xb - half_to_f32(word >> uint32(16))
            # over the lanes sharing a position: t4 (offsets 1, 2) and u_own (4 .. 2 GG)
            off = 1
            for _ in range(2 + STEPS):
                kl_top += cuda.shfl_xor_sync(_FULL_MASK, kl_top, off)
                kl_bot += cuda.shfl_xor_sync(_FULL_MASK, kl_bot, off)
                off *= 2
            if t4 == 0 and u_own == 0:
                if t_top >= 0:
                    part[0, s_top, t_top, h] = kl_top
                if t_bot >= 0 and not BOTH:
                    part[0, s_bot, t_bot, h] = kl_bot
            if not GRADS:
                continue
            cuda.syncthreads()  # the planes hold dS of every position

            # 5. dq_idx partials = dS K_idx on tensor cores: A = the three planes (exact
            # products), B = K_idx by ldmatrix.trans (K1's V); (m-tile, n-tile pair) dealt to
            # the warps, every warp running the same mma count.
            for it in range(DQ_ITERS):
                real, mt, n2 = _deal(warp, it, NW, MT * NPD, NPD)
                for i in range(8):
                    acc[i] = float32(0.0)
                for kp in range(KP):
                    for plane in range(3):
                        a0, a1, a2, a3 = ldmatrix_x4(
                            smem, OFF_E + plane * PLANE + (16 * mt + l_rows) * LDE
                            + (lane >> 4) * 4 + 8 * kp)
                        afr[4 * plane] = a0
                        afr[4 * plane + 1] = a1
                        afr[4 * plane + 2] = a2
                        afr[4 * plane + 3] = a3
                    b0, b1, b2, b3 = ldmatrix_x4_trans(smem, vi_lane + 16 * kp * LDI + 8 * n2)
                    for plane in range(3):
                        c0, c1, c2, c3 = mma(afr[4 * plane], afr[4 * plane + 1],
                                             afr[4 * plane + 2], afr[4 * plane + 3], b0, b1,
                                             acc[0], acc[1], acc[2], acc[3])
                        acc[0] = c0
                        acc[1] = c1
                        acc[2] = c2
                        acc[3] = c3
                        c0, c1, c2, c3 = mma(afr[4 * plane], afr[4 * plane + 1],
                                             afr[4 * plane + 2], afr[4 * plane + 3], b2, b3,
                                             acc[4], acc[5], acc[6], acc[7])
                        acc[4] = c0
                        acc[5] = c1
                        acc[6] = c2
                        acc[7] = c3
                if real:
                    # C layout: positions 16 mt + g4 (+8), dims 16 n2 + 8 nn + 2 t4 (+1)
                    for r8 in range(2):
                        p = 16 * mt + g4 + 8 * r8
                        if p < P:
                            t = pos_t[buf, p]
                            if t >= 0:
                                sl = pos_s[buf, p]
                                for nn in range(2):
                                    d = 16 * n2 + 8 * nn + 2 * t4
                                    dq_part[sl, t, h, d] = acc[4 * nn + 2 * r8] * cqs
                                    dq_part[sl, t, h, d + 1] = acc[4 * nn + 2 * r8 + 1] * cqs

    return _kl_kernel_grad_v4


# dk_idx on tensor cores (v4): dS split into three bf16 planes, so the mma's products are exact
_KEYS_ENTRIES_V4 = 32  # CSR entries staged per step (two k-steps of 16)
_KEYS_DIMS_V4 = 64  # dims of dk_idx per CTA (a grid axis): 3 x 32 accumulators per lane


def _keys_v4_layout(block_size, index_dim):
    """v4 dk_idx kernel: ``(LDE, LDQ, OFF_Q, bytes, dims)``. Words: three bf16 planes (hi, mid,
    lo) x two buffers of E entries x ``Bk/2 + 4``, then two buffers of E index query rows of
    the CTA's ``dims`` dims (``dims/2 + 4`` words each)."""
    dims = min(_KEYS_DIMS_V4, index_dim)
    lde = block_size // 2 + 4
    ldq = dims // 2 + 4
    off_q = 6 * _KEYS_ENTRIES_V4 * lde
    return lde, ldq, off_q, 4 * (off_q + 2 * _KEYS_ENTRIES_V4 * ldq), dims


def _keys_v4_supported(kind, block_size, index_dim):
    """The v4 dk_idx kernel needs bf16 (fp16 planes would underflow: ``dS`` is ``coef`` times
    a probability difference), at most 8 warps of 16 keys and whole CTAs of dims."""
    dims = min(_KEYS_DIMS_V4, index_dim)
    return (kind == "bfloat16" and block_size % 16 == 0 and block_size <= 128
            and index_dim % 16 == 0 and index_dim % dims == 0)


@functools.lru_cache(maxsize=None)
def _kl_kernel_keys_mma(block_size: int, index_dim: int, use_async: bool = True):
    """v4 backward pass 2: ``dk_idx[key, d] += s_idx sum_{r, (t, s)} dS[t, r, s, key]
    q_idx[t, r, d]`` for one key block and ``dims`` dims per CTA, on tensor cores.

    The row's CSR entries of every group, in order, 32 at a time: their ``dS`` rows (fp32,
    from the buffer) are split into ``hi + mid + lo`` bf16 planes (exact: 3 x 8 significand
    bits) stored entry-major, their index queries copied by ``cp.async``; warp ``w`` owns keys
    ``16w .. 16w + 15``: ``A = dSᵀ`` and ``B = Q_idx`` both by ``ldmatrix.trans``, three mma
    per product. Each step's sum (6 mma deep) is folded into a Kahan-compensated total, as v2
    folds its runs. The next step's ``dS`` rows are loaded into registers and its queries
    copied while this step computes."""
    mma_pair_bf16 = make_mma_pair(mma_bf16_m16n8k16)
    Bk, DI = block_size, index_dim
    NW = Bk // 16
    NT = 32 * NW
    E = _KEYS_ENTRIES_V4
    LDE, LDQ, OFF_Q, _, DPC = _keys_v4_layout(Bk, DI)
    assert Bk % 16 == 0 and NW <= _mma.MAX_WARPS and DPC % 16 == 0
    NN = DPC // 8
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

    @cuda.jit(device=True, inline=True)
    def entry(q_indices, slots, r, first, count, e, tq, topk):
        """``(t, slot)`` of entry ``e`` of the row of group ``r``; ``t = -1`` past the row or
        for an entry outside the chunk (never out of bounds, even for a foreign CSR)."""
        t = -1
        s = 0
        if e < count:
            t = int(q_indices[r, first + e])
            s = int(slots[r, first + e])
            if t < 0 or t >= tq or s < 0 or s >= topk:
                t = -1
        return t, s

    @cuda.jit
    def _kl_kernel_keys_v4(q_idx, ds, row_ptr, q_indices, slots, cu_k, row_offsets,
                           index_scale, dk):
        smem = _v3_smem_words()
        acc = cuda.local.array(ACC, float32)
        tot = cuda.local.array(ACC, float32)
        comp = cuda.local.array(ACC, float32)
        dsr = cuda.local.array(DSR, float32)
        afr = cuda.local.array(12, uint32)  # A fragments of the three planes
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g4 = lane // 4
        t4 = lane % 4
        hkv = q_idx.shape[1]
        tq = q_idx.shape[0]
        topk = ds.shape[2]
        nd = DI // DPC
        row = cuda.blockIdx.x // nd
        d0 = (cuda.blockIdx.x % nd) * DPC
        b = _last_le(row_offsets, row)
        kk0 = (row - int(row_offsets[b])) * Bk
        key0 = int(cu_k[b])
        nk = min(Bk, int(cu_k[b + 1]) - key0 - kk0)
        for i in range(ACC):
            tot[i] = float32(0.0)
            comp[i] = float32(0.0)
        # ldmatrix row addresses: A = dSᵀ from the entry-major planes (matrices: entries 0-7 /
        # 8-15 x keys 0-7 / 8-15 of the warp's 16), B = Q_idx as K1's V (.trans)
        a_lane = ((lane & 7) + 8 * (lane >> 4)) * LDE + 4 * ((lane >> 3) & 1) + 8 * warp
        l_rows = ((lane >> 3) & 1) * 8 + (lane & 7)
        b_lane = OFF_Q + l_rows * LDQ + (lane >> 4) * 4
        for r in range(hkv):
            first = int(row_ptr[r, row])
            count = int(row_ptr[r, row + 1]) - first
            steps = (count + E - 1) // E
            for st in range(steps + 1):
                # step st - 1 computes from buffer (st - 1) % 2 while step st is staged into
                # st % 2: its index queries by cp.async, its dS rows into registers
                buf = st % 2
                if st < steps:
                    for i in range(tid, QP, NT):
                        e = i // (DPC // 8)
                        w = 4 * (i % (DPC // 8))
                        t, _ = entry(q_indices, slots, r, first, count, st * E + e, tq, topk)
                        copy16(smem, OFF_Q + buf * QB + e * LDQ + w, q_idx,
                               ((t if t >= 0 else 0) * hkv + r) * DIW + d0 // 2 + w,
                               16 if t >= 0 else 0)
                    commit()
                    for u in range(DSPT):
                        i = tid + u * NT
                        x0 = x1 = x2 = x3 = float32(0.0)
                        if i < DSP:
                            e = i // (Bk // 4)
                            c = 4 * (i % (Bk // 4))
                            t, s = entry(q_indices, slots, r, first, count, st * E + e, tq,
                                         topk)
                            if t >= 0:
                                x0, x1, x2, x3 = load_f32x4(ds, ((t * hkv + r) * topk + s) * Bk
                                                            + c)
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
                        tot[i], comp[i] = _kahan_add(tot[i], comp[i], acc[i])
                if st < steps:
                    # split the staged dS rows into hi + mid + lo, entry-major, into buffer buf
                    for u in range(DSPT):
                        i = tid + u * NT
                        if i < DSP:
                            e = i // (Bk // 4)
                            w = e * LDE + 2 * (i % (Bk // 4)) + buf * PLANE
                            for half in range(2):
                                xa = dsr[4 * u + 2 * half]
                                xb = dsr[4 * u + 2 * half + 1]
                                for plane in range(3):
                                    word = pack_bf16x2(xa, xb)
                                    smem[plane * 2 * PLANE + w + half] = word
                                    xa = xa - bf16_to_f32(word & uint32(0xFFFF))
                                    xb = xb - bf16_to_f32(word >> uint32(16))
                wait_all()
                cuda.syncthreads()
        # C layout: keys 16w + g4 (+8), dims 8n + 2t4 (+1)
        for n in range(NN):
            for e in range(4):
                key = 16 * warp + g4 + 8 * (e // 2)
                d = d0 + 8 * n + 2 * t4 + e % 2
                if key < nk:
                    dk[key0 + kk0 + key, d] += (tot[4 * n + e] - comp[4 * n + e]) * index_scale

    return _kl_kernel_keys_v4


@cuda.jit(device=True)
def _slot_valid(I, t, r, s, nblocks):
    """Slot ``s`` of (t, r) holds a block of the query's sequence (so the CSR has its entry and
    v3 wrote its partial)."""
    blk = int(I[t, r, s])
    return 0 <= blk < nblocks


@cuda.jit
def _kl_kernel_combine_states(part, I, cu_q, cu_k, block_size, t0, want_kl, out):
    """v3: merge the per-slot states of (query t0 + i, group r) in slot order; ``out[t, r]`` =
    KL (``want_kl``) or the student's LSE. One thread per (query, group) of the chunk."""
    hkv = out.shape[1]
    i = cuda.grid(1)
    if i >= part.shape[2] * hkv:
        return
    tl = i // hkv
    r = i % hkv
    t = t0 + tl
    _, _, lk = _query_row(cu_q, cu_k, t)
    nblocks = (lk + block_size - 1) // block_size
    m = _NEG_INF
    l = float32(0.0)
    c = float32(0.0)
    k = float32(0.0)
    for s in range(I.shape[2]):
        if _slot_valid(I, t, r, s, nblocks):
            m, l, c, k = _merge(m, l, c, k, part[0, s, tl, r], part[1, s, tl, r],
                                part[2, s, tl, r], part[3, s, tl, r])
    if want_kl:
        out[t, r] = k
    else:
        out[t, r] = _student_lse(m, l)


@cuda.jit
def _kl_kernel_combine_dq(dq_part, I, cu_q, cu_k, block_size, t0, dq):
    """v3: ``dq_idx[t, r, d] = sum_s dq_part[s, t, r, d]`` in slot order, one thread per element."""
    hkv = dq.shape[1]
    di = dq.shape[2]
    i = cuda.grid(1)
    if i >= dq_part.shape[1] * hkv * di:
        return
    tl = i // (hkv * di)
    r = (i // di) % hkv
    d = i % di
    t = t0 + tl
    _, _, lk = _query_row(cu_q, cu_k, t)
    nblocks = (lk + block_size - 1) // block_size
    acc = float32(0.0)
    for s in range(I.shape[2]):
        if _slot_valid(I, t, r, s, nblocks):
            acc += dq_part[s, tl, r, d]
    dq[t, r, d] = acc


@cuda.jit
def _kl_kernel_combine_kl(part, I, cu_q, cu_k, block_size, t0, kl):
    """v3 ``kl_loss_and_backward``: ``kl[t, r] = sum_s part[0, s, t, r]`` (the grad mode's
    per-slot KL terms) in slot order, one thread per (query, group) of the chunk."""
    hkv = kl.shape[1]
    i = cuda.grid(1)
    if i >= part.shape[2] * hkv:
        return
    tl = i // hkv
    r = i % hkv
    t = t0 + tl
    _, _, lk = _query_row(cu_q, cu_k, t)
    nblocks = (lk + block_size - 1) // block_size
    acc = float32(0.0)
    for s in range(I.shape[2]):
        if _slot_valid(I, t, r, s, nblocks):
            acc += part[0, s, tl, r]
    kl[t, r] = acc


# =============================================================================================
# Shared by the versions: the teacher's own LSE (lse=None) and the mean of eq 10
# =============================================================================================

@functools.lru_cache(maxsize=None)
def _kl_kernel_teacher_lse(kind: str, group: int, head_dim: int):
    """``lse[t, h]`` over the support, one thread per (query, head): the ``lse=None`` path."""
    G, D = group, head_dim
    to_f32 = _loader(kind)

    @cuda.jit
    def _kl_kernel_teacher_lse_rows(q, k, I, cu_q, cu_k, block_size, warmup, scale, lse):
        hq = lse.shape[1]
        i = cuda.grid(1)
        if i >= lse.shape[0] * hq:
            return
        t = i // hq
        h = i % hq
        r = h // G
        key0, pos, _ = _query_row(cu_q, cu_k, t)
        m = _NEG_INF
        l = float32(0.0)
        nslots = pos // block_size + 1 if warmup else I.shape[2]
        for s in range(nslots):
            kk0, kk1 = _block_range(I, t, r, s, warmup, block_size, pos)
            for kp in range(kk0, kk1):
                x = float32(0.0)
                for d in range(D):
                    x += to_f32(q[t, h, d]) * to_f32(k[key0 + kp, r, d])
                x *= scale
                if x > m:
                    if m > _NEG_INF:
                        l *= math.exp(m - x)
                    m = x
                l += math.exp(x - m)
        lse[t, h] = m + math.log(l) if l > float32(0.0) else _NEG_INF

    return _kl_kernel_teacher_lse_rows


@functools.lru_cache(maxsize=None)
def _kl_kernel_mean(threads: int):
    """eq 10: ``out[0] = sum(x) / n`` by one CTA: Kahan-compensated strided sums per thread, then
    a fixed tree (deterministic, no atomics)."""
    NT = threads

    @cuda.jit
    def _kl_kernel_mean_tree(x, out):
        red = cuda.shared.array(NT, float32)
        tid = cuda.threadIdx.x
        n = x.shape[0]
        total = float32(0.0)
        comp = float32(0.0)
        for i in range(tid, n, NT):
            y = x[i] - comp
            nxt = total + y
            comp = (nxt - total) - y
            total = nxt
        red[tid] = total
        cuda.syncthreads()
        stride = NT // 2
        while stride > 0:
            if tid < stride:
                red[tid] += red[tid + stride]
            cuda.syncthreads()
            stride //= 2
        if tid == 0:
            out[0] = red[0] / float32(n)

    return _kl_kernel_mean_tree


# =============================================================================================
# Launchers
# =============================================================================================

def _kernel_array(x):
    """A kernel argument for an index array made by another msa.cuda launcher."""
    if SIMULATOR or hasattr(x, "copy_to_host"):
        return x
    if isinstance(x, np.ndarray):
        return cuda.to_device(x)
    return cuda.as_cuda_array(x)


def _kind(name, x, bf16_bits):
    """``'float32' | 'float16' | 'bfloat16'`` of an input; TypeError for anything else."""
    if is_bf16(x) or (bf16_bits and dtype_of(x).name in ("uint16", "int16")):
        return "bfloat16"
    dt = dtype_of(x)
    if dt in (np.dtype(np.float32), np.dtype(np.float16)):
        return dt.name
    raise TypeError(f"{name} must have dtype in {list(DTYPE_KINDS)} on the GPU, got {dt}")


class _Plan:
    """Validated KL inputs, kernel-ready views and device metadata (no big host copies unless
    ``validate``)."""

    def __init__(self, q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k,
                 block_size, scale, index_scale, version, validate, bf16_bits):
        check_array("q", q, ndim=3)
        self.kind = _kind("q", q, bf16_bits)
        tq, hq, d = (int(x) for x in q.shape)
        if hq < 1 or d < 1:
            raise ValueError(f"q must have shape [Tq, Hq >= 1, D >= 1], got {tuple(q.shape)}")
        check_array("k", k, ndim=3, shape=(None, None, d))
        tk, hkv = int(k.shape[0]), int(k.shape[1])
        if hkv < 1:
            raise ValueError(f"k must have Hkv >= 1 heads, got shape {tuple(k.shape)}")
        self.group = check_gqa(hq, hkv)
        check_array("q_idx", q_idx, ndim=3, shape=(tq, hkv, None))
        d_idx = int(q_idx.shape[2])
        if d_idx < 1:
            raise ValueError(
                f"q_idx must have shape [Tq, Hkv >= 1, Didx >= 1], got {tuple(q_idx.shape)}")
        check_array("k_idx", k_idx, ndim=2, shape=(tk, d_idx))
        for name, x in (("k", k), ("q_idx", q_idx), ("k_idx", k_idx)):
            kind = _kind(name, x, bf16_bits)
            if kind != self.kind:
                raise TypeError(f"{name} must have the dtype of q ({self.kind}), got {kind}")
        self.block_size = check_positive_int("block_size", block_size)
        self.cu_q, self.cu_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, tq, tk)
        self.warmup = block_indices is None
        self.topk = 1
        host_I = None
        if not self.warmup:
            check_array("block_indices", block_indices, ndim=3, dtypes=("int",))
            if (int(block_indices.shape[0]) != tq or int(block_indices.shape[1]) != hkv
                    or int(block_indices.shape[2]) < 1):
                raise ValueError(
                    f"block_indices must have shape [Tq, Hkv, K >= 1] = [{tq}, {hkv}, K], "
                    f"got {tuple(block_indices.shape)}")
            self.topk = int(block_indices.shape[2])
            if validate:
                from ..reference.select import check_block_indices

                host_I = check_block_indices(cu_to_host(block_indices), self.cu_q, self.cu_k,
                                             self.block_size)
        self.has_lse = lse is not None
        if self.has_lse:
            check_array("lse", lse, ndim=2, shape=(tq, hq))
            if _kind("lse", lse, False) != "float32":
                raise TypeError(f"lse must have dtype float32 (the attention's LSE), got "
                                f"{dtype_of(lse)}")
            if validate:
                self._check_lse(np.asarray(cu_to_host(lse)), host_I, tq, hkv)
        self.scale = check_scale("scale", scale, 1.0 / math.sqrt(d))
        self.index_scale = check_scale("index_scale", index_scale, 1.0 / math.sqrt(d_idx))
        self.tq, self.tk, self.hq, self.hkv, self.d, self.d_idx = tq, tk, hq, hkv, d, d_idx
        why_not_v3 = self._why_not_v3()
        if version is None:
            version = 2 if why_not_v3 else DEFAULT_VERSION
        if version not in VERSIONS:
            raise ValueError(f"version must be one of {VERSIONS} or None, got {version!r}")
        if version >= 3 and why_not_v3:
            raise ValueError(f"version={version} (tensor cores) does not support {why_not_v3}; use "
                             f"version=2 or 1")
        self.version = version
        if version >= 3:
            self._plan_v3()
        if version == 4:
            self._plan_v4()

        self.ctx = ArrayContext(q, k, q_idx, k_idx, block_indices, lse)
        views = []
        for name, x in (("q", q), ("k", k), ("q_idx", q_idx), ("k_idx", k_idx)):
            arr = self.ctx.input(name, x)
            if self.kind == "bfloat16" and str(arr.dtype) != "uint16":
                arr = arr.view(np.uint16)
            views.append(arr)
        self.q, self.k, self.q_idx, self.k_idx = views
        if self.warmup:
            self.I = _device_copy(np.full((1, 1, 1), -1, dtype=np.int32))  # never read
        else:
            self.I = self.ctx.input("block_indices", block_indices)
        self.lse = self.ctx.input("lse", lse) if self.has_lse else None
        self.d_cu_q = device_constant(self.cu_q.astype(np.int32))
        self.d_cu_k = device_constant(self.cu_k.astype(np.int32))

    def _why_not_v3(self):
        """Why v3 (tensor cores, KV-outer) cannot run these inputs, or None."""
        if self.warmup:
            return "the warmup (block_indices=None: no selection to build a CSR from)"
        if self.kind == "float32":
            return "float32 inputs (tensor cores take float16/bfloat16)"
        if self.d % 16 or self.d_idx % 16:
            return f"D={self.d}, Didx={self.d_idx} (both must be multiples of 16)"
        if self.block_size % 16 or self.block_size > MAX_BLOCK_SIZE_V3:
            return (f"block_size={self.block_size} (must be a multiple of 16, at most "
                    f"{MAX_BLOCK_SIZE_V3})")
        if self.group not in GQA_GROUP_SIZES:
            return f"G={self.group} (must be one of {GQA_GROUP_SIZES})"
        return None

    def _plan_v3(self):
        """Tile rows ``R = P*G`` (``P`` query positions of ``G`` heads) whose shared memory fits."""
        rows = DEFAULT_TILE_ROWS_V3
        limit = _mma.DYNAMIC_SMEM_LIMIT
        while True:
            positions = -(-rows // self.group)
            r = positions * self.group
            pp = -(-positions // 16) * 16
            smem = max(_v3_layout(self.block_size, self.d, self.d_idx, r, pp, t)[2]
                       for t in (True, False))
            if smem <= limit or rows <= 16:
                break
            rows //= 2
        if smem > limit:
            raise ValueError(
                f"version=3 needs {smem} bytes of shared memory for D={self.d}, "
                f"Didx={self.d_idx}, block_size={self.block_size}; use version=2")
        self.positions, self.rows, self.smem = positions, r, smem

    def _plan_v4(self):
        """v4's grad tile (``R = P G`` rows, as K1 v3) and student tile, if they fit."""
        rows = max(DEFAULT_TILE_ROWS_V4, self.group)
        while True:  # fewer rows where the positions' buffers would not fit (G = 1: 32)
            positions = rows // self.group
            smem = _v4_layout(self.block_size, self.d, self.d_idx, rows, positions)[2]
            if smem <= _mma.DYNAMIC_SMEM_LIMIT or rows <= max(16, self.group):
                break
            rows //= 2
        smem_s = _v4_student_layout(self.block_size, self.d_idx, 16 * _STUDENT_WARPS_V4)[2]
        if max(smem, smem_s) > _mma.DYNAMIC_SMEM_LIMIT:
            raise ValueError(
                f"version=4 needs {max(smem, smem_s)} bytes of shared memory for D={self.d}, "
                f"Didx={self.d_idx}, block_size={self.block_size}; use version=2")
        self.positions_v4, self.rows_v4, self.smem_v4, self.smem_student_v4 = (
            positions, rows, smem, smem_s)

    def _check_lse(self, lse, host_I, tq, hkv):
        """The reference's checks of ``lse`` on a host copy."""
        from ..reference.blocks import local_blocks
        from ..reference.kl import _check_lse_finite_on_support

        if np.isnan(lse).any() or np.isposinf(lse).any():
            raise ValueError("lse must be finite or -inf (empty support), got NaN or +inf")
        if self.warmup:
            nonempty = np.ones((tq, hkv), dtype=bool)  # a query always sees itself
        else:
            local = local_blocks(self.cu_q, self.cu_k, tq, int(self.cu_k[-1]), self.block_size)
            nonempty = ((host_I >= 0) & (host_I <= local[:, None, None])).any(axis=-1)
        _check_lse_finite_on_support(lse, np.repeat(nonempty, lse.shape[1] // hkv, axis=1))

    def teacher_lse(self):
        """The given ``lse`` (kernel view), or each head's own LSE over the support."""
        if self.has_lse:
            return self.lse
        lse = self.ctx.arg(self.ctx.empty((self.tq, self.hq), np.float32))
        n = self.tq * self.hq
        if n:
            kernel = _kl_kernel_teacher_lse(self.kind, self.group, self.d)
            kernel[_blocks(n, _THREADS_V1), _THREADS_V1](
                self.q, self.k, self.I, self.d_cu_q, self.d_cu_k, self.block_size, self.warmup,
                np.float32(self.scale), lse)
        return lse

    # -- v1 and v2 behind one interface ------------------------------------------------------
    def launch_kl(self, lse, kl):
        """``kl [Tq, Hkv]`` (kernel argument) of every (query, group)."""
        args = (self.q, self.k, self.q_idx, self.k_idx, self.I, lse, self.d_cu_q, self.d_cu_k,
                self.block_size, self.warmup, np.float32(self.scale),
                np.float32(self.index_scale), kl)
        n = self.tq * self.hkv
        if self.version == 1:
            kernel = _kl_kernel_thread_rows(self.kind, self.group, self.d, self.d_idx)
            kernel[_blocks(n, _THREADS_V1), _THREADS_V1](*args)
        else:
            kernel = _kl_kernel_cta_rows(self.kind, self.group, self.d, self.d_idx, _ROW_THREADS)
            kernel[n, _ROW_THREADS](*args)

    def launch_rows_grad(self, lse, coef, t0, count, store_ds, lse_idx, dq, ds):
        """Pass 1 of the backward for queries ``[t0, t0 + count)``."""
        args = (self.q, self.k, self.q_idx, self.k_idx, self.I, lse, self.d_cu_q, self.d_cu_k,
                self.block_size, self.warmup, np.float32(self.scale),
                np.float32(self.index_scale), coef, t0, count, store_ds, lse_idx, dq, ds)
        n = count * self.hkv
        if self.version == 1:
            kernel = _kl_kernel_thread_rows_grad(self.kind, self.group, self.d, self.d_idx)
            kernel[_blocks(n, _THREADS_V1), _THREADS_V1](*args)
        else:
            kernel = _kl_kernel_cta_rows_grad(self.kind, self.group, self.d, self.d_idx,
                                              _ROW_THREADS)
            kernel[n, _ROW_THREADS](*args)

    def launch_keys(self, lse, lse_idx, row_ptr, q_indices, slots, ds, cu_q, cu_k, row_offsets,
                    num_rows, coef, q_idx, k_idx, dk):
        """Pass 2 of the backward: ``dk += ...`` over the keys of ``cu_k`` (``num_rows`` blocks)."""
        args = (self.q, self.k, q_idx, k_idx, lse, lse_idx, row_ptr, q_indices, slots, ds,
                cu_q, cu_k, row_offsets, self.block_size, np.float32(self.scale),
                np.float32(self.index_scale), coef, dk)
        if self.version == 1:
            n = int(dk.shape[0])
            kernel = _kl_kernel_thread_keys(self.kind, self.group, self.d, self.d_idx, self.warmup)
            kernel[_blocks(n, _THREADS_V1), _THREADS_V1](*args)
        else:
            entries = _KEY_ENTRIES
            if self.warmup:
                entries = max(1, min(_KEY_ENTRIES, _KEY_STAGE_FLOATS // (self.group * self.d)))
            kernel = _kl_kernel_cta_keys(self.kind, self.group, self.d, self.d_idx,
                                         self.block_size, entries, self.warmup)
            kernel[num_rows, _key_tiles(self.block_size, self.d_idx)[2]](*args)


    # -- v3: per query chunk, CSR + schedule, KV-outer tiles, slot combine --------------------
    def chunks(self, bytes_per_query: int, budget: int):
        """``query_chunks`` of at most ``budget`` bytes of per-query buffers each."""
        from .attention import query_chunks

        return query_chunks(self.cu_q, self.cu_k, max(1, min(self.tq, budget // bytes_per_query)))

    def v3_schedule(self, t0, t1, cu_q_c, cu_k_c):
        """``(work, row_ptr, q_indices, slots, d_cu)`` of queries ``[t0, t1)``: k2q CSR and work
        items, and ``d_cu`` the chunk's ``(cu_q, cu_k)`` on the device (copied once for the
        chunk's launches)."""
        from .csr import build_csr
        from .schedule import build_schedule, launch_rows

        row_ptr, q_indices, slots = build_csr(self.I[t0:t1], cu_q_c, cu_k_c, self.block_size,
                                              validate=False)
        chunk = 2 * self.topk * self.block_size  # the paper's hot-row cut, in whole tiles
        chunk = -(-chunk // self.positions) * self.positions
        work = launch_rows(*build_schedule(row_ptr, cu_k_c, self.block_size, chunk,
                                           max_edges=max(1, (t1 - t0) * self.topk),
                                           validate=False))
        return (_kernel_array(work), _kernel_array(row_ptr), _kernel_array(q_indices),
                _kernel_array(slots), (device_constant(cu_q_c), device_constant(cu_k_c)))

    def launch_v3(self, mode, work, q_indices, slots, d_cu, t0, t1, k_lo, k_hi, lse, lse_idx,
                  coef, part, ds, dq_part):
        """The v3 kernel in ``mode`` over the work items of one query chunk (``d_cu`` from
        ``v3_schedule``)."""
        num_items = int(work.shape[0])
        if num_items == 0:
            return
        words = [x.view(np.uint32) for x in (self.q[t0:t1], self.k[k_lo:k_hi],
                                             self.q_idx[t0:t1], self.k_idx[k_lo:k_hi])]
        # cp.async needs 16-byte aligned rows: D, Didx % 16 == 0 keep slices of aligned arrays
        # aligned; inputs that are not take plain loads
        aligned = all(is_aligned16(x) for x in words)
        kernel = _kl_kernel_mma(mode, self.kind == "bfloat16", self.block_size, self.d,
                                self.d_idx, self.group, self.positions, aligned)
        # the student pass needs no K, Q or P tiles: its smaller footprint fits more CTAs per SM
        pad = -(-self.positions // 16) * 16
        smem = _v3_layout(self.block_size, self.d, self.d_idx, self.rows, pad,
                          mode != "student")[2]
        _launch_smem(kernel, num_items, 2 * self.rows, smem, *words, lse[t0:t1],
                    lse_idx[t0:t1], work, q_indices, slots, *d_cu, np.float32(self.scale),
                    np.float32(self.index_scale), coef, part, ds, dq_part)

    def launch_v4(self, mode, work, q_indices, slots, d_cu, t0, t1, k_lo, k_hi, lse, lse_idx,
                  coef, part, ds, dq_part):
        """v4's ``"student"`` (``part`` = slot states), ``"grad"`` or ``"kl"`` (the grad kernel
        without gradients: ``part[0]`` = the slots' KL terms) kernel over the work items of one
        query chunk (arguments as ``launch_v3``)."""
        num_items = int(work.shape[0])
        if num_items == 0:
            return
        words = [x.view(np.uint32) for x in (self.q[t0:t1], self.k[k_lo:k_hi],
                                             self.q_idx[t0:t1], self.k_idx[k_lo:k_hi])]
        aligned = all(is_aligned16(x) for x in words)
        bf16 = self.kind == "bfloat16"
        if mode == "student":
            kernel = _kl_kernel_student_reg(bf16, self.block_size, self.d_idx,
                                            _STUDENT_WARPS_V4, aligned)
            _launch_smem(kernel, num_items, 32 * _STUDENT_WARPS_V4, self.smem_student_v4,
                        words[2], words[3], work, q_indices, slots, *d_cu,
                        np.float32(self.index_scale * _LOG2E), part)
            return
        kernel = _kl_kernel_grad_reg(bf16, self.block_size, self.d, self.d_idx, self.group,
                                     self.positions_v4, aligned, mode == "grad")
        _launch_smem(kernel, num_items, 2 * self.rows_v4, self.smem_v4, *words, lse[t0:t1],
                    lse_idx[t0:t1], work, q_indices, slots, *d_cu,
                    np.float32(self.scale * _LOG2E), np.float32(self.index_scale),
                    coef, part, ds, dq_part)

    def combine_states(self, part, t0, want_kl, out):
        n = int(part.shape[2]) * self.hkv
        _kl_kernel_combine_states[_blocks(n, _THREADS_V1), _THREADS_V1](
            part, self.I, self.d_cu_q, self.d_cu_k, self.block_size, t0, want_kl, out)

    def combine_kl(self, part, t0, kl):
        """``kl[t, r] = sum_s part[0, s, t, r]`` over the chunk's queries (v3/v4 KL terms)."""
        n = int(part.shape[2]) * self.hkv
        _kl_kernel_combine_kl[_blocks(n, _THREADS_V1), _THREADS_V1](
            part, self.I, self.d_cu_q, self.d_cu_k, self.block_size, t0, kl)

    def combine_dq(self, dq_part, t0, dq):
        n = int(dq_part.shape[1]) * self.hkv * self.d_idx
        _kl_kernel_combine_dq[_blocks(n, _THREADS_V1), _THREADS_V1](
            dq_part, self.I, self.d_cu_q, self.d_cu_k, self.block_size, t0, dq)


def _blocks(n: int, threads: int) -> int:
    return max(1, -(-n // threads))


def _kl_loss(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k, block_size,
             scale=None, index_scale=None, *, version=None, validate=True, bf16_bits=False):
    """``kl_loss`` with ``bf16_bits``: integer (uint16/int16) inputs hold bf16 bit patterns (the
    simulator has no bf16 arrays; torch bf16 tensors are recognised by their dtype)."""
    p = _Plan(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k, block_size,
              scale, index_scale, version, validate, bf16_bits)
    ctx = p.ctx
    kl = ctx.empty((p.tq, p.hkv), np.float32)
    loss = ctx.empty((1,), np.float32, fill=0.0 if p.tq == 0 else None)
    if p.tq:
        kl_arg = ctx.arg(kl)
        if p.version == 4:
            _kl_v4(p, p.teacher_lse(), kl_arg)
        elif p.version == 3:
            _kl_v3(p, p.teacher_lse(), kl_arg)
        else:
            p.launch_kl(p.teacher_lse(), kl_arg)
        _mean_into(kl_arg, ctx.arg(loss), p.tq * p.hkv)
    return ctx.output(kl), _loss_output(ctx, loss)


def _loss_output(ctx, loss):
    """The [1] loss buffer as the caller gets it: a NumPy float32 scalar, else a 0-d array."""
    loss = ctx.output(loss)
    if isinstance(loss, np.ndarray):
        return np.float32(loss[0])
    try:
        return loss.reshape(())
    except Exception:  # a Numba device array may refuse 0-d shapes: keep [1]
        return loss


def _mean_into(kl_arg, loss_arg, n):
    """eq 10: ``loss[0] = mean(kl)`` over ``n`` elements (one CTA, fixed order)."""
    _kl_kernel_mean(_MEAN_THREADS)[1, _MEAN_THREADS](kl_arg.reshape(n), loss_arg)


def _kl_v3(p, lse, kl):
    """v3 forward: per query chunk, each (query, slot)'s state over its block, then the slots
    merged in order into ``kl``."""
    ctx = p.ctx
    per_query = 4 * p.hkv * p.topk * 4
    part_buf = None
    dummy4 = _device_copy(np.zeros((1, 1, 1, 1), np.float32))
    for t0, t1, k_lo, k_hi, cu_q_c, cu_k_c in p.chunks(per_query, MAX_DS_BYTES):
        tc = t1 - t0
        if part_buf is None:
            part_buf = ctx.arg(ctx.empty((4 * p.topk * tc * p.hkv,), np.float32))
        part = part_buf[:4 * p.topk * tc * p.hkv].reshape(4, p.topk, tc, p.hkv)
        work, _, q_indices, slots, d_cu = p.v3_schedule(t0, t1, cu_q_c, cu_k_c)
        p.launch_v3("stats", work, q_indices, slots, d_cu, t0, t1, k_lo, k_hi, lse,
                    kl, np.float32(0.0), part, dummy4, dummy4)
        p.combine_states(part, t0, True, kl)


def _kl_v4(p, lse, kl):
    """v4 forward, per query chunk: ``LSE^idx`` (the backward's student pass and slot merge),
    then each slot's ``sum_j P_j (log P_j - S^idx_j + LSE^idx)`` by the grad kernel without
    gradients, summed over the slots in order (as ``kl_loss_and_backward``)."""
    ctx = p.ctx
    per_query = 4 * p.hkv * p.topk * 4
    part_buf = None
    lse_idx = ctx.arg(ctx.empty((p.tq, p.hkv), np.float32))
    dummy4 = _device_copy(np.zeros((1, 1, 1, 1), np.float32))
    zero = np.float32(0.0)
    for t0, t1, k_lo, k_hi, cu_q_c, cu_k_c in p.chunks(per_query, MAX_DS_BYTES):
        tc = t1 - t0
        if part_buf is None:
            part_buf = ctx.arg(ctx.empty((4 * p.topk * tc * p.hkv,), np.float32))
        part = part_buf[:4 * p.topk * tc * p.hkv].reshape(4, p.topk, tc, p.hkv)
        work, _, q_indices, slots, d_cu = p.v3_schedule(t0, t1, cu_q_c, cu_k_c)
        p.launch_v4("student", work, q_indices, slots, d_cu, t0, t1, k_lo, k_hi, lse,
                    lse_idx, zero, part, dummy4, dummy4)
        p.combine_states(part, t0, False, lse_idx)
        p.launch_v4("kl", work, q_indices, slots, d_cu, t0, t1, k_lo, k_hi, lse,
                    lse_idx, zero, part, dummy4, dummy4)
        p.combine_kl(part, t0, kl)


def kl_loss(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k, block_size,
            scale=None, index_scale=None, *, version=None, validate=True):
    """Paper eq 9-10 on the GPU: ``KL(sg(P) || P_idx)`` per query and group, and its mean.

    .. math:: L_{KL} = \\frac{1}{T_q H_{kv}} \\sum_{t, r} D_{KL}(P_{t,r} \\| P^{idx}_{t,r})

    One pass over each (query, group)'s support computes the student's LSE online next to the
    state ``(m, l, C, K)`` of the module docstring (runs of keys merged in a fixed order); the
    teacher is normalised by the given main-branch ``lse`` (no second softmax
    pass). Equal to ``msa.reference.kl.kl_loss`` up to float32 rounding.

    Args:
        q: [Tq, Hq, D] float32, float16 or bfloat16 (torch); main-branch queries.
        k: [Tk, Hkv, D], same dtype: main-branch keys. ``G = Hq / Hkv``.
        q_idx: [Tq, Hkv, Didx], same dtype; k_idx: [Tk, Didx], same dtype.
        block_indices: int [Tq, Hkv, K] batch-local block ids (unique per row, ``-1`` only at
            the tail; a block after the query's own adds nothing), or ``None`` for the warmup
            (every causally visible key).
        lse: float32 [Tq, Hq], the main branch's natural-log LSE on the same support
            (``sparse_attention``'s, or ``dense_attention``'s in the warmup); ``-inf`` where the
            support is empty. ``None`` computes it here (one more pass).
        cu_seqlens_q, cu_seqlens_k: int [B+1] packed offsets, ``Lq <= Lk`` (read on the host).
        block_size: Bk >= 1.
        scale: main-branch scale (default ``1/sqrt(D)``); index_scale: index scale (default
            ``1/sqrt(Didx)``).
        version: kernel version (module table); ``None`` picks the fastest that supports the
            inputs (4 for fp16/bf16 with ``D, Didx, Bk`` multiples of 16 and a selection, else
            2).
        validate: check ``block_indices`` and ``lse`` on host copies (module docstring).

    Returns:
        ``(kl, loss)``: ``kl`` float32 [Tq, Hkv] in the caller's library and ``loss`` =
        ``kl.sum() / (Tq Hkv)``: a float32 NumPy scalar for NumPy inputs, a 0-d float32 array of
        the caller's library otherwise (no host synchronisation). An empty support gives
        ``kl = 0``; ``Tq = 0`` gives ``loss = 0``. Bitwise identical on reruns.

    Raises:
        TypeError: dtypes (not float32/float16/bfloat16, differing, non-integer indices, lse
        not float32), mixed array libraries. ValueError: shapes (``lse``, ``q_idx``, ``k_idx``,
        ``block_indices`` disagreeing with q/k), G not an integer, bad ``cu_seqlens``,
        ``block_size``, scales, a ``version`` the inputs do not support, and with ``validate``
        bad indices or ``lse`` values.
    """
    return _kl_loss(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k,
                    block_size, scale, index_scale, version=version, validate=validate)


def _check_grad_loss(grad_loss) -> float:
    if isinstance(grad_loss, bool) or not isinstance(grad_loss, numbers.Real):
        raise TypeError(f"grad_loss must be a real number, got {type(grad_loss).__name__}")
    if not math.isfinite(float(grad_loss)):
        raise ValueError(f"grad_loss must be finite, got {grad_loss!r}")
    return float(grad_loss)


def _kl_backward(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k, block_size,
                 scale=None, index_scale=None, grad_loss=1.0, *, version=None, validate=True,
                 max_ds_bytes=None, bf16_bits=False, with_kl=False):
    """``kl_backward`` with ``bf16_bits`` (see ``_kl_loss``); ``with_kl`` returns
    ``(kl, loss, dq_idx, dk_idx)`` (``kl_loss_and_backward``)."""
    from .attention import query_chunks
    from .csr import build_csr
    from ..reference.blocks import block_row_offsets

    p = _Plan(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k, block_size,
              scale, index_scale, version, validate, bf16_bits)
    grad_loss = _check_grad_loss(grad_loss)
    if max_ds_bytes is None:
        max_ds_bytes = MAX_DS_BYTES
    max_ds_bytes = check_positive_int("max_ds_bytes", max_ds_bytes)
    ctx = p.ctx
    dq = ctx.empty((p.tq, p.hkv, p.d_idx), np.float32)
    dk = ctx.empty((p.tk, p.d_idx), np.float32, fill=0.0 if p.tk * p.d_idx else None)
    kl = ctx.empty((p.tq, p.hkv), np.float32) if with_kl else None
    loss = ctx.empty((1,), np.float32, fill=0.0 if p.tq == 0 else None) if with_kl else None

    def result():
        grads = (ctx.output(dq), ctx.output(dk))
        return (ctx.output(kl), _loss_output(ctx, loss)) + grads if with_kl else grads

    if p.tq == 0:
        return result()
    lse_arg = p.teacher_lse()
    dq_arg, dk_arg = ctx.arg(dq), ctx.arg(dk)
    lse_idx = ctx.arg(ctx.empty((p.tq, p.hkv), np.float32))
    coef = np.float32(grad_loss / (p.tq * p.hkv))
    kl_arg = ctx.arg(kl) if with_kl else None
    if with_kl:
        if p.version >= 3:  # its grad pass writes the KL terms: no teacher pass of its own
            _kl_backward_v3(p, lse_arg, coef, lse_idx, dq_arg, dk_arg, max_ds_bytes, kl_arg)
            _mean_into(kl_arg, ctx.arg(loss), p.tq * p.hkv)
            return result()
        p.launch_kl(lse_arg, kl_arg)
        _mean_into(kl_arg, ctx.arg(loss), p.tq * p.hkv)

    if p.warmup:
        dummy_ds = _device_copy(np.zeros((1, 1, 1, 1), np.float32))
        p.launch_rows_grad(lse_arg, coef, 0, p.tq, False, lse_idx, dq_arg, dummy_ds)
        row_offsets = block_row_offsets(p.cu_k, p.block_size)
        if p.tk:
            dummy_csr = _device_copy(np.zeros((1, 1), np.int32))
            p.launch_keys(lse_arg, lse_idx, dummy_csr, dummy_csr, dummy_csr, dummy_ds, p.d_cu_q,
                          p.d_cu_k, device_constant(row_offsets.astype(np.int32)),
                          int(row_offsets[-1]), coef, p.q_idx, p.k_idx, dk_arg)
        return result()

    if p.version >= 3:
        _kl_backward_v3(p, lse_arg, coef, lse_idx, dq_arg, dk_arg, max_ds_bytes)
        return result()

    per_query = p.hkv * p.topk * p.block_size * 4
    q_chunk = max(1, min(p.tq, max_ds_bytes // per_query))
    ds_buf = ctx.arg(ctx.empty((q_chunk * p.hkv * p.topk * p.block_size,), np.float32))
    for t0, t1, k_lo, k_hi, cu_q_c, cu_k_c in query_chunks(p.cu_q, p.cu_k, q_chunk):
        tc = t1 - t0
        ds = ds_buf[:tc * p.hkv * p.topk * p.block_size].reshape(
            tc, p.hkv, p.topk, p.block_size)
        p.launch_rows_grad(lse_arg, coef, t0, tc, True, lse_idx, dq_arg, ds)
        if k_hi == k_lo:
            continue
        row_offsets = block_row_offsets(cu_k_c, p.block_size)
        row_ptr, q_indices, slots = build_csr(p.I[t0:t1], cu_q_c, cu_k_c, p.block_size,
                                              validate=False)
        p.launch_keys(lse_arg, lse_idx, _kernel_array(row_ptr), _kernel_array(q_indices),
                      _kernel_array(slots), ds, device_constant(cu_q_c), device_constant(cu_k_c),
                      device_constant(row_offsets.astype(np.int32)), int(row_offsets[-1]), coef,
                      p.q_idx[t0:t1], p.k_idx[k_lo:k_hi], dk_arg[k_lo:k_hi])
    return result()


def _kl_backward_v3(p, lse, coef, lse_idx, dq, dk, max_ds_bytes, kl=None):
    """v3/v4 backward, per query chunk: the student's LSE (KV-outer, index scores only, slots
    merged), then dS, the per-slot dq_idx partials and KL terms (KV-outer, tensor cores),
    dq_idx (and ``kl`` if given) summed over the slots in order, dk_idx from the dS buffer by
    a key-block kernel (v4 with bf16 inputs: ``_kl_kernel_keys_mma``; else v2's)."""
    from ..reference.blocks import block_row_offsets

    ctx = p.ctx
    per_query = p.hkv * p.topk * (p.block_size + p.d_idx + 4) * 4
    bufs = None
    dummy4 = _device_copy(np.zeros((1, 1, 1, 1), np.float32))
    zero = np.float32(0.0)
    keys = _kl_kernel_cta_keys(p.kind, p.group, p.d, p.d_idx, p.block_size, _KEY_ENTRIES,
                               False)
    key_threads = _key_tiles(p.block_size, p.d_idx)[2]
    launch = _Plan.launch_v4 if p.version == 4 else _Plan.launch_v3
    keys_v4 = p.version == 4 and _keys_v4_supported(p.kind, p.block_size, p.d_idx)
    for t0, t1, k_lo, k_hi, cu_q_c, cu_k_c in p.chunks(per_query, max_ds_bytes):
        tc = t1 - t0
        if bufs is None:
            bufs = [ctx.arg(ctx.empty((n * tc * p.hkv * p.topk,), np.float32))
                    for n in (4, p.block_size, p.d_idx)]
        part = bufs[0][:4 * p.topk * tc * p.hkv].reshape(4, p.topk, tc, p.hkv)
        ds = bufs[1][:tc * p.hkv * p.topk * p.block_size].reshape(tc, p.hkv, p.topk,
                                                                  p.block_size)
        dq_part = bufs[2][:p.topk * tc * p.hkv * p.d_idx].reshape(p.topk, tc, p.hkv, p.d_idx)
        work, row_ptr, q_indices, slots, d_cu = p.v3_schedule(t0, t1, cu_q_c, cu_k_c)
        launch(p, "student", work, q_indices, slots, d_cu, t0, t1, k_lo, k_hi, lse,
               lse_idx, zero, part, dummy4, dummy4)
        p.combine_states(part, t0, False, lse_idx)
        launch(p, "grad", work, q_indices, slots, d_cu, t0, t1, k_lo, k_hi, lse,
               lse_idx, coef, part, ds, dq_part)
        p.combine_dq(dq_part, t0, dq)
        if kl is not None:
            p.combine_kl(part, t0, kl)
        row_offsets = block_row_offsets(cu_k_c, p.block_size)
        if int(row_offsets[-1]) == 0:
            continue
        d_rows = device_constant(row_offsets.astype(np.int32))
        if keys_v4:
            qi_words = p.q_idx[t0:t1].view(np.uint32)
            kernel = _kl_kernel_keys_mma(p.block_size, p.d_idx, is_aligned16(qi_words))
            _, _, _, smem, dims = _keys_v4_layout(p.block_size, p.d_idx)
            _launch_smem(kernel, int(row_offsets[-1]) * (p.d_idx // dims),
                        2 * p.block_size, smem, qi_words, ds, row_ptr, q_indices, slots,
                        d_cu[1], d_rows, np.float32(p.index_scale), dk[k_lo:k_hi])
            continue
        keys[int(row_offsets[-1]), key_threads](
            p.q, p.k, p.q_idx[t0:t1], p.k_idx[k_lo:k_hi], lse, lse_idx, row_ptr, q_indices,
            slots, ds, *d_cu, d_rows, p.block_size, np.float32(p.scale),
            np.float32(p.index_scale), coef, dk[k_lo:k_hi])


def kl_backward(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k, block_size,
                scale=None, index_scale=None, grad_loss=1.0, *, version=None, validate=True,
                max_ds_bytes=None):
    """Paper eq 10-11 backward on the GPU: ``(dq_idx, dk_idx)`` of ``grad_loss * L_KL``.

    .. math::

        dS_{t,r,j} = \\frac{g}{T_q H_{kv}} (P^{idx}_{t,r,j} - P_{t,r,j}), \\quad
        dq^{idx}_{t,r} = s_{idx} \\sum_j dS_{t,r,j} k^{idx}_j, \\quad
        dk^{idx}_j = s_{idx} \\sum_{t,r} dS_{t,r,j} q^{idx}_{t,r}

    Arguments as :func:`kl_loss`, plus ``grad_loss`` (a finite real: the upstream gradient of
    the scalar loss, e.g. the KL coefficient lambda) and ``max_ds_bytes``, the memory of one
    query chunk's ``dS`` buffer (and v3's ``dq_idx`` partials; default 4 GiB; module
    docstring). The teacher is held constant and ``q_idx, k_idx`` come from ``stopgrad(X)``:
    nothing flows into ``q`` or ``k``.

    Returns:
        ``dq_idx`` float32 [Tq, Hkv, Didx] and ``dk_idx`` float32 [Tk, Didx] in the caller's
        library; zero for rows with an empty support and for keys no query reads. Deterministic:
        ``dq_idx`` sums each query's keys in order, ``dk_idx`` each key's queries in CSR order
        (no float atomics), so reruns are bitwise identical.

    Raises:
        As :func:`kl_loss`; ``grad_loss`` not a finite real (TypeError/ValueError).
    """
    return _kl_backward(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k,
                        block_size, scale, index_scale, grad_loss, version=version,
                        validate=validate, max_ds_bytes=max_ds_bytes)


def kl_loss_and_backward(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k,
                         block_size, scale=None, index_scale=None, grad_loss=1.0, *,
                         version=None, validate=True, max_ds_bytes=None):
    """Paper eq 9-11 in one call: :func:`kl_loss` and :func:`kl_backward` on the same inputs.

    The training step needs both; v3 then scores the support with the teacher once instead of
    twice: the backward's pass, which knows ``LSE^idx``, also sums each slot's
    ``P_j (log P_j - S^idx_j + LSE^idx)`` (summed over the slots in order: the same value as
    ``kl_loss`` up to rounding, not bitwise). v1, v2 and the warmup run the forward kernel
    and then the backward on one validated plan.

    Arguments as :func:`kl_backward`.

    Returns:
        ``(kl, loss, dq_idx, dk_idx)`` as :func:`kl_loss` and :func:`kl_backward` return them.
        Bitwise identical on reruns.

    Raises:
        As :func:`kl_backward`.
    """
    return _kl_backward(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k,
                        block_size, scale, index_scale, grad_loss, version=version,
                        validate=validate, max_ds_bytes=max_ds_bytes, with_kl=True)
