"""Arrays in and out of msa.cuda launchers, whatever library the caller uses.

A launcher takes CuPy arrays, torch CUDA tensors, Numba device arrays or (convenience, with a
copy each way) NumPy arrays, and returns arrays of the caller's library::

    ctx = ArrayContext(q=q, k=k, v=v)      # decides the library from the inputs
    dq = ctx.input("q", q)                 # what the kernel indexes
    out = ctx.empty((T, H), np.float32)    # allocated in the caller's library
    kernel[grid, block](dq, ..., ctx.arg(out))
    return ctx.output(out)

Under Numba's simulator (``NUMBA_ENABLE_CUDASIM=1``) everything is NumPy and no copy is made
(except of a strided or read-only NumPy input: see ``ArrayContext.input``).
Imported arrays are not synchronised (``sync=False``): an ``ArrayContext`` makes the caller's
current stream the launch stream (``streams``), which orders msa's kernels after the caller's
work on it.
bf16 tensors are passed to kernels as their uint16 bit patterns (Numba has no bf16 arrays);
``is_bf16`` tells a launcher which it got.
"""

from __future__ import annotations

import functools
import os

import numpy as np
from numba import cuda

from ..._checks import FLOAT_DTYPES, dtype_name, dtype_of, unsupported
from .diskcache import kernel_jit
from .streams import launch_handle, set_launch_stream, stream

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"
INT32_MAX = np.iinfo(np.int32).max
# Kernel outputs are filled with poison (NaN, -2**31) before a launch under the simulator, or on
# a GPU when MSA_POISON_OUTPUTS=1, so that an element a kernel forgets to write fails the tests.
POISON = SIMULATOR or os.environ.get("MSA_POISON_OUTPUTS", "0") == "1"


def library_of(x) -> str:
    """``'numpy' | 'cupy' | 'torch' | 'numba'`` for an array, TypeError otherwise."""
    mod = type(x).__module__.split(".")[0]
    if isinstance(x, np.ndarray):
        return "numpy"
    if mod == "torch":
        return "torch"
    if mod == "cupy":
        return "cupy"
    if cuda.is_cuda_array(x) or hasattr(x, "copy_to_host"):
        return "numba"
    raise TypeError(f"expected a NumPy, CuPy, torch or Numba CUDA array, got {type(x).__name__}")


def is_bf16(x) -> bool:
    return "bfloat16" in str(getattr(x, "dtype", ""))


FLOAT_KINDS = ("bfloat16", "float16", "float32", "float64")


def is_c_contiguous(x) -> bool:
    """Whether ``x`` (NumPy, torch, CuPy or a Numba device array) is C-contiguous."""
    if isinstance(x, np.ndarray):
        return x.flags.c_contiguous
    if hasattr(x, "is_contiguous"):  # torch
        return x.is_contiguous()
    if hasattr(x, "is_c_contiguous"):  # Numba
        return x.is_c_contiguous()
    return x.flags.c_contiguous  # CuPy
INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def float_kind(name: str, x, kinds=FLOAT_KINDS, *, bf16_bits: bool = False) -> str:
    """The floating-point kind of an array (``'bfloat16'``, ``'float16'``, ``'float32'`` or
    ``'float64'``), one of ``kinds``; a TypeError naming ``name`` for any other dtype.

    ``bf16_bits``: int16/uint16 arrays hold bf16 bit patterns (tests under the simulator, where
    NumPy has no bf16); torch bf16 tensors are recognised by their dtype.
    """
    if is_bf16(x) or (bf16_bits and dtype_of(x).name in ("int16", "uint16")):
        kind = "bfloat16"
    else:
        dt = dtype_of(x)
        kind = dt.name if dt in FLOAT_DTYPES else None
    if kind not in kinds:
        want = ", ".join(kinds[:-1]) + (" or " if len(kinds) > 1 else "") + kinds[-1]
        if kind is not None:  # a float dtype msa.reference takes (float64, say)
            raise unsupported(f"{name}.dtype", kind, "msa.cuda", want, exc=TypeError)
        raise TypeError(f"{name} must have dtype {want}, got {getattr(x, 'dtype', None)}")
    return kind


def index_dtype(name: str, x) -> np.dtype:
    """The dtype of an integer array a kernel indexes with (a selection, a CSR, a schedule, a
    block table): int32 or int64; a TypeError naming ``name`` otherwise. The reference takes any
    integer dtype; the kernels' warp shuffles and matches take 32- and 64-bit words only, and
    Numba types uint64 with int64 arithmetic as float64, which no index may be."""
    dt = dtype_of(x)
    if dt.kind not in "iu" or is_bf16(x):
        raise TypeError(f"{name} must have an integer dtype, got {dtype_name(x)}")
    if dt not in INDEX_DTYPES:
        raise unsupported(f"{name}.dtype", dt.name, "msa.cuda", "int32 and int64",
                          exc=TypeError, why="a kernel shuffles ids as 32- or 64-bit words")
    return dt


