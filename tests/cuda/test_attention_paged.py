"""``msa.cuda.attention.sparse_attention(..., block_table=...)``: K and V read from the pages of a
KV cache (docs/design.md §8, chunked prefill) equal the packed call on the gathered sequences,
bit for bit, for every K1 rung the inputs allow.

The caches come from ``tests.paged_cases.paged_problem``: pages handed out in a random
order, spare pages, and NaN in every slot no token owns (a kernel that reads one, or multiplies
it by 0, fails). The chunk's queries are the last ``Lq`` positions of each request; lengths
below one block, on a block boundary and one past it; one query chunk or several (a small
``max_partial_bytes``), so that each chunk takes its own rows of the block table.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msa.cuda import attention as gpu
from msa.reference import index as ref_index
from msa.reference import select as ref_select
from msa.testing.backends import to_numpy
from tests.paged_cases import paged_problem

BK = 16


def chunk_case(seqlens, chunk, *, dtype=np.float16, hq=4, hkv=2, d=16, topk=3, seed=0):
    """``(p, q, cu_q, I)``: the cache of ``seqlens`` and a chunk of the last ``chunk[b]``
    positions of each request, with the reference's selection for it."""
    p = paged_problem(seqlens, 1, hq=hq, hkv=hkv, d=d, bk=BK, topk=topk, dtype=dtype, seed=seed)
    chunk = np.asarray(chunk)
    rows = np.concatenate([np.arange(p.cu_k[b + 1] - chunk[b], p.cu_k[b + 1])
                           for b in range(len(seqlens))])
    cu_q = np.concatenate([[0], np.cumsum(chunk)]).astype(np.int32)
    q, q_idx = (np.ascontiguousarray(x[rows]) for x in (p.q_full, p.q_idx_full))
    M = ref_index.block_scores(q_idx.astype(np.float64), p.k_idx.astype(np.float64), cu_q,
                               p.cu_k, BK)
    I = ref_select.select_blocks(M, cu_q, p.cu_k, topk=topk, block_size=BK).astype(np.int32)
    return p, q, cu_q, I


def both(p, q, cu_q, I, **knobs):
    """``(packed, paged)`` results of the same call, as NumPy ``(o, lse)``."""
    cu_k = p.cu_k.astype(np.int32)
    packed = gpu.sparse_attention(q, p.k, p.v, I, cu_q, cu_k, BK, **knobs)
    paged = gpu.sparse_attention(q, p.k_cache, p.v_cache, I, cu_q, cu_k, BK,
                                 block_table=p.block_table, **knobs)
    return [tuple(to_numpy(x) for x in r) for r in (packed, paged)]


def assert_bitwise(packed, paged):
    for name, a, b in zip(("o", "lse"), packed, paged):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)


# version 1 (CUDA cores: float32 here), 2 (mma through shared memory), 3 (registers)
RUNGS = [(1, np.float32), (1, np.float16), (2, np.float16), (3, np.float16)]


@pytest.mark.parametrize("version, dtype", RUNGS, ids=[f"v{v}-{np.dtype(t).name}" for v, t in RUNGS])
@pytest.mark.parametrize("seqlens, chunk", [
    ([5, 32, 33], [5, 4, 33]),  # below one block, on a boundary, one past it (a whole prefill)
    ([47, 20], [1, 20]),  # a decode-like row and a whole sequence
], ids=["ragged", "mixed"])
def test_paged_equals_packed_bitwise(version, dtype, seqlens, chunk):
    p, q, cu_q, I = chunk_case(seqlens, chunk, dtype=dtype, seed=len(seqlens) + version)
    packed, paged = both(p, q, cu_q, I, version=version)
    assert_bitwise(packed, paged)
    assert np.isfinite(paged[0]).all()  # no stale (NaN) slot reached an output


