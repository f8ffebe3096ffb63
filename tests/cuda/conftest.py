"""Kernel tests: under Numba's simulator in CI, on a real GPU through the device tool.

Without either, every test here is skipped with the reason. Under the simulator the warp
operations of ``msa.cuda._simwarp`` are installed (``msa.cuda`` installs them too; it is
idempotent).
"""

import pathlib

import pytest

from msa.cuda._simwarp import install
from msa.testing.backends import cuda_runnable

install()

_HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    ok, why = cuda_runnable()
    if ok:
        return
    for item in items:
        if _HERE in pathlib.Path(item.path).parents:
            item.add_marker(pytest.mark.skip(reason=why))
