"""The index stage's kernels compiled offline for sm_90 (a GPU or NVVM; not the simulator).

Every default variant of ``msa.testing.variants.index`` (block_scores v1-v3 and the fused
top-k kernels, paper and small shapes): no float64 instruction unless the inputs are float64
(a bare float literal drags an expression to f64), no local memory where no array is indexed
at run time (the fused kernels keep their per-row heap in a local array), and the instructions
each rung is about: ``mma.sync`` in v2 and v3, ``cp.async`` and ``ldmatrix`` in v3 only,
one ``max.f32`` a fold in v3's fused top-k.
"""

import re

import pytest

from msa.cuda._core.arrays import SIMULATOR
from msa.testing.ptx import sm90_ptx
from msa.testing.variants import index as variants

pytestmark = pytest.mark.skipif(SIMULATOR, reason="compiles PTX for sm_90: not in the simulator")

_VARIANTS = {name: (kernel, sig) for name, kernel, sig in variants.variants()}


@pytest.mark.parametrize("name", _VARIANTS)
def test_index_kernel_ptx(name):
    kernel, sig = _VARIANTS[name]
    ptx = sm90_ptx(kernel, sig)
    rung = name.split(".")[0]  # v1, v2, v3, fused2, fused3
    if ".f64." not in name:
        assert not re.findall(r"\.f64\b", ptx), "float64 instructions in the PTX"
    if not rung.startswith("fused"):
        assert not re.findall(r"\b(ld|st)\.local\b", ptx), "local memory in the PTX"
    tensor_cores = rung != "v1"
    assert ("mma.sync.aligned.m16n8k16" in ptx) == tensor_cores
    assert ("cp.async" in ptx) == rung.endswith("3")
    assert ("ldmatrix" in ptx) == rung.endswith("3")
    if rung == "fused3":
        assert "max.f32" in ptx
