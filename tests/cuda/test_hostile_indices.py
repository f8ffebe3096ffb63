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
import pytest

import msa.reference as R
from msa.cuda import attention, csr
from msa.cuda.attention._backward import _sparse_attention_backward
from msa.cuda.kl import _kl_backward
from msa.problems import make_problem
from msa.testing.backends import SIMULATOR, to_numpy
from msa.testing.tolerance import assert_exact
from tests.cuda.attention_cases import bf16_bits_to_f32, cast

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1

# What a damaged query's row of head 0 holds (``nb``: its sequence's number of blocks).
DAMAGE = {
    "past the sequence": lambda nb: [0, nb, nb + 3],
    "int32 extremes": lambda nb: [INT32_MAX, 0, INT32_MIN],
    "negative ids": lambda nb: [-5, -2, 0],
    "repeats": lambda nb: [0, 0, 0],
    "repeats a later block": lambda nb: [nb // 2] * 3,
    "-1 before an id": lambda nb: [-1, 0, -1],
    "descending": lambda nb: [1, 0, -1],
}
# The damaged queries sit at positions 45 .. 69 of the first sequence (Lk = 70: blocks 0 .. 4).
# In the simulator (a Python thread per CUDA thread, its time grows with the queries) that
# sequence has only its last 25 queries (Lq = 25 < Lk: the same positions, blocks and damage)
# and the second sequence 10 queries instead of 25.
SEQ_LENS_Q = (25, 10) if SIMULATOR else (70, 25)
DAMAGED = [t - (70 - SEQ_LENS_Q[0]) for t in (45, 50, 55, 60, 65, 67, 69)]


def problem():
    """A two-sequence problem, its valid selection and one with a row of each DAMAGE."""
    p = make_problem((70, 40), SEQ_LENS_Q, num_q_heads=4, num_kv_heads=2, head_dim=8,
                     index_dim=8, block_size=16, topk=3, dtype=np.float32, seed=3)
    I = R.select_blocks(R.block_scores(p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k,
                                       p.block_size),
                        p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, p.topk)
    J = I.copy()
    assert len(DAMAGED) == len(DAMAGE)
    for t, row in zip(DAMAGED, DAMAGE.values()):
        J[t, 0, :] = row(5)
    others = ~np.isin(np.arange(p.q.shape[0]), DAMAGED)
    return p, I, J, others


@pytest.fixture(params=["poison", pytest.param("stale", marks=pytest.mark.sim_heavy)])
def fresh_ints(request, monkeypatch):
    """What a fresh integer buffer holds: the cuda conftest's poison (the dtype's minimum,
    which every consumer rejects), or ``stale`` (``MSA_TEST_INT_FILL=1``): 1, a valid-looking
    (query 1, slot 1) edge, as a buffer the caching allocator hands back after an earlier CSR
    may hold on a GPU. An entry that no kernel writes and a kernel reads then moves query 1's
    results (the CSR's repeated ids did, before 9216d1a). ``stale`` is ``sim_heavy`` (a minute
    of CI): in the simulator ``test_build_csr_stays_in_bounds_and_lists_each_query_once``
    checks every CSR entry is written, and a GPU (or ``MSA_SIM_FULL=1``) runs it."""
    if request.param == "stale":
        monkeypatch.setenv("MSA_TEST_INT_FILL", "1")  # read by the cuda conftest's poison
    return request.param


def test_forward_backward_and_kl_stay_in_bounds_and_in_their_rows(fresh_ints):
    p, I, J, others = problem()
    assert others[1]  # query 1 is undamaged: the stale edges point at it
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


def expected_csr_rows(J, cu_q, cu_k, block_size):
    """``{(h, row): [(t, s), ...]}`` of a hostile selection: each query once in the row of
    every valid block it names (its first slot naming it), in query order; invalid ids (past
    its sequence, negative) name no row."""
    nb = -(-np.diff(cu_k) // block_size)
    row0 = np.concatenate([[0], np.cumsum(nb)])
    rows = {}
    for b in range(len(nb)):
        for t in range(cu_q[b], cu_q[b + 1]):
            for h in range(J.shape[1]):
                seen = set()
                for s, j in enumerate(J[t, h]):
                    if 0 <= j < nb[b] and j not in seen:
                        seen.add(int(j))
                        rows.setdefault((h, int(row0[b] + j)), []).append((t, s))
    return rows, int(row0[-1])


@pytest.mark.parametrize("topk, scatter, dtype", [(3, None, np.int32), (4, 2, np.int32),
                                                  (4, 3, np.int32), (4, 2, np.int64)])
def test_build_csr_stays_in_bounds_and_lists_each_query_once(topk, scatter, dtype):
    # A repeated id used to be counted once per slot but written once per query: the row kept
    # unwritten entries (stale memory on a GPU, read by K1 and the backward as edges of other
    # queries). The poisoned outputs (the cuda conftest) make any entry no kernel wrote show.
    # K = 3 checks repeats by loads of the row; K = 4 (a divisor of 32: the warp holds whole
    # rows) by one match among the row's lanes, in count v2 and scatters v2 and v3.
    p, _, J, _ = problem()
    if topk == 4:  # a fourth slot: a repeat of the first (t % 4 == 0) or of the third, next
        # to it (t % 4 == 2), or -1 (odd t)
        t = np.arange(J.shape[0])[:, None] % 4
        extra = np.where(t == 0, J[:, :, 0], np.where(t == 2, J[:, :, 2], -1))
        J = np.concatenate([J, extra[:, :, None]], axis=2)
        J[0, 1] = [0, -1, -1, 0]  # an id again after -1: ascending among the ids, a repeat
        J[1, 1] = [-1, 0, -1, 0]
    J = J.astype(dtype)  # 32-bit ids are matched as 32-bit words, 64-bit ones as 64-bit
    row_ptr, q_indices, slots = (to_numpy(x) for x in csr._build_csr(
        J, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, validate=False,
        scatter_version=scatter))
    assert (np.diff(row_ptr.astype(np.int64), axis=1) >= 0).all()
    assert (row_ptr[:, 0] == 0).all() and (row_ptr[:, -1] <= J.shape[0] * J.shape[2]).all()
    assert q_indices.shape == slots.shape == (J.shape[1], J.shape[0] * J.shape[2])
    want, num_rows = expected_csr_rows(J, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    for h in range(J.shape[1]):
        for r in range(num_rows):
            lo, hi = row_ptr[h, r], row_ptr[h, r + 1]
            got = list(zip(q_indices[h, lo:hi].tolist(), slots[h, lo:hi].tolist()))
            assert got == want.get((h, r), []), (h, r)
        tail = slice(row_ptr[h, -1], None)
        assert (q_indices[h, tail] == -1).all() and (slots[h, tail] == -1).all()


def damaged(I, nb):
    """``I`` with one query of each DAMAGE (head 0) among its last ones, and those queries."""
    J = I.copy()
    rows = [I.shape[0] - 1 - 7 * i for i in range(len(DAMAGE))]
    for t, row in zip(rows, DAMAGE.values()):
        J[t, 0, :] = -1
        J[t, 0, :len(row(nb))] = row(nb)
    return J, rows


def assert_rows_bitwise(name, got, want, rows):
    """``got`` and ``want`` bit for bit on the queries not in ``rows`` (floats as integers)."""
    got, want = np.asarray(to_numpy(got)), np.asarray(to_numpy(want))
    keep = ~np.isin(np.arange(want.shape[0]), rows)
    as_int = {2: np.uint16, 4: np.uint32}[want.dtype.itemsize]
    assert_exact(got[keep].view(as_int), want[keep].view(as_int), name=name)


def assert_damage_stays_in_its_rows(run, I, J, rows):
    """``run(selection, validate)`` gives each query's own outputs by name (o as bf16 bits): on
    the clean ``I`` they are finite (they start as NaN: ``poisoned_outputs``), and a rerun and
    the damaged ``J`` (``validate=False``) give every query outside ``rows`` the same bits; the
    damage does change the LSE of its own rows, so the comparison can see a difference."""
    clean = {name: np.asarray(to_numpy(x)) for name, x in run(I, True).items()}
    for name, x in clean.items():
        assert np.isfinite(bf16_bits_to_f32(x.view(np.uint16)) if name == "o" else x).all(), name
    hurt = run(J, False)
    for what, (got, damaged_rows) in {"rerun": (run(I, True), []),
                                      "damaged": (hurt, rows)}.items():
        for name, want in clean.items():
            assert_rows_bitwise(f"{what} {name}", got[name], want, damaged_rows)
    assert not np.array_equal(np.asarray(to_numpy(hurt["lse"]))[rows], clean["lse"][rows])


def test_bf16_rungs_keep_the_damage_in_its_rows():
    """The tensor-core rungs (bf16: K1 v3 here, v4 on a GPU with wgmma; backward v2; KL v3)
    on one sequence of 3 blocks with K = 5 (every row has -1 padding): with a row of each
    DAMAGE and ``validate=False``, every other query's o, lse, dq, kl and dq_idx are bitwise
    those of the clean selection, and a rerun of the clean selection is bitwise the same. The
    outputs start as NaN (``poisoned_outputs``), and the clean ones must be finite, so a value
    read from a buffer no kernel wrote cannot pass as equal."""
    p = make_problem((48,), num_q_heads=4, num_kv_heads=1, head_dim=16, index_dim=16,
                     block_size=16, topk=5, dtype=np.float32, seed=1)
    cq, ck, bk = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size
    I = R.select_blocks(R.block_scores(p.q_idx, p.k_idx, cq, ck, bk), cq, ck, bk, p.topk)
    J, rows = damaged(I, 3)
    q, k, v, q_idx, k_idx, do = (cast(x, "bfloat16")[0] for x in (
        p.q, p.k, p.v, p.q_idx, p.k_idx, np.random.default_rng(2).standard_normal(p.q.shape)))
    o1, l1 = attention._sparse_attention(q, k, v, I, cq, ck, bk, bf16_bits=True)

    def run(sel, validate):
        o, lse = attention._sparse_attention(q, k, v, sel, cq, ck, bk, validate=validate,
                                             bf16_bits=True)
        dq = _sparse_attention_backward(q, k, v, o1, l1, do, sel, cq, ck, bk,
                                        validate=validate, bf16_bits=True)[0]
        kl = _kl_backward(q, k, q_idx, k_idx, sel, l1, cq, ck, bk, with_kl=True,
                          validate=validate, bf16_bits=True)
        return {"o": o, "lse": lse, "dq": dq, "kl": kl[0], "dq_idx": kl[2]}

    assert_damage_stays_in_its_rows(run, I, J, rows)


def test_a_repeated_id_counts_as_minus_one(fresh_ints):
    """``validate=False``, the bf16 tensor-core rungs (K1 v3, backward v2, KL v3): queries
    repeating a block id give every output, their own and the keys' (o, lse, dq, dk, dv, kl,
    dq_idx, dk_idx), bitwise what the selection with the repeats replaced by -1 gives. The CSR
    lists a repeat once and the slot sums skip it, so nothing reads a slot no kernel wrote,
    whatever fresh memory holds (``fresh_ints``; floats start as NaN)."""
    p = make_problem((48,), num_q_heads=4, num_kv_heads=1, head_dim=16, index_dim=16,
                     block_size=16, topk=5, dtype=np.float32, seed=1)
    cq, ck, bk = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size
    I = R.select_blocks(R.block_scores(p.q_idx, p.k_idx, cq, ck, bk), cq, ck, bk, p.topk)
    rep, once = I.copy(), I.copy()
    for t, row in ((47, [2, 0, 2, 1, 2]), (40, [0, 0, -1, -1, -1]), (20, [1, 1, 1, 0, 1])):
        rep[t, 0] = row
        once[t, 0] = [j if j not in row[:s] else -1 for s, j in enumerate(row)]
    assert (once != rep).any()
    q, k, v, q_idx, k_idx, do = (cast(x, "bfloat16")[0] for x in (
        p.q, p.k, p.v, p.q_idx, p.k_idx, np.random.default_rng(2).standard_normal(p.q.shape)))
    o1, l1 = attention._sparse_attention(q, k, v, I, cq, ck, bk, bf16_bits=True)

    def run(sel):
        o, lse = attention._sparse_attention(q, k, v, sel, cq, ck, bk, validate=False,
                                             bf16_bits=True)
        dq, dk, dv = _sparse_attention_backward(q, k, v, o1, l1, do, sel, cq, ck, bk,
                                                validate=False, bf16_bits=True)
        kl, _, dq_idx, dk_idx = _kl_backward(q, k, q_idx, k_idx, sel, l1, cq, ck, bk,
                                             with_kl=True, validate=False, bf16_bits=True)
        out = {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "kl": kl, "dq_idx": dq_idx,
               "dk_idx": dk_idx}
        return {name: np.asarray(to_numpy(x)) for name, x in out.items()}

    got, want = run(rep), run(once)
    for name, w in want.items():
        assert np.isfinite(bf16_bits_to_f32(w.view(np.uint16)) if name == "o" else w).all(), name
        assert_rows_bitwise(name, got[name], w, [])


@pytest.mark.big
def test_paper_shapes_keep_the_damage_in_their_rows():
    """As above at the paper's heads, dims, Bk and K (Hq 64, Hkv 4, D = Didx = 128, Bk 128,
    K 16) on 512 tokens, bf16 torch tensors through the public defaults: the GPU's own tiles
    (K1 v4 where wgmma runs, the KL's 8-position grad tiles). ``benchmarks/sanitize_smoke.py
    --paper --n 512 --stages hostile`` runs the same check under compute-sanitizer."""
    torch = pytest.importorskip("torch")
    import msa.cuda as C

    p = make_problem((512,), num_q_heads=64, num_kv_heads=4, head_dim=128, index_dim=128,
                     block_size=128, topk=16, dtype=np.float32, seed=1)
    cq, ck, bk = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size
    I = R.select_blocks(R.block_scores(p.q_idx, p.k_idx, cq, ck, bk), cq, ck, bk, p.topk)
    J, rows = damaged(I, 4)
    q, k, v, q_idx, k_idx, do = (
        torch.tensor(x, dtype=torch.float32, device="cuda").to(torch.bfloat16) for x in (
        p.q, p.k, p.v, p.q_idx, p.k_idx, np.random.default_rng(2).standard_normal(p.q.shape)))
    o1, l1 = C.sparse_attention(q, k, v, torch.tensor(I, device="cuda"), cq, ck, bk)

    def run(sel, validate):
        sel = torch.tensor(sel, device="cuda")
        o, lse = C.sparse_attention(q, k, v, sel, cq, ck, bk, validate=validate)
        dq = C.sparse_attention_backward(q, k, v, o1, l1, do, sel, cq, ck, bk,
                                         validate=validate)[0]
        kl = _kl_backward(q, k, q_idx, k_idx, sel, l1, cq, ck, bk, with_kl=True,
                          validate=validate)
        return {"o": o.view(torch.int16), "lse": lse, "dq": dq, "kl": kl[0], "dq_idx": kl[2]}

    assert_damage_stays_in_its_rows(run, I, J, rows)
