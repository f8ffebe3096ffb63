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
                              ``O(Lq Lk)`` memory per sequence
``kl_loss``                   ``dq_idx, dk_idx`` of ``L_KL`` (eq 10-11), computed with the loss
                              (``kl_loss_and_backward`` on a GPU) and scaled by the upstream
                              gradient; none into ``q``, ``k`` or ``lse``: the teacher is held
                              constant (stop-gradient)
============================  ================================================================

The selection ``block_indices`` is an integer input everywhere (top-k has no gradient; the
index branch learns from ``kl_loss`` alone, paper §3.2).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .._checks import check_cu_seqlens, check_gqa, check_positive_int, cu_to_host
from ..reference.blocks import query_positions

__all__ = ["sparse_attention", "sparse_attention_backward", "dense_attention", "kl_loss"]

# Bytes of float temporaries one chunk of the PyTorch backward may hold.
_BACKWARD_CHUNK_BYTES = 256 << 20


def _check_tensor(name, x, ndim):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")


def _same_device(**tensors):
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device, got {devices}")


def _check_qkv(q, k, v):
    """Shapes, dtypes and devices of ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]``; returns G."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, 3)
    _same_device(q=q, k=k, v=v)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if int(q.shape[2]) != int(k.shape[2]):
        raise ValueError(f"k must have q's head dim D={int(q.shape[2])}, got shape {tuple(k.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    return check_gqa(int(q.shape[1]), int(k.shape[1]))


def _kernel_indices(block_indices):
    """``block_indices`` as the int32 the kernels read, refusing values int32 cannot hold."""
    if block_indices.dtype != torch.int32 and block_indices.numel():
        lo, hi = int(block_indices.min()), int(block_indices.max())
        if lo < -1 or hi > np.iinfo(np.int32).max:
            raise ValueError(f"block_indices must hold block ids >= -1 that fit int32, got values "
                             f"in [{lo}, {hi}]")
    return block_indices.to(torch.int32).contiguous()


def _on_device(t):
    """The tensor's CUDA device as the current one (Numba launches on the current device)."""
    import contextlib

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
    contiguous inputs, ``dO`` in q's dtype, float32 gradients cast back."""
    grads = kernel(q.contiguous(), k.contiguous(), v.contiguous(), o.contiguous(),
                   lse.contiguous(), do.to(q.dtype).contiguous(), _kernel_indices(block_indices),
                   cu_q, cu_k, block_size, scale, validate=False)
    return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_indices, cu_q, cu_k, block_size, scale, backward="auto"):
        if q.is_cuda:
            from ..cuda.attention import sparse_attention as gpu_sparse_attention

            with _on_device(q):
                o, lse = gpu_sparse_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                              _kernel_indices(block_indices), cu_q, cu_k,
                                              block_size, scale)
        else:
            from ..reference.attention import sparse_attention as ref_sparse_attention

            o_np, lse_np = ref_sparse_attention(_to_numpy(q), _to_numpy(k), _to_numpy(v),
                                                _to_numpy(block_indices), cu_q, cu_k, block_size,
                                                scale)
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
            dq, dk, dv = sparse_attention_backward(q, k, v, o, lse, do, block_indices, cu_q,
                                                   cu_k, block_size, scale)
        return dq, dk, dv, None, None, None, None, None, None


