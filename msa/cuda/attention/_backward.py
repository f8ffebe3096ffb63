"""The main branch's backward on the GPU: validation once, then version 1, 2 or 3 per query chunk.

``sparse_attention_backward`` checks everything (``Spec``, ``Batch.of``, the knobs, the rung's
limits, the selection with ``validate``) and launches: ``D = rowsum(dO O)``, then version 1
(``v1_backward_cuda_cores``: dQ Q-outer, the CSR of the whole batch, dK/dV per part of a row)
or version 2 or 3 (``v2_backward_tensor_cores``, ``v3_backward_wgmma``: per query chunk whose
dQ partials fit ``max_partial_bytes``, its CSR, one kernel per part of a row, the hot rows'
sums and the dQ sum). The rows are cut into parts by ``_backward_parts``.
"""

from __future__ import annotations

import numpy as np

from ..._checks import (check_array, check_flag, check_lse, check_positive_int, check_version,
                        cu_to_host, unsupported)
from ...reference.select import check_block_indices, nonempty_supports
from .._core import mma as _mma
from .._core.arrays import INT32_MAX, ArrayContext, device_constant, device_offsets, float_kind
from .._core.launch import kernel_array, launch_smem
from .._core.memops import is_aligned16
from .._core.packed import LOG2E
from .._core.streams import stream
from ..csr import exclusive_prefix_sum, launch_build_csr, launch_slot_mask, mask_words
from .._core import wgmma as _wgmma
from .._core.arrays import SIMULATOR
from . import v1_backward_cuda_cores as v1, v2_backward_tensor_cores as v2
from . import v3_backward_wgmma as v3
from ._backward_parts import THREADS, delta_kernel, dkdv_sum_kernel, parts_kernel
from ._plan import (MAX_PARTIAL_BYTES, Spec, element_view, partials_are_bf16, query_chunk,
                    selection_args)

VERSIONS = (1, 2, 3)


