"""msa.cuda.attention.msa_prefill (Algorithm 1 lines 3-5: the fused index + top-k, then the
sparse attention) against the reference pipeline (block_scores, select_blocks,
sparse_attention)."""

from __future__ import annotations

import numpy as np

from msa.cuda import attention as gpu
from msa.problems import make_problem
from msa.reference import attention as ref
from msa.reference.index import block_scores
from msa.reference.select import select_blocks
from msa.testing.backends import SIMULATOR, to_numpy
from msa.testing.tolerance import oracle_and_baseline

from .attention_cases import check_o_lse


def test_msa_prefill_matches_reference_pipeline():
    # fewer queries of the same sequences in the simulator (a Python thread per CUDA thread)
    lq = (12, 5) if SIMULATOR else (24, 9)
    p = make_problem((24, 16), lq, num_q_heads=4, num_kv_heads=2, head_dim=16,
                     index_dim=16, block_size=8, topk=3, seed=12)
    q, k, v, q_idx, k_idx = (x.astype(np.float32) for x in (p.q, p.k, p.v, p.q_idx, p.k_idx))
    o, lse, I = gpu.msa_prefill(q, k, v, q_idx, k_idx, p.cu_seqlens_q, p.cu_seqlens_k, 8, 3,
                                version=1)
    I = to_numpy(I)
    M = block_scores(q_idx.astype(np.float64), k_idx.astype(np.float64), p.cu_seqlens_q,
                     p.cu_seqlens_k, 8)
    I_ref = select_blocks(M, p.cu_seqlens_q, p.cu_seqlens_k, 8, 3)
    np.testing.assert_array_equal(I, I_ref)
    oracle, baseline = oracle_and_baseline(ref.sparse_attention, q, k, v, I, p.cu_seqlens_q,
                                           p.cu_seqlens_k, 8)
    check_o_lse(o, lse, oracle, baseline, "float32", 1, v)
