"""msa.cuda launches on the caller's current stream (msa/cuda/_core/streams.py).

A launch on the legacy default stream is unordered with a torch or CuPy stream created
non-blocking (torch's side streams are): the kernels could read inputs that the caller's stream
has not written yet. The GPU tests hold the caller's stream back with a sleep, queue the inputs
behind it, and call msa without any host synchronisation: a kernel on another stream reads
the inputs before they are written, and the outputs differ from the ones computed on the
default stream.
"""

import ast
import pathlib

import numpy as np
import pytest

import msa

from msa.cuda._core.arrays import SIMULATOR, ArrayContext
from msa.cuda._core import streams
from msa.cuda._core.streams import launch_handle, stream, stream_handle


class _Torchish:
    cuda_stream = 1234


class _Cupyish:
    ptr = 5678


class _NumbaHandle:
    value = 91


class _Numbaish:
    handle = _NumbaHandle()


def test_stream_handle_reads_every_librarys_stream():
    assert stream_handle(0, "torch") == 0
    assert stream_handle(7, "numpy") == 7
    assert stream_handle(_Torchish(), "torch") == 1234
    assert stream_handle(_Cupyish(), "cupy") == 5678
    assert stream_handle(_Numbaish(), "numba") == 91
    assert stream_handle(None, "numpy") == 0
    assert stream_handle(None, "numba") == 0
    with pytest.raises(TypeError, match="stream must be"):
        stream_handle(True, "torch")
    with pytest.raises(TypeError, match="stream must be"):
        stream_handle("0", "torch")


