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
``dense_attention``           plain PyTorch causal GQA attention with its LSE (the indexer
                              warmup's main branch, Algorithm 1 line 5 with no selection);
                              queries in chunks, ``O(C Lk)`` memory per chunk
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
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from .._checks import (check_block_size, check_cu_seqlens, check_gqa, check_lse, check_scale,
                       cu_to_host)
from ..reference.blocks import query_positions
from ..reference.select import check_block_indices, nonempty_supports

__all__ = ["sparse_attention", "sparse_attention_backward", "dense_attention", "kl_loss"]

# Bytes of float temporaries one chunk of the PyTorch backward may hold.
_BACKWARD_CHUNK_BYTES = 256 << 20
# Elements of the per-query copies of the keys and values that ``dense_attention`` masks.
_DENSE_TILE_ELEMENTS = 1 << 22

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


def _kernel_indices(block_indices):
    """``block_indices`` as the int32 the kernels read, refusing values int32 cannot hold."""
    if block_indices.dtype != torch.int32 and block_indices.numel():
        host = np.asarray(cu_to_host(block_indices))
        lo, hi = int(host.min()), int(host.max())
        if lo < -1 or hi > np.iinfo(np.int32).max:
            raise ValueError(f"block_indices must hold block ids >= -1 that fit int32, got values "
                             f"in [{lo}, {hi}]")
    return block_indices.to(torch.int32).contiguous()


def _on_device(t):
    """The tensor's CUDA device as the current one (Numba launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _to_numpy(x):
    """A CPU tensor as a NumPy array the reference accepts (bf16 becomes float32)."""
    if x is None:
        return None
    x = x.detach()
    if x.dtype == torch.bfloat16:
        x = x.float()
    return x.cpu().numpy()


def _float_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# -- main branch ---------------------------------------------------------------------------------

BACKWARDS = ("auto", "torch", "cuda")  # sparse_attention's ``backward=`` choices


def _kernel_backward(kernel, q, k, v, o, lse, do, block_indices, cu_q, cu_k, block_size, scale):
    """``(dq, dk, dv)`` in q's, k's, v's dtypes from ``msa.cuda``'s backward (``kernel``):
    contiguous inputs, ``dO`` in q's dtype, float32 gradients cast back. The forward's own
    selection and LSE: nothing is validated again."""
    grads = kernel(q.contiguous(), k.contiguous(), v.contiguous(), o.contiguous(),
                   lse.contiguous(), do.to(q.dtype).contiguous(), _kernel_indices(block_indices),
                   cu_q, cu_k, block_size, scale=scale, validate=False)
    return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_indices, cu_q, cu_k, block_size, scale, backward="auto",
                validate=True):
        if q.is_cuda:
            from ..cuda.attention import sparse_attention as gpu_sparse_attention

            with _on_device(q):
                o, lse = gpu_sparse_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                              _kernel_indices(block_indices), cu_q, cu_k,
                                              block_size, scale=scale, validate=validate)
        else:
            from ..reference.attention import sparse_attention as ref_sparse_attention

            o_np, lse_np = ref_sparse_attention(_to_numpy(q), _to_numpy(k), _to_numpy(v),
                                                _to_numpy(block_indices), cu_q, cu_k, block_size,
                                                scale=scale)
            o = torch.from_numpy(o_np).to(q.dtype)
            lse = torch.from_numpy(lse_np).to(_float_dtype(q))
        ctx.save_for_backward(q, k, v, block_indices, o, lse)
        ctx.meta = (cu_q, cu_k, block_size, scale, backward)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, block_indices, o, lse = ctx.saved_tensors
        cu_q, cu_k, block_size, scale, how = ctx.meta
        if how == "auto" and q.is_cuda:
            from ..cuda.attention import default_backward_version

            how = "cuda" if default_backward_version(q, k, v, block_size) == 2 else "torch"
        if how == "cuda" and q.is_cuda:
            from ..cuda.attention import sparse_attention_backward as gpu_backward

            with _on_device(q):
                dq, dk, dv = _kernel_backward(gpu_backward, q, k, v, o, lse, do, block_indices,
                                              cu_q, cu_k, block_size, scale)
        else:
            dq, dk, dv = _backward(q, k, v, o, lse, do, block_indices, cu_q, cu_k, block_size,
                                   scale)
        return dq, dk, dv, None, None, None, None, None, None, None


def sparse_attention(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, block_size, *,
                     scale=None, backward="auto", validate=True):
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
    tq, hkv, d = int(q.shape[0]), int(k.shape[1]), int(q.shape[2])
    _check_indices(block_indices, tq, hkv)
    _same_device(q=q, block_indices=block_indices)
    block_size = check_block_size(block_size)
    scale = check_scale("scale", scale, 1.0 / math.sqrt(d))
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    cu_q, cu_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, tq, int(k.shape[0]))
    return _SparseAttention.apply(q, k, v, block_indices, cu_q, cu_k, block_size, scale,
                                  backward, bool(validate))


def _support(block_indices, batch, pos, cu_k, lk, block_size, width, t0, t1):
    """Packed key ids (clamped into the sequence) and the support mask of queries [t0, t1):
    ``(keys [C, Hkv, K*W] long, visible [C, Hkv, K*W] bool)``, ``W = min(Bk, max Lk)`` keys a
    block can hold."""
    dev = block_indices.device
    c = t1 - t0
    blocks = block_indices[t0:t1].long()  # [C, Hkv, K]
    key_pos = blocks[..., None] * block_size + torch.arange(width, device=dev)  # [C,Hkv,K,W]
    b = batch[t0:t1]  # [C]
    p = pos[t0:t1].view(c, 1, 1, 1)
    seq_len = lk[b].view(c, 1, 1, 1)
    visible = (blocks[..., None] >= 0) & (key_pos <= p) & (key_pos < seq_len)
    last = torch.clamp(seq_len - 1, min=0)
    keys = cu_k[b].view(c, 1, 1, 1) + torch.minimum(torch.clamp(key_pos, min=0), last)
    return keys.reshape(c, blocks.shape[1], -1), visible.reshape(c, blocks.shape[1], -1)


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
    scale = check_scale("scale", scale, 1.0 / math.sqrt(d))
    cu_q, cu_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, tq, tk)
    I = check_block_indices(np.asarray(cu_to_host(block_indices)), cu_q, cu_k, block_size)
    check_lse(_to_numpy(lse), nonempty_supports(I, cu_q, cu_k, block_size))
    return _backward(q, k, v, o, lse, do, block_indices, cu_q, cu_k, block_size, scale)


def _backward(q, k, v, o, lse, do, block_indices, cu_q, cu_k, block_size, scale):
    """:func:`sparse_attention_backward` on checked inputs (checks nothing)."""
    tq, hq, d = (int(s) for s in q.shape)
    tk, hkv = int(k.shape[0]), int(k.shape[1])
    g = hq // hkv
    topk = int(block_indices.shape[2])
    dev, ft = q.device, _float_dtype(q)
    dq = torch.zeros((tq, hq, d), dtype=ft, device=dev)
    dk = torch.zeros((tk * hkv, d), dtype=ft, device=dev)  # row key * Hkv + r
    dv = torch.zeros((tk * hkv, d), dtype=ft, device=dev)
    if tq and tk and topk:
        batch_np, pos_np = query_positions(cu_q, cu_k, tq, tk)
        batch = torch.as_tensor(batch_np, device=dev)
        pos = torch.as_tensor(pos_np, device=dev)
        cu_k_t = torch.as_tensor(cu_k, device=dev)
        lk = cu_k_t[1:] - cu_k_t[:-1]
        width = min(block_size, max(int(np.diff(cu_k).max()), 1))  # keys a block can hold
        per_query = 4 * hkv * topk * width * (4 * d + 4 * g) * (2 if ft == torch.float64 else 1)
        chunk = max(1, _BACKWARD_CHUNK_BYTES // per_query)
        heads = torch.arange(hkv, device=dev).view(1, hkv, 1)
        k_f, v_f = k.to(ft), v.to(ft)
        for t0 in range(0, tq, chunk):
            t1 = min(tq, t0 + chunk)
            c = t1 - t0
            keys, visible = _support(block_indices, batch, pos, cu_k_t, lk, block_size, width,
                                     t0, t1)
            # Each query's own copy of its keys and values, 0 off its support (selection):
            # 0 * NaN would be NaN, a 0 itself is not.
            seen = visible[..., None]  # [C, Hkv, L, 1]
            kg = torch.where(seen, k_f[keys, heads], 0.0)  # [C, Hkv, L, D]
            vg = torch.where(seen, v_f[keys, heads], 0.0)
            qc = q[t0:t1].to(ft).view(c, hkv, g, d)
            doc = do[t0:t1].to(ft).view(c, hkv, g, d)
            oc = o[t0:t1].to(ft).view(c, hkv, g, d)
            lse_c = lse[t0:t1].to(ft).view(c, hkv, g, 1)
            mask = visible[:, :, None, :]  # [C, Hkv, 1, L]
            s = torch.matmul(qc, kg.transpose(-1, -2)) * scale  # [C, Hkv, G, L]
            # only an empty support's -inf is replaced: a NaN LSE (the forward saw a NaN) stays
            lse_safe = torch.where(lse_c == -math.inf, torch.zeros_like(lse_c), lse_c)
            p = torch.where(mask, torch.exp(s - lse_safe), torch.zeros_like(s))
            dp = torch.matmul(doc, vg.transpose(-1, -2))  # [C, Hkv, G, L]
            delta = (doc * oc).sum(-1, keepdim=True)  # [C, Hkv, G, 1]
            ds = torch.where(mask, p * (dp - delta), torch.zeros_like(s))
            dq[t0:t1] = (torch.matmul(ds, kg) * scale).reshape(c, hq, d)
            rows = (keys * hkv + heads).reshape(-1)  # [C*Hkv*L]
            dk.index_add_(0, rows, (torch.matmul(ds.transpose(-1, -2), qc) * scale).reshape(-1, d))
            dv.index_add_(0, rows, torch.matmul(p.transpose(-1, -2), doc).reshape(-1, d))
    return (dq.to(q.dtype), dk.view(tk, hkv, d).to(k.dtype), dv.view(tk, hkv, d).to(v.dtype))


def dense_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale=None):
    """Paper eq 1 in plain PyTorch (autograd): causal GQA attention over every visible key.

    The indexer warmup's main branch (Algorithm 1 line 5 without a selection). Shapes as
    :func:`sparse_attention` (float dtypes only; ``scale`` keyword-only, finite and > 0);
    bottom-right causal alignment. Returns ``(o, lse)``, ``lse`` detached (float32, float64
    for float64 input).

    Queries go in chunks of ``C``: the keys every query of a chunk sees go through one matmul,
    and each query gets its own copy of the chunk's ``C - 1`` trailing keys and values with
    the ones after it set to 0 (selection, so that a NaN or inf in a later key cannot reach an
    earlier query's output or gradient). Memory ``O(Hq C Lk + Hkv C^2 D)`` per chunk.
    """
    g = _check_qkv(q, k, v)
    tq, hq, d = (int(s) for s in q.shape)
    tk, hkv = int(k.shape[0]), int(k.shape[1])
    scale = check_scale("scale", scale, 1.0 / math.sqrt(d))
    cu_q, cu_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, tq, tk)
    if _fused_dense_applies(q, cu_q, cu_k):
        return _dense_fused(q, k, v, cu_q, cu_k, scale)
    ft = _float_dtype(q)
    dev = q.device
    step = max(1, math.isqrt(_DENSE_TILE_ELEMENTS // (hkv * d)))
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]))
        lq, lk = q1 - q0, k1 - k0
        kb = k[k0:k1].to(ft)  # [Lk, Hkv, D]
        vb = v[k0:k1].to(ft)
        for i0 in range(0, lq, step):
            i1 = min(i0 + step, lq)
            c = i1 - i0
            n0 = lk - lq + i0 + 1  # keys 0..n0-1: seen by every query of the chunk
            n1 = lk - lq + i1  # keys n0..n1-1 (c - 1 of them): seen by the later queries only
            qc = q[q0 + i0:q0 + i1].to(ft).view(c, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv,G,c,D]
            kp = kb[:n0].permute(1, 0, 2)[:, None]  # [Hkv, 1, n0, D]
            vp = vb[:n0].permute(1, 0, 2)[:, None]
            s_p = torch.matmul(qc, kp.transpose(-1, -2)) * scale  # [Hkv, G, c, n0]
            i = torch.arange(c, device=dev)
            seen = i[None, :] < i[:, None]  # [c, c-1 + 1]: tail key jj is seen by query ii > jj
            seen = seen[:, :c - 1]  # [c, n1 - n0]
            sel = seen[None, :, :, None]  # [1, c, n1-n0, 1]
            kt = torch.where(sel, kb[n0:n1].permute(1, 0, 2)[:, None], 0.0)  # [Hkv, c, n_t, D]
            vt = torch.where(sel, vb[n0:n1].permute(1, 0, 2)[:, None], 0.0)
            s_t = torch.einsum("hgcd,hcnd->hgcn", qc, kt) * scale  # [Hkv, G, c, n_t]
            s_t = s_t.masked_fill(~seen, -math.inf)
            s = torch.cat([s_p, s_t], dim=-1)  # [Hkv, G, c, n1]
            lse = torch.logsumexp(s, dim=-1, keepdim=True)  # every query sees itself: finite
            p = torch.exp(s - lse)  # [Hkv, G, c, n1], 0 on the keys a query cannot see
            o = (torch.matmul(p[..., :n0], vp)
                 + torch.einsum("hgcn,hcnd->hgcd", p[..., n0:], vt))  # [Hkv, G, c, D]
            outs.append(o.permute(2, 0, 1, 3).reshape(c, hq, d))
            lses.append(lse[..., 0].permute(2, 0, 1).reshape(c, hq))
    o = torch.cat(outs) if outs else q.new_zeros((0, hq, d), dtype=ft)
    lse = torch.cat(lses) if lses else q.new_zeros((0, hq), dtype=ft)
    return o.to(q.dtype), lse.detach()


def _fused_dense_applies(q, cu_q, cu_k) -> bool:
    """Whether ``dense_attention`` runs PyTorch's fused flash kernel: CUDA fp16/bf16 tensors,
    ``D % 8 == 0`` and ``D <= 256``, and self-attention (``Lq == Lk`` for every sequence: the
    fused kernel's causal mask is the top-left one, which equals msa's bottom-right one there)."""
    d = int(q.shape[2])
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256
            and np.array_equal(cu_q, cu_k))


def _dense_fused(q, k, v, cu_q, cu_k, scale, *, op=None):
    """``dense_attention`` on PyTorch's fused flash attention, which returns the LSE: memory
    ``O(T)``, not ``O(T^2)`` (the indexer warmup at 128K tokens). One sequence at a time; K and
    V repeated over the G heads of each group (the fused kernel has no GQA).

    Non-finite keys: the fused kernel masks by multiplying (``0 * NaN``), so the keys and values
    go in with their non-finite entries set to 0, and every query that sees such a key (its
    position or a later one) gets ``o = NaN, lse = NaN`` (the reference's own rows are NaN or
    +inf there), so that no query depends on a key it cannot see. ``op`` is the fused
    operator, ``aten._scaled_dot_product_flash_attention`` by default (the tests pass the CPU
    one, ``_scaled_dot_product_flash_attention_for_cpu``, which returns ``(o, lse)``)."""
    op = op or torch.ops.aten._scaled_dot_product_flash_attention
    hq, hkv = int(q.shape[1]), int(k.shape[1])
    g = hq // hkv
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        t0, t1 = int(cu_q[b]), int(cu_q[b + 1])
        if t1 == t0:
            continue
        kb, vb = k[t0:t1], v[t0:t1]  # [L, Hkv, D]
        ok_k, ok_v = torch.isfinite(kb), torch.isfinite(vb)
        bad = ~(ok_k.all(-1) & ok_v.all(-1))  # [L, Hkv] keys with a non-finite entry
        kb = torch.where(ok_k, kb, torch.zeros((), dtype=kb.dtype, device=kb.device))
        vb = torch.where(ok_v, vb, torch.zeros((), dtype=vb.dtype, device=vb.device))
        qh = q[t0:t1].transpose(0, 1)[None]  # [1, Hq, L, D]
        kh = kb.repeat_interleave(g, dim=1).transpose(0, 1)[None]
        vh = vb.repeat_interleave(g, dim=1).transpose(0, 1)[None]
        res = op(qh, kh, vh, 0.0, True, scale=scale)
        o, lse = res[0][0].transpose(0, 1), res[1][0].transpose(0, 1)  # [L, Hq, D], [L, Hq]
        seen_bad = torch.cummax(bad.to(torch.int8), dim=0).values.bool()  # [L, Hkv]
        poison = seen_bad.repeat_interleave(g, dim=1)  # [L, Hq]
        nan = torch.full((), math.nan, dtype=o.dtype, device=o.device)
        outs.append(torch.where(poison[..., None], nan, o))
        lses.append(torch.where(poison, nan.float(), lse.float()))
    if not outs:
        return q.new_zeros(q.shape), q.new_zeros(q.shape[:2], dtype=torch.float32)
    return torch.cat(outs), torch.cat(lses).detach()


# -- the sparse KL ------------------------------------------------------------------------------

class _KLLoss(torch.autograd.Function):
    """``(kl, loss)``, and (when a gradient will be needed) ``d loss / d (q_idx, k_idx)`` for an
    upstream gradient of 1, computed in the same call: they are linear in the upstream gradient,
    so the backward only scales them (no second pass, no host read of ``grad_loss``)."""

    @staticmethod
    def forward(ctx, q_idx, k_idx, q, k, block_indices, lse, cu_q, cu_k, block_size, scale,
                index_scale, validate, want_grads):
        dq = dk = None
        knobs = dict(scale=scale, index_scale=index_scale, validate=validate)
        if q_idx.is_cuda:
            from ..cuda import kl as gpu

            dev = q_idx.device
            args = (q.contiguous(), k.contiguous(), q_idx.contiguous(), k_idx.contiguous(),
                    None if block_indices is None else _kernel_indices(block_indices),
                    None if lse is None else lse.float().contiguous(), cu_q, cu_k, block_size)
            with _on_device(q_idx):
                if want_grads:
                    kl, loss, dq, dk = gpu.kl_loss_and_backward(*args, **knobs)
                else:
                    kl, loss = gpu.kl_loss(*args, **knobs)
            loss = torch.as_tensor(loss, device=dev).reshape(())
        else:
            from ..reference import kl as ref

            args = (_to_numpy(q), _to_numpy(k), _to_numpy(q_idx), _to_numpy(k_idx),
                    _to_numpy(block_indices), _to_numpy(lse), cu_q, cu_k, block_size)
            kl_np, loss_np = ref.kl_loss(*args, **knobs)
            kl = torch.from_numpy(np.asarray(kl_np))
            loss = torch.as_tensor(np.asarray(loss_np)).reshape(())
            if want_grads:
                dq_np, dk_np = ref.kl_backward(*args, **knobs)
                dq, dk = torch.from_numpy(dq_np), torch.from_numpy(dk_np)
        loss = loss.to(_float_dtype(q_idx))
        if want_grads:
            ctx.save_for_backward(dq.to(q_idx.dtype), dk.to(k_idx.dtype))
        ctx.mark_non_differentiable(kl)
        return kl, loss

    @staticmethod
    def backward(ctx, _grad_kl, grad_loss):
        dq, dk = ctx.saved_tensors
        g = grad_loss.to(dq.dtype)
        return (g * dq, g * dk) + (None,) * 11


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
    tq, tk = int(q_idx.shape[0]), int(k_idx.shape[0])
    if block_indices is not None:
        _check_indices(block_indices, tq, int(q_idx.shape[1]))
    _same_device(q=q, k=k, q_idx=q_idx, k_idx=k_idx, lse=lse, block_indices=block_indices)
    block_size = check_block_size(block_size)
    if int(q.shape[2]) >= 1:
        scale = check_scale("scale", scale, 1.0 / math.sqrt(int(q.shape[2])))
    if int(q_idx.shape[2]) >= 1:
        index_scale = check_scale("index_scale", index_scale, 1.0 / math.sqrt(int(q_idx.shape[2])))
    cu_q, cu_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, tq, tk)
    want_grads = torch.is_grad_enabled() and (q_idx.requires_grad or k_idx.requires_grad)
    return _KLLoss.apply(q_idx, k_idx, q.detach(), k.detach(), block_indices,
                         None if lse is None else lse.detach(), cu_q, cu_k, block_size, scale,
                         index_scale, bool(validate), want_grads)
