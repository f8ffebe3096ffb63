"""Paper §3.2 eq 9-11: properties of the KL loss reference and its analytic backward.

``kl_loss``/``kl_backward`` work tile by tile (one selected key block and its queries at a time);
``student_probs``/``teacher_probs`` materialise the dense ``[Hkv, Tq, Tk]`` distributions on a
support mask built straight from token positions. The dense route in float64 is the reference;
the same dense route in float32 is the yardstick for tolerances: a float64 result must be within
twice the float32 route's error (docs/design.md §5), plus a few ulps of the output for exact zeros.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from msa.problems import make_problem
from msa.reference import kl as kl_module
from msa.reference.attention import dense_attention, sparse_attention
from msa.reference.blocks import local_blocks, max_blocks, query_positions
from msa.reference.index import block_scores
from msa.reference.kl import kl_backward, kl_loss, student_probs, teacher_probs
from msa.reference.select import select_blocks
from msa.testing.strategies import problem_shapes

EPS64 = float(np.finfo(np.float64).eps)


def all_visible_blocks(p):
    """I [Tq, Hkv, NB] selecting every block with a visible key (blocks 0..local, then -1)."""
    tq, tk, hkv = p.q.shape[0], p.k.shape[0], p.num_kv_heads
    nb = max(1, max_blocks(p.cu_seqlens_k, p.block_size))
    local = local_blocks(p.cu_seqlens_q, p.cu_seqlens_k, tq, tk, p.block_size)  # [Tq]
    b = np.arange(nb)
    row = np.where(b[None, :] <= local[:, None], b[None, :], -1).astype(np.int32)  # [Tq, NB]
    return np.ascontiguousarray(np.broadcast_to(row[:, None, :], (tq, hkv, nb)))


def random_blocks(p, rng, *, future=False):
    """A valid I [Tq, Hkv, K]: the local block and random earlier ones in random slot order;
    with ``future`` the others may also be blocks after the local one (valid, they add no key)."""
    tq, tk, hkv, bk, topk = p.q.shape[0], p.k.shape[0], p.num_kv_heads, p.block_size, p.topk
    batch, pos = query_positions(p.cu_seqlens_q, p.cu_seqlens_k, tq, tk)
    lk = np.diff(p.cu_seqlens_k.astype(np.int64))
    I = np.full((tq, hkv, topk), -1, dtype=np.int32)
    for t in range(tq):
        local = int(pos[t]) // bk
        seq_blocks = -(-int(lk[batch[t]]) // bk)
        for r in range(hkv):
            pool = list(range(local + 1 if not future else seq_blocks))
            pool.remove(local)
            n = int(rng.integers(0, min(topk - 1, len(pool)) + 1))
            row = [local] + list(rng.choice(pool, size=n, replace=False))
            rng.shuffle(row)
            I[t, r, :len(row)] = row
    return I


def selection(p, mode, rng):
    """Block indices for ``mode``: the real pipeline, random rows, or None (warmup)."""
    if mode == "warmup":
        return None
    if mode == "select":
        m = block_scores(p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
        return select_blocks(m, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, p.topk)
    if mode == "all":
        return all_visible_blocks(p)
    return random_blocks(p, rng, future=(mode == "random+future"))


def args(p, I, lse=None, dtype=None):
    """Positional arguments of kl_loss/kl_backward, the floats cast to ``dtype``."""
    cast = (lambda x: x) if dtype is None else (lambda x: x.astype(dtype))
    return (cast(p.q), cast(p.k), cast(p.q_idx), cast(p.k_idx), I, lse, p.cu_seqlens_q,
            p.cu_seqlens_k, p.block_size)


def dense_kl(p, I, dtype=np.float64):
    """KL [Tq, Hkv] and (P, P_idx) [Hkv, Tq, Tk] from the dense helpers, computed in ``dtype``."""
    P = teacher_probs(p.q.astype(dtype), p.k.astype(dtype), I, None, p.cu_seqlens_q,
                      p.cu_seqlens_k, p.block_size)
    P_idx = student_probs(p.q_idx.astype(dtype), p.k_idx.astype(dtype), I, p.cu_seqlens_q,
                          p.cu_seqlens_k, p.block_size)
    pos = P > 0
    log_ratio = np.zeros_like(P)
    log_ratio[pos] = np.log(P[pos]) - np.log(P_idx[pos])
    return (P * log_ratio).sum(axis=-1).T, P, P_idx


def dense_grads(p, P, P_idx, grad_loss=1.0):
    """dq_idx, dk_idx from ``dS = g (P_idx - P) / (Tq Hkv)`` with the dense distributions."""
    tq, hkv, d_idx = p.q_idx.shape
    scale = 1.0 / np.sqrt(d_idx)
    dS = grad_loss * (P_idx - P) / max(1, tq * hkv)  # [Hkv, Tq, Tk]
    dq = scale * np.einsum("rtj,jd->trd", dS, p.k_idx.astype(P.dtype))
    dk = scale * np.einsum("rtj,trd->jd", dS, p.q_idx.astype(P.dtype))
    return dq, dk


def assert_within_baseline(got, ref64, base32, factor=2.0):
    """max|got - ref64| <= factor * max|base32 - ref64| + 8 ulps of got at the reference's scale."""
    eps = np.finfo(np.asarray(got).dtype).eps
    got, ref64, base32 = (np.asarray(x, dtype=np.float64) for x in (got, ref64, base32))
    assert got.shape == ref64.shape
    if got.size == 0:
        return
    err = np.abs(got - ref64).max()
    base = np.abs(base32 - ref64).max()
    ulps = 8 * eps * max(1.0, np.abs(ref64).max())
    assert err <= factor * base + ulps, f"error {err:.3g} > {factor} x float32 baseline {base:.3g}"


