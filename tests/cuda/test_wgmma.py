"""``msa.cuda._core.wgmma``'s host-checkable pieces: the core-matrix layout and the matrix descriptor.

The ``wgmma`` instructions themselves run only on a GPU of compute capability 9.0 (no simulator
twin); the kernels that use them (K1 v4, the index kernel ``tc4``) are tested against the
reference in ``test_attention_*.py`` and ``test_index.py`` there. What is plain arithmetic is
tested here, in the simulator too, through the device functions' Python bodies.
"""

import numpy as np
import pytest

from msa.cuda._core import wgmma as _wgmma

core_word = _wgmma.core_word.py_func
smem_desc = _wgmma.smem_desc.py_func


@pytest.mark.parametrize("rows,d", [(8, 16), (16, 64), (64, 128), (128, 128)])
def test_core_word_is_the_core_matrix_layout(rows, d):
    """Each 16-byte piece (row r, words w..w+3) of a [rows, d] 16-bit matrix gets its own
    place, the pieces tile [0, rows * d / 2) words exactly, and the 8 rows of a core matrix
    (row group g, piece column u) are 128 contiguous bytes at g * 16 d + u * 128 bytes."""
    seen = np.zeros(rows * d // 2, dtype=np.int64)
    for r in range(rows):
        for w in range(0, d // 2, 4):
            at = core_word(r, w, d)
            seen[at:at + 4] += 1
            g, u = r // 8, w // 4
            assert at == (g * 16 * d + u * 128) // 4 + (r % 8) * 4
    assert (seen == 1).all()


@pytest.mark.parametrize("address,leading,stride", [(0, 128, 2048), (0x1230, 128, 2048),
                                                    (0x37FF0, 2048, 128), (0x40010, 16, 16)])
def test_smem_desc_bit_fields(address, leading, stride):
    """Bits 0-13: address / 16 (of the 18-bit shared window), 16-29: leading byte offset / 16,
    32-45: stride byte offset / 16; no base offset, no swizzle (bits 49-51, 62-63 zero)."""
    desc = int(smem_desc(address, leading, stride))
    assert desc & 0x3FFF == (address & 0x3FFFF) >> 4
    assert (desc >> 16) & 0x3FFF == leading >> 4
    assert (desc >> 32) & 0x3FFF == stride >> 4
    assert desc >> 46 == 0 and (desc >> 14) & 3 == 0 and (desc >> 30) & 3 == 0