def _launch_problems(path, text):
    """Launches and uploads in one file that do not name the launch stream."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Subscript) and isinstance(f.slice, ast.Tuple):
            config = f.slice.elts
            literal_zero = (len(config) > 2 and isinstance(config[2], ast.Constant)
                            and config[2].value == 0)
            # decode's simulator branch launches with 0 (no streams there)
            if len(config) == 2 or (literal_zero and path.as_posix() != "cuda/decode/_plan.py"):
                found.append(f"{path}:{node.lineno}")
        elif (isinstance(f, ast.Attribute) and f.attr == "to_device"
              and not any(k.arg == "stream" for k in node.keywords)):
            found.append(f"{path}:{node.lineno}")
    return found


def test_every_launch_and_upload_names_its_stream():
    """``kernel[grid, block](...)``, ``kernel[grid, block, 0, smem](...)`` and
    ``cuda.to_device(x)`` go on the legacy default stream whatever the launch stream is: every
    one in msa passes a stream, ``stream()`` (or the decode plan's handle)."""
    root = pathlib.Path(msa.__file__).parent
    missing = []
    for path in sorted(root.rglob("*.py")):
        missing += _launch_problems(path.relative_to(root), path.read_text())
    assert not missing, "launches without a stream:\n" + "\n".join(missing)


def test_the_launch_check_finds_what_it_looks_for():
    text = ("k[g, b](x)\nk[g, b, 0, 4](x)\ncuda.to_device(h)\n"
            "k[g, b, stream()](x)\ncuda.to_device(h, stream=stream())\n_KERNELS[3](x)\n")
    found = _launch_problems(pathlib.Path("x.py"), text)
    assert found == ["x.py:1", "x.py:2", "x.py:3"]


def test_each_call_sets_the_library_whose_stream_it_launches_on():
    streams._LIB.set("cupy")  # as a CuPy call before would leave it
    ArrayContext(q=np.zeros((2, 2), np.float32))
    assert streams._LIB.get() == "numpy"
    assert launch_handle() == 0
    assert stream() == 0


try:
    import torch
except ImportError:
    torch = None
gpu = pytest.mark.skipif(SIMULATOR or torch is None or not torch.cuda.is_available(),
                         reason="needs torch on a real GPU")


def _late(stream_, make):
    """``make()`` queued on ``stream_`` behind ~0.2 s of GPU sleep, so that a kernel on any
    other stream reads the result's memory before ``make`` has written it."""
    with torch.cuda.stream(stream_):
        torch.cuda._sleep(int(2e8))
        return make()


@gpu
def test_torchs_current_stream_is_read_on_each_device_and_side_stream():
    """The fast read of torch's current stream (``streams._torch_current_stream``) agrees with
    ``torch.cuda.current_stream()`` on the default stream, inside ``torch.cuda.stream``, and
    on every visible device."""
    for device in range(torch.cuda.device_count()):
        with torch.cuda.device(device):
            assert stream_handle(None, "torch") == torch.cuda.current_stream().cuda_stream
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                assert stream_handle(None, "torch") == side.cuda_stream != 0
            assert stream_handle(None, "torch") == torch.cuda.current_stream().cuda_stream


@gpu
def test_tensors_on_another_device_than_the_current_one_are_refused(monkeypatch):
    """msa.cuda launches on the current device: tensors of another GPU are refused by name
    before anything is allocated or launched (their pointers are not the current device's).
    With one GPU, the current device is made to look like another one."""
    import msa.cuda as C
    from msa.cuda._core import arrays

    I = torch.zeros((8, 1, 1), dtype=torch.int32, device="cuda")
    cu = np.array([0, 8], np.int32)
    C.csr.build_csr(I, cu, cu, 8)  # on the current device: fine
    here = torch.cuda.current_device()
    monkeypatch.setattr(arrays, "current_device_index", lambda lib: here + 1)
    with pytest.raises(ValueError, match=r"block_indices is on cuda:\d+ but the current CUDA "
                                         r"device is cuda:\d+.*torch\.cuda\.device"):
        C.csr.build_csr(I, cu, cu, 8)


@gpu
def test_the_pipeline_runs_on_the_callers_stream():
    """msa.cuda's selection, forward, backward and KL on torch tensors made late on a side
    stream equal the same calls on the default stream with the inputs ready, bitwise."""
    import msa.cuda as C

    rng = np.random.default_rng(0)
    T, hq, hkv, D, bs, topk = 2048, 16, 2, 128, 128, 4
    cu = np.array([0, 700, T], np.int32)

    def host(*shape):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))

    src = dict(q=host(T, hq, D), k=host(T, hkv, D), v=host(T, hkv, D), do=host(T, hq, D),
               q_idx=host(T, hkv, D), k_idx=host(T, D))

    def run(x):
        I = C.select_blocks_fused(x["q_idx"], x["k_idx"], cu, cu, bs, topk)
        o, lse = C.sparse_attention(x["q"], x["k"], x["v"], I, cu, cu, bs, validate=False)
        dq, dk, dv = C.sparse_attention_backward(x["q"], x["k"], x["v"], o, lse, x["do"], I, cu,
                                                 cu, bs, validate=False)
        kl, loss = C.kl_loss(x["q"], x["k"], x["q_idx"], x["k_idx"], I, lse, cu, cu, bs,
                             validate=False)
        return [I, o, lse, dq, dk, dv, kl, loss]

    ready = {n: t.cuda().to(torch.bfloat16) for n, t in src.items()}
    want = [t.cpu() for t in run(ready)]
    side = torch.cuda.Stream()
    late = _late(side, lambda: {n: t.clone() for n, t in ready.items()})
    with torch.cuda.stream(side):
        got = run(late)
    side.synchronize()
    for name, a, b in zip("I o lse dq dk dv kl loss".split(), want, got):
        assert torch.equal(a, b.cpu()), name


@gpu
def test_the_layer_step_runs_on_the_callers_stream():
    """MSAAttention's training step inside ``torch.cuda.stream(s)``, its input made late on
    s, equals the step on s with its input ready: outputs, KL and every weight's gradient."""
    from msa.torch import MSAAttention

    torch.manual_seed(0)
    cu = torch.tensor([0, 600, 1000], dtype=torch.int32)
    layer = MSAAttention(256, 16, 4, 64, 64, block_size=64, topk=4, device="cuda",
                         dtype=torch.bfloat16, main_backward="cuda")
    x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)

    def step(x_):
        layer.zero_grad()
        out = layer(x_, cu)
        ((out.output.float() * g.float()).sum() + out.loss_kl).backward()
        grads = [p.grad.clone() for p in layer.parameters()]
        return [out.output, out.block_indices, out.loss_kl] + grads

    # The reference on the same stream with its input ready (cuBLAS promises the same bits
    # for the same stream, not across streams)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        want = step(x.clone())
    side.synchronize()
    want = [t.cpu() for t in want]
    x_late = _late(side, x.clone)
    with torch.cuda.stream(side):
        got = step(x_late)
    side.synchronize()
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b.cpu()), i
