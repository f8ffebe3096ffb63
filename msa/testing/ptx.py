"""Offline PTX of msa's kernels (NVVM, no GPU; not the simulator).

``sm90_ptx(kernel, sig)`` compiles a ``@cuda.jit`` kernel for sm_90 (skipping the calling test
when NVVM is not installed); ``assert_no_f64_or_local(ptx)`` fails on float64 instructions (a
bare float literal drags expressions to f64) and on local memory (register arrays that spilled
or that a loop indexes at run time).

``fingerprint(ptx)`` is a short hash of a kernel's PTX with its mangled names (which carry the
module path and Numba's unique ids) replaced by their order of appearance, so that moving a
kernel to another module keeps its fingerprint while any change to its instructions does not.
Run as a script it prints one line per default kernel variant (``msa.testing.variants``)::

    python -m msa.testing.ptx [stage ...] > fingerprints.txt

Two such listings, before and after a refactor, must be identical (``diff``).
"""

from __future__ import annotations

import hashlib
import re
import sys

_MANGLED = re.compile(r"_Z[A-Za-z0-9_$]+")
_HEADER = re.compile(r"^//.*$", re.MULTILINE)


def sm90_ptx(kernel, sig) -> str:
    """PTX of ``kernel`` (a Numba CUDA dispatcher) for argument types ``sig`` on sm_90."""
    import pytest

    try:
        return compile_sm90(kernel, sig)
    except Exception as exc:  # no NVVM here: nothing to check
        if "NVVM" in str(exc) or "nvvm" in str(exc):
            pytest.skip(f"NVVM unavailable: {exc}")
        raise


def compile_sm90(kernel, sig) -> str:
    """``cuda.compile_ptx`` of a dispatcher's Python function for sm_90 (raises without NVVM).

    The device functions a kernel calls are compiled for the current device's compute
    capability; on a machine without a GPU that is taken to be 9.0 (Numba would ask the driver).
    """
    from numba import cuda
    from numba.cuda import dispatcher

    if not cuda.is_available() and not getattr(dispatcher.get_current_device, "_sm90", False):
        def sm90_device():
            return _SM90

        sm90_device._sm90 = True
        dispatcher.get_current_device = sm90_device
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    return ptx


class _SM90:
    """What a device-function compile asks of the current device, offline."""

    compute_capability = (9, 0)


def assert_no_f64_or_local(ptx: str) -> None:
    assert not re.findall(r"\.f64\b", ptx), "float64 instructions in the PTX"
    assert not re.findall(r"\b(ld|st)\.local\b", ptx), "local memory in the PTX"


def normalized(ptx: str) -> str:
    """The PTX without its comment header and with mangled names numbered by first use."""
    names: dict[str, str] = {}

    def rename(m):
        return names.setdefault(m.group(0), f"_N{len(names)}")

    return _MANGLED.sub(rename, _HEADER.sub("", ptx)).strip()


def fingerprint(ptx: str) -> str:
    """16 hex digits of the SHA-256 of ``normalized(ptx)``."""
    return hashlib.sha256(normalized(ptx).encode()).hexdigest()[:16]


def main(argv=None) -> int:
    from . import variants

    stages = list(argv if argv is not None else sys.argv[1:]) or list(variants.STAGES)
    for stage in stages:
        for name, kernel, sig in variants.of(stage):
            ptx = compile_sm90(kernel, sig)
            print(f"{stage:10s} {name:48s} {fingerprint(ptx)}  lines={ptx.count(chr(10))}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
