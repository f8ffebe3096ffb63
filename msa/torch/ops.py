"""MSA's pieces as PyTorch custom operators (``torch.library``, namespace ``msa``).

What runs under :mod:`msa.torch.functional` and :class:`msa.torch.MSAAttention`: on CUDA
tensors the ``msa.cuda`` kernels, on CPU tensors the NumPy reference, and PyTorch for the main
branch's backward off the tensor-core kernel and for the dense warmup branch. As custom
operators they are opaque to ``torch.compile``: Dynamo puts each call into the graph as one
node (no graph break inside), and a *fake* kernel gives its outputs' shapes, dtypes and devices
without reading a value. The differentiable ops register their backward (``register_autograd``)
as an op of its own, so AOTAutograd traces it into the backward graph the same way.

The ops (``torch.ops.msa.<name>``; ``cu_*`` the offsets, ``I`` the selection):

- ``check_offsets(cu, name, total) -> cu`` and ``check_cu_seqlens(cu_q, cu_k, tq, tk) ->
  (cu_q, cu_k)``: ``msa._checks``' checks of the offsets when the graph runs; new int64 CPU
  tensors. No gradient.
- ``select_blocks(q_idx, k_idx, cu_q, cu_k, block_size, topk, index_scale) -> I``: int32
  ``[Tq, Hkv, K]`` (lines 3-4). No gradient (top-k).
- ``sparse_attention(q, k, v, I, cu_q, cu_k, block_size, scale, backward, backward_partials,
  validate) -> (o, lse)``: eq 8, ``o [Tq, Hq, D]`` in q's dtype, ``lse [Tq, Hq]``. Gradient
  into q, k, v by ``sparse_attention_backward(q, k, v, o, lse, grad_o, I, cu_q, cu_k,
  block_size, scale, backward, partials) -> (dq, dk, dv)``.
- ``dense_attention(q, k, v, cu_q, cu_k, scale) -> (o, lse)``: the warmup's main branch.
  Gradient by ``dense_attention_backward(q, k, v, o, lse, grad_o, cu_q, cu_k, scale) ->
  (dq, dk, dv)``.
- ``kl_loss(q, k, q_idx, k_idx, I, lse, cu_q, cu_k, block_size, scale, index_scale, validate,
  want_grads) -> (kl, loss, dq_idx, dk_idx)``: eq 9-11, ``kl [Tq, Hkv]``, 0-d ``loss``, and
  with ``want_grads`` the gradients of ``loss`` (else empty ``[0]``). Gradient into q_idx,
  k_idx: ``grad_loss`` times ``dq_idx, dk_idx``; none without ``want_grads``.

``lse`` is float32 (float64 for float64 input) and has no gradient, nor have ``kl``,
``dq_idx``, ``dk_idx``. The ops take *checked* inputs (the functional wrappers check them,
before any op runs, with the errors of ``msa._checks``), except ``cu_seqlens``: custom ops take
no NumPy arrays, so the offsets come as CPU int64 tensors, read on the host by the real kernels
(``Tensor.numpy()``: no copy, no device wait) and never by the fake ones. Under
``torch.compile`` their values are unknown while tracing, so the wrappers hand them to
``check_offsets`` / ``check_cu_seqlens``, which check them when the graph runs, with the same
messages as in eager mode.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
from torch import Tensor

from .. import _checks
from ..reference.blocks import query_positions

# Bytes of float temporaries one chunk of the PyTorch backward may hold.
_BACKWARD_CHUNK_BYTES = 256 << 20
# Elements of the per-query copies of the keys and values that the chunked dense path masks.
_DENSE_TILE_ELEMENTS = 1 << 22


def _float_dtype(x):
    """The dtype of the LSE and the loss: float64 for float64 input, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _host(cu):
    """A CPU int64 offsets tensor as the NumPy array the backends read (no copy)."""
    return cu.numpy()


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


def _kernel_indices(block_indices):
    """``block_indices`` as the int32 the kernels read, refusing values int32 cannot hold."""
    if block_indices.dtype != torch.int32 and block_indices.numel():
        host = np.asarray(_checks.cu_to_host(block_indices))
        lo, hi = int(host.min()), int(host.max())
        if lo < -1 or hi > np.iinfo(np.int32).max:
            raise ValueError(f"block_indices must hold block ids >= -1 that fit int32, got values "
                             f"in [{lo}, {hi}]")
    return block_indices.to(torch.int32).contiguous()


