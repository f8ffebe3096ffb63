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