def _why_not_v2(spec, block_size):
    """Why version 2 cannot run this problem (``None`` if it can), its tile rows and its shared
    memory bytes."""
    d, g, bk = spec.d, spec.g, block_size
    rows = max(1, v2.TILE_ROWS // g) * g
    smem = v2.layout(bk, d, rows)[-1]
    if spec.kind == "float32":
        return "float32 inputs (tensor cores take float16/bfloat16)", rows, smem
    if d % 16 or d > v2.MAX_HEAD_DIM:
        return (f"head dim D={d} (a multiple of 16, at most {v2.MAX_HEAD_DIM}: dK, dV live in "
                f"registers)"), rows, smem
    if bk % 16 or bk > v2.MAX_BLOCK_SIZE:
        return (f"block_size={bk} (a multiple of 16, at most {v2.MAX_BLOCK_SIZE}: a warp per 16 "
                f"keys, 8 warps of ~220 registers)"), rows, smem
    if rows % 16:
        return f"G={g} (tiles of whole 16-row mma fragments)", rows, smem
    if smem > _mma.DYNAMIC_SMEM_LIMIT:
        return f"{smem} bytes of shared memory", rows, smem
    return None, rows, smem


def _why_not_v3(spec, block_size, why_not_v2):
    """Why version 3 cannot run this problem (``None`` if it can) and its shared memory."""
    d, bk = spec.d, block_size
    smem = v3.layout(bk, d, v3.TILE_ROWS)[-1] if bk in v3.BLOCK_SIZES else 0
    if why_not_v2:
        return why_not_v2, smem
    if bk not in v3.BLOCK_SIZES:
        return f"block_size={bk} (64 or 128: warpgroups of 64 keys)", smem
    if smem > _mma.DYNAMIC_SMEM_LIMIT:
        return f"{smem} bytes of shared memory", smem
    return _wgmma.why_not_available(), smem


def _bf16_dq_partials(partial_dtype, version, why_not_v2) -> bool:
    """``partial_dtype`` of the backward (``None``: float32) -> bf16 dQ partials? Checked
    against the version (1 has no partials; ``why_not_v2``: why it runs, if not asked for)."""
    if partial_dtype is None:
        return False
    bf16 = partials_are_bf16(partial_dtype, None)
    if bf16 and version == 1:
        why = f"version 2 does not support {why_not_v2}" if why_not_v2 else "version=1"
        raise ValueError(f"partial_dtype='bfloat16' needs version 2 or 3 (version 1 sums dQ "
                         f"without partials; here {why})")
    return bf16


def default_backward_version(q, k, v, block_size) -> int:
    """The version ``sparse_attention_backward(version=None)`` runs for these inputs: 3
    (``wgmma``) where it applies on a GPU, else 2 (tensor cores) where it applies
    (float16/bfloat16, D and Bk multiples of 16 up to 128), else 1."""
    return backward_version(Spec(q, k, v), check_positive_int("block_size", block_size))


def backward_version(spec, block_size) -> int:
    """``default_backward_version`` of validated shapes (``Spec``) and block size."""
    why_not_v2 = _why_not_v2(spec, block_size)[0]
    if why_not_v2:
        return 1
    if not SIMULATOR and _why_not_v3(spec, block_size, None)[0] is None:
        return 3  # (the simulator runs it on the wgmma twins when asked, not by default)
    return 2


# The default part size: about PARTS parts over the heads of a query chunk (at least MIN_PART
# entries a part, at most the forward's hot-row cut 2 K Bk), a power of two. A CSR row's length
# varies 30-fold inside a causal chunk (old blocks are picked by most queries, the newest by
# their own); with at most 2 K Bk entries a part, the first 8K-query chunk of a 32K backward ran
# 384 CTAs of one an SM, the longest 1024 tiles: the SMs were busy 61% of that kernel (ncu, H200).
# A model of the CTAs' dispatch over all four chunks: 1.20x the ideal time, 1.05x at 512 entries.
# Measured with the dQ change (H200, benchmarks.dev.backward_parts, 32K / 128K ms): this default
# (512 entries) 44.84 / 178.2, 4096 48.63 / 181.5, 1024 44.76 / 178.3, 256 46.22 / 183.2.
PARTS = 1024
MIN_PART = 256


def default_part_size(entries: int, topk: int, block_size: int) -> int:
    """The backward's default ``part_size`` for a query chunk of ``entries`` CSR entries over
    all KV heads (``Tq_chunk * Hkv * K``): ``entries / PARTS`` rounded up to a power of two,
    clipped to ``[MIN_PART, 2 K Bk]``. A function of the shapes only (not of the device), so
    the results are the same bits on every GPU."""
    want = max(1, -(-entries // PARTS))
    cap = min(2 * topk * block_size, INT32_MAX)
    return max(MIN_PART, min(cap, 1 << (want - 1).bit_length()))


def _cut_rows(ctx, row_ptr, hkv, rows, part_size, entries):
    """Cut the CSR rows into parts of at most ``part_size`` entries, without a host read:
    ``(part_ptr, per_head, num_split)``. One scan gives both the parts' offsets per head (rows
    0 .. Hkv-1 of ``part_ptr``) and the scratch slots of the rows with more than one part (rows
    Hkv ..). The grid and the scratch are sized by bounds, for heads of at most ``entries``
    entries: a head has ``sum ceil(c / part_size) <= rows + entries // part_size`` parts (CTAs
    past its last part exit at once), and its split rows (``c > part_size`` each) fewer than
    ``2 * entries / part_size`` parts, and at most ``entries``."""
    parts = ctx.empty((2 * hkv, rows), np.int32)
    parts_kernel[-(-(hkv * rows) // THREADS), THREADS, stream()](row_ptr, part_size,
                                                                 ctx.arg(parts))
    part_ptr = exclusive_prefix_sum(parts, validate=False)
    per_head = rows + entries // part_size
    num_split = hkv * min(entries, 2 * (entries // part_size))
    return kernel_array(part_ptr), per_head, num_split


def sparse_attention_backward(q, k, v, o, lse, do, block_indices, cu_seqlens_q, cu_seqlens_k,
                              block_size, *, scale=None, version=None, part_size=None,
                              max_partial_bytes=None, partial_dtype=None, validate=True):
    """The gradient of eq 8 on the GPU: ``(dq, dk, dv)`` given ``dO`` (the main branch's backward).

    Same function as ``msa.reference.attention.sparse_attention_backward`` (read it for the
    math), with ``P`` rebuilt from the forward's LSE and ``D = rowsum(dO * O)``. ``dK, dV`` are
    KV-outer: a CTA per part of a k2q CSR row (``msa.cuda.csr.build_csr``), walking the part's
    queries in ascending order. A row has one part unless it holds more than ``part_size``
    queries (a hot row: a sink block every query picks); a hot row's parts write scratch slots
    that a second kernel adds in part order. No atomics: bitwise identical on reruns.

    Masking by selection (docs/design.md §3): a query's ``dq`` does not depend on the K and V
    of a key it cannot see, nor on another query's D (NaN and inf included: bitwise the same
    ``dq``), and where it sees a non-finite K its ``dq`` is NaN where the reference's is.

    Versions (the package docstring has the table):

    1. CUDA cores, float32 throughout (any dtype): ``dQ`` Q-outer (a CTA per query and KV
       head), ``dK, dV`` accumulated in shared memory. The tested fallback; slow.
    2. tensor cores (float16/bfloat16, ``D`` and ``Bk`` multiples of 16 up to 128; the
       default where it applies and version 3 does not): one kernel does all five products
       per tile of ``64/G`` queries x G heads with ``mma.sync``, dK and dV in registers, and
       writes each (query, head, slot)'s ``dQ`` share to a float32 (or ``partial_dtype``)
       partial that a second kernel sums in slot order (as K2 sums the forward's). The
       partials take ``K*Tq*Hq*D*4`` bytes (2 in bf16), so the queries go in chunks of at
       most ``max_partial_bytes`` (default 4 GiB), each with its own CSR, adding to ``dk, dv``
       in turn. P and dS are rounded to the inputs' 16-bit type before their products
       (FlashAttention's backward).
    3. version 2 on Hopper's ``wgmma`` (also ``Bk`` 64 or 128; the default on compute
       capability 9.0): the same tiles, partials and results (bitwise version 2's on an H100
       at the paper's sizes), the products' B operands read once a warpgroup.

    Args:
        q: [Tq, Hq, D] float32, float16 or bfloat16 (torch); k, v: [Tk, Hkv, D], same dtype.
        o: the forward's output [Tq, Hq, D] (q's dtype); lse: its float32 [Tq, Hq];
            do: ``dL/dO`` [Tq, Hq, D] (q's dtype).
        block_indices, cu_seqlens_q, cu_seqlens_k, block_size, scale: as ``sparse_attention``.
        version: 1, 2, 3 or ``None`` (``default_backward_version``: 3, else 2, else 1).
        part_size: most CSR entries (queries) one dK/dV CTA takes; a row with more is split,
            and its parts' sums are added in a fixed order (so a different ``part_size`` may
            change the last bits). Default: per query chunk, its ``Tq Hkv K`` entries over
            ~1024 parts (``default_part_size``: a power of two in ``[256, 2*K*Bk]``), so that
            the SMs share the work evenly; a function of the shapes, not of the GPU.
        max_partial_bytes: versions 2 and 3's memory for one query chunk's dQ partials.
        partial_dtype: ``"float32"`` (the default) or ``"bfloat16"`` dQ partials (versions 2
            and 3). bf16 partials halve the bytes the kernel writes and ``dq_sum`` reads (and
            the memory of a chunk, so chunks twice as long), at the cost of one bf16 rounding
            of each (query, head, slot) share before the float32 sum, as the forward's
            ``partial_dtype="bfloat16"`` rounds its ``O_s``; ``dk`` and ``dv`` do not change.
        validate: check ``block_indices`` and ``lse`` on host copies first, as the reference
            does (``lse`` finite wherever the support is non-empty: ``msa._checks.check_lse``);
            ``False`` skips it (invalid entries are then skipped by the kernels: memory safe,
            result unspecified).

    Returns:
        ``(dq [Tq, Hq, D], dk [Tk, Hkv, D], dv [Tk, Hkv, D])``, float32, in the caller's library.
        Keys no query sees get 0; a query with an empty support (``lse = -inf``) gets ``dq = 0``.

    Raises:
        TypeError/ValueError as ``sparse_attention``, plus ``o``, ``do`` or ``lse`` of the wrong
        shape or dtype, ``version=2`` or ``3`` where it does not apply, and ``Bk``, ``D``, ``G`` too
        large for version 1's shared memory (the paper's Bk = D = 128, G = 16 fit; so does
        D = 256 with Bk = 64, G <= 8).
    """
    return _sparse_attention_backward(q, k, v, o, lse, do, block_indices, cu_seqlens_q,
                                      cu_seqlens_k, block_size, scale, version=version,
                                      part_size=part_size, max_partial_bytes=max_partial_bytes,
                                      partial_dtype=partial_dtype, validate=validate)


def _sparse_attention_backward(q, k, v, o, lse, do, block_indices, cu_seqlens_q, cu_seqlens_k,
                               block_size, scale=None, *, version=None, part_size=None,
                               max_partial_bytes=None, partial_dtype=None, validate=True,
                               bf16_bits=False):
    """``sparse_attention_backward``; ``bf16_bits``: int16/uint16 inputs hold bf16 bits."""
    spec = Spec(q, k, v, bf16_bits=bf16_bits)
    tq, hq, d = spec.tq, spec.hq, spec.d
    for name, x in (("o", o), ("do", do)):
        check_array(name, x, ndim=3, shape=(tq, hq, d))
        spec.same_kind(name, x)
    check_array("lse", lse, ndim=2, shape=(tq, hq))
    float_kind("lse", lse, ("float32",))  # the forward's
    batch, scale, topk = selection_args(spec, block_indices, cu_seqlens_q, cu_seqlens_k,
                                        block_size, scale)
    bs = batch.block_size
    if part_size is not None:  # else per query chunk (default_part_size)
        part_size = check_positive_int("part_size", part_size, high=INT32_MAX)
    max_partial_bytes = check_positive_int(
        "max_partial_bytes", MAX_PARTIAL_BYTES if max_partial_bytes is None
        else max_partial_bytes)
    why_not, tc_rows, tc_smem = _why_not_v2(spec, bs)
    if version is None:
        version = backward_version(spec, bs)
    version = check_version("version", version, VERSIONS)
    if version == 2 and why_not:
        raise ValueError(f"version=2 (tensor cores) does not support {why_not}; use version=1")
    if version == 3:
        why_not_v3, tc_smem = _why_not_v3(spec, bs, why_not)
        if why_not_v3:
            raise ValueError(f"version=3 (wgmma) does not support {why_not_v3}; use version=1"
                             + ("" if why_not else " or 2"))
    bf16_dq = _bf16_dq_partials(partial_dtype, version, why_not)
    smem = v1.dkdv_layout(bs, d, spec.g)[-1]
    if version == 1:
        for kernel, need, limit in (("dK/dV", smem, _mma.DYNAMIC_SMEM_LIMIT),
                                    ("dQ", v1.dq_smem(bs, d, spec.g), _mma.STATIC_SMEM_LIMIT)):
            if need > limit:
                raise unsupported(
                    "block_size", bs, "msa.cuda", "sizes whose tiles fit shared memory",
                    why=f"with head dim D={d} and G={spec.g} the {kernel} kernel needs {need} "
                        f"bytes of shared memory, more than {limit}")
    if check_flag("validate", validate):
        host_I = check_block_indices(cu_to_host(block_indices), batch.cu_q, batch.cu_k, bs)
        check_lse(np.asarray(cu_to_host(lse)),
                  nonempty_supports(host_I, batch.cu_q, batch.cu_k, bs))

    ctx = ArrayContext(q=q, k=k, v=v, o=o, lse=lse, do=do, block_indices=block_indices)
    dq = ctx.empty((tq, hq, d), np.float32)
    dk = ctx.empty((spec.tk, spec.hkv, d), np.float32, fill=0)
    dv = ctx.empty((spec.tk, spec.hkv, d), np.float32, fill=0)
    if tq == 0 or spec.tk == 0:
        return ctx.output(dq), ctx.output(dk), ctx.output(dv)
    oa, doa = (element_view(ctx, name, x, spec.bf16) for name, x in (("o", o), ("do", do)))
    I = block_indices if ctx.lib in ("torch", "cupy") else ctx.input("block_indices",
                                                                      block_indices)
    delta = ctx.empty((tq, hq), np.float32)
    arrays = (ctx.input("lse", lse), ctx.arg(delta), ctx.arg(dq), ctx.arg(dk), ctx.arg(dv))
    # D = rowsum(dO O), a warp per row
    delta_kernel(d, spec.bf16)[-(-(tq * hq * 32) // THREADS), THREADS, stream()](
        oa, doa, arrays[1])
    if version == 1:
        _version1(ctx, spec, batch, topk, q, k, v, doa, I, scale, part_size, smem, *arrays)
    else:
        _tensor_cores(ctx, spec, batch, topk, q, k, v, do, I, scale, part_size,
                      max_partial_bytes, version, tc_rows, tc_smem, bf16_dq, *arrays)
    return ctx.output(dq), ctx.output(dk), ctx.output(dv)


def _version1(ctx, spec, batch, topk, q, k, v, doa, I, scale, part_size, smem, lse_a, delta_a,
              dq_a, dk_a, dv_a):
    """Backward version 1 on the whole batch: dQ Q-outer, then dK/dV per part of a CSR row."""
    bs, d, hkv, nt = batch.block_size, spec.d, spec.hkv, THREADS
    qa, ka, va = (element_view(ctx, name, x, spec.bf16)
                  for name, x in (("q", q), ("k", k), ("v", v)))
    d_cu_q, d_cu_k = device_offsets(batch)
    v1.dq_kernel(bs, d, spec.g, spec.bf16, nt)[spec.tq * hkv, nt, stream()](
        qa, ka, va, doa, lse_a, delta_a, kernel_array(I), d_cu_q, d_cu_k, np.float32(scale),
        dq_a)
    if batch.rows == 0:
        return
    row_ptr, q_indices, _ = launch_build_csr(batch, I, ctx)
    d_row_ptr = kernel_array(row_ptr)
    d_row_offsets = device_constant(batch.row_offsets.astype(np.int32))
    part_size = part_size or default_part_size(spec.tq * hkv * topk, topk, bs)
    part_ptr, per_head, num_split = _cut_rows(ctx, d_row_ptr, hkv, batch.rows, part_size,
                                              spec.tq * topk)
    dk_part = ctx.arg(ctx.empty((max(num_split, 1), bs * d), np.float32))
    dv_part = ctx.arg(ctx.empty((max(num_split, 1), bs * d), np.float32))
    launch_smem(v1.dkdv_kernel(bs, d, spec.g, spec.bf16, nt), hkv * per_head, nt, smem, qa, ka,
                va, doa, lse_a, delta_a, d_row_ptr, kernel_array(q_indices), d_row_offsets,
                d_cu_q, d_cu_k, np.float32(scale), part_ptr, part_size, dk_a, dv_a, dk_part,
                dv_part)
    dkdv_sum_kernel(bs, d, THREADS)[hkv * batch.rows, THREADS, stream()](
        part_ptr, d_row_offsets, d_cu_k, dk_part, dv_part, dk_a, dv_a)


def _tensor_cores(ctx, spec, batch, topk, q, k, v, do, I, scale, part_size, max_partial_bytes,
                  version, tc_rows, tc_smem, bf16_dq, lse_a, delta_a, dq_a, dk_a, dv_a):
    """Backward version 2 or 3 per query chunk whose dQ partials fit ``max_partial_bytes`` (as
    ``sparse_attention``): the same launches and partials, version 3's kernel on ``wgmma``;
    ``bf16_dq``: the partials in bf16, pairs of them in the uint32 words of ``dq_buf``."""
    bs, d, hq, hkv = batch.block_size, spec.d, spec.hq, spec.hkv
    qw, kw, vw, dow = (ctx.input(name, x).view(np.uint32)
                       for name, x in (("q", q), ("k", k), ("v", v), ("do", do)))
    aligned = all(is_aligned16(x) for x in (qw, kw, vw, dow))
    if version == 3:
        k_tc = v3.backward_kernel_v3(bs, d, spec.g, spec.bf16, aligned, bf16_dq)
    else:
        k_tc = v2.backward_kernel_v2(bs, d, spec.g, tc_rows, spec.bf16, aligned, bf16_dq)
    k_sum = dkdv_sum_kernel(bs, d, THREADS)
    k_dq_sum = v2.dq_sum_kernel(d, spec.g, bf16_dq)
    q_chunk = query_chunk(spec, topk, 2 if bf16_dq else 4, max_partial_bytes)
    dw = d // 2 if bf16_dq else d  # words of a partial row
    dq_buf = ctx.arg(ctx.empty((topk * q_chunk * hq * dw,), np.float32))
    if bf16_dq:
        dq_buf = dq_buf.view(np.uint32)
    words = mask_words(topk)
    mask_buf = ctx.arg(ctx.empty((q_chunk * hkv * words,), np.int32))
    # Every chunk's offsets go to the device before the first launch (a host-to-device copy
    # inside the loop would wait for the previous chunk's kernels); no host read after that.
    chunks = [(t0, t1, k_lo, k_hi, sub, device_constant(sub.row_offsets.astype(np.int32)),
               *device_offsets(sub)) for t0, t1, k_lo, k_hi, sub in batch.chunks(q_chunk)]
    for t0, t1, k_lo, k_hi, sub, d_row_offsets, d_cu_q, d_cu_k in chunks:
        tc = t1 - t0
        I_c = I[t0:t1]
        dq_part = dq_buf[:topk * tc * hq * dw].reshape(topk, tc, hq, dw)
        if sub.rows:
            row_ptr, q_indices, slots = launch_build_csr(sub, I_c, ctx)
            d_row_ptr = kernel_array(row_ptr)
            ps = part_size or default_part_size(tc * hkv * topk, topk, bs)
            part_ptr, per_head, num_split = _cut_rows(ctx, d_row_ptr, hkv, sub.rows, ps,
                                                      tc * topk)
            dk_part = ctx.arg(ctx.empty((max(num_split, 1), bs * d), np.float32))
            dv_part = ctx.arg(ctx.empty((max(num_split, 1), bs * d), np.float32))
            dk_c, dv_c = dk_a[k_lo:k_hi], dv_a[k_lo:k_hi]
            launch_smem(k_tc, hkv * per_head, 2 * bs, tc_smem, qw[t0:t1], kw[k_lo:k_hi],
                        vw[k_lo:k_hi], dow[t0:t1], lse_a[t0:t1], delta_a[t0:t1], d_row_ptr,
                        kernel_array(q_indices), kernel_array(slots), d_row_offsets, d_cu_q,
                        d_cu_k, np.float32(scale), np.float32(scale * LOG2E), part_ptr, ps,
                        dk_c, dv_c, dk_part, dv_part, dq_part)
            # rows of one part return at once
            k_sum[hkv * sub.rows, THREADS, stream()](part_ptr, d_row_offsets, d_cu_k, dk_part,
                                                     dv_part, dk_c, dv_c)
        # every (query, head) row of dq: the sum of the slots the kernel wrote (none: 0)
        mask = mask_buf[:tc * hkv * words].reshape(tc, hkv, words)
        launch_slot_mask(kernel_array(I_c), d_cu_q, d_cu_k, bs, mask)
        k_dq_sum[-(-(tc * hq * (dw // 4)) // THREADS), THREADS, stream()](
            mask, dq_part, np.float32(scale), dq_a[t0:t1])