# -- offsets -------------------------------------------------------------------------------------

@torch.library.custom_op("msa::check_offsets", mutates_args=())
def check_offsets(cu_seqlens: Tensor, name: str, total: int) -> Tensor:
    """``msa._checks.check_offsets(name, cu_seqlens, total)`` when the graph runs: the offsets
    as a new int64 CPU tensor, or its error. Any device (a CUDA tensor is read back)."""
    return torch.from_numpy(_checks.check_offsets(name, cu_seqlens, total))


@check_offsets.register_fake
def _(cu_seqlens, name, total):
    return torch.empty(cu_seqlens.shape, dtype=torch.int64, device="cpu")


@torch.library.custom_op("msa::check_cu_seqlens", mutates_args=())
def check_cu_seqlens(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, total_q: int,
                     total_k: int) -> tuple[Tensor, Tensor]:
    """``msa._checks.check_cu_seqlens`` when the graph runs: both as new int64 CPU tensors."""
    cu_q, cu_k = _checks.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    return torch.from_numpy(cu_q), torch.from_numpy(cu_k)


@check_cu_seqlens.register_fake
def _(cu_seqlens_q, cu_seqlens_k, total_q, total_k):
    return (torch.empty(cu_seqlens_q.shape, dtype=torch.int64, device="cpu"),
            torch.empty(cu_seqlens_k.shape, dtype=torch.int64, device="cpu"))


# -- index branch: lines 3-4 ---------------------------------------------------------------------

@torch.library.custom_op("msa::select_blocks", mutates_args=())
def select_blocks(q_idx: Tensor, k_idx: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                  block_size: int, topk: int, index_scale: float | None) -> Tensor:
    """Eq 5-7: ``I [Tq, Hkv, K]`` int32, ``msa.cuda.select.select_blocks_fused`` on CUDA
    tensors (host offsets: no device read), ``block_scores`` then ``select_blocks`` of the
    reference on CPU tensors. No gradient (top-k)."""
    cu_q, cu_k = _host(cu_seqlens_q), _host(cu_seqlens_k)
    if q_idx.is_cuda:
        from ..cuda.select import select_blocks_fused

        with _on_device(q_idx):
            idx = select_blocks_fused(q_idx.detach().contiguous(), k_idx.detach().contiguous(),
                                      cu_q, cu_k, block_size=block_size, topk=topk,
                                      scale=index_scale)
        return torch.as_tensor(idx, device=q_idx.device)
    from ..reference.index import block_scores
    from ..reference.select import select_blocks as ref_select_blocks

    m = block_scores(_to_numpy(q_idx), _to_numpy(k_idx), cu_q, cu_k, block_size,
                     scale=index_scale)  # [Hkv, Tq, NB]
    idx = ref_select_blocks(m, cu_q, cu_k, block_size, topk)
    return torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int32))


@select_blocks.register_fake
def _(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size, topk, index_scale):
    return q_idx.new_empty((q_idx.shape[0], q_idx.shape[1], topk), dtype=torch.int32)


# -- main branch: line 5, eq 8 -------------------------------------------------------------------

@torch.library.custom_op("msa::sparse_attention", mutates_args=())
def sparse_attention(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor,
                     cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, block_size: int, scale: float,
                     backward: str, backward_partials: str,
                     validate: bool) -> tuple[Tensor, Tensor]:
    """Eq 8: ``(o, lse)``, ``msa.cuda.attention.sparse_attention`` on CUDA tensors (its
    ``validate``), the reference on CPU tensors (which always checks the selection).
    ``backward`` (``"auto"``, ``"torch"``, ``"cuda"``) and ``backward_partials``
    (``"float32"``, ``"bfloat16"``) are only read by the backward."""
    cu_q, cu_k = _host(cu_seqlens_q), _host(cu_seqlens_k)
    if q.is_cuda:
        from ..cuda.attention import sparse_attention as gpu_sparse_attention

        with _on_device(q):
            o, lse = gpu_sparse_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                          _kernel_indices(block_indices), cu_q, cu_k,
                                          block_size, scale=scale, validate=validate)
        return o, lse
    from ..reference.attention import sparse_attention as ref_sparse_attention

    o, lse = ref_sparse_attention(_to_numpy(q), _to_numpy(k), _to_numpy(v),
                                  _to_numpy(block_indices), cu_q, cu_k, block_size, scale=scale)
    return torch.from_numpy(o).to(q.dtype), torch.from_numpy(lse).to(_float_dtype(q))


