"""torch.compile(MSAAttention): the training step traced in one graph, equal to eager.

msa's pieces are custom operators (``msa.torch.ops``): Dynamo puts each into the graph as one
node, their fake kernels give the shapes, and their registered backwards join the backward
graph. On CPU tensors the ops run the NumPy reference and the PyTorch backwards, so a compiled
step must give the eager step's bits: the output, ``loss_kl``, the selection, the LSE and every
gradient. ``aot_eager`` keeps the file fast; one case runs the default inductor backend.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

from msa.problems import make_problem  # noqa: E402
from msa.torch import MSAAttention  # noqa: E402

CU = [0, 37, 37, 70]  # an empty sequence in the middle
MODES = {"sparse": False, "warmup": True}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make_layer(warmup, *, dtype=torch.float64, device="cpu"):
    torch.manual_seed(0)
    return MSAAttention(32, 4, 2, 8, 8, block_size=8, topk=3, warmup=warmup, dtype=dtype,
                        device=device)


def step(layer, x, cu, g):
    """The training step: ``out = layer(x, cu)``, then
    ``(sum(out.output * g) + out.loss_kl).backward()``; returns ``out`` and the gradients of
    ``x`` and of every parameter."""
    x = x.detach().requires_grad_()
    for w in layer.parameters():
        w.grad = None
    out = layer(x, cu)
    (out.output.float().mul(g).sum() + out.loss_kl).backward()
    grads = {name.removeprefix("_orig_mod."): w.grad.clone()
             for name, w in layer.named_parameters()}
    return out, dict(grads, x=x.grad)


def assert_same_step(eager, compiled, *, x_tol=0.0, grad_tol=0.0):
    """The same bits: selection, output, ``loss_kl``, LSE and every gradient; ``x``'s gradient
    (the sum of the three projections' gradients) to ``x_tol`` times its largest entry, every
    gradient to ``grad_tol`` times its largest entry."""
    (out_e, grads_e), (out_c, grads_c) = eager, compiled
    assert torch.equal(out_c.block_indices, out_e.block_indices)
    for name in ("output", "loss_kl", "lse"):
        assert torch.equal(getattr(out_c, name), getattr(out_e, name)), name
    assert grads_c.keys() == grads_e.keys()
    for name, want in grads_e.items():
        tol = max(grad_tol, x_tol if name == "x" else 0.0)
        torch.testing.assert_close(grads_c[name].float(), want.float(), rtol=0,
                                   atol=tol * float(want.abs().max()), msg=f"grad of {name}")


def inputs(dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(CU[-1], 32, generator=gen, dtype=torch.float64).to(dtype).to(device)
    g = torch.randn(CU[-1], 32, generator=gen).to(device)
    return x, torch.tensor(CU), g


@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_step_equals_eager(mode):
    """``fullgraph=True``: a graph break would be an error."""
    layer = make_layer(MODES[mode])
    x, cu, g = inputs()
    eager = step(layer, x, cu, g)
    compiled = step(torch.compile(layer, backend="aot_eager", fullgraph=True), x, cu, g)
    assert_same_step(eager, compiled)
    assert float(eager[0].loss_kl.detach()) > 0 and eager[1]["w_k_idx"].abs().max() > 0


def test_inductor_step_equals_eager():
    """The default backend (inductor: generated C++ around the ops) gives the same bits, but
    for ``x``'s gradient, whose three terms it adds in another order (float64 rounding)."""
    layer = make_layer(False)
    x, cu, g = inputs()
    assert_same_step(step(layer, x, cu, g), step(torch.compile(layer), x, cu, g), x_tol=1e-14)


def msa_ops(graph):
    return sorted({str(n.target) for n in graph.graph.nodes
                   if n.op == "call_function" and str(n.target).startswith("msa.")})


@pytest.mark.parametrize("mode", list(MODES))
def test_the_forward_is_one_graph(mode):
    """``torch._dynamo.explain``: one graph, no break; the msa ops are nodes of it."""
    layer = make_layer(MODES[mode])
    x, cu, _ = inputs()
    explained = torch._dynamo.explain(layer)(x, cu)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        [b.reason for b in explained.break_reasons]
    main = "msa.dense_attention.default" if MODES[mode] else "msa.sparse_attention.default"
    assert msa_ops(explained.graphs[0]) == sorted(
        {"msa.check_offsets.default", "msa.check_cu_seqlens.default",
         "msa.select_blocks.default", main, "msa.kl_loss.default"})


@pytest.mark.parametrize("form", ["list", "numpy", "int32 tensor"])
def test_offsets_in_every_form_trace_without_a_break(form):
    cu = {"list": list(CU), "numpy": np.array(CU),
          "int32 tensor": torch.tensor(CU, dtype=torch.int32)}[form]
    layer = make_layer(False)
    x, _, _ = inputs()
    explained = torch._dynamo.explain(layer)(x, cu)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    with torch.no_grad():
        want = layer(x, cu).output
        assert torch.equal(torch.compile(layer, backend="aot_eager")(x, cu).output, want)


@pytest.mark.parametrize("cu, error, match", [
    ([0, 37, 37, 69], ValueError, r"cu_seqlens\[-1\] must equal the packed length 70, got 69"),
    ([0, 40, 37, 70], ValueError, "cu_seqlens must be non-decreasing"),
    (torch.tensor([0.0, 70.0]), TypeError, "cu_seqlens must have dtype in"),
], ids=["total", "decreasing", "float"])
def test_bad_offsets_raise_the_eager_error_when_the_graph_runs(cu, error, match):
    """The offsets' values are checked by an op when the graph runs: the same error as eager."""
    layer = make_layer(False)
    x, _, _ = inputs()
    with pytest.raises(error, match=match):
        layer(x, cu)
    with pytest.raises(error, match=match):
        torch.compile(layer, backend="aot_eager")(x, cu)


def test_new_lengths_compile_once_more_then_stay_dynamic():
    """A second packed length recompiles once, with dynamic T and B; every step equals eager."""
    layer = make_layer(False)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter)
    gen = torch.Generator().manual_seed(2)
    for lens in ([37, 0, 33], [20, 30], [5, 10, 20, 25], [64]):
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]))
        x = torch.randn(sum(lens), 32, generator=gen, dtype=torch.float64)
        g = torch.randn(sum(lens), 32, generator=gen)
        assert_same_step(step(layer, x, cu, g), step(compiled, x, cu, g))
    assert counter.frame_count == 2