CASES = {
    "T=1": dict(seq_lens_k=(1,)),
    "T-not-multiple-of-Bk": dict(seq_lens_k=(45,), block_size=8),
    "NB<K": dict(seq_lens_k=(20,), block_size=8, topk=5),
    "G=1": dict(seq_lens_k=(33,), num_q_heads=3, num_kv_heads=3),
    "G=16": dict(seq_lens_k=(19,), num_q_heads=16, num_kv_heads=1),
    "empty-sequences": dict(seq_lens_k=(0, 17, 0, 9), seq_lens_q=(0, 17, 0, 0)),
    "many-sequences": dict(seq_lens_k=(5, 30, 1, 12, 8)),
    "Lq<Lk": dict(seq_lens_k=(40, 25), seq_lens_q=(3, 1)),
    "K=1": dict(seq_lens_k=(30,), topk=1, block_size=4),
    "Bk=1": dict(seq_lens_k=(12,), topk=3, block_size=1),
}
MODES = ("select", "random", "random+future", "warmup", "all")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_dense_distributions(case, mode):
    """kl and its mean, and both gradients, agree with the dense helpers (eq 9-10, 11)."""
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=8, index_dim=8, block_size=4, topk=3)
    p = make_problem(**{**kw, **case}, seed=7)
    I = selection(p, mode, np.random.default_rng(3))
    kl64, P, P_idx = dense_kl(p, I)
    kl32, P32, P_idx32 = dense_kl(p, I, np.float32)
    kl, loss = kl_loss(*args(p, I))
    assert kl.dtype == np.float64 and loss.dtype == np.float64
    assert_within_baseline(kl, kl64, kl32)
    assert_within_baseline(loss, kl64.mean() if kl64.size else 0.0,
                           kl32.astype(np.float64).mean() if kl32.size else 0.0)
    dq, dk = kl_backward(*args(p, I))
    dq64, dk64 = dense_grads(p, P, P_idx)
    dq32, dk32 = dense_grads(p, P32, P_idx32)
    assert_within_baseline(dq, dq64, dq32)
    assert_within_baseline(dk, dk64, dk32)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_float32_within_twice_the_float32_baseline(case):
    """Float32 in -> float32 out, as accurate as the dense float32 route; float16 computes in
    float32."""
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=8, index_dim=8, block_size=4, topk=3)
    p = make_problem(**{**kw, **case}, seed=11)
    I = selection(p, "select", None)
    kl64, P, P_idx = dense_kl(p, I)
    kl32, P32, P_idx32 = dense_kl(p, I, np.float32)
    kl, loss = kl_loss(*args(p, I, dtype=np.float32))
    assert kl.dtype == np.float32 and loss.dtype == np.float32
    assert_within_baseline(kl, kl64, kl32)
    dq, dk = kl_backward(*args(p, I, dtype=np.float32))
    assert dq.dtype == dk.dtype == np.float32
    dq64, dk64 = dense_grads(p, P, P_idx)
    dq32, dk32 = dense_grads(p, P32, P_idx32)
    assert_within_baseline(dq, dq64, dq32)
    assert_within_baseline(dk, dk64, dk32)
    kl16, _ = kl_loss(*args(p, I, dtype=np.float16))
    assert kl16.dtype == np.float32


