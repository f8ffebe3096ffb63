"""Offline PTX checks of msa's kernels (a GPU or NVVM; not the simulator).

``sm90_ptx(kernel, sig)`` compiles a ``@cuda.jit`` kernel for sm_90 (skipping the calling test
when NVVM is not installed); ``assert_no_f64_or_local(ptx)`` fails on float64 instructions (a
bare float literal drags expressions to f64) and on local memory (register arrays that spilled
or that a loop indexes at run time).
"""

from __future__ import annotations

import re


def sm90_ptx(kernel, sig) -> str:
    """PTX of ``kernel`` (a Numba CUDA dispatcher) for argument types ``sig`` on sm_90."""
    import pytest
    from numba import cuda

    try:
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    except Exception as exc:  # no NVVM here: nothing to check
        if "NVVM" in str(exc) or "nvvm" in str(exc):
            pytest.skip(f"NVVM unavailable: {exc}")
        raise
    return ptx


def assert_no_f64_or_local(ptx: str) -> None:
    assert not re.findall(r"\.f64\b", ptx), "float64 instructions in the PTX"
    assert not re.findall(r"\b(ld|st)\.local\b", ptx), "local memory in the PTX"