@functools.cache
def require_gpu() -> None:
    """Raise a RuntimeError that says what to do when msa.cuda cannot reach a GPU (checked once,
    at the first launcher call: importing msa.cuda, and compiling its kernels offline, need none)."""
    if SIMULATOR or cuda.is_available():
        return
    try:
        cuda.detect()  # numba's reason, when it gives one
        reason = "no CUDA device is visible"
    except Exception as exc:  # a missing driver library
        reason = " ".join(str(exc).split()).rstrip(":")[:200] or type(exc).__name__
    raise RuntimeError(
        f"msa.cuda needs a CUDA GPU with a working driver ({reason}); set "
        f"NUMBA_ENABLE_CUDASIM=1 before importing msa to run the kernels in Numba's simulator, "
        f"or use msa.reference (NumPy) or msa.torch on CPU tensors, which need no GPU")


def current_device_index(lib: str) -> int:
    """The current CUDA device of ``lib`` ("torch" or "cupy"), where msa.cuda launches."""
    if lib == "torch":
        import torch

        return torch.cuda.current_device()
    import cupy

    return cupy.cuda.runtime.getDevice()


class ArrayContext:
    """The caller's array library and device, taken from the launcher's inputs.

    ``ArrayContext(q=q, k=k, v=v)``: the launcher's arrays by argument name, so that an error
    names them (a torch CPU tensor, a list, arrays of two libraries or two devices); arrays
    passed positionally are named by position. ``None`` values are left out.
    """

    def __init__(self, *arrays, **named):
        require_gpu()
        items = [(f"input {i}", a) for i, a in enumerate(arrays)] + list(named.items())
        items = [(name, a) for name, a in items if a is not None]
        libs = {}
        for name, a in items:
            try:
                lib = library_of(a)
            except TypeError:
                raise TypeError(f"{name} must be a NumPy, CuPy, torch or Numba CUDA array, got "
                                f"{type(a).__name__}") from None
            if lib == "torch" and not a.is_cuda:
                raise TypeError(
                    f"{name} is a torch tensor on {a.device}: msa.cuda takes CUDA tensors (or "
                    f"NumPy arrays, copied to the GPU); msa.torch runs CPU tensors")
            libs.setdefault(lib, []).append(name)
        if len(libs) > 1:
            which = "; ".join(f"{', '.join(n)}: {lib}" for lib, n in libs.items())
            raise TypeError(f"inputs mix array libraries ({which}); pass one library's arrays"
                            + (" (NumPy is host memory: move it to the GPU)" if "numpy" in libs
                               else ""))
        self.lib = next(iter(libs), "numpy")
        self._torch_device = None
        if self.lib == "torch":
            first = None
            for name, a in items:
                if self._torch_device is None:
                    self._torch_device, first = a.device, name
                elif a.device != self._torch_device:
                    raise ValueError(f"{name} is on {a.device} and {first} on "
                                     f"{self._torch_device}: pass tensors of one device")
            current = current_device_index("torch")
            if self._torch_device.index != current:
                raise ValueError(
                    f"{first} is on {self._torch_device} but the current CUDA device is "
                    f"cuda:{current}, where msa.cuda launches: call inside "
                    f"`with torch.cuda.device({self._torch_device.index}):`")
        elif self.lib == "cupy":
            current = current_device_index("cupy")
            for name, a in items:
                if a.device.id != current:
                    raise ValueError(
                        f"{name} is on CuPy device {a.device.id} but the current CUDA device is "
                        f"{current}, where msa.cuda launches: call inside "
                        f"`with cupy.cuda.Device({a.device.id}):`")
        set_launch_stream(self.lib)

    # -- inputs -------------------------------------------------------------------------------
    def input(self, name: str, x):
        """A kernel-ready view of ``x`` (no copy except NumPy on a real GPU)."""
        if x is None:
            return None
        if self.lib == "numpy":
            # NumPy input is copied to the device anyway: a strided view is copied densely
            # first. The simulator hands the array itself to the kernels and writes every
            # argument back after a launch, so a read-only one is copied there.
            x = np.ascontiguousarray(x)
            if not SIMULATOR:
                return cuda.to_device(x, stream=stream())
            return x if x.flags.writeable else x.copy()
        if self.lib == "torch":
            if not is_c_contiguous(x):
                raise ValueError(f"{name} must be contiguous")
            t = x.detach()
            if is_bf16(t):
                t = t.view(__import__("torch").int16)
            return cuda.as_cuda_array(t, sync=False)
        if self.lib == "cupy":
            if not is_c_contiguous(x):
                raise ValueError(f"{name} must be C-contiguous")
            return cuda.as_cuda_array(x, sync=False)
        arr = cuda.as_cuda_array(x, sync=False) if not hasattr(x, "copy_to_host") else x
        if not is_c_contiguous(arr):
            raise ValueError(f"{name} must be C-contiguous")
        return arr

    def free_bytes(self) -> float:
        """Bytes this library could allocate on the inputs' device now: the driver's free memory
        plus what the library's pool holds unused (torch, CuPy). Infinite under the simulator
        and where Numba's memory manager cannot tell."""
        if SIMULATOR:
            return float("inf")
        if self.lib == "torch":
            import torch
            dev = self._torch_device
            free, _ = torch.cuda.mem_get_info(dev)
            return float(free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))
        if self.lib == "cupy":
            import cupy
            free, _ = cupy.cuda.runtime.memGetInfo()
            return float(free + cupy.get_default_memory_pool().free_bytes())
        try:
            return float(cuda.current_context().get_memory_info().free)
        except NotImplementedError:  # an external memory manager that cannot tell (Numba EMM)
            return float("inf")

    # -- outputs ------------------------------------------------------------------------------
    def empty(self, shape, dtype, fill=None):
        """An output array in the caller's library (bf16 is asked for as ``'bfloat16'``)."""
        shape = tuple(int(s) for s in shape)
        bf16 = isinstance(dtype, str) and dtype == "bfloat16"
        if self.lib == "torch":
            import torch
            tdt = torch.bfloat16 if bf16 else getattr(torch, np.dtype(dtype).name)
            out = torch.empty(shape, dtype=tdt, device=self._torch_device)
            if fill is not None:
                out.fill_(fill)
            return out
        npdt = np.uint16 if bf16 else np.dtype(dtype)
        if self.lib == "cupy":
            import cupy
            out = cupy.empty(shape, dtype=npdt)
        elif self.lib == "numba" or (self.lib == "numpy" and not SIMULATOR):
            out = cuda.device_array(shape, dtype=npdt)
        else:
            out = np.empty(shape, dtype=npdt)
        if fill is not None:
            self._fill(out, fill)
        return out

    @staticmethod
    def _fill(out, value):
        fill(out, value)

    def arg(self, out):
        """The kernel argument for an array made by :meth:`empty`."""
        if self.lib == "torch":
            t = out.view(__import__("torch").int16) if is_bf16(out) else out
            return cuda.as_cuda_array(t, sync=False)
        if self.lib == "cupy":
            return cuda.as_cuda_array(out, sync=False)
        return out

    def output(self, out):
        """What the caller gets back: NumPy inputs get NumPy outputs (copied back on a GPU)."""
        if self.lib == "numpy" and not SIMULATOR:
            return out.copy_to_host()
        return out


