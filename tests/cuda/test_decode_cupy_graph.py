"""A decode step captured in a CuPy graph (stream capture) replays bitwise as it ran eagerly.

The torch twin is ``tests/cuda/test_decode.py::test_cuda_graph_replay_equals_eager_bitwise``;
here every array is CuPy's (fp16: CuPy has no bf16), ``run`` launches on the caller's current
CuPy stream, and the graph follows the cache as it grows. GPU only (``gpu`` marker).
"""

from __future__ import annotations

import numpy as np
import pytest

from msa.cuda import decode as gpu
from tests.paged_cases import paged_problem


@pytest.mark.gpu
def test_cupy_graph_replay_equals_eager_bitwise():
    cp = pytest.importorskip("cupy")
    p = paged_problem([2000] * 4, 2, hq=64, hkv=4, d=128, d_idx=128, bk=128, topk=16,
                      dtype=np.float32, seed=1)
    c = {n: cp.asarray(np.nan_to_num(getattr(p, n), nan=0.0).astype(np.float16))
         for n in ("q", "q_idx", "k_cache", "v_cache", "k_idx_cache")}
    table = cp.asarray(p.block_table)
    lens = cp.asarray(p.cache_seqlens)
    args = (c["q"], c["q_idx"], c["k_cache"], c["v_cache"], c["k_idx_cache"], table, lens)
    pl = gpu.plan(*args, 128, 16)
    assert pl.version == 3  # fp16 at the paper configuration: the register index rung
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        eager = [x.copy() for x in gpu.run(pl, *args)]
        stream.begin_capture()
        gpu.run(pl, *args)
        graph = stream.end_capture()
        pl.o.fill(np.nan)
        pl.lse.fill(np.nan)
        pl.block_indices.fill(-7)
        graph.launch(stream)
    stream.synchronize()
    for got, want in zip((pl.o, pl.lse, pl.block_indices), eager):
        assert got.dtype == want.dtype
        assert cp.array_equal(got.view(cp.uint16) if got.dtype == cp.float16 else got,
                              want.view(cp.uint16) if want.dtype == cp.float16 else want)
    # the graph reads the cache's lengths each replay: one more token, replay == a fresh step
    with stream:
        lens += 1
        graph.launch(stream)
    stream.synchronize()
    fresh = gpu.decode_step(*args, 128, 16)
    assert cp.array_equal(pl.block_indices, fresh[2])
    assert cp.array_equal(pl.o.view(cp.uint16), fresh[0].view(cp.uint16))
