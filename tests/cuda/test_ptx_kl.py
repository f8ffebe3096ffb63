"""The sm_90 PTX of every kernel variant the KL launchers run (``msa.testing.variants.kl``): no
float64 instruction and no local memory (the teacher's and the student's scores and the dk_idx
accumulators stay in registers), and v3's on the tensor cores, with ``cp.async`` copies where
its inputs are 16-byte aligned and plain loads where they are not."""

from __future__ import annotations

import re

import pytest

from msa.cuda._core.arrays import SIMULATOR
from msa.testing import variants
from msa.testing.ptx import assert_no_f64_or_local, sm90_ptx

VARIANTS = variants.of("kl")


@pytest.mark.skipif(SIMULATOR, reason="compiles PTX for sm_90: not in the simulator")
@pytest.mark.parametrize("name, kernel, sig", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_kernel_compiles_for_sm90_without_f64_or_local_memory(name, kernel, sig):
    ptx = sm90_ptx(kernel, sig)
    assert_no_f64_or_local(ptx)
    if not name.startswith(("v3.student.", "v3.grad.", "v3.kl.", "v3.keys.")):
        return  # v1, v2 and v3's helpers (combines, the warmup's full selection): no matrix product
    dtype = "bf16" if ".bf16." in name else "f16"
    assert re.search(rf"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{dtype}\.{dtype}\.f32\b",
                     ptx), "no tensor-core mma of the inputs' dtype"
    assert ("cp.async" in ptx) == (not name.endswith(".plain"))