@st.composite
def kl_problems(draw, modes=MODES, **shape_kw):
    kw = draw(problem_shapes(max_len=40, max_heads=8, **shape_kw))
    p = make_problem(**kw)
    mode = draw(st.sampled_from(modes))
    return p, selection(p, mode, np.random.default_rng(kw["seed"]))


@given(kl_problems())
@example(problem=(make_problem((0,), num_q_heads=1, num_kv_heads=1), np.zeros((0, 1, 1), np.int32)))
def test_kl_is_nonnegative_and_matches_dense(problem):
    """KL(P || P_idx) >= 0 per (query, group) (Gibbs), and equals the dense computation."""
    p, I = problem
    kl, loss = kl_loss(*args(p, I))
    kl64, _, _ = dense_kl(p, I)
    kl32, _, _ = dense_kl(p, I, np.float32)
    assert_within_baseline(kl, kl64, kl32)
    # A KL rounds to at most a few ulps of its terms below 0 when P = P_idx.
    assert (kl >= -64 * EPS64).all()
    assert loss >= -64 * EPS64


@given(kl_problems(), st.sampled_from(["none", "attention"]))
def test_distributions_sum_to_one_on_the_support(problem, lse_source):
    """Teacher and student rows sum to 1 over the support (0 off it, all-0 when it is empty),
    with the teacher normalised by the main branch's own LSE from the attention reference.

    A sum of Tk probabilities rounds to within Tk ulps of 1; 4 Tk ulps leaves room for the LSE.
    """
    p, I = problem
    lse = None
    if lse_source == "attention":
        if I is None:
            _, lse = dense_attention(p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k)
        else:
            _, lse = sparse_attention(p.q, p.k, p.v, I, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    P = teacher_probs(p.q, p.k, I, lse, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    P_idx = student_probs(p.q_idx, p.k_idx, I, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    assert ((P > 0) == (P_idx > 0)).all()  # the same support (Gaussian logits never underflow)
    nonempty = P_idx.sum(axis=-1) > 0  # [Hkv, Tq]
    tk = max(1, p.k.shape[0])
    np.testing.assert_allclose(P.sum(axis=-1)[nonempty], 1.0, rtol=0, atol=4 * tk * EPS64)
    np.testing.assert_allclose(P_idx.sum(axis=-1)[nonempty], 1.0, rtol=0, atol=4 * tk * EPS64)
    assert (P.sum(axis=-1)[~nonempty] == 0).all()
    if lse is not None:
        kl_given, _ = kl_loss(*args(p, I, lse=lse))
        kl_own, _ = kl_loss(*args(p, I))
        kl32, _, _ = dense_kl(p, I, np.float32)
        assert_within_baseline(kl_given, kl_own, kl32)


@given(kl_problems(), st.integers(1, 3))
def test_student_equal_to_teacher_gives_zero(problem, hkv):
    """G = 1, q_idx = q, every k head = k_idx, index_scale = scale: P_idx = P, KL = 0, grad = 0."""
    p, _ = problem
    tq, tk, d = p.q.shape[0], p.k.shape[0], p.q.shape[2]
    rng = np.random.default_rng(0)
    q_idx = rng.standard_normal((tq, hkv, d))
    k_idx = rng.standard_normal((tk, d))
    q, k = q_idx.copy(), np.repeat(k_idx[:, None, :], hkv, axis=1)
    same = dataclasses.replace(p, q=q, k=k, q_idx=q_idx, k_idx=k_idx)
    I = random_blocks(same, rng)
    kl, loss = kl_loss(q, k, q_idx, k_idx, I, None, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size,
                       scale=0.3, index_scale=0.3)
    assert np.abs(kl).max(initial=0.0) <= 16 * EPS64
    dq, dk = kl_backward(q, k, q_idx, k_idx, I, None, p.cu_seqlens_q, p.cu_seqlens_k,
                         p.block_size, scale=0.3, index_scale=0.3)
    assert np.abs(dq).max(initial=0.0) <= 16 * EPS64 and np.abs(dk).max(initial=0.0) <= 16 * EPS64
    # The same inputs with a different index scale: the student differs, the KL does not vanish.
    kl_off, _ = kl_loss(q, k, q_idx, k_idx, I, None, p.cu_seqlens_q, p.cu_seqlens_k,
                        p.block_size, scale=0.3, index_scale=0.6)
    support = student_probs(q_idx, k_idx, I, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size) > 0
    several = (support.sum(axis=-1) > 1).T  # [Tq, Hkv] rows with more than one key
    assert (kl_off[several] > 0).all()


def finite_difference_check(p, I, grad_loss, seed):
    """Central differences of grad_loss * L_KL along random directions vs the analytic gradient.

    Step h = 1e-4 on O(1) inputs: the truncation error is h^2 / 6 ~ 2e-9 times the third
    derivative and the rounding error 2 eps |L| / h ~ 5e-12 |L|, both far below the 1e-6
    relative tolerance used, while a wrong gradient (e.g. a missing index_scale or 1/(Tq Hkv))
    is off by O(1) relative.
    """
    rng = np.random.default_rng(seed)
    dq, dk = kl_backward(*args(p, I), grad_loss=grad_loss)
    h = 1e-4
    for _ in range(2):
        vq = rng.standard_normal(p.q_idx.shape)
        vk = rng.standard_normal(p.k_idx.shape)

        def loss_at(step):
            a = list(args(p, I))
            a[2], a[3] = p.q_idx + step * vq, p.k_idx + step * vk
            return grad_loss * float(kl_loss(*a)[1])

        fd = (loss_at(h) - loss_at(-h)) / (2 * h)
        analytic = float((dq * vq).sum() + (dk * vk).sum())
        scale = (np.abs(dq).sum() * np.abs(vq).max(initial=0.0)
                 + np.abs(dk).sum() * np.abs(vk).max(initial=0.0))
        assert abs(fd - analytic) <= 1e-6 * scale + 2 * EPS64 * abs(loss_at(0.0)) / h, (fd, analytic)


@given(kl_problems(modes=("select", "random", "warmup")), st.sampled_from([1.0, -0.5, 3.0]))
def test_gradient_matches_finite_differences(problem, grad_loss):
    """kl_backward is the gradient of grad_loss * kl_loss with respect to q_idx and k_idx."""
    p, I = problem
    finite_difference_check(p, I, grad_loss, seed=1)


def test_gradient_every_coordinate():
    """Full Jacobian check on a tiny two-sequence problem, coordinate by coordinate.

    h = 1e-5: rounding (2 eps L / h) and truncation (h^2 / 6 times the third derivative) are
    both ~1e-11 absolute against gradients of 1e-4..1e-2: rtol 1e-5 with a 1e-9 floor for
    near-zero entries.
    """
    p = make_problem((9, 6), (5, 6), num_q_heads=4, num_kv_heads=2, head_dim=4, index_dim=3,
                     block_size=3, topk=2, seed=5)
    I = selection(p, "select", None)
    dq, dk = kl_backward(*args(p, I))
    h = 1e-5
    for name, x, grad in (("q_idx", p.q_idx, dq), ("k_idx", p.k_idx, dk)):
        fd = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            for sign in (1, -1):
                x[i] += sign * h
                fd[i] += sign * float(kl_loss(*args(p, I))[1]) / (2 * h)
                x[i] -= sign * h
        np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-9, err_msg=name)


def test_gradient_wrt_student_logits_is_p_idx_minus_p():
    """With k_idx = identity, S_idx[t, r, j] = q_idx[t, r, j] s_idx, so dq_idx reveals
    dS = (P_idx - P) / (Tq Hkv) entry by entry."""
    p = make_problem((6, 10), num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=4, topk=2,
                     seed=2)
    tk = p.k.shape[0]
    p = dataclasses.replace(p, q_idx=np.random.default_rng(1).standard_normal((p.q.shape[0], 2, tk)),
                            k_idx=np.eye(tk))
    I = random_blocks(p, np.random.default_rng(4))
    s_idx = 0.7
    dq, dk = kl_backward(*args(p, I), index_scale=s_idx)
    P = teacher_probs(p.q, p.k, I, None, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    P_idx = student_probs(p.q_idx, p.k_idx, I, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size,
                          index_scale=s_idx)
    dS = dq.transpose(1, 0, 2) / s_idx * (p.q.shape[0] * 2)  # [Hkv, Tq, Tk]
    P32 = teacher_probs(p.q.astype(np.float32), p.k.astype(np.float32), I, None, p.cu_seqlens_q,
                        p.cu_seqlens_k, p.block_size)
    P_idx32 = student_probs(p.q_idx.astype(np.float32), p.k_idx.astype(np.float32), I,
                            p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, index_scale=s_idx)
    assert_within_baseline(dS, P_idx - P, P_idx32 - P32)
    assert np.abs(dS).max() > 0.01


@given(kl_problems(modes=("select", "random", "random+future")))
def test_warmup_equals_every_visible_block(problem):
    """block_indices=None (warmup) is the same loss and gradient as selecting every visible block,
    and as select_blocks with K >= NB; adding future blocks to a row changes nothing."""
    p, I = problem
    warm = kl_loss(*args(p, None))
    every = kl_loss(*args(p, all_visible_blocks(p)))
    np.testing.assert_array_equal(warm[0], every[0])
    assert warm[1] == every[1]
    nb = max(1, max_blocks(p.cu_seqlens_k, p.block_size))
    m = block_scores(p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    big_k = select_blocks(m, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, nb + 1)
    selected = kl_loss(*args(p, big_k))
    np.testing.assert_array_equal(warm[0], selected[0])
    gw = kl_backward(*args(p, None))
    gs = kl_backward(*args(p, big_k))
    np.testing.assert_array_equal(gw[0], gs[0])
    np.testing.assert_array_equal(gw[1], gs[1])


def test_future_blocks_add_nothing():
    """A block after the query's local block holds only future keys: the KL ignores it."""
    p = make_problem((24,), num_q_heads=2, num_kv_heads=1, block_size=4, topk=3, seed=9)
    local = local_blocks(p.cu_seqlens_q, p.cu_seqlens_k, 24, 24, 4).astype(np.int32)  # [Tq]
    I = np.full((24, 1, 2), -1, dtype=np.int32)
    I[:, 0, 0] = local
    with_future = I.copy()
    with_future[:, 0, 1] = np.where(local < 5, 5, -1)  # block 5 is in every early query's future
    np.testing.assert_array_equal(kl_loss(*args(p, I))[0], kl_loss(*args(p, with_future))[0])


def test_tiling_does_not_change_the_result():
    """Splitting every (group, block) tile into one-query pieces gives the same result.

    Only the BLAS call shapes change (one [G, D] x [D, Bk] product per query instead of one per
    tile), which may round differently: a few ulps of the largest entry.
    """
    p = make_problem((37, 21), (37, 5), num_q_heads=8, num_kv_heads=2, block_size=8, topk=3, seed=4)
    I = selection(p, "select", None)
    ref = kl_loss(*args(p, I)), kl_backward(*args(p, I))
    tiled = kl_loss(*args(p, I), tile_elements=1), kl_backward(*args(p, I), tile_elements=1)
    with pytest.raises(ValueError, match="tile_elements must be >= 1, got 0"):
        kl_loss(*args(p, I), tile_elements=0)
    with pytest.raises(TypeError, match="tile_elements must be an integer"):
        kl_backward(*args(p, I), tile_elements=2.0)
    for a, b in zip(ref[0] + ref[1], tiled[0] + tiled[1]):
        np.testing.assert_allclose(a, b, rtol=0, atol=16 * EPS64 * np.abs(a).max())
        assert not np.array_equal(a, 0 * a)


def test_grad_loss_scales_the_gradient_and_unread_keys_get_none():
    p = make_problem((14, 3), (4, 3), num_q_heads=4, num_kv_heads=2, block_size=4, topk=2, seed=8)
    I = selection(p, "select", None)
    dq1, dk1 = kl_backward(*args(p, I))
    dq3, dk3 = kl_backward(*args(p, I), grad_loss=3.0)
    # Rounding of grad_loss / (Tq Hkv) differs, then sums of both signs: ulps of the largest entry.
    np.testing.assert_allclose(dq3, 3.0 * dq1, rtol=0, atol=16 * EPS64 * np.abs(dq3).max())
    np.testing.assert_allclose(dk3, 3.0 * dk1, rtol=0, atol=16 * EPS64 * np.abs(dk3).max())
    # The 4 queries of the first sequence read 2 of its 4 blocks: a key no query reads gets no
    # gradient.
    P_idx = student_probs(p.q_idx, p.k_idx, I, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    unread = ~(P_idx > 0).any(axis=(0, 1))  # [Tk]
    assert (dk1[unread] == 0).all()


def test_empty_batch():
    """Tq = 0: an empty kl, loss 0 and zero gradients (no 0/0)."""
    p = make_problem((5, 0), (0, 0), seed=0)
    I = np.zeros((0, 2, 4), dtype=np.int32)
    kl, loss = kl_loss(*args(p, I))
    assert kl.shape == (0, 2) and loss == 0.0
    dq, dk = kl_backward(*args(p, I))
    assert dq.shape == (0, 2, 16) and (dk == 0).all() and dk.shape == (5, 16)


def bad(p, I, **change):
    a = dict(q=p.q, k=p.k, q_idx=p.q_idx, k_idx=p.k_idx, block_indices=I, lse=None,
             cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k, block_size=p.block_size)
    a.update(change)
    return a


P_BAD = make_problem((10, 7), num_q_heads=4, num_kv_heads=2, block_size=4, topk=2, seed=1)
I_BAD = select_blocks(block_scores(P_BAD.q_idx, P_BAD.k_idx, P_BAD.cu_seqlens_q,
                                   P_BAD.cu_seqlens_k, 4), P_BAD.cu_seqlens_q,
                      P_BAD.cu_seqlens_k, 4, 2)
LSE_NEG_INF = np.full((17, 4), -np.inf)
I_OUT = I_BAD.copy()
I_OUT[3, 1, 0] = 7


@pytest.mark.parametrize("change, error, match", [
    (dict(q=P_BAD.q[0]), ValueError, "q must have 3"),
    (dict(q=P_BAD.q.astype(np.int64)), TypeError, "q must have dtype"),
    (dict(k=P_BAD.k[:, :, :4]), ValueError, "k must have shape"),
    (dict(k=P_BAD.k.astype(np.float32)), TypeError, "k must have the dtype"),
    (dict(k=np.concatenate([P_BAD.k, P_BAD.k[:, :1]], axis=1)), ValueError, "kv heads"),
    (dict(q_idx=P_BAD.q_idx[:, :1]), ValueError, "q_idx must have shape"),
    (dict(k_idx=P_BAD.k_idx[:, :3]), ValueError, "k_idx must have shape"),
    (dict(k_idx=P_BAD.k_idx[:5]), ValueError, "k_idx must have shape"),
    (dict(lse=np.zeros((17, 2))), ValueError, "lse must have shape"),
    (dict(lse=np.full((17, 4), np.nan)), ValueError, r"lse\[0, 0\] = nan .*lse must be"),
    (dict(lse=LSE_NEG_INF), ValueError, "lse"),
    (dict(block_indices=I_BAD[:, :1]), ValueError, "block_indices must have shape"),
    (dict(block_indices=I_BAD.astype(np.float32)), TypeError, "block_indices"),
    (dict(block_indices=I_OUT), ValueError, "block_indices"),
    (dict(cu_seqlens_q=np.array([0, 10, 16], dtype=np.int32)), ValueError, "cu_seqlens_q"),
    (dict(cu_seqlens_k=np.array([0, 5, 17], dtype=np.int32)), ValueError, "more queries"),
    (dict(block_size=0), ValueError, "block_size"),
    (dict(scale=-1.0), ValueError, "scale"),
    (dict(index_scale=float("inf")), ValueError, "index_scale"),
], ids=["q-rank", "q-int", "k-dim", "k-dtype", "G-not-int", "q_idx-heads", "k_idx-dim",
        "k_idx-length", "lse-shape", "lse-nan", "lse-inf-on-support", "I-heads", "I-float",
        "I-out-of-range", "cu_q-total", "Lq>Lk", "Bk=0", "scale<0", "index_scale-inf"])
def test_bad_inputs(change, error, match):
    for fn in (kl_loss, kl_backward):
        with pytest.raises(error, match=match):
            fn(**bad(P_BAD, I_BAD, **change))


@pytest.mark.parametrize("grad_loss, error", [(float("nan"), ValueError), ("1", TypeError),
                                              (True, TypeError)], ids=["nan", "str", "bool"])
def test_bad_grad_loss(grad_loss, error):
    with pytest.raises(error, match="grad_loss"):
        kl_backward(**bad(P_BAD, I_BAD), grad_loss=grad_loss)


def test_dense_helpers_validate():
    with pytest.raises(ValueError, match="lse must have shape"):
        teacher_probs(P_BAD.q, P_BAD.k, I_BAD, np.zeros((3, 4)), P_BAD.cu_seqlens_q,
                      P_BAD.cu_seqlens_k, 4)
    with pytest.raises(ValueError, match="lse"):
        teacher_probs(P_BAD.q, P_BAD.k, I_BAD, LSE_NEG_INF, P_BAD.cu_seqlens_q,
                      P_BAD.cu_seqlens_k, 4)
    with pytest.raises(ValueError, match="block_indices"):
        student_probs(P_BAD.q_idx, P_BAD.k_idx, I_OUT, P_BAD.cu_seqlens_q, P_BAD.cu_seqlens_k, 4)
    with pytest.raises(TypeError, match="k_idx must have the dtype"):
        student_probs(P_BAD.q_idx, P_BAD.k_idx.astype(np.float32), None, P_BAD.cu_seqlens_q,
                      P_BAD.cu_seqlens_k, 4)


def test_kl_loss_and_backward_is_both_calls():
    """The combined call returns exactly what kl_loss and kl_backward return separately."""
    p = make_problem((9, 6), (5, 6), num_q_heads=4, num_kv_heads=2, head_dim=4, index_dim=3,
                     block_size=3, topk=2, seed=5)
    I = selection(p, "select", None)
    kl, loss, dq, dk = kl_module.kl_loss_and_backward(*args(p, I), grad_loss=0.5)
    want_kl, want_loss = kl_loss(*args(p, I))
    want_dq, want_dk = kl_backward(*args(p, I), grad_loss=0.5)
    np.testing.assert_array_equal(kl, want_kl)
    assert loss == want_loss
    np.testing.assert_array_equal(dq, want_dq)
    np.testing.assert_array_equal(dk, want_dk)