@sparse_attention.register_fake
def _(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, block_size, scale, backward,
      backward_partials, validate):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=_float_dtype(q))


def _sparse_attention_setup(ctx, inputs, output):
    q, k, v, block_indices, cu_q, cu_k, block_size, scale, backward, partials, _ = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, block_indices, o, lse, cu_q, cu_k)
    ctx.knobs = (block_size, scale, backward, partials)
    ctx.mark_non_differentiable(lse)


def _sparse_attention_grad(ctx, grad_o, _grad_lse):
    q, k, v, block_indices, o, lse, cu_q, cu_k = ctx.saved_tensors
    grads = (None,) * 3
    if grad_o is not None:
        grads = torch.ops.msa.sparse_attention_backward(q, k, v, o, lse, grad_o, block_indices,
                                                        cu_q, cu_k, *ctx.knobs)
    return tuple(grads) + (None,) * 8


sparse_attention.register_autograd(_sparse_attention_grad, setup_context=_sparse_attention_setup)


@torch.library.custom_op("msa::sparse_attention_backward", mutates_args=())
def sparse_attention_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                              grad_o: Tensor, block_indices: Tensor, cu_seqlens_q: Tensor,
                              cu_seqlens_k: Tensor, block_size: int, scale: float,
                              backward: str, partials: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of eq 8: ``backward="auto"`` runs ``msa.cuda``'s tensor-core backward
    (version 3 on ``wgmma``, or 2) on CUDA tensors where it applies, else the PyTorch backward (``_backward``);
    ``"cuda"`` runs ``msa.cuda``'s backward on CUDA tensors whatever its version; ``"torch"``
    the PyTorch one. ``partials="bfloat16"``: the tensor-core versions' dQ partials in bf16
    (their ``partial_dtype``); version 1 and the PyTorch backward have none and sum in float32.
    The forward's own selection and LSE: nothing is checked again."""
    cu_q, cu_k = _host(cu_seqlens_q), _host(cu_seqlens_k)
    how = backward
    if how in ("auto", "cuda") and q.is_cuda:
        from ..cuda.attention import default_backward_version

        version = default_backward_version(q, k, v, block_size)
        if how == "auto":
            how = "cuda" if version >= 2 else "torch"
    if how == "cuda" and q.is_cuda:
        from ..cuda.attention import sparse_attention_backward as gpu_backward

        with _on_device(q):
            return _kernel_backward(gpu_backward, q, k, v, o, lse, grad_o, block_indices, cu_q,
                                    cu_k, block_size, scale,
                                    partials if version >= 2 else "float32")
    return _backward(q, k, v, o, lse, grad_o, block_indices, cu_q, cu_k, block_size, scale)


@sparse_attention_backward.register_fake
def _(q, k, v, o, lse, grad_o, block_indices, cu_seqlens_q, cu_seqlens_k, block_size, scale,
      backward, partials):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _kernel_backward(kernel, q, k, v, o, lse, do, block_indices, cu_q, cu_k, block_size, scale,
                     partials="float32"):
    """``(dq, dk, dv)`` in q's, k's, v's dtypes from ``msa.cuda``'s backward (``kernel``):
    contiguous inputs, ``dO`` in q's dtype, float32 gradients cast back, ``partials`` its
    ``partial_dtype``. The forward's own selection and LSE: nothing is validated again."""
    grads = kernel(q.contiguous(), k.contiguous(), v.contiguous(), o.contiguous(),
                   lse.contiguous(), do.to(q.dtype).contiguous(), _kernel_indices(block_indices),
                   cu_q, cu_k, block_size, scale=scale, partial_dtype=partials, validate=False)
    return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))


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


