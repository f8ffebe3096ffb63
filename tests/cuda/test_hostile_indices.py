"""``validate=False`` with a hostile selection: memory safe, and the damage stays in its rows.

A selection msa produced itself is not re-validated on the host (docs/design.md §4), so the
kernels must stay in bounds whatever ``block_indices`` holds: ids past the sequence or the
int32 range, negative ids other than -1, repeats, -1 before a real id. In the simulator an
out-of-bounds index raises ``IndexError`` naming the thread, so these runs are a memcheck of
the launch arithmetic (compute-sanitizer does the same on the GPU: benchmarks/sanitize_smoke.py).
Only the damaged query's rows may change: every other query's output, LSE and ``dq`` stay
bitwise those of the clean selection.
"""

from __future__ import annotations

import numpy as np

import msa.reference as R
from msa.cuda import attention, csr
from msa.cuda.kl import _kl_backward
from msa.problems import make_problem
from msa.testing.backends import SIMULATOR, to_numpy

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1

# What a damaged query's row of head 0 holds (``nb``: its sequence's number of blocks).
DAMAGE = {
    "past the sequence": lambda nb: [0, nb, nb + 3],
    "int32 extremes": lambda nb: [INT32_MAX, 0, INT32_MIN],
    "negative ids": lambda nb: [-5, -2, 0],
    "repeats": lambda nb: [0, 0, 0],
    "-1 before an id": lambda nb: [-1, 0, -1],
    "descending": lambda nb: [1, 0, -1],
}
# The damaged queries sit at positions 45 .. 69 of the first sequence (Lk = 70: blocks 0 .. 4).
# In the simulator (a Python thread per CUDA thread, its time grows with the queries) that
# sequence has only its last 25 queries (Lq = 25 < Lk: the same positions, blocks and damage)
# and the second sequence 10 queries instead of 25.
SEQ_LENS_Q = (25, 10) if SIMULATOR else (70, 25)
DAMAGED = [t - (70 - SEQ_LENS_Q[0]) for t in (45, 50, 55, 60, 65, 69)]


def problem():
    """A two-sequence problem, its valid selection and one with a row of each DAMAGE."""
    p = make_problem((70, 40), SEQ_LENS_Q, num_q_heads=4, num_kv_heads=2, head_dim=8,
                     index_dim=8, block_size=16, topk=3, dtype=np.float32, seed=3)
    I = R.select_blocks(R.block_scores(p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k,
                                       p.block_size),
                        p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, p.topk)
    J = I.copy()
    for t, row in zip(DAMAGED, DAMAGE.values()):
        J[t, 0, :] = row(5)
    others = ~np.isin(np.arange(p.q.shape[0]), DAMAGED)
    return p, I, J, others


def test_forward_backward_and_kl_stay_in_bounds_and_in_their_rows():
    p, I, J, others = problem()
    args = (p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    o1, l1 = (to_numpy(x) for x in attention.sparse_attention(p.q, p.k, p.v, I, *args))
    o2, l2 = (to_numpy(x) for x in attention.sparse_attention(p.q, p.k, p.v, J, *args,
                                                                 validate=False))
    np.testing.assert_array_equal(o1[others], o2[others])
    np.testing.assert_array_equal(l1[others], l2[others])

    do = np.random.default_rng(0).standard_normal(p.q.shape).astype(np.float32)
    g1 = attention.sparse_attention_backward(p.q, p.k, p.v, o1, l1, do, I, *args)
    g2 = attention.sparse_attention_backward(p.q, p.k, p.v, o1, l1, do, J, *args,
                                             validate=False)
    np.testing.assert_array_equal(to_numpy(g1[0])[others], to_numpy(g2[0])[others])

    kl1 = _kl_backward(p.q, p.k, p.q_idx, p.k_idx, I, l1, *args, with_kl=True)
    kl2 = _kl_backward(p.q, p.k, p.q_idx, p.k_idx, J, l1, *args, with_kl=True,
                       validate=False)
    # (kl [Tq, Hkv], loss, dq_idx [Tq, Hkv, Didx], dk_idx): a query's own are kl and dq_idx
    for what in (0, 2):
        np.testing.assert_array_equal(to_numpy(kl1[what])[others], to_numpy(kl2[what])[others])


def test_build_csr_stays_in_bounds():
    p, _, J, _ = problem()
    row_ptr, q_indices, slots = (to_numpy(x) for x in csr.build_csr(
        J, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, validate=False))
    assert (np.diff(row_ptr.astype(np.int64), axis=1) >= 0).all()
    assert (row_ptr[:, 0] == 0).all() and (row_ptr[:, -1] <= J.shape[0] * J.shape[2]).all()
    assert q_indices.shape == slots.shape == (J.shape[1], J.shape[0] * J.shape[2])
