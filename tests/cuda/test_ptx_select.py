"""The select stage's kernels compiled offline for sm_90 (a GPU or NVVM; not the simulator).

Every default variant of ``msa.testing.variants.select`` (select_blocks v1-v3): no float64
instruction unless the scores are float64, v3's warp-wide list in registers (no local memory;
v1's sorted array and v2's heaps are local arrays by design), v3's 128-bit loads where it takes
them and the warp shuffles of v2 and v3.
"""

import re

import pytest

from msa.cuda._core.arrays import SIMULATOR
from msa.testing.ptx import sm90_ptx
from msa.testing.variants import select as variants

pytestmark = pytest.mark.skipif(SIMULATOR, reason="compiles PTX for sm_90: not in the simulator")

_VARIANTS = {name: (kernel, sig) for name, kernel, sig in variants.variants()}


@pytest.mark.parametrize("name", _VARIANTS)
def test_select_kernel_ptx(name):
    kernel, sig = _VARIANTS[name]
    ptx = sm90_ptx(kernel, sig)
    rung = name.split(".")[0]  # v1, v2, v3
    if "float64" not in name:
        assert not re.findall(r"\.f64\b", ptx), "float64 instructions in the PTX"
    if rung == "v3":
        assert not re.findall(r"\b(ld|st)\.local\b", ptx), "local memory in the PTX"
        assert bool(re.search(r"ld\.global(\.nc)?\.v4\.f32", ptx)) == name.endswith(".vec")
    assert ("shfl.sync" in ptx) == (rung != "v1")
