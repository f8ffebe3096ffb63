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


def test_without_a_gpu_the_first_launch_says_what_to_do():
    """Off the simulator and without a GPU, importing msa.cuda works (offline PTX needs it) and
    the first launcher call raises a RuntimeError naming NUMBA_ENABLE_CUDASIM and msa.reference."""
    import os
    import subprocess
    import sys

    code = ("import numpy as np, msa.cuda as C\n"
            "from numba import cuda\n"
            "if cuda.is_available(): print('GPU'); raise SystemExit\n"
            "try:\n"
            "    C.combine_partials(np.zeros((1, 2, 1, 4), np.float32), np.zeros((1, 2, 1), np.float32))\n"
            "except RuntimeError as e: print('MSG', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300).stdout
    if out.startswith("GPU"):
        import pytest

        pytest.skip("a GPU is visible")
    assert "MSG msa.cuda needs a CUDA GPU" in out and "NUMBA_ENABLE_CUDASIM=1" in out, out
