"""msa.cuda.schedule equals msa.reference.schedule exactly (paper §4.2, the hot-row scheduler).

The GPU returns ``(work [capacity, 6], num_items [1])``: the first ``W = num_items[0]`` rows must
be the reference's ``[W, 6]`` and the rest -1. Buffers start poisoned, so a row or an offset a
kernel forgets to write cannot pass.
"""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from msa._batch import Batch
from msa.cuda import csr as gpu_csr
from msa.cuda import schedule as gpu
from msa.cuda._core.arrays import ArrayContext
from msa.reference.blocks import block_row_offsets
from msa.reference.csr import build_csr
from msa.reference.schedule import build_schedule
from msa.reference.select import fixed_blocks
from msa.testing.backends import to_numpy
from msa.testing.strategies import offsets as cu
from msa.testing.strategies import seq_lens


def random_row_ptr(lk, bk, hkv, seed, *, hot_rows=0):
    """row_ptr int32 [Hkv, rows+1] a selection could give: each row of sequence b holds at most
    Lk_b queries; about 30% of rows are empty and ``hot_rows`` per head are (nearly) full."""
    rng = np.random.default_rng(seed)
    offsets = block_row_offsets(cu(lk), bk)
    cap = np.repeat(np.asarray(lk, np.int64), np.diff(offsets))  # [rows] longest possible row
    counts = (rng.random((hkv, cap.size)) * (np.minimum(cap, 12) + 1)).astype(np.int64)
    counts[rng.random(counts.shape) < 0.3] = 0
    for h in range(hkv):
        hot = rng.permutation(cap.size)[:hot_rows]
        counts[h, hot] = cap[hot] - rng.integers(0, 2, size=hot.size) * (cap[hot] > 1)
    row_ptr = np.zeros((hkv, cap.size + 1), np.int32)
    row_ptr[:, 1:] = np.cumsum(counts, axis=1)
    return row_ptr


def assert_same_schedule(got, want):
    work, num_items = (to_numpy(x) for x in got)
    assert work.dtype == np.int32 and work.ndim == 2 and work.shape[1] == 6
    assert num_items.dtype == np.int32 and num_items.shape == (1,)
    w = int(num_items[0])
    assert w == len(want) <= len(work)
    np.testing.assert_array_equal(work[:w], want)
    assert np.all(work[w:] == -1)


# --- hostile shapes ---------------------------------------------------------------------------

# Each row also picks a path: "default" (as shipped), "tiles" (two rows per tile, look-back scan
# blocks of two threads), "max_edges" (the tight capacity).
SHAPES = [
    # id, seq_lens_k, Bk, Hkv, hot rows per head, path
    ("one-row", [3], 4, 1, 0, "default"),
    ("T=1", [1], 4, 2, 0, "tiles"),
    ("Lk-not-multiple-of-Bk", [13], 4, 1, 1, "max_edges"),
    ("empty-sequences", [0, 9, 0, 5, 0], 4, 2, 1, "tiles"),
    ("many-sequences", [7, 30, 12, 19, 9, 4], 4, 3, 2, "default"),
    ("every-row-hot", [32], 8, 2, 4, "tiles"),
    ("Hkv=4", [40], 8, 4, 1, "default"),
    ("no-keys", [0], 4, 2, 0, "default"),
    ("keys-of-empty-rows", [0, 9], 4, 1, 0, "max_edges"),
    ("many-sequences-tiles", [7, 30, 12, 19, 9, 4], 4, 3, 2, "tiles"),
    ("every-row-hot-default", [32], 8, 2, 4, "default"),
]


def run_path(path, row_ptr, cu_k, bk, chunk_size):
    if path == "default":
        return gpu.build_schedule(row_ptr, cu_k, bk, chunk_size)
    if path == "tiles":
        return gpu._build_schedule(row_ptr, cu_k, bk, chunk_size, item_tile=2, scan_threads=2)
    return gpu.build_schedule(row_ptr, cu_k, bk, chunk_size, max_edges=int(row_ptr[:, -1].max()))