def sparse_attention(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, block_size, scale=None,
                     *, backward="auto"):
    """Paper eq 8 with autograd: ``(o [Tq, Hq, D], lse [Tq, Hq])``, differentiable in q, k, v.

    Args:
        q: [Tq, Hq, D]; k, v: [Tk, Hkv, D], same dtype and device. CUDA tensors run
            ``msa.cuda.attention.sparse_attention`` (fp16/bf16 on tensor cores); CPU tensors run
            ``msa.reference.attention.sparse_attention`` (float32/float64).
        block_indices: int [Tq, Hkv, K] (``select_blocks``' output: batch-local block ids,
            ascending, -1 at the tail), same device.
        cu_seqlens_q, cu_seqlens_k: int [B+1] packed offsets (any device; read on the host).
        block_size: Bk. scale: softmax scale, default ``1/sqrt(D)``.
        backward: ``"auto"`` (default): ``msa.cuda.sparse_attention_backward`` on CUDA
            tensors where its tensor-core version applies (fp16/bf16, D and Bk multiples of
            16 up to 128; 27x the PyTorch backward and 4.4x dense SDPA's at 128K on an
            H200, ``docs/performance.md``), else the PyTorch backward;
            ``"torch"``: ``sparse_attention_backward`` below, PyTorch on any device;
            ``"cuda"``: ``msa.cuda``'s backward on CUDA tensors whatever its version (the
            CUDA-core version 1 is slower than PyTorch), the PyTorch path elsewhere.

    Returns:
        ``o`` in q's dtype (float32 for bf16 on the CPU path is cast back to bf16) and ``lse``
        float32 (float64 for float64 input), natural log, ``-inf`` for an empty support. ``lse``
        has no gradient (it is what ``kl_loss`` reads as the teacher's normaliser).
    """
    _check_qkv(q, k, v)
    _check_tensor("block_indices", block_indices, 3)
    _same_device(q=q, block_indices=block_indices)
    if block_indices.is_floating_point():
        raise TypeError(f"block_indices must be an integer tensor, got {block_indices.dtype}")
    cu_q, cu_k = check_cu_seqlens(cu_to_host(cu_seqlens_q),
                                  cu_to_host(cu_seqlens_k),
                                  int(q.shape[0]), int(k.shape[0]))
    scale = 1.0 / math.sqrt(int(q.shape[2])) if scale is None else float(scale)
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    return _SparseAttention.apply(q, k, v, block_indices, cu_q, cu_k, int(block_size), scale,
                                  backward)


def _support(block_indices, batch, pos, cu_k, lk, block_size, t0, t1):
    """Packed key ids (clamped into the sequence) and the support mask of queries [t0, t1):
    ``(keys [C, Hkv, K*Bk] long, visible [C, Hkv, K*Bk] bool)``."""
    dev = block_indices.device
    c = t1 - t0
    blocks = block_indices[t0:t1].long()  # [C, Hkv, K]
    key_pos = blocks[..., None] * block_size + torch.arange(block_size, device=dev)  # [C,Hkv,K,Bk]
    b = batch[t0:t1]  # [C]
    p = pos[t0:t1].view(c, 1, 1, 1)
    seq_len = lk[b].view(c, 1, 1, 1)
    visible = (blocks[..., None] >= 0) & (key_pos <= p) & (key_pos < seq_len)
    last = torch.clamp(seq_len - 1, min=0)
    keys = cu_k[b].view(c, 1, 1, 1) + torch.minimum(torch.clamp(key_pos, min=0), last)
    return keys.reshape(c, blocks.shape[1], -1), visible.reshape(c, blocks.shape[1], -1)


