"""Hypothesis strategies that draw consistent MSA problems (DESIGN §5).

``problem_shapes()`` draws the sizes of a packed batch; ``problems()`` turns them into an
``msa.problems.Problem``. Sizes stay tiny so that the CUDA simulator runs them in CI.
"""

from __future__ import annotations

from hypothesis import strategies as st

from msa.problems import make_problem

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
