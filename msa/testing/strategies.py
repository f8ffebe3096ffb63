"""Hypothesis strategies that draw consistent MSA problems (docs/design.md §5).

``problem_shapes()`` draws the sizes of a packed batch; ``problems()`` turns them into an
``msa.problems.Problem``. Sizes stay tiny so that the CUDA simulator runs them in CI.

For the stages after the index, inputs are drawn directly rather than computed:
``block_score_arrays``/``select_problems`` (distinct scores for a unique top-k, or tie-heavy
ones for the tie rule), ``block_indices_for``/``block_index_problems``/``problems_with_indices``
(valid selections with uniform, sliding-window-like or hot patterns), ``chunk_sizes``.
Large arrays come from a NumPy generator seeded by hypothesis, so examples shrink by size.
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st

from msa.problems import make_problem
from msa.reference.blocks import local_blocks, max_blocks

GROUP_SIZES = (1, 2, 4, 8, 16)


@st.composite
def seq_lens(draw, *, max_seqs: int = 3, max_len: int = 96, allow_empty: bool = True):
    """``(seq_lens_q, seq_lens_k)``: several sequences, each with ``0 <= Lq <= Lk``."""
    n = draw(st.integers(1, max_seqs))
    lk = draw(st.lists(st.integers(0 if allow_empty else 1, max_len), min_size=n, max_size=n))
    lq = [draw(st.one_of(st.just(x), st.integers(0 if allow_empty else min(1, x), x))) for x in lk]
    return lq, lk


@st.composite
def problem_shapes(draw, *, max_seqs: int = 3, max_len: int = 96, max_heads: int = 16,
                   max_topk: int = 6, block_sizes=(4, 8, 16, 32), dims=(4, 8, 16)):
    """A dict of keyword arguments for ``make_problem``: G in {1,2,4,8,16}, varlen, Lq <= Lk."""
    g = draw(st.sampled_from([g for g in GROUP_SIZES if g <= max_heads]))
    hkv = draw(st.integers(1, max(1, min(3, max_heads // g))))
    lq, lk = draw(seq_lens(max_seqs=max_seqs, max_len=max_len))
    return dict(
        seq_lens_q=lq,
        seq_lens_k=lk,
        num_q_heads=g * hkv,
        num_kv_heads=hkv,
        head_dim=draw(st.sampled_from(dims)),
        index_dim=draw(st.sampled_from(dims)),
        block_size=draw(st.sampled_from(block_sizes)),
        topk=draw(st.integers(1, max_topk)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def problems(**kwargs):
    """Strategy of ``Problem`` objects (float64) built from ``problem_shapes(**kwargs)``."""
    return problem_shapes(**kwargs).map(lambda kw: make_problem(**kw))


# -- kernel-test inputs -------------------------------------------------------------------------
# Sizes a simulated kernel runs in seconds (each CUDA thread is a Python thread there); kernels
# accept Bk, D, Didx down to 16 (docs/design.md §3). Use as ``problems(**KERNEL_SHAPES)``.
KERNEL_SHAPES = dict(max_seqs=2, max_len=64, max_heads=4, max_topk=4, block_sizes=(16, 32),
                     dims=(16,))


def offsets(lengths) -> np.ndarray:
    """``cu_seqlens`` int32 [B+1] of sequence lengths: ``[0, l0, l0 + l1, ...]``."""
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)


@st.composite
def packed_batches(draw, *, max_seqs: int = 3, max_len: int = 96, allow_empty: bool = True):
    """``(cu_seqlens_q, cu_seqlens_k)``, int32 [B+1] each, from ``seq_lens``."""
    lq, lk = draw(seq_lens(max_seqs=max_seqs, max_len=max_len, allow_empty=allow_empty))
    return offsets(lq), offsets(lk)


def _local_blocks(cu_seqlens_q, cu_seqlens_k, block_size):
    """``(local [Tq] int64, NB)``: each query's local block ``floor(pos / Bk)`` and the NB axis."""
    tq, tk = int(cu_seqlens_q[-1]), int(cu_seqlens_k[-1])
    local = local_blocks(cu_seqlens_q, cu_seqlens_k, tq, tk, block_size)
    return local, max_blocks(cu_seqlens_k, block_size)