def sparse_attention_backward(q, k, v, o, lse, do, block_indices, cu_seqlens_q, cu_seqlens_k,
                              block_size, scale=None):
    """``(dq, dk, dv)`` of eq 8 given ``dO``, in PyTorch (any device), FlashAttention's rule.

    With ``P = exp(s Q Kᵀ - LSE)`` on the support (0 elsewhere) and ``D_t = rowsum(dO * O)``:
    ``dS = P * (dO Vᵀ - D)``, ``dQ = s dS K``, ``dK = s dSᵀ Q``, ``dV = Pᵀ dO``, summed over the
    G heads of each group. Computed per chunk of queries in float32 (float64 for float64
    input); returned in the inputs' dtypes. ``dk, dv`` are accumulated with ``index_add_``.
    """
    g = _check_qkv(q, k, v)
    tq, hq, d = (int(s) for s in q.shape)
    tk, hkv = int(k.shape[0]), int(k.shape[1])
    for name, x, shape in (("o", o, (tq, hq, d)), ("do", do, (tq, hq, d)), ("lse", lse, (tq, hq))):
        _check_tensor(name, x, len(shape))
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    _check_tensor("block_indices", block_indices, 3)
    if tuple(block_indices.shape[:2]) != (tq, hkv) or block_indices.is_floating_point():
        raise ValueError(f"block_indices must be an integer tensor [Tq={tq}, Hkv={hkv}, K], got "
                         f"{block_indices.dtype} {tuple(block_indices.shape)}")
    _same_device(q=q, o=o, lse=lse, do=do, block_indices=block_indices)
    block_size = check_positive_int("block_size", block_size)
    topk = int(block_indices.shape[2])
    cu_q, cu_k = check_cu_seqlens(cu_to_host(cu_seqlens_q),
                                  cu_to_host(cu_seqlens_k), tq, tk)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
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
        width = topk * block_size
        per_query = 4 * hkv * width * (4 * d + 4 * g) * (2 if ft == torch.float64 else 1)
        chunk = max(1, _BACKWARD_CHUNK_BYTES // per_query)
        heads = torch.arange(hkv, device=dev).view(1, hkv, 1)
        k_f, v_f = k.to(ft), v.to(ft)
        for t0 in range(0, tq, chunk):
            t1 = min(tq, t0 + chunk)
            c = t1 - t0
            keys, visible = _support(block_indices, batch, pos, cu_k_t, lk, block_size, t0, t1)
            kg = k_f[keys, heads]  # [C, Hkv, L, D]
            vg = v_f[keys, heads]
            qc = q[t0:t1].to(ft).view(c, hkv, g, d)
            doc = do[t0:t1].to(ft).view(c, hkv, g, d)
            oc = o[t0:t1].to(ft).view(c, hkv, g, d)
            lse_c = lse[t0:t1].to(ft).view(c, hkv, g, 1)
            mask = visible[:, :, None, :]  # [C, Hkv, 1, L]
            s = torch.matmul(qc, kg.transpose(-1, -2)) * scale  # [C, Hkv, G, L]
            lse_safe = torch.where(torch.isfinite(lse_c), lse_c, torch.zeros_like(lse_c))
            p = torch.where(mask, torch.exp(s - lse_safe), torch.zeros_like(s))
            dp = torch.matmul(doc, vg.transpose(-1, -2))  # [C, Hkv, G, L]
            delta = (doc * oc).sum(-1, keepdim=True)  # [C, Hkv, G, 1]
            ds = p * (dp - delta)
            dq[t0:t1] = (torch.matmul(ds, kg) * scale).reshape(c, hq, d)
            rows = (keys * hkv + heads).reshape(-1)  # [C*Hkv*L]
            dk.index_add_(0, rows, (torch.matmul(ds.transpose(-1, -2), qc) * scale).reshape(-1, d))
            dv.index_add_(0, rows, torch.matmul(p.transpose(-1, -2), doc).reshape(-1, d))
    return (dq.to(q.dtype), dk.view(tk, hkv, d).to(k.dtype), dv.view(tk, hkv, d).to(v.dtype))


def dense_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=None):
    """Paper eq 1 in plain PyTorch (autograd): causal GQA attention over every visible key.

    The indexer warmup's main branch (Algorithm 1 line 5 without a selection). Shapes as
    :func:`sparse_attention`; bottom-right causal alignment. Returns ``(o, lse)``, ``lse``
    detached (float32, float64 for float64 input). Memory ``O(Hq Lq Lk)`` per sequence.
    """
    g = _check_qkv(q, k, v)
    tq, hq, d = (int(s) for s in q.shape)
    tk, hkv = int(k.shape[0]), int(k.shape[1])
    cu_q, cu_k = check_cu_seqlens(cu_to_host(cu_seqlens_q),
                                  cu_to_host(cu_seqlens_k), tq, tk)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    ft = _float_dtype(q)
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]))
        lq, lk = q1 - q0, k1 - k0
        qb = q[q0:q1].to(ft).view(lq, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, G, Lq, D]
        kb = k[k0:k1].to(ft).permute(1, 0, 2)[:, None]  # [Hkv, 1, Lk, D]
        vb = v[k0:k1].to(ft).permute(1, 0, 2)[:, None]
        s = torch.matmul(qb, kb.transpose(-1, -2)) * scale  # [Hkv, G, Lq, Lk]
        pos = torch.arange(lk - lq, lk, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(lk, device=q.device)[None, :] > pos, -math.inf)
        lse = torch.logsumexp(s, dim=-1, keepdim=True)  # every query sees itself: finite
        o = torch.matmul(torch.exp(s - lse), vb)  # [Hkv, G, Lq, D]
        outs.append(o.permute(2, 0, 1, 3).reshape(lq, hq, d))
        lses.append(lse[..., 0].permute(2, 0, 1).reshape(lq, hq))
    o = torch.cat(outs) if outs else q.new_zeros((0, hq, d), dtype=ft)
    lse = torch.cat(lses) if lses else q.new_zeros((0, hq), dtype=ft)
    return o.to(q.dtype), lse.detach()


# -- the sparse KL ------------------------------------------------------------------------------

