"""Paper Algorithm 1 as a PyTorch module: one MSA attention layer that trains.

.. code-block:: text

    1: Q, K, V      <- X W_q, X W_k, X W_v              gradients from the LM loss
    2: Q_idx, K_idx <- sg(X) W_q_idx, sg(X) W_k_idx     gradients from L_KL only
    3-4: I          <- TopK(BlockMaxPool(Q_idx, K_idx))  no gradient (exp-free top-k)
    5: O, LSE       <- TopKAttn(Q, K, V, I)             (dense causal attention in the warmup)
    6: output       <- O W_o
    7: L_KL         <- KLdiv(Q_idx, K_idx, sg(Q), sg(K), I, sg(LSE))

The training loop adds ``L = L_LM + lambda * sum_layers L_KL``. On CUDA tensors lines 3-5 and 7
run the msa.cuda kernels (fused index + top-k, KV-outer attention, sparse KL and its backward);
on CPU tensors the NumPy reference. The weights use the reference's layout (``x @ W``), so
``MSAAttention.from_params(msa.reference.init_params(...))`` is the same layer as
``msa.reference.msa_layer``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from .._checks import (check_block_size, check_choice, check_flag, check_gqa, check_positive_int,
                       check_scale)
from . import functional as F
from . import ops
# the device and dtype checks live in cache.py, which this module imports (not the reverse)
from .cache import _check_device, _check_dtype, decode_attention_step


def _check_process_group(group):
    """``process_group``: None (one device) or a ``torch.distributed.ProcessGroup``; TypeError
    otherwise (a string or a rank would fail only in ``forward``, in ``torch.distributed``)."""
    if group is None:
        return None
    if not torch.distributed.is_available():
        raise TypeError(f"process_group must be None: torch {torch.__version__} has no "
                        f"torch.distributed, got {type(group).__name__} {group!r}")
    if not isinstance(group, torch.distributed.ProcessGroup):
        raise TypeError(f"process_group must be None or a torch.distributed.ProcessGroup (e.g. "
                        f"torch.distributed.group.WORLD after init_process_group), got "
                        f"{type(group).__name__} {group!r}")
    return group


class MSAOutput(NamedTuple):
    """What :meth:`MSAAttention.forward` returns."""

    output: torch.Tensor  # [T, d_model]
    loss_kl: torch.Tensor  # 0-d: eq 10, trains only w_q_idx and w_k_idx
    block_indices: torch.Tensor  # [T, Hkv, K] int32: the selection of lines 3-4
    lse: torch.Tensor  # [T, Hq]: the main branch's LSE (no gradient)


class MSAAttention(nn.Module):
    """One MSA layer (paper Algorithm 1) over packed variable-length sequences (self-attention).

    Args:
        d_model: hidden size. num_q_heads (Hq), num_kv_heads (Hkv): GQA heads, Hq = G Hkv.
        head_dim: D. index_dim: Didx (one index query head per group, one shared index key).
        block_size: Bk (paper 128). topk: K blocks per query and group (paper 16).
        scale, index_scale: softmax scales, default ``1/sqrt(D)`` and ``1/sqrt(Didx)``.
        warmup: the indexer warmup (§3.2): dense main branch, KL on the full causal support.
            An attribute: flip ``layer.warmup`` when the warmup ends.
        main_backward: the main branch's backward, ``"auto"`` (default), ``"torch"`` or
            ``"cuda"`` (the ``backward`` argument of ``msa.torch.sparse_attention``); an
            attribute.
        main_backward_partials: ``"float32"`` (default) or ``"bfloat16"``: the dQ partials of
            the main branch's tensor-core backward (the ``backward_partials`` argument of
            ``msa.torch.sparse_attention``: half the traffic, a dq within ~0.3% of its largest
            value of the float32 one's); an attribute.
        process_group: a ``torch.distributed`` group for context parallelism (``None``: one
            device). ``forward`` then takes this rank's rows of ``x`` (``msa.distributed.
            shard_tokens``) and runs ``msa.distributed.context_parallel_msa``; an attribute.
        cp_chunk_size: tokens per context-parallel chunk (default: ``msa.distributed``'s).
        device, dtype: of the weights (normal with variance ``1/fan_in``, as
            ``msa.reference.init_params``); a float dtype, a device this torch can use.

    ``block_size``, ``topk``, ``warmup``, ``main_backward``, ``main_backward_partials``,
    ``process_group`` and ``cp_chunk_size`` are properties: a value set later is checked as the
    constructor checks it (``layer.warmup = "no"`` is a TypeError at once). Every argument is
    checked before a weight is allocated: a TypeError or ValueError naming it.

    On a GPU use bf16 or fp16 activations for the tensor-core kernels (float32 runs the
    CUDA-core versions). The main branch's backward is ``msa.cuda``'s tensor-core kernel on
    such activations, PyTorch code (``functional.sparse_attention_backward``) otherwise
    (``main_backward``); the index branch's is the KL kernel.
    """

    def __init__(self, d_model: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 index_dim: int, *, block_size: int = 128, topk: int = 16, scale=None,
                 index_scale=None, warmup: bool = False, main_backward: str = "auto",
                 main_backward_partials: str = "float32", process_group=None,
                 cp_chunk_size=None, device=None, dtype=None):
        super().__init__()
        for name, value in (("d_model", d_model), ("head_dim", head_dim),
                            ("index_dim", index_dim)):
            check_positive_int(name, value)
        check_gqa(num_q_heads, num_kv_heads)
        device = _check_device(device, types=("cpu", "cuda", "meta"))  # meta: deferred init
        dtype = _check_dtype(dtype)
        self.d_model, self.num_q_heads, self.num_kv_heads = d_model, num_q_heads, num_kv_heads
        self.head_dim, self.index_dim = head_dim, index_dim
        # the knobs below are properties that check every value set, here and later
        self.block_size, self.topk = block_size, topk
        scale = None if scale is None else check_scale("scale", scale, 1.0)
        index_scale = None if index_scale is None else check_scale("index_scale", index_scale, 1.0)
        self.scale, self.index_scale = scale, index_scale
        self.warmup, self.main_backward = warmup, main_backward
        self.main_backward_partials = main_backward_partials
        # context parallelism (msa.distributed): this rank's queries against all ranks' keys
        self.process_group, self.cp_chunk_size = process_group, cp_chunk_size
        kw = dict(device=device, dtype=dtype)

        def weight(fan_in, fan_out):
            w = torch.empty((fan_in, fan_out), **kw)
            nn.init.normal_(w, std=1.0 / math.sqrt(fan_in))
            return nn.Parameter(w)

        self.w_q = weight(d_model, num_q_heads * head_dim)
        self.w_k = weight(d_model, num_kv_heads * head_dim)
        self.w_v = weight(d_model, num_kv_heads * head_dim)
        self.w_o = weight(num_q_heads * head_dim, d_model)
        self.w_q_idx = weight(d_model, num_kv_heads * index_dim)
        self.w_k_idx = weight(d_model, index_dim)

    # -- knobs that may change after construction (documented attributes): each set checked,
    # so that a bad value fails at the assignment and not inside the next forward -------------
    @property
    def block_size(self) -> int:
        """Bk, an integer in ``[1, 2**31 - 1]``."""
        return self._block_size

    @block_size.setter
    def block_size(self, value):
        self._block_size = check_block_size(value)

    @property
    def topk(self) -> int:
        """K blocks per query and group, an integer ``>= 1``."""
        return self._topk

    @topk.setter
    def topk(self, value):
        self._topk = check_positive_int("topk", value)

    @property
    def warmup(self) -> bool:
        """The indexer warmup (§3.2): True or False (``"no"`` is no bool: TypeError)."""
        return self._warmup

    @warmup.setter
    def warmup(self, value):
        self._warmup = check_flag("warmup", value)

    @property
    def main_backward(self) -> str:
        """The main branch's backward: ``"auto"``, ``"torch"`` or ``"cuda"``."""
        return self._main_backward

    @main_backward.setter
    def main_backward(self, value):
        self._main_backward = check_choice("main_backward", value, F.BACKWARDS)

    @property
    def main_backward_partials(self) -> str:
        """The dQ partials of the main branch's tensor-core backward: ``"float32"`` or
        ``"bfloat16"``."""
        return self._main_backward_partials

    @main_backward_partials.setter
    def main_backward_partials(self, value):
        self._main_backward_partials = check_choice("main_backward_partials", value,
                                                    F.BACKWARD_PARTIALS)

    @property
    def process_group(self):
        """None or a ``torch.distributed.ProcessGroup`` (context parallelism)."""
        return self._process_group

    @process_group.setter
    def process_group(self, value):
        self._process_group = _check_process_group(value)

    @property
    def cp_chunk_size(self):
        """None (``msa.distributed``'s default) or tokens per context-parallel chunk, >= 1."""
        return self._cp_chunk_size

    @cp_chunk_size.setter
    def cp_chunk_size(self, value):
        self._cp_chunk_size = None if value is None else check_positive_int("cp_chunk_size", value)

    @classmethod
    def from_params(cls, params, *, block_size: int = 128, topk: int = 16, device=None,
                    dtype=None, **kwargs) -> MSAAttention:
        """The layer with the weights of a ``msa.reference.MSAParams`` (copied), in their dtype
        unless ``dtype`` says otherwise.

        The weights are checked first, as ``MSAParams`` checks them when made (its fields may
        have been reassigned since): one float dtype for all six, shapes that agree with the
        heads, ``d_model``, ``D`` and ``Didx`` they define; TypeError/ValueError naming the
        weight otherwise (no weight is cast to another's dtype, none is cut or padded)."""
        from ..reference.layer import MSAParams

        if not isinstance(params, MSAParams):
            raise TypeError(f"params must be an msa.reference.MSAParams, got {type(params).__name__}")
        params.__post_init__()  # the dataclass's own checks, again
        if dtype is None:
            dtype = torch.from_numpy(np.zeros(0, dtype=np.asarray(params.w_q).dtype)).dtype
        layer = cls(params.w_q.shape[0], params.num_q_heads, params.num_kv_heads,
                    params.head_dim, params.index_dim, block_size=block_size, topk=topk,
                    device=device, dtype=dtype, **kwargs)
        with torch.no_grad():
            for name in ("w_q", "w_k", "w_v", "w_o", "w_q_idx", "w_k_idx"):
                # contiguous: torch.from_numpy refuses negative strides (a reversed view)
                w = np.ascontiguousarray(np.asarray(getattr(params, name)))
                getattr(layer, name).copy_(torch.from_numpy(w))
        return layer

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, Hq={self.num_q_heads}, Hkv={self.num_kv_heads}, "
                f"D={self.head_dim}, Didx={self.index_dim}, block_size={self.block_size}, "
                f"topk={self.topk}, warmup={self.warmup}, main_backward={self.main_backward}, "
                f"main_backward_partials={self.main_backward_partials}")

    def select(self, q_idx, k_idx, cu_seqlens):
        """Lines 3-4: ``I [T, Hkv, K]`` int32 from the index branch (no gradient):
        ``msa.cuda.select.select_blocks_fused`` on CUDA tensors, the reference's
        ``block_scores`` and ``select_blocks`` on CPU tensors (``ops.select_blocks``)."""
        cu = F._checked_offsets("cu_seqlens", cu_seqlens, q_idx.shape[0])
        return self._select(q_idx, k_idx, cu)

    def _select(self, q_idx, k_idx, cu):
        # host offsets (a CPU int64 tensor): the GPU path reads them as they are, no device copy
        with torch.no_grad():
            return ops.select_blocks(q_idx.detach(), k_idx.detach(), cu, cu, self.block_size,
                                     self.topk, self.index_scale)

    def _check_input(self, x) -> None:
        """``x [T, d_model]`` a tensor of the layer's dtype and device (``forward``, ``decode``)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim != 2 or x.shape[1] != self.d_model:
            raise ValueError(f"x must have shape [T, d_model={self.d_model}], got {tuple(x.shape)}")
        if x.dtype != self.w_q.dtype:
            raise TypeError(f"x must have the layer's dtype {self.w_q.dtype}, got {x.dtype} "
                            "(use layer.to(dtype) or x.to(dtype))")
        if x.device != self.w_q.device:
            raise ValueError(f"x must be on the layer's device {self.w_q.device}, got {x.device}")

    def forward(self, x: torch.Tensor, cu_seqlens) -> MSAOutput:
        """Algorithm 1 on ``x [T, d_model]``, sequences packed by ``cu_seqlens [B+1]``.

        Returns :class:`MSAOutput` ``(output [T, d_model], loss_kl, block_indices, lse)``.
        """
        self._check_input(x)
        if self.process_group is not None:  # x is this rank's share (msa.distributed.shard_tokens)
            from ..distributed import context_parallel_msa  # here: msa.distributed imports msa.torch

            return context_parallel_msa(self, x, cu_seqlens, self.process_group,
                                        chunk_size=self.cp_chunk_size)
        t = x.shape[0]
        # host int64 offsets, checked here (under torch.compile, by an op when the graph runs)
        cu = F._checked_offsets("cu_seqlens", cu_seqlens, t)
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        # line 1: main projections  [T, Hq, D], [T, Hkv, D]
        q = (x @ self.w_q).view(t, hq, d)
        k = (x @ self.w_k).view(t, hkv, d)
        v = (x @ self.w_v).view(t, hkv, d)
        # line 2: index projections on sg(X)  [T, Hkv, Didx], [T, Didx]
        xs = x.detach()
        q_idx = (xs @ self.w_q_idx).view(t, hkv, self.index_dim)
        k_idx = xs @ self.w_k_idx
        # lines 3-4: causal block max and top-k with the forced local block
        idx = self._select(q_idx, k_idx, cu)
        # line 5: the main branch
        if self.warmup:
            o, lse = F.dense_attention(q, k, v, cu, cu, scale=self.scale)
        else:
            # the layer's own selection: not checked on the host again (no wait for the GPU)
            o, lse = F.sparse_attention(q, k, v, idx, cu, cu, self.block_size, scale=self.scale,
                                        backward=self.main_backward,
                                        backward_partials=self.main_backward_partials,
                                        validate=False)
        # line 6
        output = o.reshape(t, hq * d) @ self.w_o
        # line 7: the KL on the selected support (the full causal support in the warmup)
        # the layer's own selection and LSE: not re-validated (a NaN in x gives NaN rows)
        _, loss = F.kl_loss(q, k, q_idx, k_idx, None if self.warmup else idx, lse, cu, cu,
                            self.block_size, scale=self.scale, index_scale=self.index_scale,
                            validate=False)
        return MSAOutput(output, loss, idx, lse)

    def decode(self, x: torch.Tensor, cache, slots):
        """One generation step on a paged KV cache (``msa.torch.PagedKVCache``): ``x [B*Lq,
        d_model]`` the hidden states of each request's ``Lq`` new tokens (request-major over
        ``slots``). Appends their K, V and K_idx to the cache and runs the decode step; returns
        ``(output [B*Lq, d_model], block_indices [B*Lq, Hkv, K])``. See
        ``msa.torch.cache.decode_attention_step``."""
        return decode_attention_step(self, x, cache, slots)
