"""Paper Algorithm 1 across the ranks of a process group: queries local, keys all-gathered.

.. code-block:: text

    rank r holds the rows x_r [n_r, d_model] of Sharding.token_ids(r) (its chunks, §9)
    1-2: k, v, k_idx <- x_r W_k, x_r W_v, sg(x_r) W_k_idx        local rows
         K, V, K_idx <- all-gather (backward: reduce-scatter)      [T, ...], global order
         q, q_idx    <- x_r W_q, sg(x_r) W_q_idx                   local, overlaps the gather
    per round (a query span per sequence, keys = its sequence up to the span's last query):
    3-4: I          <- TopK(BlockMaxPool(q_idx, K_idx))            the layer's selection
    5:   O, LSE     <- TopKAttn(q, K, V, I)                        (dense in the warmup)
    7:   L_KL share <- KLdiv(...) * rows / T
    6:   output     <- O W_o                                       local rows

Every function is ``msa.torch``'s (``sparse_attention``, ``dense_attention``, ``kl_loss``) or
the same selection ``MSAAttention.select`` runs, called with the round's ``cu_seqlens_q``,
``cu_seqlens_k``: a query sees exactly the keys it sees on one device, with the same positions
and block ids, so the selection is the one device's bit for bit and the floats differ only in
the order of the sums that span ranks.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .._checks import check_positive_int
from ..torch import dense_attention, kl_loss, ops, sparse_attention
from ..torch.layer import MSAAttention, MSAOutput
from .comm import gather_keys, wait_for_pieces
from .sharding import Sharding, shard_tokens

__all__ = ["ContextParallelMSA", "context_parallel_msa", "all_reduce_gradients"]

_MAX_PIECES = 8  # collectives one gather is cut into on a GPU (at most)


def context_parallel_msa(layer: MSAAttention, x_local: torch.Tensor, cu_seqlens,
                         process_group=None, *, chunk_size: int | None = None,
                         pieces: int | None = None) -> MSAOutput:
    """``layer`` (an ``msa.torch.MSAAttention``) on a packed batch spread over a process group.

    Args:
        layer: the weights and knobs (block size, top-k, scales, ``warmup``, ``main_backward``);
            the same on every rank (e.g. broadcast from rank 0).
        x_local: [n_r, d_model], this rank's rows of the global ``x [T, d_model]``, in the local
            order ``shard_tokens(cu_seqlens, W, chunk_size).token_ids(rank)``; the layer's
            dtype and device.
        cu_seqlens: int [B+1], the *global* batch (the same on every rank; read on the host).
        process_group: a ``torch.distributed`` group (None: the default one); gloo for CPU
            tensors, NCCL for CUDA tensors.
        chunk_size, pieces: keyword-only, the same on every rank (each piece is a collective).
            ``chunk_size``: tokens per chunk of the sharding
            (default two chunks per rank, the zigzag). ``pieces``: collectives the key gather is
            cut into, so that early rounds start before the late keys arrive (GPU; default 1
            on the CPU, the number of rounds, at most 8, on a GPU).

    Returns:
        ``MSAOutput(output [n_r, d_model], loss_kl, block_indices [n_r, Hkv, K], lse [n_r, Hq])``
        for this rank's rows. ``loss_kl`` is this rank's share of eq 10: the sum over the ranks
        is the one-device ``L_KL``. Gradients: ``x_local`` gets its rows of the one-device
        ``dx``; each weight gets this rank's part, and the sum over the ranks
        (:func:`all_reduce_gradients`, or DDP over the group with the loss scaled by W, since DDP
        averages) is the one-device gradient. Every rank must run the backward (it holds a
        reduce-scatter).
    """
    if not isinstance(layer, MSAAttention):
        raise TypeError(f"layer must be an msa.torch.MSAAttention, got {type(layer).__name__}")
    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    sharding = shard_tokens(cu_seqlens, world, chunk_size)
    n = int(sharding.counts[rank])
    _check_input(layer, x_local, n, rank)
    dev = x_local.device
    hq, hkv, d, di = layer.num_q_heads, layer.num_kv_heads, layer.head_dim, layer.index_dim
    rounds = sharding.rounds(rank)
    if pieces is None:
        pieces = min(_MAX_PIECES, max(len(sharding.rounds(r)) for r in range(world))) \
            if x_local.is_cuda else 1
    pieces = min(check_positive_int("pieces", pieces), sharding.padded_rows(1))
    n_pad = sharding.padded_rows(pieces)

    # lines 1-2, the key side: local rows, all-gathered in one buffer [n_pad, 2 Hkv D + Didx]
    k = x_local @ layer.w_k  # [n, Hkv*D]
    v = x_local @ layer.w_v
    k_idx = x_local.detach() @ layer.w_k_idx  # [n, Didx]
    buf = nn.functional.pad(torch.cat([k, v, k_idx], dim=1), (0, 0, 0, n_pad - n))
    layout, backward_rows, round_keys = _device_plan(sharding, rank, pieces, dev)
    events = []
    K, V, K_idx = gather_keys(buf, layout, backward_rows, sharding.total,
                              (hkv * d, hkv * d, di), process_group, events=events)
    t = sharding.total
    K, V = K.view(t, hkv, d), V.view(t, hkv, d)  # [T, Hkv, D], global order
    # lines 1-2, the query side (on a GPU this runs while the gather is in flight)
    q = (x_local @ layer.w_q).view(n, hq, d)
    q_idx = (x_local.detach() @ layer.w_q_idx).view(n, hkv, di)

    needed = sharding.pieces_needed(rank, pieces)
    outs, lses, sel, loss = [], [], [], None
    for j, rd in enumerate(rounds):
        wait_for_pieces(events, int(needed[j]), dev)
        rows = slice(rd.row0, rd.row1)
        keys = round_keys[j]
        k_r, v_r, ki_r = (_take(a, keys) for a in (K, V, K_idx))
        cu_q, cu_k = rd.cu_seqlens_q, rd.cu_seqlens_k
        idx = _select(layer, q_idx[rows].detach(), ki_r.detach(), cu_q, cu_k)  # lines 3-4
        if layer.warmup:  # line 5
            o, lse = dense_attention(q[rows], k_r, v_r, cu_q, cu_k, scale=layer.scale)
        else:
            o, lse = sparse_attention(q[rows], k_r, v_r, idx, cu_q, cu_k, layer.block_size,
                                      scale=layer.scale, backward=layer.main_backward,
                                      backward_partials=layer.main_backward_partials,
                                      validate=False)
        _, loss_r = kl_loss(q[rows], k_r, q_idx[rows], ki_r, None if layer.warmup else idx, lse,
                            cu_q, cu_k, layer.block_size, scale=layer.scale,
                            index_scale=layer.index_scale, validate=False)  # line 7
        share = loss_r * ((rd.row1 - rd.row0) / t)  # eq 10 divides by T Hkv, not the round's
        loss = share if loss is None else loss + share
        outs.append(o)
        lses.append(lse)
        sel.append(idx)
    wait_for_pieces(events, len(events), dev)  # nothing later reads a piece in flight
    o = torch.cat(outs)  # [n, Hq, D]: the rounds are the local rows in order
    output = o.reshape(n, hq * d) @ layer.w_o  # line 6
    return MSAOutput(output, loss, torch.cat(sel), torch.cat(lses))


def _check_input(layer, x, n, rank):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x_local must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 2 or tuple(x.shape) != (n, layer.d_model):
        raise ValueError(f"x_local must have shape [n_r, d_model] = [{n}, {layer.d_model}] on "
                         f"rank {rank} (Sharding.token_ids({rank})), got {tuple(x.shape)}")
    if x.dtype != layer.w_q.dtype:
        raise TypeError(f"x_local must have the layer's dtype {layer.w_q.dtype}, got {x.dtype}")
    if x.device != layer.w_q.device:
        raise ValueError(f"x_local must be on the layer's device {layer.w_q.device}, got "
                         f"{x.device}")


@functools.lru_cache(maxsize=32)
def _device_plan(sharding: Sharding, rank: int, pieces: int, device: torch.device):
    """The index maps of a sharding on ``device``, made once (no host-to-device copy, hence no
    wait for the GPU, in a step): the gather's ``layout`` and ``backward_rows``, and per round
    its keys, a ``slice`` of the global rows when it has one span (a view), else an int64 index
    tensor (a gather)."""
    layout = tuple((torch.as_tensor(t, device=device), torch.as_tensor(r, device=device))
                   for t, r in sharding.piece_layout(pieces))
    backward_rows = torch.as_tensor(sharding.rank_major_rows(pieces), device=device)
    keys = []
    for rd in sharding.rounds(rank):
        if rd.key_starts.size == 1:
            k0 = int(rd.key_starts[0])
            keys.append(slice(k0, k0 + int(rd.cu_seqlens_k[-1])))
        else:
            keys.append(torch.as_tensor(rd.key_ids(), device=device))
    return layout, backward_rows, tuple(keys)


def _take(a, keys):
    return a[keys] if isinstance(keys, slice) else a.index_select(0, keys)


def _select(layer, q_idx, k_idx, cu_q, cu_k):
    """Lines 3-4 as ``MSAAttention.select`` (the same ``torch.ops.msa.select_blocks``), with a
    round's own ``cu_seqlens_q, cu_seqlens_k``: ``I [n, Hkv, K]`` int32 (no gradient)."""
    cu = [torch.from_numpy(np.ascontiguousarray(c, dtype=np.int64)) for c in (cu_q, cu_k)]
    with torch.no_grad():
        return ops.select_blocks(q_idx, k_idx, *cu, layer.block_size, layer.topk,
                                 layer.index_scale)