def fill(out, value):
    """Fill a NumPy, CuPy, torch or Numba device array with ``value`` in place; return it."""
    if library_of(out) == "torch":
        out.fill_(value)
    elif hasattr(out, "fill"):  # NumPy, CuPy
        out.fill(value)
    else:  # Numba device array: no fill method, no Ellipsis assignment
        n = int(np.prod(out.shape))
        if n:
            flat = out.reshape(n)
            _fill_kernel[(n + 255) // 256, 256, stream()](flat, flat.dtype.type(value))
    return out


@kernel_jit
def _fill_kernel(flat, value):
    i = cuda.grid(1)
    if i < flat.size:
        flat[i] = value


def device_constant(host):
    """A small host array on the device that no kernel writes, memoised by content, device and
    launch stream (the simulator indexes NumPy directly).

    A fresh upload per call costs more than its bytes: the copy from pageable memory waits for
    the GPU's queued work, and freeing Numba's device arrays (a ``cuMemFree`` once enough are
    pending) waits for the whole GPU. Either stalls the host, so that the GPU then idles while
    the host prepares the next launches (at 128K, ~6 ms of a 52 ms ``sparse_attention`` with
    16 uploads of chunk offsets a call).
    """
    host = np.ascontiguousarray(host)
    if SIMULATOR:
        return host
    return _cached_constant(host.tobytes(), host.dtype.str, host.shape,
                            cuda.get_current_device().id, launch_handle())


@functools.lru_cache(maxsize=256)
def _cached_constant(data: bytes, dtype: str, shape: tuple, device_id: int, handle: int):
    # One copy per launch stream, queued on it: the kernels that read it are ordered after it
    # (a copy made on another stream could still be in flight).
    return cuda.to_device(np.frombuffer(data, dtype=dtype).reshape(shape), stream=stream())


def device_offsets(batch):
    """``(cu_q, cu_k)`` of a validated ``msa._batch.Batch`` as int32 device constants (the
    memoised uploads of ``device_constant``), made once per batch (``batch.memo``); ``cu_q`` is
    None for a batch of keys only."""
    got = batch.memo.get("device_offsets")
    if got is None:
        got = batch.memo["device_offsets"] = tuple(
            None if cu is None else device_constant(cu.astype(np.int32))
            for cu in (batch.cu_q, batch.cu_k))
    return got
