"""Host planning of the KL stage: the rung that runs, its tiles, the kernel-ready views and the
launches, per query chunk where the buffers are bounded. ``Plan`` takes what ``msa.cuda.kl``
validated and checks nothing again.
"""

from __future__ import annotations

import numpy as np

from ..._checks import GQA_GROUP_SIZES
from .._core import mma as _mma
from .._core import wgmma as _wgmma
from .._core.arrays import SIMULATOR, ArrayContext, device_constant, device_offsets
from .._core.launch import kernel_array, launch_smem
from .._core.memops import is_aligned16
from .._core.packed import LOG2E
from .._core.streams import stream
from ..csr import exclusive_prefix_sum, launch_build_csr, launch_slot_mask, mask_words
from ..schedule import launch_rows, launch_schedule
from . import v1_thread_rows as v1
from . import v2_cta_rows as v2
from . import v3_dk_idx as v3dk
from . import v3_student as v3s
from . import v3_tensor_cores as v3
from ._common import (kl_kernel_combine_dq, kl_kernel_combine_kl, kl_kernel_combine_states,
                      kl_kernel_full_selection, kl_kernel_mean, kl_kernel_teacher_lse)

VERSIONS = (1, 2, 3)
DEFAULT_VERSION = 3
# Default budget of one query chunk's per-query buffers (dS, dq_idx partials, states), bytes;
# also the most that v3's warmup may spend on its full selection.
MAX_DS_BYTES = 4 << 30
# v3's hot-row cut is ``2 K Bk`` queries (the paper's); the warmup's K = NB slots cut as K = 16.
WARMUP_CUT_TOPK = 16
# Threads per CTA (powers of two). The simulator runs every thread as a Python thread and every
# barrier costs milliseconds there, so it gets fewer; the kernels are the same.
THREADS = 32 if SIMULATOR else 128  # one thread per output: v1, the combines, the teacher LSE
ROW_THREADS = 8 if SIMULATOR else 128  # v2: one CTA per (query, group)
MEAN_THREADS = 32 if SIMULATOR else 512


def why_not_tensor_cores(kind, warmup, block_size, head_dim, index_dim, group, *,
                         full_selection_bytes=0):
    """Why v3 (tensor cores, KV-outer) cannot run these inputs, or None (its tiles' fit in
    shared memory is ``tensor_core_tiles``'). v3 runs the warmup as the selection of every
    visible block (``Plan``), ``full_selection_bytes`` of int32 ``[Tq, Hkv, NB]``."""
    if warmup and full_selection_bytes > MAX_DS_BYTES:
        return (f"the warmup at this size (its full causal support as a selection [Tq, Hkv, NB] "
                f"int32 would take {full_selection_bytes} bytes, more than {MAX_DS_BYTES})")
    if kind == "float32":
        return "float32 inputs (tensor cores take float16/bfloat16)"
    if head_dim % 16 or index_dim % 16:
        return f"D={head_dim}, Didx={index_dim} (both must be multiples of 16)"
    if block_size % 16 or block_size > v3.MAX_BLOCK_SIZE:
        return (f"block_size={block_size} (must be a multiple of 16, at most "
                f"{v3.MAX_BLOCK_SIZE})")
    if group not in GQA_GROUP_SIZES:
        return f"G={group} (must be one of {GQA_GROUP_SIZES})"
    return None


