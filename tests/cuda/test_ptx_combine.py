"""The sm_90 PTX of every K2 kernel variant (``msa.testing.variants.combine``): no float64
instructions, no local memory; version 2 moves the partials in 16-byte loads."""

from __future__ import annotations

import pytest

from msa.cuda._core.arrays import SIMULATOR
from msa.testing import variants
from msa.testing.ptx import assert_no_f64_or_local, sm90_ptx

# In the simulator the factories build simulator kernels (and K1 v4 has none): nothing to list.
CASES = ([pytest.param(None, None, None, id="sm90",
                       marks=pytest.mark.skip(reason="compiles PTX for sm_90: not in the simulator"))]
         if SIMULATOR else [pytest.param(*v, id=v[0]) for v in variants.of("combine")])


@pytest.mark.parametrize("name, kernel, sig", CASES)
def test_kernel_compiles_for_sm90_without_f64_or_local_memory(name, kernel, sig):
    ptx = sm90_ptx(kernel, sig)
    assert_no_f64_or_local(ptx)
    if name.startswith("k2.v2"):
        assert "ld.global.nc.v4" in ptx
