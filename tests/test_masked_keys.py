"""A query's output and gradients do not depend on any key it cannot see (docs/design.md §3).

Masking is by selection, never by multiplying a masked value by zero (``0 * NaN`` is NaN), so
changing a key that query ``t`` cannot see (its ``k`` and ``v``, or ``k`` and ``k_idx`` for the
KL), to NaN or an infinity too, must leave everything of ``t`` bitwise unchanged: its output and LSE, its partials, its KL term, its ``dq`` (and
``dq_idx``), and in a layer its output row. "Cannot see" is the support: another sequence, a
later position, or (sparse attention and the KL) a block its group did not select.

Backends: ``msa.reference`` and ``msa.torch`` (CPU). The NumPy-in, NumPy-out cases call the
stage functions through ``msa.testing.backends.Backend``, so ``msa.cuda`` is one more entry of
``NUMPY_BACKENDS`` (it then needs float32 inputs and skips what it lacks; to be added by the
cuda owner).
"""

import contextlib
import warnings

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import msa.reference as R
from msa.problems import make_problem
from msa.reference.blocks import key_positions, query_positions
from msa.testing import strategies as mst
from msa.testing.backends import Backend

torch = pytest.importorskip("torch")

NUMPY_BACKENDS = ["reference"]  # + "cuda" (simulator or GPU): to be added by the cuda owner
POISONS = [float("nan"), float("inf"), float("-inf"), 1e30, -3.0]

SHAPES = dict(max_len=40, max_heads=4, max_topk=3, dims=(4, 8), block_sizes=(4, 8, 16))


def bits(x):
    """The bit pattern of a float array (so that -0.0 != 0.0 and NaN == NaN of the same bits)."""
    x = np.ascontiguousarray(np.asarray(x))
    return x.view(np.dtype(f"u{x.itemsize}"))


def assert_same_bits(a, b, blind, what):
    """``a[blind] == b[blind]`` bit for bit; ``blind`` selects the leading axes."""
    a, b = np.asarray(a), np.asarray(b)
    assert np.array_equal(bits(a)[blind], bits(b)[blind]), (
        f"{what} changed where the key is invisible: rows "
        f"{np.argwhere(blind & (bits(a) != bits(b)).reshape(*blind.shape, -1).any(-1))[:5].tolist()}")


