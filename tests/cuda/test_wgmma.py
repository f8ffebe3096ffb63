"""``msa.cuda._core.wgmma`` against NumPy: the core-matrix layout, the matrix descriptor, and
``wgmma`` itself, A from registers (B K-major and N-major) and from shared memory.

On a GPU of compute capability 9.0 the products run the instruction, so they pin down the
layout and descriptor conventions the kernels rely on; in the simulator they run the twins,
which must read the same bytes the same way. The kernels built on ``wgmma`` (K1 v4, backward
v3) are tested against the reference in ``test_attention_*.py``.
"""

import functools

import numpy as np
import pytest
from numba import cuda, float32

from msa.cuda._core import wgmma as _wgmma
from msa.cuda._core.arrays import SIMULATOR
from msa.cuda._core.memops import dynamic_smem_u32

from .attention_cases import f32_to_bf16_bits

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


def _core_words(x_bits):
    """A [rows, cols] uint16 matrix as the uint32 words of its core-matrix layout."""
    rows, cols = x_bits.shape
    pairs = x_bits.astype(np.uint32)[:, 0::2] | (x_bits.astype(np.uint32)[:, 1::2] << 16)
    out = np.zeros(rows * cols // 2, np.uint32)
    for r in range(rows):
        for w in range(0, cols // 2, 4):
            at = core_word(r, w, cols)
            out[at:at + 4] = pairs[r, w:w + 4]
    return out


@functools.lru_cache(maxsize=None)
def _product_kernel(n, mode):
    """One warpgroup: ``out [64, n]`` = A [64, 16] B [16, n], twice with ``accumulate`` on
    the second call when ``mode`` ends in "+": "rs0"/"rs1" (A in registers, B K-major / N-major
    at word 0 of the shared memory) or "ss" (B K-major, A K-major after it)."""
    trans_b = 1 if mode.startswith("rs1") else 0
    twice = mode.endswith("+")
    if mode.startswith("ss"):
        wg = _wgmma.make_wgmma_ss(n, "bf16")
    else:
        wg = _wgmma.make_wgmma_rs(n, "bf16", trans_b)
    wait = _wgmma.make_wgmma_wait(n // 2)
    nacc = n // 2
    # B K-major: [n, 16] core matrices (next 8 k +128 B, next 8 n +256 B); N-major: [16, n]
    # (next 8 k +16 n B, next 8 n +128 B); A: [64, 16] K-major after B
    lbo, sbo = (16 * n, 128) if trans_b else (128, 256)
    a_at = 8 * n  # words: B's 16 n 16-bit values
    SS = mode.startswith("ss")
    cw = _wgmma.core_word

    @cuda.jit
    def product(a_words, b_words, out):
        smem = dynamic_smem_u32()
        acc = cuda.local.array(nacc, float32)
        tid = cuda.threadIdx.x
        for i in range(tid, b_words.size, 128):
            smem[i] = b_words[i]
        for i in range(tid, 512, 128):
            smem[a_at + i] = a_words[i]
        _wgmma.fence_proxy_async()
        cuda.syncthreads()
        warp = tid // 32
        g = (tid % 32) // 4
        t = tid % 4
        row = 16 * warp + g
        desc_b = _wgmma.smem_desc(_wgmma.shared_address(smem, 0), lbo, sbo)
        desc_a = _wgmma.smem_desc(_wgmma.shared_address(smem, a_at), 128, 256)
        for i in range(nacc):
            acc[i] = float32(0.0)
        _wgmma.wgmma_fence()
        for rep in range(2 if twice else 1):
            if SS:
                wg(acc, desc_a, desc_b, rep)
            else:  # A's fragment of mma.sync: rows g, g + 8, words t and t + 4 of the row
                a0 = smem[a_at + cw(row, 0, 16) + t]
                a1 = smem[a_at + cw(row + 8, 0, 16) + t]
                a2 = smem[a_at + cw(row, 4, 16) + t]
                a3 = smem[a_at + cw(row + 8, 4, 16) + t]
                wg(acc, a0, a1, a2, a3, desc_b, rep)
        _wgmma.wgmma_commit()
        wait(acc)
        for i in range(n // 8):
            for e in range(2):
                out[row, 8 * i + 2 * t + e] = acc[4 * i + e]
                out[row + 8, 8 * i + 2 * t + e] = acc[4 * i + 2 + e]

    return product


@pytest.mark.parametrize("mode", ["rs0", "rs1+", "ss+"])
@pytest.mark.parametrize("n", [16, 64])
def test_wgmma_products_equal_numpy(mode, n):
    """Small-integer bf16 values, so that every product and sum is exact in float32: the GPU's
    instruction and the twin must both give A B (2 A B with ``accumulate`` on the second
    call), element for element."""
    if not SIMULATOR and _wgmma.why_not_available():
        pytest.skip(_wgmma.why_not_available())
    rng = np.random.default_rng(n + len(mode))
    a = rng.integers(-4, 5, (64, 16)).astype(np.float32)
    b = rng.integers(-4, 5, (16, n)).astype(np.float32)
    a_bits = f32_to_bf16_bits(a)
    b_bits = f32_to_bf16_bits(b)
    b_words = _core_words(b_bits if mode.startswith("rs1") else b_bits.T.copy())
    a_words = _core_words(a_bits)
    out = cuda.to_device(np.full((64, n), np.nan, np.float32))
    _product_kernel(n, mode)[1, 128, 0, 4 * (8 * n + 512)](
        cuda.to_device(a_words), cuda.to_device(b_words), out)
    want = a @ b * (2 if mode.endswith("+") else 1)
    np.testing.assert_array_equal(out.copy_to_host(), want)