class _KLLoss(torch.autograd.Function):
    """The loss, and (when a gradient will be needed) ``d loss / d (q_idx, k_idx)`` for an
    upstream gradient of 1, computed in the same call: they are linear in the upstream gradient,
    so the backward only scales them (no second pass, no host read of ``grad_loss``)."""

    @staticmethod
    def forward(ctx, q_idx, k_idx, q, k, block_indices, lse, cu_q, cu_k, block_size, scale,
                index_scale, want_grads):
        tail = (block_size, scale, index_scale)
        dq = dk = None
        if q_idx.is_cuda:
            from ..cuda import kl as gpu

            dev = q_idx.device
            args = (q.contiguous(), k.contiguous(), q_idx.contiguous(), k_idx.contiguous(),
                    None if block_indices is None else _kernel_indices(block_indices),
                    lse.float().contiguous(), cu_q, cu_k, *tail)
            with _on_device(q_idx):
                if want_grads:
                    kl, loss, dq, dk = gpu.kl_loss_and_backward(*args)
                else:
                    kl, loss = gpu.kl_loss(*args)
            loss = torch.as_tensor(loss, device=dev).reshape(())
        else:
            from ..reference import kl as ref

            args = (_to_numpy(q), _to_numpy(k), _to_numpy(q_idx), _to_numpy(k_idx),
                    _to_numpy(block_indices), _to_numpy(lse), cu_q, cu_k, *tail)
            kl_np, loss_np = ref.kl_loss(*args)
            kl = torch.from_numpy(np.asarray(kl_np))
            loss = torch.as_tensor(np.asarray(loss_np)).reshape(())
            if want_grads:
                dq_np, dk_np = ref.kl_backward(*args)
                dq, dk = torch.from_numpy(dq_np), torch.from_numpy(dk_np)
        loss = loss.to(_float_dtype(q_idx))
        if want_grads:
            ctx.save_for_backward(dq.to(q_idx.dtype), dk.to(k_idx.dtype))
        ctx.mark_non_differentiable(kl)
        return loss, kl

    @staticmethod
    def backward(ctx, grad_loss, _grad_kl):
        dq, dk = ctx.saved_tensors
        g = grad_loss.to(dq.dtype)
        return (g * dq, g * dk, None, None, None, None, None, None, None, None, None, None)


def kl_loss(q_idx, k_idx, q, k, block_indices, lse, cu_seqlens_q, cu_seqlens_k, block_size,
            scale=None, index_scale=None):
    """Paper eq 9-10 with autograd: ``(loss, kl [Tq, Hkv])``, differentiable in q_idx, k_idx.

    Note the argument order: the trained tensors come first (``msa.reference.kl.kl_loss`` takes
    ``q, k, q_idx, k_idx``). ``q`` [Tq, Hq, D], ``k`` [Tk, Hkv, D] and ``lse`` [Tq, Hq] (the main
    branch's, e.g. from :func:`sparse_attention`) are the teacher: held constant, no gradient
    flows into them whatever their ``requires_grad``. ``block_indices=None`` is the warmup
    (full causal support, ``lse`` from :func:`dense_attention`). ``loss`` is a 0-d tensor
    (float32; float64 for float64 input). When ``q_idx`` or ``k_idx`` requires a gradient the
    gradients are computed in the forward call (the training step needs both; on a GPU the
    teacher is then scored once) and the backward scales them by the upstream gradient.
    """
    for name, x, nd in (("q_idx", q_idx, 3), ("k_idx", k_idx, 2), ("q", q, 3), ("k", k, 3),
                        ("lse", lse, 2)):
        _check_tensor(name, x, nd)
    if block_indices is not None:
        _check_tensor("block_indices", block_indices, 3)
    _same_device(q_idx=q_idx, k_idx=k_idx, q=q, k=k, lse=lse, block_indices=block_indices)
    cu_q, cu_k = check_cu_seqlens(cu_to_host(cu_seqlens_q),
                                  cu_to_host(cu_seqlens_k),
                                  int(q_idx.shape[0]), int(k_idx.shape[0]))
    want_grads = torch.is_grad_enabled() and (q_idx.requires_grad or k_idx.requires_grad)
    return _KLLoss.apply(q_idx, k_idx, q.detach(), k.detach(), block_indices, lse.detach(),
                         cu_q, cu_k, int(block_size), scale, index_scale, want_grads)
