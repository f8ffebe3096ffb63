"""msa.torch.MSAAttention: the same layer as msa.reference.msa_layer, and it trains."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import msa.reference as R  # noqa: E402
from msa.torch import MSAAttention  # noqa: E402

CU = np.array([0, 37, 37, 70])  # an empty sequence in the middle


def inputs(seed=0, d_model=32):
    return np.random.default_rng(seed).standard_normal((int(CU[-1]), d_model))


@pytest.mark.parametrize("warmup", [False, True], ids=["sparse", "warmup"])
def test_forward_equals_reference_layer(warmup):
    params = R.init_params(32, 4, 2, 8, 8, seed=1)
    x = inputs()
    out_ref, loss_ref, aux = R.msa_layer(x, params, CU, 8, 3, warmup=warmup)
    layer = MSAAttention.from_params(params, block_size=8, topk=3, warmup=warmup)
    out = layer(torch.from_numpy(x), torch.tensor(CU))
    np.testing.assert_array_equal(out.block_indices.numpy(), aux["block_indices"])
    np.testing.assert_allclose(out.output.detach().numpy(), out_ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(out.lse.numpy(), aux["lse"], rtol=0, atol=1e-12)
    assert abs(float(out.loss_kl.detach()) - loss_ref) <= 1e-12


def test_gradients_reach_the_right_weights():
    """The LM loss trains w_q, w_k, w_v, w_o and never the index weights (sg(X), eq 11); the KL
    trains only w_q_idx, w_k_idx, with the reference's dq_idx, dk_idx pulled back through X."""
    params = R.init_params(32, 4, 2, 8, 8, seed=2)
    x = torch.from_numpy(inputs(1)).requires_grad_()
    layer = MSAAttention.from_params(params, block_size=8, topk=3)
    out = layer(x, CU)
    out.output.square().sum().backward(retain_graph=True)
    for name in ("w_q", "w_k", "w_v", "w_o"):
        assert getattr(layer, name).grad.abs().max() > 0, name
    assert layer.w_q_idx.grad is None and layer.w_k_idx.grad is None
    x_grad_lm = x.grad.clone()
    layer.zero_grad()
    out.loss_kl.backward()
    assert layer.w_q.grad is None and layer.w_v.grad is None  # the teacher is held constant
    torch.testing.assert_close(x.grad, x_grad_lm, rtol=0, atol=0)  # no KL gradient into X
    aux = R.msa_layer(x.detach().numpy(), params, CU, 8, 3)[2]
    dq_idx, dk_idx = R.kl_backward(aux["q"], aux["k"], aux["q_idx"], aux["k_idx"],
                                   aux["block_indices"], aux["lse"], CU, CU, 8)
    xn = x.detach().numpy()
    np.testing.assert_allclose(layer.w_q_idx.grad.numpy(), xn.T @ dq_idx.reshape(len(xn), -1),
                               rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(layer.w_k_idx.grad.numpy(), xn.T @ dk_idx, rtol=1e-10, atol=1e-14)


def test_main_weights_gradcheck():
    """Finite differences of the whole layer w.r.t. w_v and w_q (the selection does not depend
    on them, so the output is smooth in them)."""
    params = R.init_params(8, 2, 1, 4, 4, seed=3)
    cu = np.array([0, 19])
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((19, 8)))
    layer = MSAAttention.from_params(params, block_size=4, topk=2)

    def f(w_q, w_v):
        # the layer's forward with w_q and w_v as free inputs
        q = (x @ w_q).view(19, 2, 4)
        k = (x @ layer.w_k).view(19, 1, 4)
        v = (x @ w_v).view(19, 1, 4)
        from msa.torch import sparse_attention

        idx = layer.select((x @ layer.w_q_idx).view(19, 1, 4), x @ layer.w_k_idx, cu)
        o, _ = sparse_attention(q, k, v, idx, cu, cu, 4)
        return o.reshape(19, 8) @ layer.w_o

    w_q = layer.w_q.detach().clone().requires_grad_()
    w_v = layer.w_v.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(f, (w_q, w_v))


