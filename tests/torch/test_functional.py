"""msa.torch.functional: forwards equal the reference, backwards are the true gradients.

CPU tensors run the NumPy reference, so float64 ``gradcheck`` checks every backward against
finite differences. A second, independent check: the main branch's PyTorch backward against
autograd through a plain masked softmax built from the reference's support. GPU tests (marked
``gpu``) compare the CUDA path with the CPU one.
"""

import math

import numpy as np
import pytest
from hypothesis import given

torch = pytest.importorskip("torch")

import msa.reference as R  # noqa: E402
from msa.problems import make_problem  # noqa: E402
from msa.reference.blocks import query_positions  # noqa: E402
from msa.testing import strategies as mst  # noqa: E402
from msa.torch import (dense_attention, kl_loss, sparse_attention,  # noqa: E402
                       sparse_attention_backward)

T = torch.from_numpy


def select(p):
    m = R.block_scores(p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    return R.select_blocks(m, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, p.topk)


def support_mask(p, I):
    """[Tq, Hkv, Tk] bool: key j in the support of (query t, group r), from the reference."""
    tq, tk = p.q.shape[0], p.k.shape[0]
    batch, pos = query_positions(p.cu_seqlens_q, p.cu_seqlens_k, tq, tk)
    mask = np.zeros((tq, p.num_kv_heads, tk), dtype=bool)
    for t in range(tq):
        b = batch[t]
        for r in range(p.num_kv_heads):
            for blk in I[t, r]:
                if blk < 0:
                    continue
                lo = blk * p.block_size
                hi = min((blk + 1) * p.block_size, pos[t] + 1)
                if hi > lo:
                    mask[t, r, p.cu_seqlens_k[b] + lo:p.cu_seqlens_k[b] + hi] = True
    return mask


def masked_attention(q, k, v, mask, scale):
    """Eq 8 as a dense masked softmax in PyTorch (autograd): an independent backward."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    s = torch.einsum("trgd,jrd->trgj", q.view(tq, hkv, g, d), k) * scale  # [Tq, Hkv, G, Tk]
    m = torch.as_tensor(mask)[:, :, None, :]
    s = s.masked_fill(~m, -math.inf)
    has = m.any(-1, keepdim=True)
    p = torch.where(has, torch.softmax(torch.where(has, s, torch.zeros_like(s)), -1),
                    torch.zeros_like(s))
    p = torch.where(m, p, torch.zeros_like(p))
    return torch.einsum("trgj,jrd->trgd", p, v).reshape(tq, hq, d)


CASES = {
    "one-seq": dict(seq_lens_k=(40,), seq_lens_q=None),
    "varlen-Lq<Lk": dict(seq_lens_k=(29, 17), seq_lens_q=(11, 17)),
    "empty-seq": dict(seq_lens_k=(0, 21, 9), seq_lens_q=(0, 5, 9)),
    "T=1": dict(seq_lens_k=(1,), seq_lens_q=None),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_sparse_attention_forward_equals_reference(case):
    p = make_problem(**CASES[case], num_q_heads=4, num_kv_heads=2, head_dim=8, index_dim=8,
                     block_size=8, topk=2, seed=3)
    I = select(p)
    o, lse = sparse_attention(T(p.q), T(p.k), T(p.v), T(I), p.cu_seqlens_q, p.cu_seqlens_k, 8)
    o_ref, lse_ref = R.sparse_attention(p.q, p.k, p.v, I, p.cu_seqlens_q, p.cu_seqlens_k, 8)
    np.testing.assert_array_equal(o.numpy(), o_ref)
    np.testing.assert_array_equal(lse.numpy(), lse_ref)
    assert not lse.requires_grad


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_sparse_attention_gradcheck(case):
    """The PyTorch backward against finite differences of the reference forward (float64)."""
    p = make_problem(**CASES[case], num_q_heads=2, num_kv_heads=1, head_dim=4, index_dim=4,
                     block_size=8, topk=2, seed=5)
    if p.q.shape[0] == 0:
        pytest.skip("no queries")
    I = T(select(p))
    q, k, v = (T(x).requires_grad_() for x in (p.q, p.k, p.v))

    def f(q, k, v):
        return sparse_attention(q, k, v, I, p.cu_seqlens_q, p.cu_seqlens_k, 8)[0]

    assert torch.autograd.gradcheck(f, (q, k, v))


@given(mst.problems_with_indices(max_len=40, max_heads=4, max_topk=3, dims=(4, 8)))
def test_sparse_attention_backward_equals_autograd_of_a_masked_softmax(case):
    """Any valid selection (hot rows, -1 tails, future blocks): dq, dk, dv equal autograd
    through a dense masked softmax on the reference's support (float64, rounding only)."""
    p, I = case
    scale = 1.0 / math.sqrt(p.q.shape[2])
    q, k, v = (T(x).requires_grad_() for x in (p.q, p.k, p.v))
    o_want = masked_attention(q, k, v, support_mask(p, I), scale)
    do = T(np.random.default_rng(0).standard_normal(p.q.shape))
    want = torch.autograd.grad(o_want, (q, k, v), do, allow_unused=True)
    o, lse = sparse_attention(q, k, v, T(I), p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    np.testing.assert_allclose(o.detach().numpy(), o_want.detach().numpy(), rtol=0, atol=1e-12)
    got = sparse_attention_backward(q.detach(), k.detach(), v.detach(), o.detach(), lse, do,
                                    T(I), p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    for name, a, b in zip("qkv", got, want):
        b = torch.zeros_like(a) if b is None else b
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-9, atol=1e-11, err_msg=f"d{name}")



@given(mst.problems_with_indices(max_len=40, max_heads=4, max_topk=3, dims=(4, 8)))
def test_sparse_attention_backward_equals_the_reference(case):
    """msa.torch's backward and msa.reference's (NumPy) compute the same gradient (float64)."""
    p, I = case
    cu_q, cu_k, bk = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size
    o, lse = R.sparse_attention(p.q, p.k, p.v, I, cu_q, cu_k, bk)
    do = np.random.default_rng(1).standard_normal(p.q.shape)
    want = R.sparse_attention_backward(p.q, p.k, p.v, o, lse, do, I, cu_q, cu_k, bk)
    got = sparse_attention_backward(*(T(x) for x in (p.q, p.k, p.v, o, lse, do)), T(I), cu_q,
                                    cu_k, bk)
    for name, a, b in zip("qkv", got, want):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-9, atol=1e-11, err_msg=f"d{name}")


def test_dense_attention_equals_reference_and_gradcheck():
    p = make_problem((13, 6), (9, 6), num_q_heads=4, num_kv_heads=2, head_dim=4, seed=1)
    q, k, v = (T(x).requires_grad_() for x in (p.q, p.k, p.v))
    o, lse = dense_attention(q, k, v, p.cu_seqlens_q, p.cu_seqlens_k)
    o_ref, lse_ref = R.dense_attention(p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k)
    np.testing.assert_allclose(o.detach().numpy(), o_ref, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse.numpy(), lse_ref, rtol=0, atol=1e-13)
    assert torch.autograd.gradcheck(
        lambda q, k, v: dense_attention(q, k, v, p.cu_seqlens_q, p.cu_seqlens_k)[0], (q, k, v))


@pytest.mark.parametrize("warmup", [False, True], ids=["selected", "warmup"])
def test_kl_loss_value_gradient_and_stop_gradient(warmup):
    p = make_problem((30, 11), (22, 11), num_q_heads=4, num_kv_heads=2, head_dim=4, index_dim=4,
                     block_size=8, topk=2, seed=2)
    I = None if warmup else select(p)
    if warmup:
        _, lse = R.dense_attention(p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k)
    else:
        _, lse = R.sparse_attention(p.q, p.k, p.v, I, p.cu_seqlens_q, p.cu_seqlens_k, 8)
    I_t = None if I is None else T(I)
    q, k, lse_t = T(p.q).requires_grad_(), T(p.k).requires_grad_(), T(lse).requires_grad_()
    qi, ki = T(p.q_idx).requires_grad_(), T(p.k_idx).requires_grad_()
    kl, loss = kl_loss(q, k, qi, ki, I_t, lse_t, p.cu_seqlens_q, p.cu_seqlens_k, 8)
    kl_ref, loss_ref = R.kl_loss(p.q, p.k, p.q_idx, p.k_idx, I, lse, p.cu_seqlens_q,
                                 p.cu_seqlens_k, 8)
    np.testing.assert_array_equal(kl.numpy(), kl_ref)
    assert float(loss.detach()) == float(loss_ref) and loss.shape == ()
    (0.37 * loss).backward()
    dq_ref, dk_ref = R.kl_backward(p.q, p.k, p.q_idx, p.k_idx, I, lse, p.cu_seqlens_q,
                                   p.cu_seqlens_k, 8, grad_loss=0.37)
    # 0.37 * (gradient for 1) against the reference's gradient for 0.37: rounding only
    np.testing.assert_allclose(qi.grad.numpy(), dq_ref, rtol=1e-14, atol=1e-16)
    np.testing.assert_allclose(ki.grad.numpy(), dk_ref, rtol=1e-14, atol=1e-16)
    assert q.grad is None and k.grad is None and lse_t.grad is None  # the teacher is constant

    def f(qi, ki):
        return kl_loss(q, k, qi, ki, I_t, lse_t, p.cu_seqlens_q, p.cu_seqlens_k, 8)[1]

    assert torch.autograd.gradcheck(f, (qi.detach().requires_grad_(),
                                        ki.detach().requires_grad_()))


BAD = {
    "q-numpy": (lambda a: dict(a, q=a["q"].numpy()), TypeError, "q must be a torch.Tensor"),
    "k-2d": (lambda a: dict(a, k=a["k"][:, 0]), ValueError, "k must have 3 dimensions"),
    "indices-float": (lambda a: dict(a, block_indices=a["block_indices"].double()), TypeError,
                      "block_indices must have an integer dtype"),
    "cu-wrong-total": (lambda a: dict(a, cu_seqlens_q=[0, 3]), ValueError, "cu_seqlens_q"),
}


BAD.update({
    "v-heads": (lambda a: dict(a, v=a["v"].repeat(1, 2, 1)), ValueError, "v must have k's shape"),
    "k-dim": (lambda a: dict(a, k=a["k"][..., :2], v=a["v"][..., :2]), ValueError, "head dim"),
    "v-dtype": (lambda a: dict(a, v=a["v"].float()), TypeError, "v must have q's dtype"),
})

@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_names_the_argument(case):
    change, error, match = BAD[case]
    p = make_problem((8,), num_q_heads=2, num_kv_heads=1, head_dim=4, block_size=4, topk=1)
    args = change(dict(q=T(p.q), k=T(p.k), v=T(p.v), block_indices=T(select(p)),
                       cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k, block_size=4))
    with pytest.raises(error, match=match):
        sparse_attention(**args)


# --- the CUDA path (real GPU) -------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("backward", ["auto", "torch", "cuda"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_forward_and_backward_match_the_cpu_path(dtype, backward):
    """bf16/fp32 CUDA tensors (the msa.cuda kernels forward; the PyTorch backward on the GPU, or
    msa.cuda's backward kernels) against the float64 CPU path on the same rounded values."""
    p = make_problem((700, 300), num_q_heads=8, num_kv_heads=2, head_dim=64, index_dim=64,
                     block_size=64, topk=4, seed=7)
    I = select(p)
    dt = getattr(torch, dtype)
    cpu = [T(x).to(dt).double().requires_grad_() for x in (p.q, p.k, p.v)]
    gpu = [x.detach().to(dt).cuda().requires_grad_() for x in cpu]
    do = torch.randn(p.q.shape, dtype=torch.float64)
    o_c, lse_c = sparse_attention(*cpu, T(I), p.cu_seqlens_q, p.cu_seqlens_k, 64)
    o_g, lse_g = sparse_attention(*gpu, T(I).cuda(), p.cu_seqlens_q, p.cu_seqlens_k, 64,
                                  backward=backward)
    tol = 2e-2 if dtype == "bfloat16" else 1e-4
    np.testing.assert_allclose(o_g.double().cpu().detach().numpy(), o_c.detach().numpy(),
                               atol=tol, rtol=tol)
    np.testing.assert_allclose(lse_g.double().cpu().numpy(), lse_c.numpy(), atol=tol, rtol=tol)
    g_c = torch.autograd.grad(o_c, cpu, do)
    g_g = torch.autograd.grad(o_g, gpu, do.to(dt).cuda())
    for a, b in zip(g_g, g_c):
        scale = float(b.abs().max())
        np.testing.assert_allclose(a.double().cpu().numpy(), b.numpy(), atol=tol * 4 * scale,
                                   rtol=0)


@pytest.mark.gpu
def test_cuda_dense_attention_matches_the_cpu_path():
    """The warmup's main branch on CUDA bf16 (PyTorch's fused flash attention and its backward,
    ``msa.torch.ops._dense_fused_backward``) against the float64 CPU path (chunked, with the
    sparse PyTorch backward) on the same rounded values."""
    gen = torch.Generator().manual_seed(3)
    cu = np.array([0, 300, 700])
    q, k, v = (torch.randn(700, h, 64, generator=gen).to(torch.bfloat16) for h in (8, 2, 2))
    cpu = [x.double().requires_grad_() for x in (q, k, v)]
    gpu = [x.cuda().requires_grad_() for x in (q, k, v)]
    o_c, lse_c = dense_attention(*cpu, cu, cu)
    o_g, lse_g = dense_attention(*gpu, cu, cu)
    tol = 2e-2
    np.testing.assert_allclose(o_g.double().cpu().detach().numpy(), o_c.detach().numpy(),
                               atol=tol, rtol=tol)
    np.testing.assert_allclose(lse_g.double().cpu().numpy(), lse_c.numpy(), atol=tol, rtol=tol)
    do = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    g_c = torch.autograd.grad(o_c, cpu, do)
    g_g = torch.autograd.grad(o_g, gpu, do.to(torch.bfloat16).cuda())
    for a, b in zip(g_g, g_c):
        scale = float(b.abs().max())
        np.testing.assert_allclose(a.double().cpu().numpy(), b.numpy(), atol=tol * 4 * scale,
                                   rtol=0)


@pytest.mark.gpu
def test_cuda_prefill_takes_offsets_on_the_host_or_the_device():
    """``msa.cuda.msa_prefill`` (index, top-k, sparse attention) on CUDA tensors with
    ``cu_seqlens`` as NumPy arrays (no device-to-host read) or as CUDA tensors: the same bits."""
    from msa.cuda.attention import msa_prefill

    p = make_problem((700, 300), num_q_heads=8, num_kv_heads=2, head_dim=64, index_dim=64,
                     block_size=64, topk=4, seed=8)
    args = [T(x).to(torch.bfloat16).cuda() for x in (p.q, p.k, p.v, p.q_idx, p.k_idx)]
    host = msa_prefill(*args, p.cu_seqlens_q, p.cu_seqlens_k, 64, 4)
    dev = msa_prefill(*args, T(p.cu_seqlens_q).cuda(), T(p.cu_seqlens_k).cuda(), 64, 4)
    for a, b in zip(host, dev):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


def test_sparse_attention_backward_choice():
    """``backward="cuda"`` and the default ``"auto"`` need CUDA tensors: on the CPU they take
    the PyTorch path (the same gradient bit for bit); an unknown choice is refused by name, by
    the layer too."""
    p = make_problem((30,), num_q_heads=4, num_kv_heads=2, head_dim=8, index_dim=8,
                     block_size=8, topk=2, seed=2)
    I = T(select(p))
    grads = []
    for how in ("torch", "cuda", "auto"):
        qkv = [T(x).requires_grad_() for x in (p.q, p.k, p.v)]
        o, _ = sparse_attention(*qkv, I, p.cu_seqlens_q, p.cu_seqlens_k, 8, backward=how)
        grads.append(torch.autograd.grad(o.sum(), qkv))
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert torch.equal(a, b)
    # the PyTorch backward has no partials: bf16 partials change nothing there
    qkv = [T(x).requires_grad_() for x in (p.q, p.k, p.v)]
    o, _ = sparse_attention(*qkv, I, p.cu_seqlens_q, p.cu_seqlens_k, 8,
                            backward_partials="bfloat16")
    for a, b in zip(grads[0], torch.autograd.grad(o.sum(), qkv)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="backward"):
        sparse_attention(T(p.q), T(p.k), T(p.v), I, p.cu_seqlens_q, p.cu_seqlens_k, 8,
                         backward="triton")
    for bad in ("float16", torch.bfloat16, None):
        with pytest.raises(ValueError, match="backward_partials"):
            sparse_attention(T(p.q), T(p.k), T(p.v), I, p.cu_seqlens_q, p.cu_seqlens_k, 8,
                             backward_partials=bad)
    from msa.torch import MSAAttention

    with pytest.raises(ValueError, match="main_backward"):
        MSAAttention(16, 4, 2, 8, 8, main_backward="numpy")


@pytest.mark.simulator
@pytest.mark.parametrize("dtype,block_size,partials", [
    ("float32", 8, "float32"), pytest.param("float16", 8, "float32", marks=pytest.mark.sim_heavy),
    ("float16", 16, "float32"), ("float16", 16, "bfloat16")])
def test_cuda_backward_wiring_in_the_simulator(dtype, block_size, partials):
    """The ``backward="cuda"`` branch (``_kernel_backward``) drives msa.cuda's backward kernels
    (here in the simulator, on NumPy copies of the CPU tensors; version 1, and version 2 for
    float16 with Bk = 16, with float32 or bf16 dQ partials) to the PyTorch backward's
    gradients, in the inputs' dtypes."""
    from msa.cuda.attention import sparse_attention_backward as kernel
    from msa.torch.ops import _kernel_backward

    def on_numpy(*args, **kw):
        host = [x.numpy() if isinstance(x, torch.Tensor) else x for x in args]
        return tuple(torch.from_numpy(np.asarray(g)) for g in kernel(*host, **kw))

    bk = block_size
    # (simulator only: a Python thread per CUDA thread, so few queries; still two sequences
    # of several blocks, Lq < Lk in the second)
    p = make_problem((40, 23), (20, 8), num_q_heads=4, num_kv_heads=2, head_dim=16,
                     index_dim=8, block_size=bk, topk=3, seed=4)
    I = T(select(p))
    dt = getattr(torch, dtype)
    q, k, v = (T(x).to(dt) for x in (p.q, p.k, p.v))
    o, lse = sparse_attention(q.float(), k.float(), v.float(), I, p.cu_seqlens_q,
                              p.cu_seqlens_k, bk)
    do = torch.randn(q.shape, dtype=torch.float64).to(dt)
    got = _kernel_backward(on_numpy, q, k, v, o.to(dt), lse.float(), do, I.long(),
                           p.cu_seqlens_q, p.cu_seqlens_k, bk, 0.25, partials)
    want = sparse_attention_backward(q.float(), k.float(), v.float(), o.to(dt).float(), lse,
                                     do.float(), I, p.cu_seqlens_q, p.cu_seqlens_k, bk, scale=0.25)
    # bf16 partials: each slot's share of dq rounded once more (2**-9 of it, 3 slots)
    tol = 1e-5 if dtype == "float32" else 2e-3 if partials == "float32" else 4e-3
    for name, a, b in zip("qkv", got, want):
        assert a.dtype == dt, name
        scale = float(b.abs().max())
        np.testing.assert_allclose(a.float().numpy(), b.numpy(), rtol=0, atol=tol * scale,
                                   err_msg=f"d{name}")
    if partials == "bfloat16":  # the option reached the kernel: dq moved, dk and dv did not
        f32 = _kernel_backward(on_numpy, q, k, v, o.to(dt), lse.float(), do, I.long(),
                               p.cu_seqlens_q, p.cu_seqlens_k, bk, 0.25, "float32")
        assert not torch.equal(got[0], f32[0])
        assert torch.equal(got[1], f32[1]) and torch.equal(got[2], f32[2])


def test_kl_loss_without_grad_mode_computes_the_loss_only():
    p = make_problem((20,), num_q_heads=2, num_kv_heads=1, head_dim=4, index_dim=4,
                     block_size=8, topk=2, seed=4)
    I = select(p)
    _, lse = R.sparse_attention(p.q, p.k, p.v, I, p.cu_seqlens_q, p.cu_seqlens_k, 8)
    qi = T(p.q_idx).requires_grad_()
    with torch.no_grad():
        kl, loss = kl_loss(T(p.q), T(p.k), qi, T(p.k_idx), T(I), T(lse), p.cu_seqlens_q,
                           p.cu_seqlens_k, 8)
    want = R.kl_loss(p.q, p.k, p.q_idx, p.k_idx, I, lse, p.cu_seqlens_q, p.cu_seqlens_k, 8)
    assert not loss.requires_grad and float(loss) == float(want[1])
    np.testing.assert_array_equal(kl.numpy(), want[0])


DENSE_BAD = {
    "v-heads": (lambda q, k, v: (q, k, v[:, :1]), ValueError, "v must have k's shape"),
    "gqa": (lambda q, k, v: (q[:, :3], k, v), ValueError, "num_q_heads|Hq|divide|multiple"),
}


@pytest.mark.parametrize("case", list(DENSE_BAD), ids=list(DENSE_BAD))
def test_dense_attention_bad_input(case):
    change, error, match = DENSE_BAD[case]
    p = make_problem((6,), num_q_heads=4, num_kv_heads=2, head_dim=4)
    with pytest.raises(error, match=match):
        dense_attention(*change(T(p.q), T(p.k), T(p.v)), p.cu_seqlens_q, p.cu_seqlens_k)


def test_sparse_attention_backward_bad_input():
    p = make_problem((8,), num_q_heads=2, num_kv_heads=1, head_dim=4, block_size=4, topk=1)
    I = T(select(p))
    q, k, v = T(p.q), T(p.k), T(p.v)
    o, lse = sparse_attention(q, k, v, I, p.cu_seqlens_q, p.cu_seqlens_k, 4)
    args = [q, k, v, o, lse, torch.ones_like(o), I, p.cu_seqlens_q, p.cu_seqlens_k, 4]
    with pytest.raises(ValueError, match="do must have shape"):
        sparse_attention_backward(*args[:5], o[:3], *args[6:])
    with pytest.raises(ValueError, match="block_size"):
        sparse_attention_backward(*args[:9], 0)
    with pytest.raises(ValueError, match="block_indices"):
        sparse_attention_backward(*args[:6], I[:, :, :0].squeeze(1), *args[7:])


def cpu_flash(q, k, v, scale):
    """PyTorch's CPU flash operator as ``msa.torch.ops._flash`` (the CUDA one) is called."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True,
                                                                       scale=scale)


def cpu_flash_backward(do, q, k, v, o, lse, scale):
    """Its backward, as ``msa.torch.ops._flash_backward``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, o, lse, 0.0, True, scale=scale)