def tensor_core_tiles(block_size, head_dim, index_dim, group, *, tile_rows=None,
                      min_positions=None):
    """``(positions, rows, smem, smem_student)`` of v3's grad tile (``R = P G`` rows, as K1 v3)
    and student tile, or None if they do not fit shared memory: at least ``tile_rows`` rows and
    ``min_positions`` positions (default ``v3.TILE_ROWS``, ``v3.MIN_POSITIONS``), at most 16
    warps, halved while the tile does not fit."""
    tile_rows = v3.TILE_ROWS if tile_rows is None else tile_rows
    min_positions = v3.MIN_POSITIONS if min_positions is None else min_positions
    rows = min(max(tile_rows, group * min_positions), 16 * _mma.MAX_WARPS)
    while True:  # fewer rows where the positions' buffers would not fit (G = 1: 32)
        positions = rows // group
        smem = v3.grad_layout(block_size, head_dim, index_dim, rows, positions)[2]
        if smem <= _mma.DYNAMIC_SMEM_LIMIT or rows <= max(16, group):
            break
        rows //= 2
    smem_s = v3s.student_layout(block_size, index_dim, 16 * v3s.STUDENT_WARPS)[2]
    if max(smem, smem_s) > _mma.DYNAMIC_SMEM_LIMIT:
        return None
    return positions, rows, smem, smem_s