def test_training_the_index_branch_lowers_the_kl():
    """Adam on w_q_idx, w_k_idx alone: the student learns the teacher (paper §3.2)."""
    torch.manual_seed(0)
    layer = MSAAttention(32, 4, 2, 8, 8, block_size=8, topk=3, dtype=torch.float64)
    opt = torch.optim.Adam([layer.w_q_idx, layer.w_k_idx], lr=3e-2)
    x = torch.from_numpy(inputs(4))
    losses = []
    for _ in range(20):
        out = layer(x, CU)
        opt.zero_grad()
        out.loss_kl.backward()
        opt.step()
        losses.append(float(out.loss_kl.detach()))
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("bad, error, match", [
    (lambda x: x.numpy(), TypeError, "x must be a torch.Tensor"),
    (lambda x: x[:, :5], ValueError, "x must have shape"),
    (lambda x: x[:10], ValueError, "cu_seqlens"),
], ids=["numpy", "d_model", "tokens"])
def test_bad_input(bad, error, match):
    layer = MSAAttention(32, 4, 2, 8, 8, block_size=8, topk=3, dtype=torch.float64)
    with pytest.raises(error, match=match):
        layer(bad(torch.from_numpy(inputs())), CU)


def test_bad_construction():
    with pytest.raises(ValueError, match="num_kv_heads|Hkv|divide"):
        MSAAttention(32, 5, 2, 8, 8)
    with pytest.raises(ValueError, match="topk"):
        MSAAttention(32, 4, 2, 8, 8, topk=0)


@pytest.mark.gpu
@pytest.mark.parametrize("main_backward", ["torch", "cuda"])
def test_cuda_layer_trains_in_bf16(main_backward):
    """The layer on the GPU (fused index + top-k, K1/K2, KL kernels; the main branch's backward
    in PyTorch or msa.cuda) in bf16: the selection equals the CPU layer's on the same rounded
    weights up to near ties, the outputs agree to bf16 accuracy, and a few steps lower the KL
    with every weight getting a finite gradient."""
    torch.manual_seed(0)
    cu = torch.tensor([0, 600, 1000], dtype=torch.int32)
    layer = MSAAttention(256, 16, 4, 64, 64, block_size=64, topk=4, device="cuda",
                         dtype=torch.bfloat16, main_backward=main_backward)
    x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    out = layer(x, cu)
    cpu = MSAAttention(256, 16, 4, 64, 64, block_size=64, topk=4, dtype=torch.float64)
    cpu.load_state_dict({k: v.double().cpu() for k, v in layer.state_dict().items()})
    ref = cpu(x.double().cpu(), cu)
    agree = (out.block_indices.cpu() == ref.block_indices).float().mean()
    assert agree > 0.97, float(agree)
    assert abs(float(out.loss_kl) - float(ref.loss_kl)) < 0.05 * float(ref.loss_kl)
    opt = torch.optim.Adam([layer.w_q_idx, layer.w_k_idx], lr=1e-2)
    first = float(out.loss_kl)
    for _ in range(10):
        out = layer(x, cu)
        opt.zero_grad()
        (out.output.float().square().mean() + out.loss_kl).backward()
        opt.step()
    assert float(out.loss_kl) < first
    for name, w in layer.named_parameters():
        assert w.grad is not None and bool(torch.isfinite(w.grad).all()), name


@pytest.mark.gpu
def test_cuda_layer_bf16_backward_partials():
    """``main_backward_partials="bfloat16"``: the same forward, and the same gradients wherever
    dq does not enter (dk, dv and the KL's are the float32 partials' bit for bit); ``w_q``'s
    and ``x``'s gradients move by the bf16 rounding of dq's per-slot shares only."""
    torch.manual_seed(1)
    cu = torch.tensor([0, 600, 1000], dtype=torch.int32)
    layer = MSAAttention(256, 16, 4, 64, 64, block_size=64, topk=4, device="cuda",
                         dtype=torch.bfloat16)
    x0 = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    grads = []
    for partials in ("float32", "bfloat16"):
        layer.main_backward_partials = partials
        layer.zero_grad()
        x = x0.clone().requires_grad_()
        out = layer(x, cu)
        ((out.output * g).sum() + out.loss_kl).backward()
        grads.append({"output": out.output.detach(), "x": x.grad,
                      **{n: w.grad for n, w in layer.named_parameters()}})
    f32, bf16 = grads
    for name in ("output", "w_k", "w_v", "w_o", "w_q_idx", "w_k_idx"):
        assert torch.equal(f32[name], bf16[name]), name
    for name in ("w_q", "x"):
        assert not torch.equal(f32[name], bf16[name]), name
        diff = (f32[name].float() - bf16[name].float()).abs().max()
        assert float(diff) <= 1e-2 * float(f32[name].float().abs().max()), name