def test_fused_dense_warmup_equals_the_chunked_path_and_masks_non_finite_keys():
    """``_dense_fused`` and ``_dense_fused_backward`` (the CUDA warmup's flash-attention path,
    here on PyTorch's CPU flash operator) equal ``dense_attention``'s chunked path: outputs,
    LSE and gradients; a NaN key poisons exactly the queries that see it (its position and
    later ones of its group), which pass no gradient: every other query's ``dq`` keeps its
    bits, and no gradient is NaN."""
    from msa.torch.ops import _dense_fused, _dense_fused_backward

    gen = torch.Generator().manual_seed(0)
    lens = [37, 20]
    cu = np.array([0, 37, 57])
    q = torch.randn(57, 4, 16, generator=gen, requires_grad=True)
    k = torch.randn(57, 2, 16, generator=gen, requires_grad=True)
    v = torch.randn(57, 2, 16, generator=gen, requires_grad=True)
    o1, lse1 = dense_attention(q, k, v, cu, cu, scale=0.3)
    o2, lse2 = _dense_fused(q.detach(), k.detach(), v.detach(), cu, cu, 0.3, flash=cpu_flash)
    torch.testing.assert_close(o2, o1.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse2, lse1.float(), rtol=1e-5, atol=1e-5)
    g = torch.randn(o1.shape, generator=gen)
    grads1 = torch.autograd.grad((o1 * g).sum(), (q, k, v))
    qkv = (q.detach(), k.detach(), v.detach())
    grads2 = _dense_fused_backward(*qkv, o2, lse2, g, cu, cu, 0.3,
                                   flash_backward=cpu_flash_backward)
    for a, b in zip(grads2, grads1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    v_bad = v.detach().clone()
    v_bad[10, 1, 3] = math.nan  # key 10 of sequence 0, group 1 (heads 2, 3)
    o3, lse3 = _dense_fused(q.detach(), k.detach(), v_bad, cu, cu, 0.3, flash=cpu_flash)
    poisoned = torch.zeros(57, 4, dtype=torch.bool)
    poisoned[10:lens[0], 2:] = True
    assert torch.isnan(o3[poisoned]).all() and torch.isnan(lse3[poisoned]).all()
    assert torch.equal(o3[~poisoned], o2[~poisoned])
    assert torch.equal(lse3[~poisoned], lse2[~poisoned])
    dq3, dk3, dv3 = _dense_fused_backward(q.detach(), k.detach(), v_bad, o3, lse3, g, cu, cu,
                                          0.3, flash_backward=cpu_flash_backward)
    assert torch.equal(dq3[~poisoned], grads2[0][~poisoned])
    assert torch.isfinite(dq3).all() and torch.isfinite(dk3).all() and torch.isfinite(dv3).all()
    assert float(dv3[10, 1, 3]) == 0.0  # the entry the forward replaced by 0
