"""The sm_90 PTX of every kernel variant of K1 and the backward (``msa.testing.variants.
attention``): no float64 instructions, no local memory, and the instructions each rung is
about (``mma.sync`` in the tensor-core rungs, ``ldmatrix...trans`` where V or dO fragments come
from shared memory by it, ``wgmma`` and no ``mma.sync`` in K1 v4 and backward v3)."""

from __future__ import annotations

import pytest

from msa.cuda._core import mma as _mma
from msa.cuda._core.arrays import SIMULATOR
from msa.testing import variants
from msa.testing.ptx import assert_no_f64_or_local, sm90_ptx

# In the simulator the factories build simulator kernels (the wgmma ones on their twins):
# nothing to compile for sm_90.
CASES = ([pytest.param(None, None, None, id="sm90",
                       marks=pytest.mark.skip(reason="compiles PTX for sm_90: not in the simulator"))]
         if SIMULATOR else [pytest.param(*v, id=v[0]) for v in variants.of("attention")])


@pytest.mark.parametrize("name, kernel, sig", CASES)
def test_kernel_compiles_for_sm90_without_f64_or_local_memory(name, kernel, sig):
    ptx = sm90_ptx(kernel, sig)
    assert_no_f64_or_local(ptx)
    if name.startswith(("k1.v2", "k1.v3", "bwd.v2.tc")) and _mma.MMA_BACKEND == "ptx":
        assert "mma.sync.aligned.m16n8k16" in ptx
    if name.startswith(("k1.v3", "bwd.v2.tc")):
        assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
    if name.startswith(("k1.v4", "bwd.v3")):
        assert "wgmma.mma_async.sync.aligned" in ptx and "mma.sync" not in ptx
