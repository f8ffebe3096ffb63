"""The launch stream: the CUDA stream every msa.cuda kernel of a call goes on.

Each public entry records its inputs' library (``ArrayContext``), and every launch goes on
that library's *current* stream at launch time: torch's for torch tensors, CuPy's for CuPy
arrays, the legacy default stream (0) for NumPy and Numba arrays and under the simulator. A
caller inside ``with torch.cuda.stream(s):`` thus gets msa's kernels ordered after the work that
made its inputs and before the work that reads its outputs, as torch's own ops are. The stream
is read at each launch, not kept from the entry: an internal launcher called later on its own
(``launch_build_csr``, ``lookback_scan``, ...) goes on the current stream of the last library
used, outside a ``with torch.cuda.stream`` block the default stream, never on a side stream a
finished call left behind. ``launch`` and ``launch_smem`` read it; a bracket launch passes it
to Numba: ``kernel[grid, block, stream()]``. The library is a ``ContextVar``: each thread keeps
its own.
"""

from __future__ import annotations

import contextvars
import functools

from numba import cuda

_LIB = contextvars.ContextVar("msa_launch_library", default="numpy")


def stream_handle(stream, lib: str) -> int:
    """The CUDA stream handle to launch on: ``stream`` (a handle, or a torch, CuPy or Numba
    stream) or, for None, the caller's current stream (torch, CuPy; 0 otherwise)."""
    if stream is None:
        if lib == "torch":
            return _torch_current_stream()()
        if lib == "cupy":
            import cupy

            return int(cupy.cuda.get_current_stream().ptr)
        return 0
    if isinstance(stream, bool):
        raise TypeError("stream must be a stream handle (int), a torch, CuPy or Numba stream, "
                        "or None, got bool")
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    handle = getattr(stream, "handle", None)  # a Numba stream
    if handle is not None:
        return int(getattr(handle, "value", handle) or 0)
    raise TypeError(f"stream must be a stream handle (int), a torch, CuPy or Numba stream, or "
                    f"None, got {type(stream).__name__}")


@functools.lru_cache(maxsize=None)
def _torch_current_stream():
    """A function returning torch's current stream handle on its current device: torch's own
    raw getter (what its compiled code launches on; a fraction of a microsecond), else the
    public ``torch.cuda.current_stream()`` (4 us: it builds a Stream object)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    device = getattr(torch._C, "_cuda_getDevice", None)
    if raw is not None and device is not None:
        return lambda: int(raw(device()))
    return lambda: int(torch.cuda.current_stream().cuda_stream)


def set_launch_stream(lib: str) -> None:
    """Make ``lib``'s current stream the launch stream (module docstring); the public entries
    call it once, through ``ArrayContext``."""
    _LIB.set(lib)


def launch_handle() -> int:
    """The launch stream's handle now (0: the legacy default stream)."""
    return stream_handle(None, _LIB.get())


def stream():
    """The launch stream as Numba's dispatcher takes it: ``kernel[grid, block, stream()]``."""
    handle = launch_handle()
    return 0 if handle == 0 else _numba_stream(handle)


@functools.lru_cache(maxsize=64)
def _numba_stream(handle: int):
    return cuda.external_stream(handle)


@functools.lru_cache(maxsize=64)
def core_stream(handle: int):
    """The ``cuda.core`` stream object of a handle, which a compiled kernel's launch wants."""
    from numba.cuda.cudadrv.driver import ExperimentalStream

    return ExperimentalStream.from_handle(handle)