# --- every op against its fake kernel and its registered autograd (torch.library.opcheck) -----

OPS = ["check_offsets", "check_cu_seqlens", "select_blocks", "sparse_attention",
       "sparse_attention_backward", "dense_attention", "dense_attention_backward", "kl_loss",
       "kl_loss without grads", "kl_loss warmup"]


def op_case(name):
    """Small float64 CPU inputs for one op: ``(op, args)``."""
    from msa.torch import ops

    T = torch.from_numpy
    p = make_problem((13, 11), (9, 11), num_q_heads=4, num_kv_heads=2, head_dim=4, index_dim=4,
                     block_size=4, topk=2, seed=2)  # Lq < Lk
    cu_q, cu_k = T(p.cu_seqlens_q.astype(np.int64)), T(p.cu_seqlens_k.astype(np.int64))
    q, k, v, qi, ki = (T(x).requires_grad_() for x in (p.q, p.k, p.v, p.q_idx, p.k_idx))
    I = ops.select_blocks(qi.detach(), ki.detach(), cu_q, cu_k, 4, 2, None)
    o, lse = ops.sparse_attention(q, k, v, I, cu_q, cu_k, 4, 0.5, "auto", "float32", True)
    do = torch.randn(o.shape, dtype=o.dtype, generator=torch.Generator().manual_seed(0))
    s = make_problem((13, 11), num_q_heads=4, num_kv_heads=2, head_dim=4, seed=3)  # Lq = Lk
    cu = T(s.cu_seqlens_q.astype(np.int64))
    qs, ks, vs = (T(x).requires_grad_() for x in (s.q, s.k, s.v))
    o_d, lse_d = ops.dense_attention(qs, ks, vs, cu, cu, 0.5)
    msa = torch.ops.msa
    teacher = (q.detach(), k.detach(), qi, ki)
    tq, tk = int(q.shape[0]), int(k.shape[0])
    return {
        "check_offsets": lambda: (msa.check_offsets, (cu_q, "cu_seqlens_q", tq)),
        "check_cu_seqlens": lambda: (msa.check_cu_seqlens, (cu_q, cu_k, tq, tk)),
        "select_blocks": lambda: (msa.select_blocks,
                                  (qi.detach(), ki.detach(), cu_q, cu_k, 4, 2, 0.5)),
        "sparse_attention": lambda: (msa.sparse_attention,
                                     (q, k, v, I, cu_q, cu_k, 4, 0.5, "torch", "float32", True)),
        "sparse_attention_backward": lambda: (
            msa.sparse_attention_backward, (q.detach(), k.detach(), v.detach(), o.detach(), lse,
                                            do, I, cu_q, cu_k, 4, 0.5, "torch", "float32")),
        "dense_attention": lambda: (msa.dense_attention, (qs, ks, vs, cu, cu, 0.5)),
        "dense_attention_backward": lambda: (
            msa.dense_attention_backward, (qs.detach(), ks.detach(), vs.detach(), o_d.detach(),
                                           lse_d, torch.randn_like(o_d), cu, cu, 0.5)),
        "kl_loss": lambda: (msa.kl_loss,
                            (*teacher, I, lse, cu_q, cu_k, 4, 0.5, 0.5, True, True)),
        "kl_loss without grads": lambda: (msa.kl_loss, (*teacher, I, lse, cu_q, cu_k, 4, None,
                                                        None, False, False)),
        "kl_loss warmup": lambda: (msa.kl_loss, (*teacher, None, None, cu_q, cu_k, 4, None,
                                                 None, True, True)),
    }[name]()


@pytest.mark.parametrize("name", OPS)
def test_opcheck(name):
    """Schema, autograd registration, fake kernel against the real one (shapes, dtypes,
    strides, devices) and AOT dispatch with dynamic shapes, backward included."""
    op, args = op_case(name)
    torch.library.opcheck(op.default, args)


# --- the CUDA path (real GPU) -------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("mode", list(MODES))
def test_cuda_compiled_step_equals_eager(mode, backend):
    """bf16 on the GPU (the msa.cuda kernels; the warmup on PyTorch's fused flash attention):
    the compiled step's forward has the eager bits; so have the sparse step's weight gradients
    (msa's kernels are deterministic), ``x``'s to bf16 rounding (inductor adds its three terms
    in another order), the warmup's to rounding (the flash backward adds ``dq`` with atomics)."""
    layer = make_layer(MODES[mode], dtype=torch.bfloat16, device="cuda")
    x, cu, g = inputs(torch.bfloat16, "cuda")
    eager = step(layer, x, cu, g)
    compiled = step(torch.compile(layer, backend=backend), x, cu, g)
    assert_same_step(eager, compiled, x_tol=1e-2, grad_tol=2e-2 if MODES[mode] else 0.0)