def _backward(q, k, v, o, lse, do, block_indices, cu_q, cu_k, block_size, scale):
    """``msa.torch.sparse_attention_backward`` on checked inputs (checks nothing): per chunk of
    queries the selected keys are gathered, ``P`` is rebuilt from the forward's LSE, and
    ``dk, dv`` are scattered with ``index_add_``. Host offsets ``cu_q, cu_k``."""
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
            qc = q[t0:t1].to(ft).reshape(c, hkv, g, d)
            doc = do[t0:t1].to(ft).reshape(c, hkv, g, d)
            oc = o[t0:t1].to(ft).reshape(c, hkv, g, d)
            lse_c = lse[t0:t1].to(ft).reshape(c, hkv, g, 1)
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


# -- the warmup's dense main branch (Algorithm 1 line 5 without a selection) ---------------------

@torch.library.custom_op("msa::dense_attention", mutates_args=())
def dense_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                    cu_seqlens_k: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Eq 1, causal GQA attention over every visible key: ``(o, lse)``. PyTorch's fused flash
    attention on CUDA fp16/bf16 self-attention (``_dense_fused``), else queries in chunks
    (``_dense_chunked``)."""
    cu_q, cu_k = _host(cu_seqlens_q), _host(cu_seqlens_k)
    if _fused_dense_applies(q, cu_q, cu_k):
        return _dense_fused(q, k, v, cu_q, cu_k, scale)
    return _dense_chunked(q, k, v, cu_q, cu_k, scale)


@dense_attention.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=_float_dtype(q))


def _dense_attention_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)


def _dense_attention_grad(ctx, grad_o, _grad_lse):
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    grads = (None,) * 3
    if grad_o is not None:
        grads = torch.ops.msa.dense_attention_backward(q, k, v, o, lse, grad_o, cu_q, cu_k,
                                                       ctx.scale)
    return tuple(grads) + (None,) * 3


dense_attention.register_autograd(_dense_attention_grad, setup_context=_dense_attention_setup)


@torch.library.custom_op("msa::dense_attention_backward", mutates_args=())
def dense_attention_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                             grad_o: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                             scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of ``dense_attention``: the fused flash backward where the forward ran
    the fused kernel; elsewhere the sparse PyTorch backward (``_backward``) with the selection
    that holds every key, one block of ``max Lk`` keys per query: the dense causal support."""
    cu_q, cu_k = _host(cu_seqlens_q), _host(cu_seqlens_k)
    if _fused_dense_applies(q, cu_q, cu_k):
        return _dense_fused_backward(q, k, v, o, lse, grad_o, cu_q, cu_k, scale)
    tq, hkv = int(q.shape[0]), int(k.shape[1])
    everything = torch.zeros((tq, hkv, 1), dtype=torch.int32, device=q.device)  # block 0
    max_lk = max(int(np.diff(cu_k).max()), 1)
    return _backward(q, k, v, o, lse, grad_o, everything, cu_q, cu_k, max_lk, scale)


@dense_attention_backward.register_fake
def _(q, k, v, o, lse, grad_o, cu_seqlens_q, cu_seqlens_k, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _dense_chunked(q, k, v, cu_q, cu_k, scale):
    """``dense_attention`` in plain PyTorch, queries in chunks of ``C``: the keys every query of
    a chunk sees go through one matmul, and each query gets its own copy of the chunk's
    ``C - 1`` trailing keys and values with the ones after it set to 0 (selection, so that a
    NaN or inf in a later key cannot reach an earlier query's output). Memory
    ``O(Hq C Lk + Hkv C^2 D)`` per chunk."""
    hq, d = int(q.shape[1]), int(q.shape[2])
    hkv = int(k.shape[1])
    g = hq // hkv
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
    return o.to(q.dtype), lse


def _fused_dense_applies(q, cu_q, cu_k) -> bool:
    """Whether ``dense_attention`` runs PyTorch's fused flash kernel: CUDA fp16/bf16 tensors,
    ``D % 8 == 0`` and ``D <= 256``, and self-attention (``Lq == Lk`` for every sequence: the
    fused kernel's causal mask is the top-left one, which equals msa's bottom-right one there)."""
    d = int(q.shape[2])
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256
            and np.array_equal(cu_q, cu_k))


def _flash(q, k, v, scale):
    """``aten._scaled_dot_product_flash_attention``, causal, no dropout, on ``[1, H, L, D]``:
    ``(o [1, H, L, D], lse [1, H, L] float32)``."""
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, scale=scale)
    return res[0], res[1]