def _blocks(n: int, threads: int) -> int:
    return max(1, -(-n // threads))


class Plan:
    """Validated KL inputs as kernel arguments, the rung and its tiles, and the launches.

    Attributes: ``batch`` (``msa._batch.Batch``), ``kind`` (``'float32' | 'float16' |
    'bfloat16'``), ``tq, tk, hq, hkv, group, d, d_idx, topk, block_size``, ``warmup``,
    ``scale, index_scale`` (floats), ``version``; ``ctx`` the caller's array library; ``q, k,
    q_idx, k_idx`` kernel views (bf16 as uint16), ``I`` the selection (a dummy in v1 and v2's
    warmup), ``lse`` (None if not given), ``d_cu_q, d_cu_k`` the offsets on the device; for v3
    the tile (``positions, rows, smem, smem_student``) and ``cut_topk``, the ``K`` of its hot-row
    cut.

    v3 in the warmup: the full causal support is written as a selection, ``I[t, r, s] = s`` for
    every block up to the query's own and ``-1`` after (``K = NB`` slots, int32 ``[Tq, Hkv,
    NB]``: 2 GiB at 128K tokens in the paper configuration), and the selection path runs on it
    (``warmup`` is then False): the same support, so the same loss and gradients.
    """

    def __init__(self, batch, kind, arrays, block_indices, lse, shape, scale, index_scale,
                 version, tiles):
        q, k, q_idx, k_idx = arrays
        self.batch = batch
        self.kind = kind
        self.tq, self.tk, self.hq, self.hkv, self.d, self.d_idx = shape
        self.group = self.hq // self.hkv
        self.block_size = batch.block_size
        self.warmup = block_indices is None
        self.topk = 1 if self.warmup else int(block_indices.shape[2])
        self.scale, self.index_scale = scale, index_scale
        self.version = version
        if version == 3:
            self.positions, self.rows, self.smem, self.smem_student = tiles
        self.ctx = ArrayContext(q=q, k=k, q_idx=q_idx, k_idx=k_idx,
                                block_indices=block_indices, lse=lse)
        views = []
        for name, x in (("q", q), ("k", k), ("q_idx", q_idx), ("k_idx", k_idx)):
            arr = self.ctx.input(name, x)
            if kind == "bfloat16" and str(arr.dtype) != "uint16":
                arr = arr.view(np.uint16)
            views.append(arr)
        self.q, self.k, self.q_idx, self.k_idx = views
        if self.warmup:
            self.I = device_constant(np.full((1, 1, 1), -1, dtype=np.int32))  # never read
        else:
            self.I = self.ctx.input("block_indices", block_indices)
        self.lse = self.ctx.input("lse", lse)
        self.d_cu_q, self.d_cu_k = device_offsets(batch)
        self.cut_topk = self.topk
        self._mask_buf = None  # v3's slot masks, one chunk's at a time (``slot_mask``)
        if self.warmup and version == 3:
            self.I = self._full_selection()
            self.warmup, self.topk, self.cut_topk = False, int(self.I.shape[2]), WARMUP_CUT_TOPK

    def _full_selection(self):
        """The warmup's support as a selection: int32 ``[Tq, Hkv, max(NB, 1)]`` (kernel arg)."""
        nb = max(1, self.batch.nb)
        I = self.ctx.arg(self.ctx.empty((self.tq, self.hkv, nb), np.int32))
        n = self.tq * nb
        if n:
            kl_kernel_full_selection[_blocks(n, THREADS), THREADS, stream()](
                self.d_cu_q, self.d_cu_k, self.block_size, I)
        return I

    # -- every rung ------------------------------------------------------------------------
    def teacher_lse(self):
        """The given ``lse`` (kernel view), or each head's own LSE over the support."""
        if self.lse is not None:
            return self.lse
        lse = self.ctx.arg(self.ctx.empty((self.tq, self.hq), np.float32))
        n = self.tq * self.hq
        if n:
            kernel = kl_kernel_teacher_lse(self.kind, self.group, self.d)
            kernel[_blocks(n, THREADS), THREADS, stream()](
                self.q, self.k, self.I, self.d_cu_q, self.d_cu_k, self.block_size, self.warmup,
                np.float32(self.scale), lse)
        return lse

    def mean_into(self, kl, loss):
        """eq 10: ``loss[0] = mean(kl)`` over the ``Tq Hkv`` elements (one CTA, fixed order)."""
        kl_kernel_mean(MEAN_THREADS)[1, MEAN_THREADS, stream()](kl.reshape(self.tq * self.hkv),
                                                                loss)

    def chunks(self, bytes_per_query: int, budget: int):
        """``Batch.chunks`` of at most ``budget`` bytes of per-query buffers each."""
        return self.batch.chunks(max(1, min(self.tq, budget // bytes_per_query)))

    # -- v1 and v2 behind one interface ------------------------------------------------------
    def launch_kl(self, lse, kl):
        """``kl [Tq, Hkv]`` (kernel argument) of every (query, group)."""
        args = (self.q, self.k, self.q_idx, self.k_idx, self.I, lse, self.d_cu_q, self.d_cu_k,
                self.block_size, self.warmup, np.float32(self.scale),
                np.float32(self.index_scale), kl)
        n = self.tq * self.hkv
        if self.version == 1:
            kernel = v1.kl_kernel_thread_rows(self.kind, self.group, self.d, self.d_idx)
            kernel[_blocks(n, THREADS), THREADS, stream()](*args)
        else:
            kernel = v2.kl_kernel_cta_rows(self.kind, self.group, self.d, self.d_idx,
                                           ROW_THREADS)
            kernel[n, ROW_THREADS, stream()](*args)

    def launch_rows_grad(self, lse, coef, t0, count, store_ds, lse_idx, dq, ds):
        """Pass 1 of the backward for queries ``[t0, t0 + count)``."""
        args = (self.q, self.k, self.q_idx, self.k_idx, self.I, lse, self.d_cu_q, self.d_cu_k,
                self.block_size, self.warmup, np.float32(self.scale),
                np.float32(self.index_scale), coef, t0, count, store_ds, lse_idx, dq, ds)
        n = count * self.hkv
        if self.version == 1:
            kernel = v1.kl_kernel_thread_rows_grad(self.kind, self.group, self.d, self.d_idx)
            kernel[_blocks(n, THREADS), THREADS, stream()](*args)
        else:
            kernel = v2.kl_kernel_cta_rows_grad(self.kind, self.group, self.d, self.d_idx,
                                                ROW_THREADS)
            kernel[n, ROW_THREADS, stream()](*args)

    def launch_keys(self, lse, lse_idx, row_ptr, q_indices, slots, ds, cu_q, cu_k, row_offsets,
                    num_rows, coef, q_idx, k_idx, dk):
        """Pass 2 of the backward: ``dk += ...`` over the keys of ``cu_k`` (``num_rows`` blocks):
        v1's kernel for version 1, else v2's (v3's too where its own does not apply)."""
        args = (self.q, self.k, q_idx, k_idx, lse, lse_idx, row_ptr, q_indices, slots, ds,
                cu_q, cu_k, row_offsets, self.block_size, np.float32(self.scale),
                np.float32(self.index_scale), coef, dk)
        if self.version == 1:
            n = int(dk.shape[0])
            kernel = v1.kl_kernel_thread_keys(self.kind, self.group, self.d, self.d_idx,
                                              self.warmup)
            kernel[_blocks(n, THREADS), THREADS, stream()](*args)
        else:
            entries = v2.KEY_ENTRIES
            if self.warmup:
                entries = max(1, min(v2.KEY_ENTRIES,
                                     v2.KEY_STAGE_FLOATS // (self.group * self.d)))
            kernel = v2.kl_kernel_cta_keys(self.kind, self.group, self.d, self.d_idx,
                                           self.block_size, entries, self.warmup)
            kernel[num_rows, v2.key_tiles(self.block_size, self.d_idx)[2], stream()](*args)

    def backward_rows(self, lse, coef, lse_idx, dq, dk, max_ds_bytes):
        """v1/v2 backward: pass 1 per (query, group), pass 2 per key (the warmup, whole) or
        per query chunk of the ``dS`` buffer (a selection: each chunk its own CSR)."""
        ctx = self.ctx
        if self.warmup:
            dummy_ds = device_constant(np.zeros((1, 1, 1, 1), np.float32))
            self.launch_rows_grad(lse, coef, 0, self.tq, False, lse_idx, dq, dummy_ds)
            if self.tk:
                dummy_csr = device_constant(np.zeros((1, 1), np.int32))
                self.launch_keys(lse, lse_idx, dummy_csr, dummy_csr, dummy_csr, dummy_ds,
                                 self.d_cu_q, self.d_cu_k, _row_offsets(self.batch),
                                 self.batch.rows, coef, self.q_idx, self.k_idx, dk)
            return
        per_query = self.hkv * self.topk * self.block_size * 4
        q_chunk = max(1, min(self.tq, max_ds_bytes // per_query))
        ds_buf = ctx.arg(ctx.empty((q_chunk * self.hkv * self.topk * self.block_size,),
                                   np.float32))
        for t0, t1, k_lo, k_hi, sub in self.batch.chunks(q_chunk):
            tc = t1 - t0
            ds = ds_buf[:tc * self.hkv * self.topk * self.block_size].reshape(
                tc, self.hkv, self.topk, self.block_size)
            self.launch_rows_grad(lse, coef, t0, tc, True, lse_idx, dq, ds)
            if k_hi == k_lo:
                continue
            row_ptr, q_indices, slots = self._csr(t0, t1, sub)
            self.launch_keys(lse, lse_idx, row_ptr, q_indices, slots, ds, *device_offsets(sub),
                             _row_offsets(sub), sub.rows, coef, self.q_idx[t0:t1],
                             self.k_idx[k_lo:k_hi], dk[k_lo:k_hi])

    # -- v3: per query chunk, CSR + schedule, KV-outer tiles, slot combine --------------------
    def _csr(self, t0, t1, sub):
        """The k2q CSR ``(row_ptr, q_indices, slots)`` of queries ``[t0, t1)`` (kernel args)."""
        row_ptr, q_indices, slots = launch_build_csr(sub, self.I[t0:t1], self.ctx)
        return kernel_array(row_ptr), kernel_array(q_indices), kernel_array(slots)

    def schedule(self, t0, t1, sub):
        """``(work, row_ptr, q_indices, slots, d_cu)`` of queries ``[t0, t1)``: the k2q CSR and
        the work items, and ``d_cu`` the chunk's ``(cu_q, cu_k)`` on the device."""
        row_ptr, q_indices, slots = self._csr(t0, t1, sub)
        chunk = 2 * self.cut_topk * self.block_size  # the paper's hot-row cut, in whole tiles
        chunk = -(-chunk // self.positions) * self.positions
        work = launch_rows(*launch_schedule(sub, row_ptr, chunk, max(1, (t1 - t0) * self.topk),
                                            self.ctx))
        return kernel_array(work), row_ptr, q_indices, slots, device_offsets(sub)

    def _words(self, t0, t1, k_lo, k_hi):
        """The chunk's ``q, k, q_idx, k_idx`` as uint32 words (two 16-bit values each) and
        whether they are all 16-byte aligned (``cp.async``; D, Didx % 16 == 0 keep slices of
        aligned arrays aligned; inputs that are not take plain loads)."""
        words = [x.view(np.uint32) for x in (self.q[t0:t1], self.k[k_lo:k_hi],
                                             self.q_idx[t0:t1], self.k_idx[k_lo:k_hi])]
        return words, all(is_aligned16(x) for x in words)

    def launch_student(self, work, q_indices, slots, d_cu, t0, t1, k_lo, k_hi, part):
        """v3's ``LSE^idx`` pass over one query chunk's work items: ``part`` = slot states."""
        if int(work.shape[0]) == 0:
            return
        words, aligned = self._words(t0, t1, k_lo, k_hi)
        kernel = v3s.kl_kernel_student(self.kind == "bfloat16", self.block_size, self.d_idx,
                                       v3s.STUDENT_WARPS, aligned)
        launch_smem(kernel, int(work.shape[0]), 32 * v3s.STUDENT_WARPS, self.smem_student,
                    words[2], words[3], work, q_indices, slots, *d_cu,
                    np.float32(self.index_scale * LOG2E), part)

    def launch_grad(self, grads, work, q_indices, slots, d_cu, t0, t1, k_lo, k_hi, lse,
                    lse_idx, coef, part, ds, dq_part):
        """v3's grad pass over one query chunk's work items (``grads=False``: the KL terms
        into ``part[0]`` only, ``kl_loss``'s pass; ``ds`` and ``dq_part`` untouched)."""
        if int(work.shape[0]) == 0:
            return
        words, aligned = self._words(t0, t1, k_lo, k_hi)
        kernel = v3.kl_kernel_grad(self.kind == "bfloat16", self.block_size, self.d,
                                   self.d_idx, self.group, self.positions, aligned, grads,
                                   self.teacher_wgmma())
        launch_smem(kernel, int(work.shape[0]), 2 * self.rows, self.smem, *words, lse[t0:t1],
                    lse_idx[t0:t1], work, q_indices, slots, *d_cu,
                    np.float32(self.scale * LOG2E), np.float32(self.index_scale), coef, part,
                    ds, dq_part)

    def teacher_wgmma(self) -> bool:
        """Whether v3's grad pass computes the teacher's ``S = Q Kᵀ`` on ``wgmma``: where the
        tile is whole warpgroups and ``v3.TEACHER_WGMMA`` says so (None: where wgmma runs)."""
        if self.rows % 64:
            return False
        if v3.TEACHER_WGMMA is not None:
            return bool(v3.TEACHER_WGMMA)
        return not SIMULATOR and _wgmma.why_not_available() is None

    # The slot sums below add the slots that are CSR entries of the chunk (``slot_mask``).
    def slot_mask(self, t0, t1, d_cu):
        """The slot mask of queries ``[t0, t1)`` on the chunk's offsets ``d_cu`` (``schedule``:
        those its CSR was built on), in a buffer reused across chunks."""
        words = mask_words(self.topk)
        n = (t1 - t0) * self.hkv * words
        if self._mask_buf is None or int(self._mask_buf.shape[0]) < n:
            self._mask_buf = self.ctx.arg(self.ctx.empty((n,), np.int32))
        mask = self._mask_buf[:n].reshape(t1 - t0, self.hkv, words)
        launch_slot_mask(self.I[t0:t1], *d_cu, self.block_size, mask)
        return mask

    def combine_states(self, part, t0, mask, want_kl, out):
        n = int(part.shape[2]) * self.hkv
        kl_kernel_combine_states[_blocks(n, THREADS), THREADS, stream()](
            part, mask, t0, want_kl, out)

    def combine_kl(self, part, t0, mask, kl):
        """``kl[t, r] = sum_s part[0, s, t, r]`` over the chunk's queries (the KL terms)."""
        n = int(part.shape[2]) * self.hkv
        kl_kernel_combine_kl[_blocks(n, THREADS), THREADS, stream()](part, mask, t0, kl)

    def combine_dq(self, dq_part, t0, mask, dq):
        n = int(dq_part.shape[1]) * self.hkv * self.d_idx
        kl_kernel_combine_dq[_blocks(n, THREADS), THREADS, stream()](dq_part, mask, t0, dq)

    def forward_tensor_cores(self, lse, kl):
        """v3 forward, per query chunk: ``LSE^idx`` (the backward's student pass and slot
        merge), then each slot's ``sum_j P_j (log P_j - S^idx_j + LSE^idx)`` by the grad kernel
        without gradients, summed over the slots in order (as ``kl_loss_and_backward``)."""
        ctx = self.ctx
        per_query = 4 * self.hkv * self.topk * 4
        part_buf = None
        lse_idx = ctx.arg(ctx.empty((self.tq, self.hkv), np.float32))
        dummy4 = device_constant(np.zeros((1, 1, 1, 1), np.float32))
        zero = np.float32(0.0)
        for t0, t1, k_lo, k_hi, sub in self.chunks(per_query, MAX_DS_BYTES):
            tc = t1 - t0
            if part_buf is None:
                part_buf = ctx.arg(ctx.empty((4 * self.topk * tc * self.hkv,), np.float32))
            part = part_buf[:4 * self.topk * tc * self.hkv].reshape(4, self.topk, tc, self.hkv)
            work, _, q_indices, slots, d_cu = self.schedule(t0, t1, sub)
            mask = self.slot_mask(t0, t1, d_cu)
            self.launch_student(work, q_indices, slots, d_cu, t0, t1, k_lo, k_hi, part)
            self.combine_states(part, t0, mask, False, lse_idx)
            self.launch_grad(False, work, q_indices, slots, d_cu, t0, t1, k_lo, k_hi, lse,
                             lse_idx, zero, part, dummy4, dummy4)
            self.combine_kl(part, t0, mask, kl)

    def backward_tensor_cores(self, lse, coef, lse_idx, dq, dk, max_ds_bytes, kl=None):
        """v3 backward, per query chunk: the student's LSE (index scores only, slots merged),
        then dS, the per-slot dq_idx partials and KL terms, dq_idx (and ``kl`` if given) summed
        over the slots in order, dk_idx from the dS buffer by a key-block kernel (v3's for
        bf16 and ``Bk <= 128``, else v2's)."""
        ctx = self.ctx
        per_query = self.hkv * self.topk * (self.block_size + self.d_idx + 4) * 4
        bufs = None
        keys_tc = v3dk.keys_supported(self.kind, self.block_size, self.d_idx)
        for t0, t1, k_lo, k_hi, sub in self.chunks(per_query, max_ds_bytes):
            tc = t1 - t0
            if bufs is None:  # sized by the first chunk, the longest
                bufs = [ctx.arg(ctx.empty((n * tc * self.hkv * self.topk,), np.float32))
                        for n in (4, self.block_size, self.d_idx)]
                if keys_tc:  # dk_idx's scratch slots of the rows cut into parts
                    splits = 2 * (tc * self.hkv * self.topk // v3dk.KEYS_PART_ENTRIES)
                    bufs.append(ctx.arg(ctx.empty((max(1, splits),
                                                   self.block_size * self.d_idx), np.float32)))
            part = bufs[0][:4 * self.topk * tc * self.hkv].reshape(4, self.topk, tc, self.hkv)
            ds = bufs[1][:tc * self.hkv * self.topk * self.block_size].reshape(
                tc, self.hkv, self.topk, self.block_size)
            dq_part = bufs[2][:self.topk * tc * self.hkv * self.d_idx].reshape(
                self.topk, tc, self.hkv, self.d_idx)
            work, row_ptr, q_indices, slots, d_cu = self.schedule(t0, t1, sub)
            mask = self.slot_mask(t0, t1, d_cu)
            self.launch_student(work, q_indices, slots, d_cu, t0, t1, k_lo, k_hi, part)
            self.combine_states(part, t0, mask, False, lse_idx)
            self.launch_grad(True, work, q_indices, slots, d_cu, t0, t1, k_lo, k_hi, lse,
                             lse_idx, coef, part, ds, dq_part)
            self.combine_dq(dq_part, t0, mask, dq)
            if kl is not None:
                self.combine_kl(part, t0, mask, kl)
            if sub.rows == 0:
                continue
            d_rows = _row_offsets(sub)
            if not keys_tc:
                self.launch_keys(lse, lse_idx, row_ptr, q_indices, slots, ds, *d_cu, d_rows,
                                 sub.rows, coef, self.q_idx[t0:t1], self.k_idx[k_lo:k_hi],
                                 dk[k_lo:k_hi])
                continue
            self.launch_keys_tensor_cores(row_ptr, q_indices, slots, ds, d_cu[1], d_rows,
                                          sub.rows, tc, t0, t1, dk[k_lo:k_hi], bufs[3])

    def launch_keys_tensor_cores(self, row_ptr, q_indices, slots, ds, cu_k, d_rows, rows, tc,
                                 t0, t1, dk, dk_part):
        """dk_idx of a query chunk from its dS buffer (``v3_dk_idx``): the CSR rows cut into
        parts of at most ``KEYS_PART_ENTRIES`` entries (a scan of their counts, no host read;
        the grid sized by a bound: ``rows + entries / part`` parts), a CTA a part, then the
        rows of several parts summed from their scratch slots ``dk_part`` (at least ``2
        entries / part`` of them) in part order; no sum where no row can hold two parts."""
        ctx = self.ctx
        ps = v3dk.KEYS_PART_ENTRIES
        entries = tc * self.hkv * self.topk  # every (query, group) holds at most K entries
        parts = ctx.empty((2, rows), np.int32)
        v3dk.keys_parts_kernel[-(-rows // v3dk.SUM_THREADS), v3dk.SUM_THREADS, stream()](
            row_ptr, np.int64(ps), ctx.arg(parts))
        part_ptr = kernel_array(exclusive_prefix_sum(parts, validate=False))
        qi_words = self.q_idx[t0:t1].view(np.uint32)
        kernel = v3dk.kl_kernel_keys(self.block_size, self.d_idx, is_aligned16(qi_words))
        _, _, _, smem, dims, threads = v3dk.keys_layout(self.block_size, self.d_idx)
        launch_smem(kernel, (rows + entries // ps) * (self.d_idx // dims), threads, smem,
                    qi_words, ds, row_ptr, q_indices, slots, cu_k, d_rows, part_ptr,
                    np.int64(ps), np.float32(self.index_scale), dk, dk_part)
        if entries > ps:
            summed, slices = v3dk.keys_sum_kernel(self.block_size, self.d_idx)
            summed[rows * slices, v3dk.SUM_THREADS, stream()](part_ptr, d_rows, cu_k, dk_part,
                                                              dk)


def _row_offsets(batch):
    """The batch's CSR row offsets as an int32 device constant."""
    return device_constant(batch.row_offsets.astype(np.int32))
