"""msa.cuda._core.arrays.device_constant: the launchers' memoised uploads of read-only offsets.

A repeated call must upload nothing (same content: the same device array), while any
difference in content, dtype or shape must give an array of its own; the device copy keeps the
values it was made from.
"""

import numpy as np

from msa.cuda._core.arrays import SIMULATOR, device_constant
from msa.testing.backends import to_numpy


def test_device_constant_holds_the_values():
    for a in (np.array([0, 5, 9], np.int32), np.arange(6, dtype=np.int64).reshape(2, 3),
              np.zeros((1, 1, 1), np.float32)):
        d = device_constant(a)
        got = to_numpy(d)
        assert got.dtype == a.dtype and got.shape == a.shape
        assert got.tobytes() == a.tobytes()


def test_device_constant_memoises_by_content_dtype_and_shape():
    a = np.array([0, 5, 9, 12], np.int32)
    d = device_constant(a)
    if SIMULATOR:  # the simulator indexes the host array itself: nothing to memoise
        assert d is a
        return
    assert device_constant(a.copy()) is d  # equal content: no new upload
    others = [a.astype(np.int64), a.reshape(2, 2), np.array([0, 5, 9, 13], np.int32)]
    for b in others:
        e = device_constant(b)
        assert e is not d
        assert to_numpy(e).tobytes() == b.tobytes() and e.shape == b.shape
    a[1] = 7  # the caller's array may change later: the device copy does not
    assert to_numpy(d).tolist() == [0, 5, 9, 12]
    assert device_constant(a) is not d


# Every public launcher of msa.cuda on valid NumPy inputs, in a process without the simulator.
_NO_GPU_CALLS = """
import numpy as np, msa.cuda as C, msa.reference as R
from msa.cuda import decode as CD
from msa.problems import make_problem
from numba import cuda
if cuda.is_available(): print('GPU'); raise SystemExit
p = make_problem((40,), num_q_heads=2, num_kv_heads=1, head_dim=16, index_dim=16,
                 block_size=16, topk=2, dtype=np.float16)
q, k, v, qi, ki, cq, ck = p.q, p.k, p.v, p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k
M = R.block_scores(qi, ki, cq, ck, 16)
I = R.select_blocks(M, cq, ck, topk=2, block_size=16).astype(np.int32)
o, lse = R.sparse_attention(q, k, v, I, cq, ck, 16)
o = o.astype(np.float16); lse = lse.astype(np.float32)
counts = R.csr_histogram(I, cq, ck, 16).astype(np.int32)
row_ptr, qx, slots = (a.astype(np.int32) for a in R.build_csr(I, cq, ck, 16))
work = R.build_schedule(row_ptr, ck, 16, 5).astype(np.int32)
op, lp = (a.astype(np.float32) for a in R.attention_partials(q, k, v, work, qx, slots, cq, ck, 16, 2))
kc = np.zeros((3, 1, 16, 16), np.float16); kic = np.zeros((3, 16, 16), np.float16)
table = np.arange(3, dtype=np.int32)[None]; lens = np.array([40], np.int32)
calls = {
    "block_scores": lambda: C.block_scores(qi, ki, cq, ck, 16),
    "select_blocks": lambda: C.select_blocks(M.astype(np.float32), cq, ck, topk=2, block_size=16),
    "select_blocks_fused": lambda: C.select_blocks_fused(qi, ki, cq, ck, block_size=16, topk=2),
    "csr_histogram": lambda: C.csr_histogram(I, cq, ck, 16),
    "exclusive_prefix_sum": lambda: C.exclusive_prefix_sum(counts),
    "csr_scatter": lambda: C.csr_scatter(I, row_ptr, cq, ck, 16),
    "build_csr": lambda: C.build_csr(I, cq, ck, 16),
    "build_schedule": lambda: C.build_schedule(row_ptr, ck, 16, 5),
    "attention_partials": lambda: C.attention_partials(q, k, v, work, qx, slots, cq, ck, 16, 2),
    "combine_partials": lambda: C.combine_partials(op, lp),
    "sparse_attention": lambda: C.sparse_attention(q, k, v, I, cq, ck, 16),
    "sparse_attention_backward": lambda: C.sparse_attention_backward(q, k, v, o, lse, o, I, cq, ck, 16),
    "msa_prefill": lambda: C.msa_prefill(q, k, v, qi, ki, cq, ck, block_size=16, topk=2),
    "kl_loss": lambda: C.kl_loss(q, k, qi, ki, I, lse, cq, ck, 16),
    "kl_backward": lambda: C.kl_backward(q, k, qi, ki, I, lse, cq, ck, 16),
    "kl_loss_and_backward": lambda: C.kl_loss_and_backward(q, k, qi, ki, I, lse, cq, ck, 16),
    "decode.plan": lambda: CD.plan(q[:1], qi[:1], kc, kc, kic, table, lens, 16, 2),
    "decode.decode_step": lambda: CD.decode_step(q[:1], qi[:1], kc, kc, kic, table, lens, 16, 2),
    "decode.append_to_cache": lambda: CD.append_to_cache(k[:1], v[:1], ki[:1], kc, kc, kic, table, lens),
    "decode.gather_cache": lambda: CD.gather_cache(kc, kc, kic, table, lens),
}
for name, call in calls.items():
    try:
        call()
        print(name, "RAN")
    except RuntimeError as e:
        ok = "msa.cuda needs a CUDA GPU" in str(e) and "NUMBA_ENABLE_CUDASIM=1" in str(e)
        print(name, "OK" if ok else "OTHER " + " ".join(str(e).split())[:200])
    except Exception as e:
        print(name, type(e).__name__, " ".join(str(e).split())[:200])
"""


def test_without_a_gpu_every_launcher_says_what_to_do():
    """Off the simulator and without a GPU, importing msa.cuda works (offline PTX needs it) and
    every public launcher, on valid inputs, raises a RuntimeError naming NUMBA_ENABLE_CUDASIM
    and msa.reference (not Numba's driver error from a planner that asked the device first)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", _NO_GPU_CALLS], capture_output=True, text=True,
                         env=env, timeout=300)
    if out.stdout.startswith("GPU"):
        import pytest

        pytest.skip("a GPU is visible")
    lines = out.stdout.splitlines()
    assert len(lines) == 20, out.stdout + out.stderr
    assert [line for line in lines if not line.endswith(" OK")] == [], out.stdout
