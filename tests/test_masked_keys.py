"""A query's output and gradients do not depend on any key it cannot see (docs/design.md §3).

Masking is by selection, never by multiplying a masked value by zero (``0 * NaN`` is NaN), so
changing a key that query ``t`` cannot see (its ``k`` and ``v``, or ``k`` and ``k_idx`` for the
KL), to NaN or an infinity too, must leave everything of ``t`` bitwise unchanged: its output and LSE, its partials, its KL term, its ``dq`` (and
``dq_idx``), and in a layer its output row. "Cannot see" is the support: another sequence, a
later position, or (sparse attention and the KL) a block its group did not select.

Backends: ``msa.reference`` and ``msa.torch`` (CPU) run the properties below through
``msa.testing.backends.Backend`` on float64 and float32 problems. ``msa.cuda`` has them per
stage, on the inputs that reach each of its rungs (v1 on float32, the tensor-core rungs on
float16 and bf16 with D and Bk multiples of 16): the forward (K1 every rung, K2,
``sparse_attention``) at the end of this file, which also checks that a NaN or an infinity in V
at a key a row does see gives the reference's NaN and infinities; the backward's ``dq`` in
``tests/cuda/test_attention_backward.py``; ``kl`` and ``dq_idx`` in ``tests/cuda/test_kl.py``;
block scores and the fused selection in ``tests/cuda/test_index.py``; decode on a paged cache
(stale slots, later drafts) in ``tests/cuda/test_decode.py``.
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
from msa.testing.backends import Backend, cuda_runnable

torch = pytest.importorskip("torch")

NUMPY_BACKENDS = ["reference"]  # msa.cuda: its own per-rung tests (module docstring)
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
    # some row must be blind to key j, or the example compares nothing
    assume((~sees(p, I if indices else None, j)[1]).any())
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
    # given o, lse and dO, a key's own dk and dv read only its own scores and values
    others = np.arange(p.k.shape[0]) != j
    assert_same_bits(g1[1], g2[1], others, "dk of another key")
    assert_same_bits(g1[2], g2[2], others, "dv of another key")


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


# --- msa.cuda's forward: K1 (every rung) and K2, simulator or GPU -------------------------------
# A tensor-core rung computes O = P V over the whole block, P = 0 at the keys a row cannot see:
# it keeps non-finite V values out of its tiles and restores the rows that see them (_tile).

def _cuda_or_skip():
    ok, why = cuda_runnable()
    if not ok:
        pytest.skip(why)


def _v4_or_skip():
    from msa.cuda._core.wgmma import why_not_available

    why = why_not_available()
    if why:
        pytest.skip(why)


# version, input kind: v1 on float32, v2 and v3 on float16 and bf16 (bit patterns), v4 on a GPU
CUDA_RUNGS = [pytest.param(1, "float32", id="v1-f32"), pytest.param(2, "float16", id="v2-f16"),
              pytest.param(2, "bfloat16", id="v2-bf16"), pytest.param(3, "float16", id="v3-f16"),
              pytest.param(3, "bfloat16", id="v3-bf16"), pytest.param(4, "float16", id="v4-f16"),
              pytest.param(4, "bfloat16", id="v4-bf16")]
# The tensor-core rungs need D and Bk multiples of 16; the simulator is slow (a Python thread a
# CUDA thread): small problems, a few examples.
CUDA_SHAPES = {1: dict(max_len=24, max_heads=4, max_topk=3, dims=(4, 8), block_sizes=(4, 8, 16)),
               2: dict(max_len=40, max_heads=4, max_topk=3, dims=(16,), block_sizes=(16,))}


def _cuda_inputs(kind, *arrays):
    """``(what msa.cuda gets, the same values in float32)`` for each array: float32, float16,
    or bf16 bit patterns (uint16; the simulator's NumPy has no bf16)."""
    from tests.cuda.attention_cases import cast

    return [cast(x, kind) for x in arrays]


@st.composite
def cuda_cases(draw, version):
    p, I = draw(mst.problems_with_indices(**CUDA_SHAPES[min(version, 2)]))
    assume(p.k.shape[0] > 0 and p.q.shape[0] > 0)
    j = p.k.shape[0] - 1 - draw(st.integers(0, p.k.shape[0] - 1))
    return p, I, j, draw(st.sampled_from(POISONS))


def _cuda_partials(version, kind, q, k, v, work, q_indices, slots, p, **knobs):
    from msa.cuda.attention import _attention_partials

    o, lse = _attention_partials(q, k, v, work, q_indices, slots, p.cu_seqlens_q,
                                 p.cu_seqlens_k, p.block_size, p.topk, version=version,
                                 bf16_bits=kind == "bfloat16", **knobs)
    return np.array(o), np.array(lse)


def _one_dtype_a_rung(*heavy):
    """CUDA_RUNGS with ``heavy`` (ids) sim_heavy: a rung's two 16-bit kinds draw the same cases
    through the same kernel, so the simulator runs one of them a rung (on a GPU both)."""
    return [pytest.param(*c.values, id=c.id, marks=pytest.mark.sim_heavy) if c.id in heavy
            else c for c in CUDA_RUNGS]


# v2-bf16, v3-f16 and v4 run on a GPU (and with MSA_SIM_FULL=1): v2-f16 and v3-bf16 cover the
# rungs, and v4 on the wgmma twins is v3's arithmetic (test_cuda_visible_nonfinite_values_...
# runs its masking code in the simulator)
@pytest.mark.parametrize("version,kind", _one_dtype_a_rung("v2-bf16", "v3-f16", "v4-f16",
                                                           "v4-bf16"))
@mst.fewer_in_simulator(3)
@given(data=st.data())
def test_cuda_attention_partials_and_combine(version, kind, data):
    """K1 then K2 of msa.cuda, as ``test_attention_partials_and_combine``: a key's k and v
    poisoned leave the partials, o and lse of every query that cannot see it bitwise unchanged,
    and the combined LSEs of the poisoned run have the reference's NaN and infinities."""
    _cuda_or_skip()
    if version == 4:
        _v4_or_skip()
    from msa.cuda.combine import combine_partials

    p, I, j, value = data.draw(cuda_cases(version))
    args = (p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    row_ptr, q_indices, slots = R.build_csr(I, *args)
    work = R.build_schedule(row_ptr, p.cu_seqlens_k, p.block_size, 5)
    with quiet():
        (q, q32), (k, _), (v, _) = _cuda_inputs(kind, p.q, p.k, p.v)
        (k2, k32), (v2, v32) = _cuda_inputs(kind, poisoned(p.k, j, value),
                                            poisoned(p.v, j, value))
        parts1 = _cuda_partials(version, kind, q, k, v, work, q_indices, slots, p)
        parts2 = _cuda_partials(version, kind, q, k2, v2, work, q_indices, slots, p)
        o1, l1 = (np.array(x) for x in combine_partials(*parts1))
        o2, l2 = (np.array(x) for x in combine_partials(*parts2))
        _, l8 = R.sparse_attention(q32, k32, v32, I, *args)
    _, support = sees(p, I, j)
    blind = heads(~support, p.group_size)  # [Tq, Hq]
    for s in range(p.topk):
        assert_same_bits(parts1[0][s], parts2[0][s], blind, f"o_part[{s}]")
        assert_same_bits(parts1[1][s], parts2[1][s], blind, f"lse_part[{s}]")
    assert_same_bits(o1, o2, blind, "o")
    assert_same_bits(l1, l2, blind, "lse")
    np.testing.assert_array_equal(np.isnan(l2), np.isnan(l8))
    np.testing.assert_array_equal(np.isposinf(l2), np.isposinf(l8))
    np.testing.assert_array_equal(np.isneginf(l2), np.isneginf(l8))
    assert np.isnan(o2[np.isnan(l8) | np.isposinf(l8)]).all()
    assert (o2[np.isneginf(l8)] == 0).all()


@pytest.mark.parametrize("version,kind,partials", [
    pytest.param(1, "float32", "float32", id="v1-f32"),
    pytest.param(2, "float16", "bfloat16", id="v2-f16-bf16part"),
    pytest.param(3, "bfloat16", "bfloat16", id="v3-bf16-bf16part"),
    pytest.param(4, "bfloat16", "bfloat16", id="v4-bf16-bf16part")])
@mst.fewer_in_simulator(2)
@given(data=st.data())
def test_cuda_sparse_attention_forward(version, kind, partials, data):
    """The forward half of ``test_sparse_attention_and_its_backward`` on msa.cuda (CSR,
    schedule, K1, K2 in one call), with bf16 partials on the tensor-core rungs."""
    _cuda_or_skip()
    if version == 4:
        _v4_or_skip()
    from msa.cuda.attention import _sparse_attention

    p, I, j, value = data.draw(cuda_cases(version))
    args = (I, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    out = []
    with quiet():
        (q, _), = _cuda_inputs(kind, p.q)
        for kk, vv in ((p.k, p.v), (poisoned(p.k, j, value), poisoned(p.v, j, value))):
            (k, _), (v, _) = _cuda_inputs(kind, kk, vv)
            o, lse = _sparse_attention(q, k, v, *args, version=version, partial_dtype=partials,
                                       bf16_bits=kind == "bfloat16")
            out.append((np.array(o), np.array(lse)))
    _, support = sees(p, I, j)
    blind = heads(~support, p.group_size)
    assert_same_bits(out[0][0], out[1][0], blind, "o")
    assert_same_bits(out[0][1], out[1][1], blind, "lse")


def _visible_poison_case():
    """A problem whose V holds, at keys every later query of the sequence sees (k stays finite),
    a NaN in one column, +inf in another, -inf in a third, and +inf and -inf in a fourth; with
    the selection of every block up to the query's (``(p, I)``; D = Bk = 16, two sequences)."""
    from tests.cuda.attention_cases import problem

    p, I = problem([20, 9], [37, 9], 4, 2, 16, 16, 3, seed=7)
    v = np.array(p.v)
    for t, d, value in ((3, 1, np.nan), (17, 5, np.inf), (21, 5, np.inf), (18, 9, -np.inf),
                        (19, 12, np.inf), (33, 12, -np.inf), (37 + 4, 2, np.inf)):
        v[t, 0, d] = value
    v[20, 1, 7] = np.nan  # the other KV head
    p.v = v
    return p, I


# v3-f16 runs on a GPU (and with MSA_SIM_FULL=1): v3-bf16 is the same problem through the same
# rung and knobs (fp16 and bf16 differ in the mma type alone), v2-f16 fp16 inputs' poisons on
# tensor cores
@pytest.mark.parametrize("version,kind", _one_dtype_a_rung("v3-f16", "v4-f16"))
def test_cuda_visible_nonfinite_values_give_the_references_classes(version, kind):
    """A NaN or an infinity in V at a key a row sees makes that row's output NaN or that
    infinity, as the reference's (IEEE) arithmetic does, in K1's partials and in the whole
    sparse attention (bf16 partials on the tensor-core rungs: the epilogue that restores them
    reads back and re-rounds its 16-bit stores); every other element stays close to it."""
    _cuda_or_skip()
    if version == 4:
        _v4_or_skip()
    from msa.cuda.attention import _sparse_attention
    from tests.cuda.attention_cases import as_float

    p, I = _visible_poison_case()
    args = (p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    row_ptr, q_indices, slots = R.build_csr(I, *args)
    work = R.build_schedule(row_ptr, p.cu_seqlens_k, p.block_size, 6)
    with quiet():
        (q, q32), (k, k32), (v, v32) = _cuda_inputs(kind, p.q, p.k, p.v)
        got = [_cuda_partials(version, kind, q, k, v, work, q_indices, slots, p)[0]]
        want = [R.attention_partials(q32, k32, v32, work, q_indices, slots, *args, p.topk)[0]]
        o, _ = _sparse_attention(q, k, v, I, *args, version=version,
                                 partial_dtype="float32" if version == 1 else "bfloat16",
                                 bf16_bits=kind == "bfloat16")
        got.append(as_float(np.array(o), kind))
        want.append(R.sparse_attention(q32, k32, v32, I, *args)[0])
    for name, a, b in zip(("o_part", "o"), got, want):
        assert np.isnan(b).any() and np.isposinf(b).any() and np.isneginf(b).any()
        for cls in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(cls(a), cls(b), err_msg=f"{name}: {cls.__name__}")
        finite = np.isfinite(b)
        np.testing.assert_allclose(a[finite], b[finite], atol=5e-2, err_msg=name)
    if version == 3:  # 3 warp groups over the block, and plain loads instead of cp.async
        for knobs in ({"groups": 3}, {"assume_unaligned": True}):
            with quiet():
                other = _cuda_partials(version, kind, q, k, v, work, q_indices, slots, p,
                                       **knobs)[0]
            assert bits(other).tobytes() == bits(got[0]).tobytes(), knobs
