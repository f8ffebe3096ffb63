"""The sm_90 PTX of every kernel variant the CSR build launches (``msa.testing.variants.csr``,
the scans of ``_core.scan`` included): no float64 instructions, no local memory."""

from __future__ import annotations

import pytest

from msa.cuda._core.arrays import SIMULATOR
from msa.testing import variants
from msa.testing.ptx import assert_no_f64_or_local, sm90_ptx

VARIANTS = variants.of("csr")


@pytest.mark.skipif(SIMULATOR, reason="compiles PTX for sm_90: not in the simulator")
@pytest.mark.parametrize("kernel, sig", [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_kernel_compiles_for_sm90_without_f64_or_local_memory(kernel, sig):
    assert_no_f64_or_local(sm90_ptx(kernel, sig))