@settings(max_examples=3, deadline=None)
@given(st.data())
def test_paged_equals_packed_over_query_chunks(data):
    """Several query chunks (a partials budget of a few queries): each chunk's items take the
    pages of its own sequences."""
    n = data.draw(st.integers(1, 2), label="requests")
    seqlens = data.draw(st.lists(st.integers(1, 40), min_size=n, max_size=n), label="seqlens")
    chunk = [data.draw(st.integers(1, s), label="chunk") for s in seqlens]
    g = data.draw(st.sampled_from([1, 2]), label="G")
    p, q, cu_q, I = chunk_case(seqlens, chunk, hq=2 * g, seed=data.draw(st.integers(0, 9)))
    per_query = I.shape[2] * q.shape[1] * q.shape[2] * 2  # bf16-sized partials: a lower bound
    # at most about 6 chunks (each chunk launches every kernel of the pipeline, twice here: 27
    # chunks of 3 queries made one example 20 s in the simulator)
    least = max(3, -(-sum(chunk) // 6))
    budget = per_query * data.draw(st.integers(least, least + 5), label="queries a chunk")
    packed, paged = both(p, q, cu_q, I, version=3, max_partial_bytes=budget)
    assert_bitwise(packed, paged)


def test_paged_errors_name_the_argument():
    p, q, cu_q, I = chunk_case([20, 33], [3, 4])
    cu_k = p.cu_k.astype(np.int32)

    def call(k=p.k_cache, v=p.v_cache, table=p.block_table, cu=cu_k, bk=BK, **kw):
        return gpu.sparse_attention(q, k, v, I, cu_q, cu, bk, block_table=table, **kw)

    with pytest.raises(ValueError, match="block_table must have a row per sequence"):
        call(table=p.block_table[:1])
    with pytest.raises(ValueError, match="k must have 4 dimensions"):
        call(k=p.k)
    with pytest.raises(ValueError, match="block_size must equal the page size"):
        call(bk=32)
    bad = p.block_table.copy()
    bad[1, 2] = p.k_cache.shape[0]  # a page past the cache, in a block request 1 uses
    with pytest.raises(ValueError, match=r"block_table\[1, 2\]"):
        call(table=bad)
    long = cu_k.copy()
    long[-1] = long[-2] + p.block_table.shape[1] * BK + 1
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        call(cu=long)
    with pytest.raises(TypeError, match="block_table"):
        call(table=p.block_table.astype(np.float32))


@pytest.mark.parametrize("version, dtype", RUNGS, ids=[f"v{v}-{np.dtype(t).name}" for v, t in RUNGS])
def test_paged_hostile_pages_without_validation_stay_in_bounds(version, dtype):
    """``validate=False`` with page ids past the cache or negative: the items of those blocks
    are skipped (the simulator raises on any out-of-bounds read), the others are unchanged."""
    p, q, cu_q, I = chunk_case([80, 33], [6, 5], dtype=dtype)
    table = p.block_table.copy()
    table[0, 1] = 10 ** 6
    table[1, 0] = -5
    cu_k = p.cu_k.astype(np.int32)
    o, lse = (to_numpy(x) for x in gpu.sparse_attention(
        q, p.k_cache, p.v_cache, I, cu_q, cu_k, BK, block_table=table, validate=False,
        version=version))
    good, _ = both(p, q, cu_q, I, version=version)
    # request 0's queries that select neither block 1 nor (they cannot) request 1's block 0
    untouched = np.nonzero(~(I[:6] == 1).any(axis=(1, 2)))[0]
    assert untouched.size and (I[:6] == 1).any()  # rows of both kinds
    np.testing.assert_array_equal(o[untouched], good[0][untouched])


@pytest.mark.big
@pytest.mark.parametrize("version", [4, 3, 2, 1])
def test_big_paper_configuration_paged_equals_packed(version):
    """The paper configuration (Hq = 64, Hkv = 4, D = Bk = 128, K = 16), bf16 torch tensors on
    the GPU: two requests of 8192 and 5157 cached tokens, chunks of their last 1000 and 300,
    pages shuffled and stale pages NaN; the paged call equals the packed one bit for bit (on
    compute capability 9.0 version 4 is the default, which the simulator cannot run)."""
    torch = pytest.importorskip("torch")
    from tests.cuda.attention_cases import big_problem

    bk, hkv, d = 128, 4, 128
    lens, chunk = [8192, 5157], [1000, 300]
    q, k, v, I, cu_q, cu_k = big_problem(chunk, lens, 64, hkv, d, bk, 16, seed=7)
    nb = [-(-n // bk) for n in lens]
    rng = np.random.default_rng(8)
    pages = rng.permutation(sum(nb) + 5)  # 5 spare pages
    table = np.full((2, max(nb)), -1, np.int32)
    table[0, :nb[0]], table[1, :nb[1]] = pages[:nb[0]], pages[nb[0]:sum(nb)]
    bf = dict(device="cuda", dtype=torch.bfloat16)
    k_cache = torch.full((pages.size, hkv, bk, d), float("nan"), **bf)
    v_cache = torch.full((pages.size, hkv, bk, d), float("nan"), **bf)
    tk, tv = (torch.from_numpy(x).to(**bf) for x in (k, v))
    for b in range(2):
        for j in range(nb[b]):
            lo, hi = int(cu_k[b]) + j * bk, min(int(cu_k[b]) + (j + 1) * bk, int(cu_k[b + 1]))
            k_cache[table[b, j], :, :hi - lo] = tk[lo:hi].transpose(0, 1)
            v_cache[table[b, j], :, :hi - lo] = tv[lo:hi].transpose(0, 1)
    tq, tI = torch.from_numpy(q).to(**bf), torch.from_numpy(I).cuda()
    packed = gpu.sparse_attention(tq, tk, tv, tI, cu_q, cu_k, bk, version=version)
    paged = gpu.sparse_attention(tq, k_cache, v_cache, tI, cu_q, cu_k, bk, version=version,
                                 block_table=torch.from_numpy(table).cuda())
    for a, b in zip(packed, paged):
        assert torch.equal(a, b)
    assert torch.isfinite(paged[0].float()).all()
