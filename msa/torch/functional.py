"""Autograd functions of MSA for PyTorch: the main branch (eq 8) and the sparse KL (eq 9-11).

Each forward runs where the tensors are: ``msa.cuda`` for CUDA tensors (the kernels), and
``msa.reference`` (NumPy) for CPU tensors, so the same training code runs on a laptop and
``torch.autograd.gradcheck`` can check every backward in float64. Every function takes packed
variable-length batches with ``cu_seqlens`` as the rest of msa does (read on the host: they
are small).

============================  ================================================================
function                      gradients
============================  ================================================================
``sparse_attention``          ``dq, dk, dv`` of eq 8 on the selected support: on CUDA
                              fp16/bf16 tensors ``msa.cuda``'s tensor-core backward (version 2,
                              bitwise reproducible); elsewhere in PyTorch
                              (``sparse_attention_backward``: per chunk of queries the selected
                              keys are gathered, ``P`` is rebuilt from the forward's LSE, and
                              ``dk, dv`` are scattered with ``index_add_``, float atomics on a
                              GPU); ``backward=`` picks one explicitly
``dense_attention``           ``dq, dk, dv`` of causal GQA attention over every visible key
                              (the indexer warmup's main branch, Algorithm 1 line 5 with no
                              selection): on CUDA fp16/bf16 self-attention PyTorch's fused
                              flash attention and its backward, ``O(T)`` memory; elsewhere
                              queries in chunks, ``O(C Lk)`` memory per chunk, and the PyTorch
                              backward above with the support of every visible key
``kl_loss``                   ``dq_idx, dk_idx`` of ``L_KL`` (eq 10-11), computed with the loss
                              (``kl_loss_and_backward`` on a GPU) and scaled by the upstream
                              gradient; none into ``q``, ``k`` or ``lse``: the teacher is held
                              constant (stop-gradient)
============================  ================================================================

The selection ``block_indices`` is an integer input everywhere (top-k has no gradient; the
index branch learns from ``kl_loss`` alone, paper §3.2). Arguments are in the reference's order,
``scale``, ``index_scale`` and the other knobs keyword-only; every function checks its inputs
(errors name the argument) and masks by selection: a query's output and gradients do not depend
on any key it cannot see, NaN included.

What runs are the custom operators of :mod:`msa.torch.ops` (``torch.ops.msa.*``), so that
``torch.compile`` traces these functions, and ``MSAAttention``, with no graph break: the
checks here read only shapes, dtypes and Python scalars, except those of ``cu_seqlens``, whose
values a trace cannot read; under ``torch.compile`` ``ops.check_cu_seqlens`` checks them when
the graph runs, with the same errors.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from .._checks import (check_block_size, check_choice, check_cu_seqlens, check_flag, check_gqa,
                       check_lse, check_offsets, check_scale, cu_to_host)
from ..reference.select import check_block_indices, nonempty_supports
from . import ops

__all__ = ["sparse_attention", "sparse_attention_backward", "dense_attention", "kl_loss"]


@torch.compiler.assume_constant_result
def _check_scale(name, value, default):
    """``msa._checks.check_scale``. Under ``torch.compile`` Dynamo calls it while tracing, on
    the constants of the trace, rather than tracing the NumPy inside it (a graph break)."""
    return check_scale(name, value, default)


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(name, x, ndim, *, kind=None):
    """``x`` a torch.Tensor of rank ``ndim``; ``kind`` ``"float"`` (fp16/bf16/fp32/fp64) or
    ``"int"`` (any integer dtype, not bool) checks its dtype too."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if kind == "float" and x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have a float dtype (float16, bfloat16, float32, float64), "
                        f"got {x.dtype}")
    if kind == "int" and (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool):
        raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")


def _same_device(**tensors):
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device, got {devices}")


