"""Algorithm 1 (msa.reference.layer): the layer composes the stages exactly as the paper lists them."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from msa import reference as R
from msa.reference.layer import init_params, msa_layer

CASES = {
    "one-seq": dict(lens=(70,), hq=4, hkv=2, bk=16, topk=2),
    "varlen-G1": dict(lens=(33, 1, 50), hq=2, hkv=2, bk=8, topk=3),
    "T=1": dict(lens=(1,), hq=8, hkv=1, bk=16, topk=4),
    "NB<K": dict(lens=(20,), hq=4, hkv=1, bk=16, topk=5),
}


def _setup(lens, hq, hkv, d_model=24, d=8, didx=8, seed=0):
    params = init_params(d_model, hq, hkv, d, didx, seed=seed)
    x = np.random.default_rng(seed + 1).standard_normal((sum(lens), d_model))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return params, x, cu


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_layer_composes_the_stages(case):
    params, x, cu = _setup(case["lens"], case["hq"], case["hkv"])
    out, loss, aux = msa_layer(x, params, cu, case["bk"], case["topk"])
    t, hq, d = x.shape[0], case["hq"], params.head_dim
    # line 1-2 projections
    np.testing.assert_array_equal(aux["q"], (x @ params.w_q).reshape(t, hq, d))
    np.testing.assert_array_equal(aux["k_idx"], x @ params.w_k_idx)
    # lines 3-5 are the stage functions applied in order
    m = R.block_scores(aux["q_idx"], aux["k_idx"], cu, cu, case["bk"])
    np.testing.assert_array_equal(aux["block_scores"], m)
    idx = R.select_blocks(m, cu, cu, case["bk"], case["topk"])
    np.testing.assert_array_equal(aux["block_indices"], idx)
    o, lse = R.sparse_attention(aux["q"], aux["k"], aux["v"], idx, cu, cu, case["bk"])
    np.testing.assert_array_equal(aux["o"], o)
    # line 6
    np.testing.assert_allclose(out, o.reshape(t, -1) @ params.w_o, rtol=0, atol=0)
    # line 7: the KL of the layer is the stage's loss, and it is a KL (>= 0)
    _, want = R.kl_loss(aux["q"], aux["k"], aux["q_idx"], aux["k_idx"], idx, lse, cu, cu, case["bk"])
    assert loss == pytest.approx(float(want), rel=0, abs=0)
    assert loss >= 0


def test_warmup_is_dense_and_equals_sparse_with_every_block():
    params, x, cu = _setup((90, 41), 4, 2)
    bk = 16
    nb = R.max_blocks(cu, bk)
    out_w, loss_w, aux_w = msa_layer(x, params, cu, bk, 2, warmup=True)
    o_dense, _ = R.dense_attention(aux_w["q"], aux_w["k"], aux_w["v"], cu, cu)
    np.testing.assert_array_equal(aux_w["o"], o_dense)
    # with K >= NB every visible block is selected: sparse layer == warmup layer
    out_all, loss_all, _ = msa_layer(x, params, cu, bk, nb, warmup=False)
    np.testing.assert_allclose(out_all, out_w, rtol=1e-12, atol=1e-12)
    assert loss_all == pytest.approx(loss_w, rel=1e-10, abs=1e-12)
    # with few blocks the main branch really is sparse
    out_sparse, _, _ = msa_layer(x, params, cu, bk, 1, warmup=False)
    assert np.abs(out_sparse - out_w).max() > 1e-3


@given(st.integers(1, 3), st.integers(0, 10_000))
def test_layer_loss_is_finite_and_nonnegative(topk, seed):
    params, x, cu = _setup((37, 12), 4, 1, seed=seed)
    out, loss, aux = msa_layer(x, params, cu, 8, topk)
    assert np.isfinite(out).all() and np.isfinite(loss) and loss >= 0
    assert aux["kl"].shape == (49, 1)


def test_layer_rejects_bad_input():
    params, x, cu = _setup((10,), 2, 1)
    with pytest.raises(ValueError, match="x"):
        msa_layer(x[:, :5], params, cu, 8, 2)
    with pytest.raises(ValueError, match="block_size"):
        msa_layer(x, params, cu, 0, 2)
    with pytest.raises(ValueError, match="topk"):
        msa_layer(x, params, cu, 8, 0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        msa_layer(x, params, np.array([0, 9], np.int32), 8, 2)
    with pytest.raises(ValueError, match="Hkv"):
        init_params(8, 3, 2, 4, 4)