def _flash_backward(do, q, k, v, o, lse, scale):
    """``aten._scaled_dot_product_flash_attention_backward`` of :func:`_flash`:
    ``(dq, dk, dv)``. No cumulative lengths (``None``: one dense batch, not varlen); the
    philox seed and offset are read only with dropout."""
    n = int(q.shape[2])
    unused = torch.empty((), dtype=torch.int64)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, o, lse, None, None, n, n, 0.0, True, unused, unused, scale=scale)


def _fused_sequence(q, k, v, t0, t1, g):
    """Sequence ``[t0, t1)`` as the fused kernel takes it: ``[1, H, L, D]`` queries, keys and
    values with their non-finite entries set to 0 and repeated over the G heads of each group
    (the kernel has no GQA); ``ok_k, ok_v [L, Hkv, D]`` (the finite entries) and
    ``poison [L, Hq]``: the queries that see a key with a non-finite entry."""
    kb, vb = k[t0:t1], v[t0:t1]  # [L, Hkv, D]
    ok_k, ok_v = torch.isfinite(kb), torch.isfinite(vb)
    bad = ~(ok_k.all(-1) & ok_v.all(-1))  # [L, Hkv] keys with a non-finite entry
    kb = torch.where(ok_k, kb, torch.zeros((), dtype=kb.dtype, device=kb.device))
    vb = torch.where(ok_v, vb, torch.zeros((), dtype=vb.dtype, device=vb.device))
    qh = q[t0:t1].transpose(0, 1)[None]  # [1, Hq, L, D]
    kh = kb.repeat_interleave(g, dim=1).transpose(0, 1)[None]
    vh = vb.repeat_interleave(g, dim=1).transpose(0, 1)[None]
    seen_bad = torch.cummax(bad.to(torch.int8), dim=0).values.bool()  # [L, Hkv]
    return qh, kh, vh, ok_k, ok_v, seen_bad.repeat_interleave(g, dim=1)


def _dense_fused(q, k, v, cu_q, cu_k, scale, *, flash=_flash):
    """``dense_attention`` on PyTorch's fused flash attention, which returns the LSE: memory
    ``O(T)``, not ``O(T^2)`` (the indexer warmup at 128K tokens). One sequence at a time.

    Non-finite keys: the fused kernel masks by multiplying (``0 * NaN``), so the keys and values
    go in with their non-finite entries set to 0, and every query that sees such a key (its
    position or a later one) gets ``o = NaN, lse = NaN`` (the reference's own rows are NaN or
    +inf there), so that no query depends on a key it cannot see. ``flash`` is
    :func:`_flash` (the tests pass PyTorch's CPU flash operator)."""
    g = int(q.shape[1]) // int(k.shape[1])
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        t0, t1 = int(cu_q[b]), int(cu_q[b + 1])
        if t1 == t0:
            continue
        qh, kh, vh, _, _, poison = _fused_sequence(q, k, v, t0, t1, g)
        o, lse = flash(qh, kh, vh, scale)
        o, lse = o[0].transpose(0, 1), lse[0].transpose(0, 1)  # [L, Hq, D], [L, Hq]
        nan = torch.full((), math.nan, dtype=o.dtype, device=o.device)
        outs.append(torch.where(poison[..., None], nan, o))
        lses.append(torch.where(poison, nan.float(), lse.float()))
    if not outs:
        return q.new_zeros(q.shape), q.new_zeros(q.shape[:2], dtype=torch.float32)
    return torch.cat(outs), torch.cat(lses)


