"""Random MSA problems: consistent inputs for the demo, the notebooks, the tests and benchmarks.

``make_problem`` draws a packed variable-length batch (paper §2, docs/design.md §3) with Gaussian
q, k, v, q_idx, k_idx. Everything is NumPy on the host; move it to a GPU with CuPy or torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._checks import check_gqa, check_positive_int


@dataclass
class Problem:
    """One MSA problem. Shapes: q [Tq,Hq,D]; k, v [Tk,Hkv,D]; q_idx [Tq,Hkv,Didx]; k_idx [Tk,Didx]."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    q_idx: np.ndarray
    k_idx: np.ndarray
    cu_seqlens_q: np.ndarray  # int32 [B+1]
    cu_seqlens_k: np.ndarray  # int32 [B+1]
    block_size: int
    topk: int
    meta: dict = field(default_factory=dict)

    @property
    def num_q_heads(self) -> int:
        return self.q.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.k.shape[1]


def make_problem(
    seq_lens_k=(300,),
    seq_lens_q=None,
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    index_dim: int = 16,
    block_size: int = 32,
    topk: int = 4,
    dtype=np.float64,
    seed: int = 0,
) -> Problem:
    """Draw a packed batch of sequences with ``Lk`` keys and the last ``Lq`` of them as queries.

    ``seq_lens_q`` defaults to ``seq_lens_k`` (prefill). Values are standard normal in ``dtype``.
    """
    seq_lens_k = [int(x) for x in seq_lens_k]
    seq_lens_q = list(seq_lens_k) if seq_lens_q is None else [int(x) for x in seq_lens_q]
    if len(seq_lens_q) != len(seq_lens_k):
        raise ValueError(
            f"seq_lens_q and seq_lens_k must have the same length, got {len(seq_lens_q)} and {len(seq_lens_k)}")
    for lq, lk in zip(seq_lens_q, seq_lens_k):
        if lq < 0 or lk < 0 or lq > lk:
            raise ValueError(f"each sequence needs 0 <= Lq <= Lk, got Lq={lq}, Lk={lk}")
    check_gqa(num_q_heads, num_kv_heads)
    for name, v in (("head_dim", head_dim), ("index_dim", index_dim), ("block_size", block_size),
                    ("topk", topk)):
        check_positive_int(name, v)
    rng = np.random.default_rng(seed)
    tq, tk = sum(seq_lens_q), sum(seq_lens_k)

    def normal(*shape):
        return rng.standard_normal(shape).astype(dtype)

    return Problem(
        q=normal(tq, num_q_heads, head_dim),
        k=normal(tk, num_kv_heads, head_dim),
        v=normal(tk, num_kv_heads, head_dim),
        q_idx=normal(tq, num_kv_heads, index_dim),
        k_idx=normal(tk, index_dim),
        cu_seqlens_q=np.concatenate([[0], np.cumsum(seq_lens_q)]).astype(np.int32),
        cu_seqlens_k=np.concatenate([[0], np.cumsum(seq_lens_k)]).astype(np.int32),
        block_size=block_size,
        topk=topk,
        meta={"seed": seed},
    )
