"""Kernel tests: under Numba's simulator in CI, on a real GPU through the device tool.

Without either, every test here is skipped with the reason. Under the simulator the warp
operations of ``msa.cuda._core.simwarp`` are installed (``msa.cuda`` installs them too; it is
idempotent).
"""

import pathlib

import numpy as np
import pytest

from msa.cuda._core.arrays import ArrayContext
from msa.cuda._core.simwarp import install
from msa.testing.backends import cuda_runnable, poison

install()

_HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    ok, why = cuda_runnable()
    if ok:
        return
    for item in items:
        if _HERE in pathlib.Path(item.path).parents:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every array a launcher allocates without a fill value starts as poison (docs/design.md §5).

    Floats start as NaN and integers as their minimum (``msa.testing.backends.poison_value``), so
    an element that no kernel writes cannot pass a comparison. Works for NumPy (simulator), CuPy,
    torch and Numba device arrays.
    """
    empty = ArrayContext.empty

    def poisoned(self, shape, dtype, fill=None):
        out = empty(self, shape, dtype, fill)
        if fill is None and int(np.prod(shape)):
            poison(out)
        return out

    monkeypatch.setattr(ArrayContext, "empty", poisoned)