@st.composite
def block_score_arrays(draw, cu_seqlens_q, cu_seqlens_k, num_kv_heads: int, block_size: int, *,
                       ties: bool = False, dtype=np.float32):
    """M [Hkv, Tq, NB] (float32/float64) shaped like ``index.block_scores`` of that batch.

    ``-inf`` at every block after the query's local block (nothing visible there, eq 6). The
    visible scores are all distinct (``ties=False``: multiples of 1/8, exact in float32, so the
    top-k is unique and a selection test cannot fail on a near-tie), or drawn from a set of one
    to three small integers (``ties=True``: the tie rule, smaller block id first, decides).
    """
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    local, nb = _local_blocks(cu_seqlens_q, cu_seqlens_k, block_size)
    visible = np.arange(nb)[None, :] <= local[:, None]  # [Tq, NB]
    visible = np.broadcast_to(visible, (num_kv_heads,) + visible.shape)  # [Hkv, Tq, NB]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = int(visible.sum())
    if ties:
        levels = draw(st.integers(1, 3))
        values = rng.integers(0, levels, size=n).astype(np.float64)
    else:
        values = (rng.permutation(n) - n // 2) / 8.0
    scores = np.full(visible.shape, -np.inf, dtype=dtype)  # [Hkv, Tq, NB]
    scores[visible] = values
    return scores


@st.composite
def select_problems(draw, *, ties: bool = False, max_seqs: int = 3, max_len: int = 96,
                    max_kv_heads: int = 3, block_sizes=(4, 8, 16, 32), max_topk: int = 6,
                    dtype=np.float32):
    """Keyword arguments of ``select_blocks``: ``block_scores, cu_seqlens_q, cu_seqlens_k,
    block_size, topk`` (``ties`` as in ``block_score_arrays``)."""
    cu_q, cu_k = draw(packed_batches(max_seqs=max_seqs, max_len=max_len))
    block_size = draw(st.sampled_from(block_sizes))
    hkv = draw(st.integers(1, max_kv_heads))
    return dict(
        block_scores=draw(block_score_arrays(cu_q, cu_k, hkv, block_size, ties=ties, dtype=dtype)),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        block_size=block_size,
        topk=draw(st.integers(1, max_topk)),
    )


SELECTION_PATTERNS = ("uniform", "recent", "hot")


@st.composite
def block_indices_for(draw, cu_seqlens_q, cu_seqlens_k, num_kv_heads: int, topk: int,
                      block_size: int, *, fill: bool | None = None, pattern: str | None = None):
    """A valid selection I [Tq, Hkv, K] int32 for that batch, drawn directly (no scores).

    Each row holds ascending unique batch-local blocks ``b <= L`` (``L = floor(pos / Bk)``, the
    query's local block, always included), then ``-1`` to the end: what ``select_blocks``
    returns and ``check_block_indices`` accepts.

    Args:
        fill: True: every row has ``min(K, L + 1)`` blocks, as ``select_blocks`` gives with finite
            scores; False: between 1 (the local block alone) and that; None: drawn.
        pattern: how the other blocks are picked: ``"uniform"``; ``"recent"`` (mostly near the
            local block, like a sliding window); ``"hot"`` (a few blocks chosen by most queries,
            so a k2q CSR row gets more queries than a scheduler chunk); None: drawn.
    """
    if fill is None:
        fill = draw(st.booleans())
    if pattern is None:
        pattern = draw(st.sampled_from(SELECTION_PATTERNS))
    if pattern not in SELECTION_PATTERNS:
        raise ValueError(f"pattern must be one of {SELECTION_PATTERNS}, got {pattern!r}")
    local, nb = _local_blocks(cu_seqlens_q, cu_seqlens_k, block_size)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    # two hot blocks among the first four, so that most queries can see them
    hot = rng.choice(max(min(nb, 4), 1), size=min(2, max(nb, 1)), replace=False)
    out = np.full((local.size, num_kv_heads, topk), -1, dtype=np.int32)  # [Tq, Hkv, K]
    for t, L in enumerate(local.tolist()):
        n_max = min(topk, L + 1)
        if pattern == "uniform":
            weight = np.ones(L)
        elif pattern == "recent":
            weight = 4.0 ** -(L - 1 - np.arange(L)).clip(max=20)
        else:
            weight = np.where(np.isin(np.arange(L), hot), 1000.0, 1.0)
        for r in range(num_kv_heads):
            n = n_max if fill else int(rng.integers(1, n_max + 1))
            others = rng.choice(L, size=n - 1, replace=False, p=weight / weight.sum()) if n > 1 \
                else np.empty(0, dtype=np.int64)
            out[t, r, :n] = np.sort(np.append(others, L))
    return out


@st.composite
def block_index_problems(draw, *, max_seqs: int = 3, max_len: int = 96, max_kv_heads: int = 3,
                         block_sizes=(4, 8, 16, 32), max_topk: int = 6, fill: bool | None = None,
                         pattern: str | None = None):
    """A dict ``block_indices, cu_seqlens_q, cu_seqlens_k, block_size, topk, num_kv_heads`` with
    a valid selection (``block_indices_for``): the inputs of the CSR stage."""
    cu_q, cu_k = draw(packed_batches(max_seqs=max_seqs, max_len=max_len))
    block_size = draw(st.sampled_from(block_sizes))
    hkv = draw(st.integers(1, max_kv_heads))
    topk = draw(st.integers(1, max_topk))
    return dict(
        block_indices=draw(block_indices_for(cu_q, cu_k, hkv, topk, block_size, fill=fill,
                                             pattern=pattern)),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        block_size=block_size,
        topk=topk,
        num_kv_heads=hkv,
    )


@st.composite
def problems_with_indices(draw, *, fill: bool | None = None, pattern: str | None = None,
                          **shape_kwargs):
    """``(Problem, I)``: a ``problems(**shape_kwargs)`` draw and a valid selection for it (the
    inputs of sparse attention and KL, independent of any selector)."""
    problem = draw(problems(**shape_kwargs))
    indices = draw(block_indices_for(problem.cu_seqlens_q, problem.cu_seqlens_k,
                                     problem.num_kv_heads, problem.topk, problem.block_size,
                                     fill=fill, pattern=pattern))
    return problem, indices


def chunk_sizes(max_size: int = 64):
    """Scheduler chunk sizes (queries per work item): powers of two and any size, 1 included."""
    powers = [c for c in (1, 2, 4, 8, 16, 32, 64, 128) if c <= max_size]
    return st.one_of(st.sampled_from(powers), st.integers(1, max_size))


def fewer_in_simulator(n: int):
    """A test decorator: at most ``n`` hypothesis examples under Numba's simulator (every
    simulated CUDA thread is a Python thread), the profile's count on a GPU."""
    from msa.cuda._core.arrays import SIMULATOR  # here: the strategies need no CUDA import

    return settings(max_examples=n) if SIMULATOR else (lambda test: test)
