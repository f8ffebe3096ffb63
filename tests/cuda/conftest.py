"""Kernel tests: under Numba's simulator in CI, on a real GPU through the device tool.

Without either, every test here is skipped with the reason. Under the simulator the warp
operations of ``msa.cuda._core.simwarp`` are installed (``msa.cuda`` installs them too; it is
idempotent).
"""

import os
import pathlib

import numpy as np
import pytest

from msa.cuda._core.arrays import ArrayContext
from msa.cuda._core.arrays import fill as fill_array
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


# MSA_TEST_INT_FILL=v: fresh integer buffers start as v instead of their minimum. A small v
# looks like a valid index (as recycled memory may on a GPU), so a kernel that reads an entry
# no kernel wrote and takes it for a query, slot or block shows up (e.g. 0 or 1). Read at each
# allocation, so that a test can set it too (monkeypatch.setenv).
INT_FILL = "MSA_TEST_INT_FILL"


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every array a launcher allocates without a fill value starts as poison (docs/design.md §5).

    Floats start as NaN and integers as their minimum (``msa.testing.backends.poison_value``;
    ``MSA_TEST_INT_FILL``: a given value), so an element that no kernel writes cannot pass a
    comparison. Works for NumPy (simulator), CuPy, torch and Numba device arrays.
    """
    empty = ArrayContext.empty

    def poisoned(self, shape, dtype, fill=None):
        out = empty(self, shape, dtype, fill)
        if fill is None and int(np.prod(shape)):
            poison(out)
            ints = not isinstance(dtype, str) and np.dtype(dtype).kind in "iu"
            value = os.environ.get(INT_FILL)
            if value is not None and ints:
                if type(out).__module__.split(".")[0] == "torch":
                    out.fill_(int(value))
                else:
                    fill_array(out, np.dtype(dtype).type(int(value)))
        return out

    monkeypatch.setattr(ArrayContext, "empty", poisoned)
