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

and the KL of (query, group) is the ``K`` of the state of its whole support
(``msa.cuda.kl._state``). ``P_j = 0`` (an underflowed teacher) contributes nothing to ``D`` or
``C`` (``0 log 0 = 0``); an empty support (``l = 0``, the merge's identity) gives ``KL = 0``.
``C`` is 1 up to rounding when ``lse`` is the teacher's own LSE on this support.

Accuracy. Long float32 sums drift like ``sqrt(n)`` ulps, and a single running
``(m, l, A = sum P log P, B = sum P (S^idx - m), C)`` over thousands of keys cancels terms of
size ``log N`` to a KL of ~1 (measured on the GPU: 25x the float32 NumPy reference's error for
``kl``, 7-10x for ``dk_idx``, which sums ``Tq Hkv`` terms per key). Hence runs of at most one
slot (v1) or ``Bk / threads`` keys (v2) with Kahan-compensated ``l, D, C``, the state merge
above (whose terms are of the size of the KL), and ``dk_idx`` summed in runs of ``FOLD`` (or
32-entry mma steps) folded into a compensated sum. The simulator cannot show this (``math.exp``
of a float32 returns a Python float there, so its sums run in float64); the ``big`` GPU tests do.

Backward (eq 10-11): ``dS_j = g (P^idx_j - P_j) / (Tq Hkv)`` on the support,
``dq_idx = s_idx sum_j dS_j k_idx_j``, ``dk_idx_j = s_idx sum_{t, r} dS_{t,r,j} q_idx_{t,r}``.
``kl_backward`` needs ``LSE^idx`` before ``dS``, so it first finds it (index scores only, cheap),
then computes the teacher and ``dS`` once, writing ``dS`` of every selected block to a buffer
``[Tq, Hkv, K, Bk]`` (0 on hidden keys) and summing ``dq_idx``; ``dk_idx`` is then summed
KV-outer from the buffer over the queries of the key block's k2q CSR row
(``msa.cuda.csr.build_csr``), in CSR order (v3: a hot row in parts, their sums added in part
order, ``msa.cuda.kl.v3_dk_idx``). In the warmup (the support is the whole causal
past) v3 writes that support as a selection, every block up to the query's own in ``K = NB``
slots (int32 ``[Tq, Hkv, NB]``, 2 GiB at 128K tokens in the paper configuration), and runs the
path above on it; v1 and v2 keep no buffer there: a key visits every later query of its
sequence and recomputes ``dS``.

Every output element is written by one thread that sums in a fixed order, with no float atomics:
reruns are bitwise identical. The loss of eq 10 is the mean of ``kl`` by one CTA
(Kahan-compensated per-thread sums, then a fixed tree).

Rungs (``version=None`` picks the fastest that supports the inputs). Measured on the H200 at the
paper configuration (Hq = 64, Hkv = 4, D = Didx = 128, Bk = 128, K = 16, bf16), the training
step's call ``kl_loss_and_backward``:

===  ==========================  ====================================  ==========================
v    idea (file)                 default where                         verdict
===  ==========================  ====================================  ==========================
1    one thread per (query,      nowhere: the teaching rung            not timed at 32K
     group) and per key, from    (the simulator's fastest:             (``bench_kl --v1-max-n``)
     global memory               no barriers)
     (``v1_thread_rows``)
2    one CTA per (query, group)  fp32; ``D``, ``Didx``, ``Bk`` not     811 ms at 32K (ff049cb):
     and per key block, the      multiples of 16, ``Bk > 256``,        28x v3; the warmup step
     queries in shared memory    other ``G``, v3 tiles over shared     at 32K 10.56 s (its KL)
     (``v2_cta_rows``)           memory, a warmup whose full
                                 selection passes 4 GiB; its
                                 dk_idx for v3 on fp16 or
                                 ``Bk > 128``
3    KV-outer on tensor cores,   fp16/bf16 otherwise, the warmup       H200 (4cbaf1f): 14.98 ms
     the work in registers; was  too (as every visible block           at 32K, 51.62 at 128K,
     v4 (``v3_student``,         selected) (sm_80 and later:           1.35x / 1.45x the
     ``v3_tensor_cores``,        ``mma.sync``, ``cp.async``; the       attention forward; the
     ``v3_dk_idx``)              teacher on ``wgmma`` on sm_90)        warmup 6.87 s at 128K (H100)
===  ==========================  ====================================  ==========================

The old v3 (KV-outer, the teacher's scores staged through 185 KB of shared memory; 92.9 ms at
32K) is gone: no input ran it by default (where its smaller tiles fitted and v3's did not, the
default raised; such inputs, ``D + Didx`` from about 272 up, now run v2). All accumulate in
fp32; inputs fp32/fp16/bf16 (bf16 as uint16 bits), any ``G`` (v3: 1, 2, 4, 8, 16).
``lse=None`` (the teacher's LSE computed here, a convenience) adds one pass, one thread per
(query, head).

Memory: the ``dS`` buffer is ``Tq*Hkv*K*Bk`` float32 (4 GiB at 128K tokens in the paper
configuration; v3 adds the ``dq_idx`` partials, ``Tq*Hkv*K*Didx``). ``kl_backward`` processes
queries in chunks whose buffers fit ``max_ds_bytes`` (default 4 GiB): each chunk is a smaller
problem of the same kind (its queries against the keys they can see, ``msa._batch.Batch.chunks``)
with its own CSR, and adds its ``dk_idx`` contribution to the keys in chunk order. A
``block_size`` above 256 and longer than every sequence is taken as the longest sequence's
length rounded up to 16 (the same blocks: one a sequence), so that the buffer is sized by the
keys there are; one query's buffer beyond ``max_ds_bytes`` is an error naming ``block_size``.

Bad input raises before any launch; the public functions check everything once (a
``msa._batch.Batch`` of the offsets, the arrays' shapes and dtypes, the version) and the plan
and launches below check nothing again. With ``validate=True`` (default) the launchers copy
``block_indices`` and ``lse`` to the host once to check them like the reference does (indices in
range, unique, ``-1`` only at the tail; ``lse`` not NaN/+inf and finite wherever the support is
non-empty). ``validate=False`` skips those copies; the kernels still never read or write out of
bounds (invalid blocks and CSR entries are skipped), but the result for invalid indices or a
wrong ``lse`` is unspecified.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from ..._batch import Batch
from ..._checks import (check_array, check_flag, check_gqa, check_lse, check_positive_int,
                        check_scale, check_version, cu_to_host)
from ...reference.select import check_block_indices
from .._core.arrays import float_kind, index_dtype
from .._core.mma import DYNAMIC_SMEM_LIMIT
from ._plan import (DEFAULT_VERSION, MAX_DS_BYTES, VERSIONS, Plan, tensor_core_tiles,
                    why_not_tensor_cores)

__all__ = ["kl_loss", "kl_backward", "kl_loss_and_backward"]

DTYPE_KINDS = ("float32", "float16", "bfloat16")
# A block_size above this and above every sequence is taken as the longest sequence (rounded up
# to 16): the same blocks, one a sequence, with buffers sized by the keys there are.
_LONG_BLOCK = 256


def _validated(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k, block_size,
               scale, index_scale, version, validate, bf16_bits) -> Plan:
    """Check every argument once (errors name it) and plan the call.

    ``bf16_bits``: integer (uint16/int16) inputs hold bf16 bit patterns (the simulator has no
    bf16 arrays; torch bf16 tensors are recognised by their dtype)."""
    check_array("q", q, ndim=3)
    kind = float_kind("q", q, DTYPE_KINDS, bf16_bits=bf16_bits)
    tq, hq, d = (int(x) for x in q.shape)
    if hq < 1 or d < 1:
        raise ValueError(f"q must have shape [Tq, Hq >= 1, D >= 1], got {tuple(q.shape)}")
    check_array("k", k, ndim=3, shape=(None, None, d))
    tk, hkv = int(k.shape[0]), int(k.shape[1])
    if hkv < 1:
        raise ValueError(f"k must have Hkv >= 1 heads, got shape {tuple(k.shape)}")
    group = check_gqa(hq, hkv)
    check_array("q_idx", q_idx, ndim=3, shape=(tq, hkv, None))
    d_idx = int(q_idx.shape[2])
    if d_idx < 1:
        raise ValueError(
            f"q_idx must have shape [Tq, Hkv >= 1, Didx >= 1], got {tuple(q_idx.shape)}")
    check_array("k_idx", k_idx, ndim=2, shape=(tk, d_idx))
    for name, x in (("k", k), ("q_idx", q_idx), ("k_idx", k_idx)):
        other = float_kind(name, x, DTYPE_KINDS, bf16_bits=bf16_bits)
        if other != kind:
            raise TypeError(f"{name} must have the dtype of q ({kind}), got {other}")
    batch = Batch.of(cu_seqlens_q, cu_seqlens_k, block_size, total_q=tq, total_k=tk)
    longest = -(-int(batch.lk.max()) // 16) * 16 if batch.num_seqs else 0
    if batch.block_size > max(longest, _LONG_BLOCK):
        # every sequence is one block (block 0) whatever block_size >= its length: the
        # longest length (a multiple of 16, as the tensor cores want) is the same blocking,
        # and it sizes the dS buffer [Tq, Hkv, K, Bk] by the keys there are
        batch = Batch.of(batch.cu_q, batch.cu_k, max(longest, _LONG_BLOCK))
    host_I = None
    validate = check_flag("validate", validate)
    if block_indices is not None:
        check_array("block_indices", block_indices, ndim=3, dtypes=("int",))
        index_dtype("block_indices", block_indices)
        if (int(block_indices.shape[0]) != tq or int(block_indices.shape[1]) != hkv
                or int(block_indices.shape[2]) < 1):
            raise ValueError(
                f"block_indices must have shape [Tq, Hkv, K >= 1] = [{tq}, {hkv}, K], "
                f"got {tuple(block_indices.shape)}")
        if validate:
            host_I = check_block_indices(cu_to_host(block_indices), batch.cu_q, batch.cu_k,
                                         batch.block_size)
    if lse is not None:
        check_array("lse", lse, ndim=2, shape=(tq, hq))
        float_kind("lse", lse, ("float32",))  # the attention's LSE
        if validate:
            _check_lse(np.asarray(cu_to_host(lse)), host_I, batch, group)
    scale = check_scale("scale", scale, 1.0 / math.sqrt(d))
    index_scale = check_scale("index_scale", index_scale, 1.0 / math.sqrt(d_idx))
    version, tiles = _version(version, kind, block_indices is None, batch.block_size, d, d_idx,
                              group, full_selection_bytes=4 * tq * hkv * batch.nb)
    return Plan(batch, kind, (q, k, q_idx, k_idx), block_indices, lse,
                (tq, tk, hq, hkv, d, d_idx), scale, index_scale, version, tiles)


def _version(version, kind, warmup, block_size, d, d_idx, group, *, full_selection_bytes=0):
    """``(version, tiles)``: the requested rung, or the fastest that supports the inputs, and
    v3's tiles (``_plan.tensor_core_tiles``) where it runs."""
    why = why_not_tensor_cores(kind, warmup, block_size, d, d_idx, group,
                               full_selection_bytes=full_selection_bytes)
    tiles = None if why else tensor_core_tiles(block_size, d, d_idx, group)
    if why is None and tiles is None:
        why = (f"D={d}, Didx={d_idx}, block_size={block_size} (its tiles need more than the "
               f"{DYNAMIC_SMEM_LIMIT} bytes of shared memory a kernel may have)")
    if version is None:
        version = 2 if why else DEFAULT_VERSION
    check_version("version", version, VERSIONS)
    if version == 3 and why:
        raise ValueError(f"version=3 (tensor cores) does not support {why}; use version=2 or 1")
    return version, tiles


def _check_lse(lse, host_I, batch, group):
    """The reference's checks of ``lse`` on a host copy (``host_I``: the checked selection,
    None in the warmup)."""
    if host_I is None:
        nonempty = np.ones((lse.shape[0], lse.shape[1] // group), dtype=bool)  # sees itself
    else:
        local = batch.query_pos // batch.block_size  # [Tq]
        nonempty = ((host_I >= 0) & (host_I <= local[:, None, None])).any(axis=-1)
    check_lse(lse, nonempty)


def _check_grad_loss(grad_loss) -> float:
    if isinstance(grad_loss, bool) or not isinstance(grad_loss, numbers.Real):
        raise TypeError(f"grad_loss must be a real number, got {type(grad_loss).__name__}")
    if not math.isfinite(float(grad_loss)):
        raise ValueError(f"grad_loss must be finite, got {grad_loss!r}")
    return float(grad_loss)


def _loss_output(ctx, loss):
    """The [1] loss buffer as the caller gets it: a NumPy float32 scalar, else a 0-d array."""
    loss = ctx.output(loss)
    if isinstance(loss, np.ndarray):
        return np.float32(loss[0])
    try:
        return loss.reshape(())
    except Exception:  # a Numba device array may refuse 0-d shapes: keep [1]
        return loss


def _kl_loss(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k, block_size,
             scale=None, index_scale=None, *, version=None, validate=True, bf16_bits=False):
    """``kl_loss`` with ``bf16_bits`` (``_validated``)."""
    p = _validated(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k,
                   block_size, scale, index_scale, version, validate, bf16_bits)
    ctx = p.ctx
    kl = ctx.empty((p.tq, p.hkv), np.float32)
    loss = ctx.empty((1,), np.float32, fill=0.0 if p.tq == 0 else None)
    if p.tq:
        kl_arg = ctx.arg(kl)
        if p.version == 3:
            p.forward_tensor_cores(p.teacher_lse(), kl_arg)
        else:
            p.launch_kl(p.teacher_lse(), kl_arg)
        p.mean_into(kl_arg, ctx.arg(loss))
    return ctx.output(kl), _loss_output(ctx, loss)


def _kl_backward(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k, block_size,
                 scale=None, index_scale=None, grad_loss=1.0, *, version=None, validate=True,
                 max_ds_bytes=None, bf16_bits=False, with_kl=False):
    """``kl_backward`` with ``bf16_bits`` (``_validated``); ``with_kl`` returns
    ``(kl, loss, dq_idx, dk_idx)`` (``kl_loss_and_backward``)."""
    p = _validated(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k,
                   block_size, scale, index_scale, version, validate, bf16_bits)
    grad_loss = _check_grad_loss(grad_loss)
    if max_ds_bytes is None:
        max_ds_bytes = MAX_DS_BYTES
    max_ds_bytes = check_positive_int("max_ds_bytes", max_ds_bytes)
    if not p.warmup:  # the chunks hold at least one query: its dS must fit the budget
        per_query = p.hkv * p.topk * p.block_size * 4  # dS [Hkv, K, Bk] float32
        if per_query > max_ds_bytes:
            raise ValueError(
                f"block_size={p.block_size}: one query's dS buffer [Hkv, K, block_size] float32 "
                f"takes {per_query} bytes, more than max_ds_bytes={max_ds_bytes}; pass a larger "
                f"max_ds_bytes or a smaller block_size")
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
    if p.version == 3:  # its grad pass writes the KL terms: no teacher pass of its own
        p.backward_tensor_cores(lse_arg, coef, lse_idx, dq_arg, dk_arg, max_ds_bytes, kl_arg)
        if with_kl:
            p.mean_into(kl_arg, ctx.arg(loss))
        return result()
    if with_kl:
        p.launch_kl(lse_arg, kl_arg)
        p.mean_into(kl_arg, ctx.arg(loss))
    p.backward_rows(lse_arg, coef, lse_idx, dq_arg, dk_arg, max_ds_bytes)
    return result()


def kl_loss(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k, block_size, *,
            scale=None, index_scale=None, version=None, validate=True):
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
        version: kernel rung 1, 2 or 3 (module table); ``None`` picks the fastest that
            supports the inputs (3 for fp16/bf16 with ``D, Didx, Bk`` multiples of 16, the
            warmup included while its full selection fits 4 GiB, else 2).
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


def kl_backward(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k, block_size,
                *, scale=None, index_scale=None, grad_loss=1.0, version=None, validate=True,
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
                         block_size, *, scale=None, index_scale=None, grad_loss=1.0,
                         version=None, validate=True, max_ds_bytes=None):
    """Paper eq 9-11 in one call: :func:`kl_loss` and :func:`kl_backward` on the same inputs.

    The training step needs both; v3 then scores the support with the teacher once instead of
    twice: the backward's grad pass also sums each slot's KL term, and ``kl`` equals
    ``kl_loss``'s bitwise (v3's forward is that very pass without the gradients), in the
    warmup too. v1 and v2 run the forward kernel and then the backward on one validated plan.

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