@pytest.mark.parametrize("lk, bk, hkv, hot_rows, path", [s[1:] for s in SHAPES],
                         ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("chunk_size", [1, 3, 10_000])
def test_schedule_equals_reference(lk, bk, hkv, hot_rows, path, chunk_size):
    row_ptr = random_row_ptr(lk, bk, hkv, seed=len(lk) + hkv, hot_rows=hot_rows)
    want = build_schedule(row_ptr, cu(lk), bk, chunk_size)
    assert_same_schedule(run_path(path, row_ptr, cu(lk), bk, chunk_size), want)


def test_literal_schedule_of_paper_example():
    # 000 §5.6: row_ptr = [0, 2, 4, 7, 8] (one sequence of 16 keys, 4 blocks), chunks of 2.
    work, num_items = gpu.build_schedule(np.array([[0, 2, 4, 7, 8]], np.int32), cu([16]), 4, 2)
    assert int(num_items[0]) == 5
    np.testing.assert_array_equal(work[:5], [
        # kv_head, row, q_begin, q_count, batch, kv_block
        [0, 0, 0, 2, 0, 0],
        [0, 1, 2, 2, 0, 1],
        [0, 2, 4, 2, 0, 2],
        [0, 2, 6, 1, 0, 2],
        [0, 3, 7, 1, 0, 3],
    ])
    assert np.all(work[5:] == -1)


def test_hot_sink_row_from_gpu_csr():
    # Everyone selects block 0 (sink + window): the GPU CSR feeds the GPU scheduler directly.
    lq = lk = [100]
    I = fixed_blocks(cu(lq), cu(lk), 8, 3, num_kv_heads=2)
    row_ptr, _, _ = gpu_csr.build_csr(I, cu(lq), cu(lk), 8)
    got = gpu.build_schedule(row_ptr, cu(lk), 8, 16, max_edges=I.shape[0] * I.shape[2])
    want = build_schedule(build_csr(I, cu(lq), cu(lk), 8)[0], cu(lk), 8, 16)
    assert_same_schedule(got, want)
    assert np.all(want[:12, 3] == 16) and set(map(tuple, want[:, :2])) >= {(0, 0), (1, 0)}


def test_reruns_are_bitwise_identical():
    row_ptr = random_row_ptr([30, 17, 25], 4, 2, seed=9, hot_rows=3)
    first = [to_numpy(x).copy() for x in gpu._build_schedule(row_ptr, cu([30, 17, 25]), 4, 3,
                                                             item_tile=4)]
    second = [to_numpy(x) for x in gpu._build_schedule(row_ptr, cu([30, 17, 25]), 4, 3,
                                                       item_tile=4)]
    for a, b in zip(first, second):
        assert a.tobytes() == b.tobytes()


def test_launch_schedule_on_query_chunks():
    # What other stages call: the unchecked CSR build and schedule on the chunks of a validated
    # batch (Batch.chunks), each against the reference on the chunk's own offsets.
    lq, lk, bk, chunk = [30, 0, 21], [40, 9, 21], 4, 3
    I = fixed_blocks(cu(lq), cu(lk), bk, 3, num_kv_heads=2)
    ctx = ArrayContext(I)
    dI = ctx.input("block_indices", I)
    for t0, t1, _, _, sub in Batch.of(cu(lq), cu(lk), bk).chunks(16):
        row_ptr, _, _ = gpu_csr.launch_build_csr(sub, dI[t0:t1], ctx)
        got = gpu.launch_schedule(sub, row_ptr, chunk, (t1 - t0) * I.shape[2], ctx)
        want_ptr = build_csr(I[t0:t1], sub.cu_q, sub.cu_k, bk)[0]
        assert_same_schedule(got, build_schedule(want_ptr, sub.cu_k, bk, chunk))


# --- capacity ---------------------------------------------------------------------------------

def test_capacity_is_tight_for_a_full_selection():
    # Every query of a prefill selects every block of its sequence (later blocks are valid too):
    # each row holds Lk_b queries, the case the capacity bound is built for.
    lk, bk, chunk_size = [10, 7], 4, 3
    nb = [-(-n // bk) for n in lk]
    I = np.full((sum(lk), 1, max(nb)), -1, np.int32)
    I[: lk[0], 0, : nb[0]] = np.arange(nb[0])
    I[lk[0]:, 0, : nb[1]] = np.arange(nb[1])
    row_ptr = build_csr(I, cu(lk), cu(lk), bk)[0]
    work, num_items = gpu.build_schedule(row_ptr, cu(lk), bk, chunk_size)
    assert len(work) == int(num_items[0]) == sum(b * -(-n // chunk_size) for n, b in zip(lk, nb))


def test_documented_capacities():
    one_m = np.array([1 << 20], np.int64)  # Lk of one sequence
    assert 4 * gpu._capacity(one_m, 128, 4096, (1 << 20) * 16) == 49_144
    assert 4 * gpu._capacity(one_m, 128, 4096, None) == 8_388_608


# --- hypothesis -------------------------------------------------------------------------------

@settings(max_examples=max(4, settings().max_examples // 2))  # about a second per example
@given(lens=seq_lens(max_seqs=4, max_len=40), bk=st.sampled_from([1, 4, 8, 16]),
       hkv=st.integers(1, 3), hot_rows=st.integers(0, 3), chunk_size=st.integers(1, 20),
       item_tile=st.sampled_from([None, 1, 2, 5]), use_max_edges=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
@example(lens=([0], [40]), bk=1, hkv=3, hot_rows=3, chunk_size=7, item_tile=5,
         use_max_edges=True, seed=1)
def test_schedule_matches_reference(lens, bk, hkv, hot_rows, chunk_size, item_tile,
                                    use_max_edges, seed):
    lk = lens[1]
    row_ptr = random_row_ptr(lk, bk, hkv, seed, hot_rows=hot_rows)
    max_edges = int(row_ptr[:, -1].max()) if use_max_edges else None
    got = gpu._build_schedule(row_ptr, cu(lk), bk, chunk_size, max_edges=max_edges,
                              item_tile=item_tile)
    assert_same_schedule(got, build_schedule(row_ptr, cu(lk), bk, chunk_size))
    # Every CSR entry is covered once by items inside its row, at most chunk_size long.
    work = to_numpy(got[0])[: int(to_numpy(got[1])[0])]
    for h in range(hkv):
        mine = work[work[:, 0] == h]
        covered = np.concatenate([np.arange(b, b + n) for b, n in mine[:, 2:4]] or [[]])
        np.testing.assert_array_equal(np.sort(covered), np.arange(row_ptr[h, -1]))
    assert np.all((work[:, 3] >= 1) & (work[:, 3] <= chunk_size))


# --- bad input --------------------------------------------------------------------------------

GOOD_ROW_PTR, GOOD_CU_K = np.array([[0, 2, 4, 7, 8]], np.int32), cu([16])


@pytest.mark.parametrize("row_ptr, error", [
    pytest.param(np.array([[0, 2, 4, 7]], np.int32), ValueError, id="rows-not-rows+1"),
    pytest.param(np.array([0, 2, 4, 7, 8], np.int32), ValueError, id="rank-1"),
    pytest.param(np.array([[1, 2, 4, 7, 8]], np.int32), ValueError, id="not-starting-at-0"),
    pytest.param(np.array([[0, 4, 2, 7, 8]], np.int32), ValueError, id="decreasing"),
    pytest.param(np.array([[0, 2, 4, 7, 2**31]], np.int64), ValueError, id="past-int32"),
    pytest.param(np.array([[0, 2, 4, 7, 8]], np.float64), TypeError, id="float-dtype"),
    pytest.param(np.array([[0, 2, 19, 20, 21]], np.int32), ValueError,
                 id="row-longer-than-its-sequence"),
])
def test_bad_row_ptr(row_ptr, error):
    with pytest.raises(error, match="row_ptr"):
        gpu.build_schedule(row_ptr, GOOD_CU_K, 4, 2)


def test_row_ptr_past_max_edges():
    with pytest.raises(ValueError, match="row_ptr"):
        gpu.build_schedule(GOOD_ROW_PTR, GOOD_CU_K, 4, 2, max_edges=7)
    with pytest.raises(ValueError, match="max_edges"):
        gpu.build_schedule(GOOD_ROW_PTR, GOOD_CU_K, 4, 2, max_edges=-1)


@pytest.mark.parametrize("chunk_size, error", [(0, ValueError), (-3, ValueError),
                                               (2.0, TypeError), (True, TypeError)],
                         ids=["zero", "negative", "float", "bool"])
def test_bad_chunk_size(chunk_size, error):
    with pytest.raises(error, match="chunk_size"):
        gpu.build_schedule(GOOD_ROW_PTR, GOOD_CU_K, 4, chunk_size)


@pytest.mark.parametrize("cu_k", [
    pytest.param(np.array([1, 16], np.int32), id="not-starting-at-0"),
    pytest.param(np.array([0, 9, 5], np.int32), id="decreasing"),
    pytest.param(np.array([0], np.int32), id="no-sequence"),
    pytest.param(np.array([[0, 16]], np.int32), id="rank-2"),
    pytest.param(np.array([0.0, 16.0]), id="float-dtype"),
])
def test_bad_cu_seqlens_k(cu_k):
    with pytest.raises((ValueError, TypeError), match="cu_seqlens_k"):
        gpu.build_schedule(GOOD_ROW_PTR, cu_k, 4, 2)


def test_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        gpu.build_schedule(GOOD_ROW_PTR, GOOD_CU_K, 0, 2)


@pytest.mark.parametrize("row_ptr", [
    [[0, 4, 2, 7, 8]], [[5, 2, 4, 7, 8]], [[0, 2, 19, 20, 21]], [[0, 2**30, 2**31 - 1, 0, 9]],
], ids=["decreasing", "not-starting-at-0", "row-longer-than-its-sequence", "huge"])
@pytest.mark.parametrize("chunk_size", [1, 3])
def test_unvalidated_garbage_stays_in_bounds(row_ptr, chunk_size):
    # Simulator: any out-of-bounds access raises. The result is unspecified but bounded.
    work, num_items = gpu.build_schedule(np.array(row_ptr, np.int32), GOOD_CU_K, 4, chunk_size,
                                         validate=False)
    assert 0 <= int(num_items[0]) <= len(work)


# --- production sizes (GPU only) --------------------------------------------------------------

def _test_csr():
    """tests/cuda/test_csr.py by path (its name clashes with tests/reference/test_csr.py)."""
    path = pathlib.Path(__file__).with_name("test_csr.py")
    spec = importlib.util.spec_from_file_location("_msa_cuda_test_csr", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.big
@pytest.mark.parametrize("n", [128 * 1024, 1024 * 1024], ids=["128K", "1M"])
@pytest.mark.parametrize("hot", [0, 3], ids=["uniform", "skewed"])
@pytest.mark.parametrize("chunk_size", [64, 4096])
def test_production_size_equals_reference(n, hot, chunk_size):
    import torch

    hkv, topk, bk = 4, 16, 128
    I = _test_csr().production_selection(n, hkv, topk, bk, seed=n + hot, hot=hot)
    dI = torch.from_numpy(I).cuda()
    cu_k = cu([n])
    row_ptr, _, _ = gpu_csr.build_csr(dI, cu_k, cu_k, bk, validate=False)
    got = gpu.build_schedule(row_ptr, cu_k, bk, chunk_size, max_edges=n * topk, validate=False)
    again = gpu.build_schedule(row_ptr, cu_k, bk, chunk_size, max_edges=n * topk, validate=False)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    assert_same_schedule(got, build_schedule(to_numpy(row_ptr), cu_k, bk, chunk_size))