def _dense_fused_backward(q, k, v, o, lse, do, cu_q, cu_k, scale, *, flash_backward=_flash_backward):
    """``(dq, dk, dv)`` of :func:`_dense_fused` by the fused kernel's backward, sequence by
    sequence. A poisoned query (``o = lse = NaN``) passes no gradient (its ``dO`` is 0 and its
    LSE ``+inf``: ``P = 0``); ``dk, dv`` are summed over the G heads of each group and are 0 on
    the non-finite entries the forward replaced by 0."""
    hq, hkv = int(q.shape[1]), int(k.shape[1])
    g = hq // hkv
    dq, dk, dv = q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    for b in range(len(cu_q) - 1):
        t0, t1 = int(cu_q[b]), int(cu_q[b + 1])
        if t1 == t0:
            continue
        qh, kh, vh, ok_k, ok_v, poison = _fused_sequence(q, k, v, t0, t1, g)
        rows = poison[..., None]  # [L, Hq, 1]
        ob = torch.where(rows, zero, o[t0:t1]).transpose(0, 1)[None]  # [1, Hq, L, D]
        dob = torch.where(rows, zero, do[t0:t1].to(q.dtype)).transpose(0, 1)[None]
        lb = torch.where(poison, math.inf, lse[t0:t1].float()).transpose(0, 1)[None].contiguous()
        gq, gk, gv = flash_backward(dob, qh, kh, vh, ob, lb, scale)
        n = t1 - t0
        dq[t0:t1] = gq[0].transpose(0, 1)
        dk[t0:t1] = torch.where(ok_k, gk[0].transpose(0, 1).reshape(n, hkv, g, -1).sum(2), zero)
        dv[t0:t1] = torch.where(ok_v, gv[0].transpose(0, 1).reshape(n, hkv, g, -1).sum(2), zero)
    return dq, dk, dv


# -- the sparse KL: line 7, eq 9-11 --------------------------------------------------------------

@torch.library.custom_op("msa::kl_loss", mutates_args=())
def kl_loss(q: Tensor, k: Tensor, q_idx: Tensor, k_idx: Tensor, block_indices: Tensor | None,
            lse: Tensor | None, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, block_size: int,
            scale: float | None, index_scale: float | None, validate: bool,
            want_grads: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Eq 9-10: ``(kl, loss, dq_idx, dk_idx)``; with ``want_grads`` ``dq_idx, dk_idx`` are the
    gradients of ``loss`` for an upstream gradient of 1, computed in the same call
    (``kl_loss_and_backward`` on a GPU: the teacher scored once), else empty ``[0]``. They
    are linear in the upstream gradient, so the backward only scales them (no second pass, no
    host read of ``grad_loss``). ``block_indices=None`` is the warmup (full causal support)."""
    cu_q, cu_k = _host(cu_seqlens_q), _host(cu_seqlens_k)
    ft = _float_dtype(q_idx)
    knobs = dict(scale=scale, index_scale=index_scale, validate=validate)
    dq = dk = None
    if q_idx.is_cuda:
        from ..cuda import kl as gpu

        args = (q.contiguous(), k.contiguous(), q_idx.contiguous(), k_idx.contiguous(),
                None if block_indices is None else _kernel_indices(block_indices),
                None if lse is None else lse.float().contiguous(), cu_q, cu_k, block_size)
        with _on_device(q_idx):
            if want_grads:
                kl, loss, dq, dk = gpu.kl_loss_and_backward(*args, **knobs)
            else:
                kl, loss = gpu.kl_loss(*args, **knobs)
        loss = torch.as_tensor(loss, device=q_idx.device).reshape(())
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
    if want_grads:
        dq, dk = dq.to(q_idx.dtype), dk.to(k_idx.dtype)
    else:
        dq, dk = q_idx.new_empty(0), k_idx.new_empty(0)
    return kl.to(ft), loss.to(ft), dq, dk


@kl_loss.register_fake
def _(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k, block_size, scale,
      index_scale, validate, want_grads):
    ft = _float_dtype(q_idx)
    grads = ((q_idx.new_empty(q_idx.shape), k_idx.new_empty(k_idx.shape)) if want_grads
             else (q_idx.new_empty(0), k_idx.new_empty(0)))
    return (q_idx.new_empty(q_idx.shape[:2], dtype=ft), q_idx.new_empty((), dtype=ft)) + grads


def _kl_loss_setup(ctx, inputs, output):
    kl, loss, dq, dk = output
    ctx.save_for_backward(dq, dk)
    # without want_grads (the last input) the loss has no gradient either
    ctx.mark_non_differentiable(kl, dq, dk, *(() if inputs[-1] else (loss,)))


def _kl_loss_grad(ctx, _grad_kl, grad_loss, _grad_dq, _grad_dk):
    dq, dk = ctx.saved_tensors
    if grad_loss is None:
        return (None,) * 13
    g = grad_loss.to(dq.dtype)
    return (None, None, g * dq, g * dk) + (None,) * 9


kl_loss.register_autograd(_kl_loss_grad, setup_context=_kl_loss_setup)
