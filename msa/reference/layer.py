"""Paper Algorithm 1: one MSA layer, forward, with the auxiliary KL loss and the warmup switch.

.. code-block:: text

    1: Q, K, V      <- X W_q, X W_k, X W_v              (N,Hq,D), (N,Hkv,D), (N,Hkv,D)
    2: Q_idx, K_idx <- sg(X) W_q_idx, sg(X) W_k_idx     (N,Hkv,Didx), (N,Didx)
    3: M_idx        <- BlockMaxPool(Q_idx, K_idx, Bk)   (Hkv,N,NB), causal, per group
    4: I            <- TopK(M_idx, k)                   local block always included
    5: O            <- TopKAttn(Q, K, V, I)             (N,Hq,D)
    6: output       <- O W_o                            (N,d_model)
    7: L_KL         <- KLdiv(Q_idx, K_idx, sg(Q), sg(K), I)
    8: return output, L_KL

During the indexer warmup (§3.2, mechanism three) line 5 is dense causal attention and line 7 is
taken on the full causal support; lines 3-4 still run so their cost and output can be inspected.
The training loop adds ``L = L_LM + lambda * sum_layers L_KL`` (the paper gives no lambda).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import (FLOAT_DTYPES, check_array, check_block_size, check_flag, check_gqa,
                       check_offsets, check_positive_int, check_scale, check_topk, cu_to_host,
                       dtype_of)
from .attention import dense_attention, sparse_attention
from .index import block_scores, index_projections
from .kl import kl_loss
from .select import select_blocks


@dataclass
class MSAParams:
    """Weights of one MSA layer (row-major ``x @ W``).

    w_q [d_model, Hq*D], w_k and w_v [d_model, Hkv*D], w_o [Hq*D, d_model],
    w_q_idx [d_model, Hkv*Didx], w_k_idx [d_model, Didx] (the only weights ``L_KL`` trains).
    """

    w_q: np.ndarray
    w_k: np.ndarray
    w_v: np.ndarray
    w_o: np.ndarray
    w_q_idx: np.ndarray
    w_k_idx: np.ndarray
    num_q_heads: int
    num_kv_heads: int

    def __post_init__(self):
        """Every weight checked when the parameters are made (``dataclasses.replace`` too): one
        float dtype, 2-D, shapes that agree with each other and with the heads."""
        check_gqa(self.num_q_heads, self.num_kv_heads)
        hq, hkv = self.num_q_heads, self.num_kv_heads
        check_array("w_q", self.w_q, ndim=2, dtypes=FLOAT_DTYPES)
        d_model, width = (int(s) for s in self.w_q.shape)
        if d_model < 1 or width < hq or width % hq:
            raise ValueError(f"w_q must have shape [d_model >= 1, Hq*D] with Hq = {hq}, got "
                             f"{tuple(self.w_q.shape)}")
        d = width // hq
        check_array("w_k_idx", self.w_k_idx, ndim=2, shape=(d_model, None))
        d_idx = int(self.w_k_idx.shape[1])
        if d_idx < 1:
            raise ValueError(f"w_k_idx must have shape [d_model, Didx >= 1], got "
                             f"{tuple(self.w_k_idx.shape)}")
        for name, shape in (("w_k", (d_model, hkv * d)), ("w_v", (d_model, hkv * d)),
                            ("w_o", (hq * d, d_model)), ("w_q_idx", (d_model, hkv * d_idx))):
            check_array(name, getattr(self, name), ndim=2, shape=shape)
        dtype = dtype_of(self.w_q)
        for name in ("w_k", "w_v", "w_o", "w_q_idx", "w_k_idx"):
            if dtype_of(getattr(self, name)) != dtype:
                raise TypeError(f"{name} must have w_q's dtype {dtype}, got "
                                f"{dtype_of(getattr(self, name))}")

    @property
    def head_dim(self) -> int:
        return self.w_q.shape[1] // self.num_q_heads

    @property
    def index_dim(self) -> int:
        return self.w_k_idx.shape[1]


def init_params(d_model: int, num_q_heads: int, num_kv_heads: int, head_dim: int, index_dim: int,
                *, seed: int = 0, dtype=np.float64) -> MSAParams:
    """Random layer weights with variance ``1/fan_in`` (paper main config: 3072, 64, 4, 128, 128).

    ``dtype``: float16, float32 or float64 (TypeError otherwise: integer weights would round to
    zero). ``seed``: an integer.
    """
    for name, v in (("d_model", d_model), ("head_dim", head_dim), ("index_dim", index_dim)):
        check_positive_int(name, v)
    check_gqa(num_q_heads, num_kv_heads)
    check_positive_int("seed", seed, low=0)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be a float dtype (float16/32/64), got {dtype!r}") from None
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be float16, float32 or float64, got {dt}")
    rng = np.random.default_rng(seed)

    def w(fan_in, fan_out):
        return (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(dtype)

    return MSAParams(
        w_q=w(d_model, num_q_heads * head_dim),
        w_k=w(d_model, num_kv_heads * head_dim),
        w_v=w(d_model, num_kv_heads * head_dim),
        w_o=w(num_q_heads * head_dim, d_model),
        w_q_idx=w(d_model, num_kv_heads * index_dim),
        w_k_idx=w(d_model, index_dim),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
    )


def msa_layer(x, params: MSAParams, cu_seqlens, block_size: int, topk: int, *, warmup: bool = False,
              scale=None, index_scale=None):
    """Algorithm 1 forward on a packed batch of self-attention sequences.

    Args:
        x: hidden states [T, d_model], float16/32/64, the weights' dtype; sequences packed by
            ``cu_seqlens``.
        params: :class:`MSAParams`.
        cu_seqlens: [B+1] int prefix sums of the sequence lengths (queries = keys: prefill).
        block_size: Bk (paper 128); topk: K blocks per query and group (paper 16), in
            ``[1, max(NB, 64)]``.
        warmup, scale, index_scale: keyword-only. ``warmup``: dense main branch and KL on the
            full causal support (indexer warmup, §3.2).

    Returns:
        ``(output [T, d_model], loss_kl (float), aux)`` where ``aux`` holds every intermediate:
        ``q, k, v, q_idx, k_idx, block_scores, block_indices, o, lse, kl``.
    """
    if not isinstance(params, MSAParams):
        raise TypeError(f"params must be an MSAParams, got {type(params).__name__}")
    check_array("x", x, ndim=2, dtypes=FLOAT_DTYPES, shape=(None, params.w_q.shape[0]))
    if dtype_of(x) != np.dtype(params.w_q.dtype):
        raise TypeError(f"x must have the weights' dtype {params.w_q.dtype}, got {dtype_of(x)}")
    x = np.asarray(cu_to_host(x))  # [T, d_model]
    block_size = check_block_size(block_size)
    warmup = check_flag("warmup", warmup)
    t = x.shape[0]
    cu_seqlens = check_offsets("cu_seqlens", cu_seqlens, t)
    scale = check_scale("scale", scale, 1.0 / np.sqrt(params.head_dim))
    index_scale = check_scale("index_scale", index_scale, 1.0 / np.sqrt(params.index_dim))
    topk = check_topk(topk, -(-int(np.diff(cu_seqlens).max(initial=0)) // block_size), block_size)
    hq, hkv, d = params.num_q_heads, params.num_kv_heads, params.head_dim
    # line 1: main projections  [T, Hq, D], [T, Hkv, D]
    q = (x @ params.w_q).reshape(t, hq, d)
    k = (x @ params.w_k).reshape(t, hkv, d)
    v = (x @ params.w_v).reshape(t, hkv, d)
    # line 2: index projections on sg(X)  [T, Hkv, Didx], [T, Didx]
    q_idx, k_idx = index_projections(x, params.w_q_idx, params.w_k_idx, hkv)
    # lines 3-4: causal block max and exp-free top-k with the forced local block
    m = block_scores(q_idx, k_idx, cu_seqlens, cu_seqlens, block_size, scale=index_scale)  # [Hkv, T, NB]
    idx = select_blocks(m, cu_seqlens, cu_seqlens, block_size, topk)  # [T, Hkv, K]
    # line 5: the main branch
    if warmup:
        o, lse = dense_attention(q, k, v, cu_seqlens, cu_seqlens, scale=scale)  # [T, Hq, D], [T, Hq]
    else:
        o, lse = sparse_attention(q, k, v, idx, cu_seqlens, cu_seqlens, block_size, scale=scale)
    # line 6: output projection  [T, d_model]
    output = o.reshape(t, hq * d) @ params.w_o
    # line 7: the KL loss on the selected support (full causal support during warmup)
    # msa's own selection and LSE (a NaN in x gives NaN rows, not an error)
    kl, loss = kl_loss(q, k, q_idx, k_idx, None if warmup else idx, lse, cu_seqlens, cu_seqlens,
                       block_size, scale=scale, index_scale=index_scale, validate=False)
    aux = dict(q=q, k=k, v=v, q_idx=q_idx, k_idx=k_idx, block_scores=m, block_indices=idx,
               o=o, lse=lse, kl=kl)
    return output, float(loss), aux
