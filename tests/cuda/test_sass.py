"""``msa.testing.sass``: the SASS listing parser (always), and a kernel's SASS offline where
NVVM, ptxas, cuobjdump and nvdisasm are installed (skipped otherwise, and in the simulator)."""

from __future__ import annotations

import pytest

from msa.cuda._core.arrays import SIMULATOR
from msa.testing import sass, variants

LISTING = """
        Function : kernel
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDSM.16.MT88.4 R4, [R2] ;
        /*0020*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        /*0030*/                   IMAD.WIDE.U32 R10, R2, 0x4, R12 ;
        /*0040*/               @!P0 BRA 0x10 ;
        /*0050*/                   STG.E desc[UR4][R10.64], R8 ;
        /*0060*/                   BRA 0x70 ;
        /*0070*/                   EXIT ;
"""


def test_the_parser_finds_instructions_loops_and_classes():
    ins = sass.instructions(LISTING)
    assert [a for a, _, _ in ins] == [0x0, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70]
    assert ins[4][1] == "BRA" and ins[4][2] == "@!P0 BRA 0x10"  # the guard leaves the opcode
    assert sass.loops(ins) == [(0x10, 0x40)]  # only the backward branch is a loop
    body = sass.mix(ins, 0x10, 0x40)
    assert body == {"ldmatrix": 1, "tensor": 1, "integer": 1, "branch": 1}
    assert sass.mix(ins)["global"] == 1 and sass.class_of("FOO.BAR") == "other"


@pytest.mark.skipif(SIMULATOR, reason="compiles PTX for sm_90: not in the simulator")
def test_a_tensor_core_kernel_has_its_mma_in_a_loop():
    missing = [name for name, path in sass.tools().items() if not path]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")
    from msa.testing.ptx import sm90_ptx

    name, kernel, sig = next(v for v in variants.of("attention")
                             if v[0].startswith("bwd.v2.tc.f16.bk32.d32"))
    text, info = sass.compile_sass(sm90_ptx(kernel, sig))
    ins = sass.instructions(text)
    assert any(sass.mix(ins, lo, hi)["tensor"] > 0 for lo, hi in sass.loops(ins))
    report = sass.summary(name, text, info)
    assert report.startswith(f"{name}: {len(ins)} instructions, ") and " registers" in report