def all_reduce_gradients(parameters, process_group=None):
    """Sum each parameter's ``.grad`` over the group, in place: after the backward of
    :func:`context_parallel_msa` this gives every rank the one-device gradient. Parameters
    without a gradient are skipped (the same ones on every rank)."""
    for p in parameters:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=process_group)


class ContextParallelMSA(nn.Module):
    """An ``msa.torch.MSAAttention`` run across a process group (:func:`context_parallel_msa`).

    Shares the layer's parameters (``self.layer``). ``forward(x_local, cu_seqlens)`` returns
    this rank's :class:`msa.torch.MSAOutput`; :meth:`shard` gives the sharding, whose
    ``token_ids(rank)`` say which rows of the global batch ``x_local`` holds::

        cp = ContextParallelMSA(layer, group, chunk_size=1024)
        ids = cp.shard(cu_seqlens).token_ids(dist.get_rank(group))
        out = cp(x[ids], cu_seqlens)
        (lm_loss_share(out.output) + lam * out.loss_kl).backward()
        all_reduce_gradients(cp.parameters(), group)
    """

    def __init__(self, layer: MSAAttention, process_group=None, *, chunk_size: int | None = None,
                 pieces: int | None = None):
        super().__init__()
        if not isinstance(layer, MSAAttention):
            raise TypeError(f"layer must be an msa.torch.MSAAttention, got {type(layer).__name__}")
        self.layer, self.process_group = layer, process_group
        self.chunk_size, self.pieces = chunk_size, pieces

    def shard(self, cu_seqlens) -> Sharding:
        """The :class:`Sharding` of a global batch over this group."""
        return shard_tokens(cu_seqlens, dist.get_world_size(self.process_group), self.chunk_size)

    def forward(self, x_local: torch.Tensor, cu_seqlens) -> MSAOutput:
        return context_parallel_msa(self.layer, x_local, cu_seqlens, self.process_group,
                                    chunk_size=self.chunk_size, pieces=self.pieces)

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}, pieces={self.pieces}"