def _check_qkv(q, k, v):
    """Shapes, dtypes and devices of ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]``; returns G."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, 3, kind="float")
    _same_device(q=q, k=k, v=v)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if int(q.shape[2]) < 1:
        raise ValueError(f"q must have head dim D >= 1, got shape {tuple(q.shape)}")
    if int(q.shape[2]) != int(k.shape[2]):
        raise ValueError(f"k must have q's head dim D={int(q.shape[2])}, got shape {tuple(k.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    return check_gqa(int(q.shape[1]), int(k.shape[1]))


def _check_indices(block_indices, tq, hkv):
    _check_tensor("block_indices", block_indices, 3, kind="int")
    if tuple(block_indices.shape[:2]) != (tq, hkv) or int(block_indices.shape[2]) < 1:
        raise ValueError(f"block_indices must have shape [Tq, Hkv, K >= 1] = [{tq}, {hkv}, K], "
                         f"got {tuple(block_indices.shape)}")


def _offsets_tensor(name, cu):
    """Offsets as a tensor to trace (under ``torch.compile``): a tensor as it is, a list or
    tuple of ints as a constant int64 tensor; values are checked by the op that takes it."""
    if isinstance(cu, torch.Tensor):
        return cu
    if isinstance(cu, (list, tuple)):
        for x in cu:
            if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                raise TypeError(f"{name} must hold integers, got {type(x).__name__} {x!r}")
        return torch.tensor(cu, dtype=torch.int64)
    if isinstance(cu, np.ndarray):
        return torch.from_numpy(cu)
    raise TypeError(f"{name} must be an integer array or a list of ints [B+1], "
                    f"got {type(cu).__name__}")


def _checked_offsets(name, cu_seqlens, total):
    """One offsets array checked (``msa._checks.check_offsets``), as the CPU int64 tensor the
    ops take. Eagerly it is read and checked here; under ``torch.compile``, where a trace
    cannot read its values, ``ops.check_offsets`` checks it when the graph runs."""
    if torch.compiler.is_compiling():
        return ops.check_offsets(_offsets_tensor(name, cu_seqlens), name, total)
    return torch.from_numpy(check_offsets(name, cu_seqlens, total))


def _checked_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k):
    """``cu_seqlens_q, cu_seqlens_k`` checked (``msa._checks.check_cu_seqlens``) as the ops
    take them, CPU int64 tensors; under ``torch.compile`` by ``ops.check_cu_seqlens`` when the
    graph runs."""
    if torch.compiler.is_compiling():
        return ops.check_cu_seqlens(_offsets_tensor("cu_seqlens_q", cu_seqlens_q),
                                    _offsets_tensor("cu_seqlens_k", cu_seqlens_k), total_q,
                                    total_k)
    cu_q, cu_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    return torch.from_numpy(cu_q), torch.from_numpy(cu_k)


# -- main branch ---------------------------------------------------------------------------------

BACKWARDS = ("auto", "torch", "cuda")  # sparse_attention's ``backward=`` choices
BACKWARD_PARTIALS = ("float32", "bfloat16")  # its ``backward_partials=`` choices


def sparse_attention(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, block_size, *,
                     scale=None, backward="auto", backward_partials="float32", validate=True):
    """Paper eq 8 with autograd: ``(o [Tq, Hq, D], lse [Tq, Hq])``, differentiable in q, k, v.

    Args:
        q: [Tq, Hq, D]; k, v: [Tk, Hkv, D], same float dtype and device. CUDA tensors run
            ``msa.cuda.attention.sparse_attention`` (fp16/bf16 on tensor cores); CPU tensors run
            ``msa.reference.attention.sparse_attention`` (float32/float64).
        block_indices: int [Tq, Hkv, K] (``select_blocks``' output: batch-local block ids,
            ascending, -1 at the tail), same device; checked by the backend (the reference, or
            the CUDA launcher's ``validate=True``).
        cu_seqlens_q, cu_seqlens_k: int [B+1] packed offsets (a tensor on any device, an array
            or a list; read on the host).
        block_size: Bk, an integer >= 1.
        scale: keyword-only softmax scale (finite, > 0), default ``1/sqrt(D)``.
        backward: keyword-only. ``"auto"`` (default): ``msa.cuda.sparse_attention_backward`` on
            CUDA tensors where its tensor-core version applies (fp16/bf16, D and Bk multiples
            of 16 up to 128; 27x the PyTorch backward and 4.4x dense SDPA's at 128K on an
            H200, ``docs/performance.md``), else the PyTorch backward;
            ``"torch"``: ``sparse_attention_backward`` below, PyTorch on any device;
            ``"cuda"``: ``msa.cuda``'s backward on CUDA tensors whatever its version (the
            CUDA-core version 1 is slower than PyTorch), the PyTorch path elsewhere.
        backward_partials: keyword-only. The dtype of the per-slot ``dQ`` shares that
            ``msa.cuda``'s tensor-core backward writes and then sums (its ``partial_dtype``):
            ``"float32"`` (default) or ``"bfloat16"``, which halves their traffic (a 128K
            backward 16-22% faster on an H100) for a ``dq`` within ~0.3% of its largest value
            of the float32 one's (``docs/performance.md``). The PyTorch backward and the
            CUDA-core version 1 have no partials: they sum in float32 whatever this says.
        validate: keyword-only. ``True`` (default): the CUDA launcher checks ``block_indices``
            on a host copy (a device-to-host copy and a wait for the GPU); ``False`` trusts a
            selection msa made itself (``MSAAttention`` passes its own), so that a training step
            never waits for the GPU. On CPU tensors the reference always checks.

    Returns:
        ``o`` in q's dtype (float32 for bf16 on the CPU path is cast back to bf16) and ``lse``
        float32 (float64 for float64 input), natural log, ``-inf`` for an empty support. ``lse``
        has no gradient (it is what ``kl_loss`` reads as the teacher's normaliser). A query's
        output and gradients do not depend on the keys it cannot see, NaN included.
    """
    _check_qkv(q, k, v)
    tq, hkv, d = q.shape[0], k.shape[1], q.shape[2]
    _check_indices(block_indices, tq, hkv)
    _same_device(q=q, block_indices=block_indices)
    block_size = check_block_size(block_size)
    scale = _check_scale("scale", scale, 1.0 / math.sqrt(d))
    check_choice("backward", backward, BACKWARDS)
    check_choice("backward_partials", backward_partials, BACKWARD_PARTIALS)
    cu_q, cu_k = _checked_cu_seqlens(cu_seqlens_q, cu_seqlens_k, tq, k.shape[0])
    return ops.sparse_attention(q, k, v, block_indices, cu_q, cu_k, block_size, scale, backward,
                                backward_partials, check_flag("validate", validate))


def sparse_attention_backward(q, k, v, o, lse, do, block_indices, cu_seqlens_q, cu_seqlens_k,
                              block_size, *, scale=None):
    """``(dq, dk, dv)`` of eq 8 given ``dO``, in PyTorch (any device), FlashAttention's rule.

    With ``P = exp(s Q Kᵀ - LSE)`` on the support (0 elsewhere) and ``D_t = rowsum(dO * O)``:
    ``dS = P * (dO Vᵀ - D)``, ``dQ = s dS K``, ``dK = s dSᵀ Q``, ``dV = Pᵀ dO``, summed over the
    G heads of each group. Computed per chunk of queries in float32 (float64 for float64
    input); returned in the inputs' dtypes. ``dk, dv`` are accumulated with ``index_add_``.
    Each query reads only the keys of its support (the gathered keys and values are masked by
    selection), so its ``dq`` does not depend on a key it cannot see, NaN included.

    Checks what the forward checks, on a host copy (the autograd backward of
    :func:`sparse_attention` skips them: it gets the forward's own selection and LSE):
    shapes, float ``o``/``do``/``lse``, ``block_indices`` (``check_block_indices``: ids of the
    query's own sequence, no duplicate, ``-1`` only at the tail), and ``lse`` finite wherever
    the support is non-empty (``-inf`` only where it is empty, never NaN or ``+inf``;
    ``msa._checks.check_lse``). ``scale`` is keyword-only.
    """
    _check_qkv(q, k, v)
    tq, hq, d = (int(s) for s in q.shape)
    tk, hkv = int(k.shape[0]), int(k.shape[1])
    for name, x, shape in (("o", o, (tq, hq, d)), ("do", do, (tq, hq, d)), ("lse", lse, (tq, hq))):
        _check_tensor(name, x, len(shape), kind="float")
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    _check_indices(block_indices, tq, hkv)
    _same_device(q=q, o=o, lse=lse, do=do, block_indices=block_indices)
    block_size = check_block_size(block_size)
    scale = _check_scale("scale", scale, 1.0 / math.sqrt(d))
    cu_q, cu_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, tq, tk)
    I = check_block_indices(np.asarray(cu_to_host(block_indices)), cu_q, cu_k, block_size)
    check_lse(ops._to_numpy(lse), nonempty_supports(I, cu_q, cu_k, block_size))
    return ops.sparse_attention_backward(q, k, v, o, lse, do, block_indices,
                                         torch.from_numpy(cu_q), torch.from_numpy(cu_k),
                                         block_size, scale, "torch", "float32")


def dense_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale=None):
    """Paper eq 1 with autograd: causal GQA attention over every visible key.

    The indexer warmup's main branch (Algorithm 1 line 5 without a selection): ``q [Tq, Hq,
    D]``, ``k, v [Tk, Hkv, D]`` packed by ``cu_seqlens_q, cu_seqlens_k [B+1]`` (float dtypes
    only; ``scale`` keyword-only, finite and > 0); bottom-right causal alignment. Returns ``(o
    [Tq, Hq, D], lse [Tq, Hq])``, ``lse`` without gradient (float32, float64 for float64
    input).

    On CUDA fp16/bf16 self-attention (``Lq == Lk`` per sequence, ``D % 8 == 0``, ``D <= 256``)
    PyTorch's fused flash attention and its backward, one sequence at a time (memory ``O(T)``);
    keys with a non-finite entry go in as 0 and the queries that see them get ``o = lse = NaN``.
    Elsewhere queries go in chunks of ``C``: the keys every query of a chunk sees go through one
    matmul, and each query gets its own copy of the chunk's ``C - 1`` trailing keys and values
    with the ones after it set to 0 (selection, so that a NaN or inf in a later key cannot reach
    an earlier query's output or gradient); memory ``O(Hq C Lk + Hkv C^2 D)`` per chunk. Its
    backward is :func:`sparse_attention_backward`'s on the support of every visible key.
    """
    _check_qkv(q, k, v)
    scale = _check_scale("scale", scale, 1.0 / math.sqrt(q.shape[2]))
    cu_q, cu_k = _checked_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    return ops.dense_attention(q, k, v, cu_q, cu_k, scale)


# -- the sparse KL ------------------------------------------------------------------------------

def kl_loss(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k, block_size, *,
            scale=None, index_scale=None, validate=True):
    """Paper eq 9-10 with autograd: ``(kl [Tq, Hkv], loss)``, differentiable in q_idx, k_idx.

    Arguments and results as ``msa.reference.kl.kl_loss`` (same order): ``q`` [Tq, Hq, D],
    ``k`` [Tk, Hkv, D], ``q_idx`` [Tq, Hkv, Didx], ``k_idx`` [Tk, Didx], one float dtype and
    device. ``q``, ``k`` and ``lse`` [Tq, Hq] (the main branch's, e.g. from
    :func:`sparse_attention`; ``None`` computes each head's own) are the teacher: held
    constant, no gradient flows into them whatever their ``requires_grad``.
    ``block_indices=None`` is the warmup (full causal support, ``lse`` from
    :func:`dense_attention`). ``scale``, ``index_scale`` are keyword-only. ``loss`` is a 0-d
    tensor (float32; float64 for float64 input), ``kl`` has no gradient. With ``validate=True``
    (keyword-only) the backend checks the selection and ``lse`` (finite on a non-empty
    support); ``False`` trusts them as msa's own (``MSAAttention`` passes its forward's). When ``q_idx`` or ``k_idx`` requires
    a gradient the gradients are computed in the forward call (the training step needs both;
    on a GPU the teacher is then scored once) and the backward scales them by the upstream
    gradient.
    """
    for name, x, nd in (("q", q, 3), ("k", k, 3), ("q_idx", q_idx, 3), ("k_idx", k_idx, 2)):
        _check_tensor(name, x, nd, kind="float")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    if lse is not None:
        _check_tensor("lse", lse, 2, kind="float")
    tq, tk = q_idx.shape[0], k_idx.shape[0]
    if block_indices is not None:
        _check_indices(block_indices, tq, q_idx.shape[1])
    _same_device(q=q, k=k, q_idx=q_idx, k_idx=k_idx, lse=lse, block_indices=block_indices)
    block_size = check_block_size(block_size)
    if q.shape[2] >= 1:
        scale = _check_scale("scale", scale, 1.0 / math.sqrt(q.shape[2]))
    if q_idx.shape[2] >= 1:
        index_scale = _check_scale("index_scale", index_scale, 1.0 / math.sqrt(q_idx.shape[2]))
    cu_q, cu_k = _checked_cu_seqlens(cu_seqlens_q, cu_seqlens_k, tq, tk)
    want_grads = torch.is_grad_enabled() and (q_idx.requires_grad or k_idx.requires_grad)
    kl, loss, _, _ = ops.kl_loss(q.detach(), k.detach(), q_idx, k_idx, block_indices,
                                 None if lse is None else lse.detach(), cu_q, cu_k, block_size,
                                 scale, index_scale, check_flag("validate", validate),
                                 want_grads)
    return kl, loss