def sees(p, I, j):
    """``(causal [Tq], support [Tq, Hkv])`` bool: query t (and its group r) can see packed key j."""
    tq, tk = p.q.shape[0], p.k.shape[0]
    bq, pq = query_positions(p.cu_seqlens_q, p.cu_seqlens_k, tq, tk)
    bk_, pk = key_positions(p.cu_seqlens_k, tk)
    causal = (bq == bk_[j]) & (pk[j] <= pq)  # [Tq]
    if I is None:
        return causal, np.broadcast_to(causal[:, None], (tq, p.num_kv_heads))
    selected = (np.asarray(I) == pk[j] // p.block_size).any(axis=-1)  # [Tq, Hkv]
    return causal, causal[:, None] & selected


def heads(blind_groups, g):
    """[Tq, Hkv] -> [Tq, Hq]: each group's mask for its G query heads."""
    return np.repeat(blind_groups, g, axis=1)


def poisoned(x, j, value):
    y = np.array(x, copy=True)
    y[j] = value
    return y


def as_dtype(p, dtype):
    for name in ("q", "k", "v", "q_idx", "k_idx"):
        setattr(p, name, getattr(p, name).astype(dtype))
    return p


@st.composite
def cases(draw, *, indices=True):
    p, I = draw(mst.problems_with_indices(**SHAPES))
    assume(p.k.shape[0] > 0 and p.q.shape[0] > 0)
    p = as_dtype(p, draw(st.sampled_from([np.float64, np.float32])))
    # counted from the end: the simplest example poisons the last key, the one fewest see
    j = p.k.shape[0] - 1 - draw(st.integers(0, p.k.shape[0] - 1))
    value = draw(st.sampled_from(POISONS))
    return p, (I if indices else None), j, value


@contextlib.contextmanager
def quiet():
    """NumPy's warnings off: NaN and inf inputs make invalid-value warnings on purpose."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


# --- NumPy in, NumPy out: msa.reference (and msa.cuda, later) ----------------------------------

@pytest.mark.parametrize("name", NUMPY_BACKENDS)
@given(case=cases(indices=False))
def test_dense_attention(name, case):
    b = Backend(name)
    p, _, j, value = case
    k2, v2 = poisoned(p.k, j, value), poisoned(p.v, j, value)
    with quiet():
        o1, l1 = b.attention.dense_attention(p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k)
        o2, l2 = b.attention.dense_attention(p.q, k2, v2, p.cu_seqlens_q, p.cu_seqlens_k)
    causal, _ = sees(p, None, j)
    assert_same_bits(o1, o2, ~causal, "o")
    assert_same_bits(l1, l2, ~causal, "lse")


@pytest.mark.parametrize("name", NUMPY_BACKENDS)
@given(case=cases())
def test_sparse_attention_and_its_backward(name, case):
    b = Backend(name)
    p, I, j, value = case
    args = (p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    k2, v2 = poisoned(p.k, j, value), poisoned(p.v, j, value)
    with quiet():
        o1, l1 = b.attention.sparse_attention(p.q, p.k, p.v, I, *args)
        o2, l2 = b.attention.sparse_attention(p.q, k2, v2, I, *args)
        # the backward gets the same o, lse, do (the clean forward's: a query that sees the
        # poison has a NaN LSE, which a backward refuses); dq of a blind query must not move
        do = np.random.default_rng(j).standard_normal(p.q.shape).astype(p.q.dtype)
        g1 = b.attention.sparse_attention_backward(p.q, p.k, p.v, o1, l1, do, I, *args)
        g2 = b.attention.sparse_attention_backward(p.q, k2, v2, o1, l1, do, I, *args)
    _, support = sees(p, I, j)
    blind = heads(~support, p.group_size)  # [Tq, Hq]
    assert_same_bits(o1, o2, blind, "o")
    assert_same_bits(l1, l2, blind, "lse")
    assert_same_bits(g1[0], g2[0], blind, "dq")


@pytest.mark.parametrize("name", NUMPY_BACKENDS)
@given(case=cases())
def test_attention_partials_and_combine(name, case):
    b = Backend(name)
    p, I, j, value = case
    args = (p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    row_ptr, q_indices, slots = R.build_csr(I, *args)
    work = R.build_schedule(row_ptr, p.cu_seqlens_k, p.block_size, 5)
    k2, v2 = poisoned(p.k, j, value), poisoned(p.v, j, value)
    with quiet():
        parts1 = b.attention.attention_partials(p.q, p.k, p.v, work, q_indices, slots, *args,
                                                p.topk)
        parts2 = b.attention.attention_partials(p.q, k2, v2, work, q_indices, slots, *args,
                                                p.topk)
        o1, l1 = b.combine.combine_partials(*parts1)
        o2, l2 = b.combine.combine_partials(*parts2)
        o8, l8 = R.sparse_attention(p.q, k2, v2, I, *args)
    _, support = sees(p, I, j)
    blind = heads(~support, p.group_size)  # [Tq, Hq]
    for s in range(p.topk):
        assert_same_bits(parts1[0][s], parts2[0][s], blind, f"o_part[{s}]")
        assert_same_bits(parts1[1][s], parts2[1][s], blind, f"lse_part[{s}]")
    assert_same_bits(o1, o2, blind, "o")
    assert_same_bits(l1, l2, blind, "lse")
    # K1 + K2 = eq 8 on poisoned inputs too: the same NaN and +inf LSEs with NaN outputs, and
    # o = 0 where a row's visible scores are all -inf (no mass, like an empty support)
    np.testing.assert_array_equal(np.isnan(l2), np.isnan(l8))
    np.testing.assert_array_equal(np.isposinf(l2), np.isposinf(l8))
    np.testing.assert_array_equal(np.isneginf(l2), np.isneginf(l8))
    assert np.isnan(o2[np.isnan(l8) | np.isposinf(l8)]).all()
    assert (o2[np.isneginf(l8)] == 0).all() and (o8[np.isneginf(l8)] == 0).all()


@pytest.mark.parametrize("name", NUMPY_BACKENDS)
@pytest.mark.parametrize("warmup", [False, True], ids=["selected", "warmup"])
@given(case=cases())
def test_kl_loss_and_backward(name, warmup, case):
    b = Backend(name)
    p, I, j, value = case
    I = None if warmup else I
    args = (p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    if warmup:
        _, lse = R.dense_attention(p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k)
    else:
        _, lse = R.sparse_attention(p.q, p.k, p.v, I, *args)
    k2, ki2 = poisoned(p.k, j, value), poisoned(p.k_idx, j, value)
    with quiet():
        kl1, _, dq1, _ = b.kl.kl_loss_and_backward(p.q, p.k, p.q_idx, p.k_idx, I, lse, *args)
        kl2, _, dq2, _ = b.kl.kl_loss_and_backward(p.q, k2, p.q_idx, ki2, I, lse, *args)
    _, support = sees(p, I, j)
    assert_same_bits(kl1, kl2, ~support, "kl")
    assert_same_bits(dq1, dq2, ~support, "dq_idx")


@pytest.mark.parametrize("name", NUMPY_BACKENDS)
@given(case=cases(indices=False), pool=st.sampled_from(["max", "mean"]))
def test_index_scores(name, case, pool):
    b = Backend(name)
    p, _, j, value = case
    ki2 = poisoned(p.k_idx, j, value)
    with quiet():
        m1 = b.index.block_scores(p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size,
                                  pool=pool)
        m2 = b.index.block_scores(p.q_idx, ki2, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size,
                                  pool=pool)
        s1 = R.index_scores(p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k)
        s2 = R.index_scores(p.q_idx, ki2, p.cu_seqlens_q, p.cu_seqlens_k)
    causal, _ = sees(p, None, j)
    assert_same_bits(m1.transpose(1, 0, 2), m2.transpose(1, 0, 2), ~causal, "block_scores")
    assert_same_bits(s1.transpose(1, 0, 2), s2.transpose(1, 0, 2), ~causal, "index_scores")


# --- msa.torch (CPU: the reference forwards, PyTorch backwards) --------------------------------

T = torch.from_numpy


@given(case=cases(), dense=st.booleans())
def test_torch_attention_forward_and_gradients(case, dense):
    from msa.torch import dense_attention, sparse_attention

    p, I, j, value = case
    k2, v2 = poisoned(p.k, j, value), poisoned(p.v, j, value)
    do = T(np.random.default_rng(j).standard_normal(p.q.shape).astype(p.q.dtype))
    out = []
    for k, v in ((p.k, p.v), (k2, v2)):
        q, k, v = (T(np.array(x)).requires_grad_() for x in (p.q, k, v))
        with quiet():
            if dense:
                o, lse = dense_attention(q, k, v, p.cu_seqlens_q, p.cu_seqlens_k)
            else:
                o, lse = sparse_attention(q, k, v, T(I), p.cu_seqlens_q, p.cu_seqlens_k,
                                          p.block_size)
            (dq,) = torch.autograd.grad(o, (q,), do)
        out.append((o.detach().numpy(), lse.numpy(), dq.numpy()))
    causal, support = sees(p, None if dense else I, j)
    blind = heads(~support, p.group_size)
    for name, a, b in zip(("o", "lse", "dq"), *out):
        assert_same_bits(a, b, blind, name)


@given(case=cases())
def test_torch_kl_loss(case):
    from msa.torch import kl_loss

    p, I, j, value = case
    args = (p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    _, lse = R.sparse_attention(p.q, p.k, p.v, I, *args)
    k2, ki2 = poisoned(p.k, j, value), poisoned(p.k_idx, j, value)
    out = []
    for k, ki in ((p.k, p.k_idx), (k2, ki2)):
        qi = T(np.array(p.q_idx)).requires_grad_()
        with quiet():
            kl, loss = kl_loss(T(p.q), T(k), qi, T(ki), T(I), T(lse), *args)
            (dq,) = torch.autograd.grad(loss, (qi,))
        out.append((kl.numpy(), dq.numpy()))
    _, support = sees(p, I, j)
    for name, a, b in zip(("kl", "dq_idx"), *out):
        assert_same_bits(a, b, ~support, name)


# --- the layer (Algorithm 1): a poisoned token changes no output row that cannot see it ---------

@st.composite
def layer_cases(draw):
    lens = draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
    j = sum(lens) - 1 - draw(st.integers(0, sum(lens) - 1))
    return lens, j, draw(st.sampled_from(POISONS)), draw(st.booleans())


@pytest.mark.parametrize("backend", ["reference", "torch"])
@given(case=layer_cases())
def test_layer_output_rows(backend, case):
    """Token ``j`` poisoned in ``x`` changes its own query, hence its own selection. In the
    warmup (dense causal attention) nothing else changes, bit for bit. With the selection, a
    chunk of queries shares one union of blocks (the reference's Q-outer vectorisation), and
    that union may lose a block that only ``j`` had chosen: the other rows are then summed
    over a different set of padding columns, which may move their last bit, never more, and
    no NaN or inf reaches them."""
    lens, j, value, warmup = case
    params = R.init_params(16, 4, 2, 8, 8, seed=len(lens))
    x = np.random.default_rng(j).standard_normal((sum(lens), 16))
    x2 = poisoned(x, j, value)
    cu = mst.offsets(lens)
    with quiet():
        if backend == "reference":
            out = [R.msa_layer(a, params, cu, 8, 2, warmup=warmup)[0] for a in (x, x2)]
        else:
            from msa.torch import MSAAttention

            layer = MSAAttention.from_params(params, block_size=8, topk=2, warmup=warmup)
            with torch.no_grad():
                out = [layer(T(a), cu).output.numpy() for a in (x, x2)]
    p = make_problem(lens, num_q_heads=4, num_kv_heads=2)
    causal, _ = sees(p, None, j)
    if warmup:
        assert_same_bits(out[0], out[1], ~causal, "output")
    else:
        assert np.isfinite(out[1][~causal]).all()
        np.testing.assert_allclose(out[1][~causal], out[0][~causal], rtol=1e-13, atol=1e-15)
