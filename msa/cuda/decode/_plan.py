"""Host side of the decode stage: kernel arguments, stream launches, split counts.

``run`` must be capturable in a CUDA graph, so every launch here goes on a stream the caller
names (``torch.cuda.current_stream()`` by default for torch tensors, CuPy's current stream for
CuPy arrays), never on the legacy default stream, which stream capture forbids. A ``Kernel`` is
compiled once for the argument types a plan fixes (``Kernel.compile``); ``Kernel.launch`` then
only packs pointers and calls the driver (``cuda.core.launch``), the fast path of
``msa.cuda._core.launch.launch`` with a stream and dynamic shared memory. Under Numba's
simulator a launch is the plain ``kernel[grid, block, 0, smem](*arrays)``.

Arrays become kernel arguments through ``arg(x, view)``: the pointer, shape and dtype read once
from the tensor (no Numba array is built), optionally reinterpreted: ``"words"`` views a
16-bit array as uint32 pairs (``cp.async`` and ``ldmatrix`` move words), ``"bits"`` views it as
uint16 (bf16 bit patterns, which Numba has no type for).
"""

from __future__ import annotations

import ctypes
import functools
import math

import numpy as np
from numba import cuda

from ..._checks import dtype_of
from .._core.arrays import SIMULATOR, is_bf16, library_of, require_gpu
from .._core.streams import core_stream

if not SIMULATOR:
    from numba.cuda import types as _nbtypes
    from numba.cuda.np.numpy_support import from_dtype as _from_dtype


# -- kernel arguments ---------------------------------------------------------------------------

def _pointer_shape(x):
    """``(pointer, shape, itemsize, C-contiguous)`` of a device array of any library."""
    lib = library_of(x)
    if lib == "torch":
        return (x.data_ptr(), tuple(x.shape), x.element_size(), x.is_contiguous())
    if hasattr(x, "device_ctypes_pointer"):  # Numba
        return (x.device_ctypes_pointer.value or 0, tuple(x.shape), x.dtype.itemsize,
                x.is_c_contiguous())
    cai = x.__cuda_array_interface__
    itemsize = np.dtype(cai["typestr"]).itemsize
    strides = cai.get("strides")
    return cai["data"][0] or 0, tuple(cai["shape"]), itemsize, strides is None or (
        tuple(strides) == _c_strides(tuple(cai["shape"]), itemsize))


def _c_strides(shape, itemsize):
    out, step = [], itemsize
    for extent in reversed(shape):
        out.append(step)
        step *= max(int(extent), 1)
    return tuple(reversed(out))


class Arg:
    """A C-contiguous device array as a kernel parameter: what Numba's argument packing would
    produce for it (meminfo, parent, size, itemsize, data, shape..., strides...)."""

    __slots__ = ("value", "type", "params")

    def __init__(self, value, ptr, shape, dtype):
        dtype = np.dtype(dtype)
        self.value = value  # keeps the array alive while the launch is queued
        self.type = _array_type(dtype, len(shape))
        size = math.prod(shape)
        self.params = (0, 0, size, dtype.itemsize, ptr) + tuple(shape) + _c_strides(
            shape, dtype.itemsize)


@functools.lru_cache(maxsize=None)
def _array_type(dtype, ndim):
    return _nbtypes.Array(_from_dtype(dtype), ndim, "C")


def arg(x, view=None):
    """``x`` as a kernel argument: ``Arg`` on a GPU, the NumPy array (viewed) in the simulator.

    ``view``: None (as is; bf16 tensors as uint16 bits), ``"bits"`` (16-bit as uint16) or
    ``"words"`` (16-bit as uint32 pairs: the last axis halves). ``x`` must be C-contiguous.
    """
    if SIMULATOR:
        if view == "words":
            return x.view(np.uint32)
        if view == "bits":
            return x.view(np.uint16)
        return x
    ptr, shape, itemsize, contiguous = _pointer_shape(x)
    if not contiguous:
        raise ValueError("kernel arguments must be C-contiguous")
    if view == "words":
        if itemsize != 2 or shape[-1] % 2:
            raise ValueError(f"a word view needs a 16-bit array with an even last axis, got "
                             f"itemsize {itemsize}, shape {shape}")
        return Arg(x, ptr, shape[:-1] + (shape[-1] // 2,), np.uint32)
    if view == "bits" or is_bf16(x):
        return Arg(x, ptr, shape, np.uint16)
    return Arg(x, ptr, shape, dtype_of(x))


# -- launches -----------------------------------------------------------------------------------

def _scalar(v):
    """A Python/NumPy scalar as ``(numba type, ctypes value)``: ints int64, np.float64 float64,
    other floats float32 (the kernels' compute type)."""
    if isinstance(v, (bool, np.bool_)):
        raise TypeError("kernel scalars are ints or floats")
    if isinstance(v, (int, np.integer)):
        return _nbtypes.int64, ctypes.c_int64(int(v))
    if isinstance(v, np.float64):
        return _nbtypes.float64, ctypes.c_double(float(v))
    return _nbtypes.float32, ctypes.c_float(float(v))


def sim_scalar(v):
    """The simulator's value of a kernel scalar (float32 unless given as np.float64)."""
    if isinstance(v, (int, np.integer)) or isinstance(v, np.float64):
        return v
    return np.float32(v)


class Kernel:
    """One kernel, one launch configuration, compiled for the argument types of its first
    launch (``compile``) and launched without Numba's per-launch typing."""

    def __init__(self, dispatcher, grid, block, smem: int = 0):
        self.dispatcher = dispatcher
        self.grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else (grid,)))
        self.block = int(block)
        self.smem = int(smem)
        self._compiled = None
        self._function = None
        self._config = None

    def compile(self, *args):
        """Compile for these arguments' types (plan time), raise the shared-memory limit."""
        if SIMULATOR or self._compiled is not None:
            return self
        sig = tuple(a.type if isinstance(a, Arg) else _scalar(a)[0] for a in args)
        self._compiled = self.dispatcher.compile(sig)
        cufunc = self._compiled._codelibrary.get_cufunc()
        if self.smem > 48 * 1024:
            _raise_smem_limit(cufunc, self.smem)
        self._function = cufunc.kernel
        from cuda.core import LaunchConfig
        from numba.cuda._compat import CUDA_CORE_GE_1_0

        coop = "is_cooperative" if CUDA_CORE_GE_1_0 else "cooperative_launch"
        grid3 = (self.grid + (1, 1))[:3]
        self._config = LaunchConfig(grid=grid3, block=(self.block, 1, 1), shmem_size=self.smem,
                                    **{coop: False})
        return self

    def launch(self, stream: int, *args):
        """Queue the kernel on stream ``stream`` (a handle); arrays as ``arg`` made them."""
        if SIMULATOR:
            self.dispatcher[self.grid, self.block, 0, self.smem](*(
                a if isinstance(a, np.ndarray) else sim_scalar(a) for a in args))
            return
        if self._compiled is None:
            self.compile(*args)
        from cuda.core import launch as core_launch

        params = []
        for a in args:
            if isinstance(a, Arg):
                params.extend(a.params)
            else:
                params.append(_scalar(a)[1])
        core_launch(core_stream(stream), self._config, self._function, *params)


def _raise_smem_limit(cufunc, nbytes):
    """Allow ``nbytes`` of dynamic shared memory (above 48 KB a launch fails until the kernel's
    attribute is raised; device README)."""
    from numba.cuda.cudadrv.driver import binding, driver

    attr = binding.CUfunction_attribute
    try:
        driver.cuKernelSetAttribute(attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes,
                                    cufunc.handle, cufunc.device.id)
    except Exception as exc:  # a private API: say what failed
        raise RuntimeError(f"raising the dynamic shared memory limit to {nbytes} bytes failed "
                           f"({type(exc).__name__}: {exc})") from exc


def grid_1d(n: int, threads: int) -> int:
    return max(1, -(-int(n) // threads))


# -- splits -------------------------------------------------------------------------------------

def multiprocessors() -> int:
    """SMs of the current GPU (132 on an H200; the simulator plans as for one)."""
    if SIMULATOR:
        return 132
    require_gpu()
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


# The split kernels' grids: one wave of CTAs. H200, paper configuration (run R, Lq = 1, each
# kernel in a CUDA graph): a split's fixed costs (its queries, its heap or union, its partial
# and the combine's share) outweigh any tail of a second wave, so both kernels plan the most
# splits that still fit the GPU at once. The index kernel (71.8 KB of shared memory: 3 CTAs an
# SM) at B = 32 x 64K: 12 splits 0.271 ms a step against 0.277 for 33 (8 CTAs an SM, rounded
# up), 8 x 128K 48 against 132: 0.154 against 0.161 (the merge 0.028 against 0.035); at
# 128 x 8K 3 splits cost 0.005 ms over 9. The attention kernel (109 KB, 168 registers: 2 CTAs
# an SM fit) plans one CTA an SM: fewer, longer splits, and at B Hkv near the SM count one
# split, which writes the outputs with no combine kernel. H100 (benchmarks.dev.decode_knobs,
# one call, against 2 CTAs an SM): 32 x 64K 1 split 0.0617 ms against 2 splits' 0.0658 +
# 0.0083 (combine), the step 0.2752 against 0.2844; 8 x 128K 4 splits against 8, the step
# 0.1565 against 0.1788 (kernels 0.0225 + 0.0067 against 0.0237 + 0.0069); 128 x 8K and Lq = 8
# plan one split either way. Before (H200, run R): 2 splits 0.0527 + 0.0085 ms against 5
# splits' 0.0723 + 0.0107 at 32 x 64K, 3 splits 0.0566 + 0.0095.
INDEX_CTAS_PER_SM = 3
CTAS_PER_SM = 1
MIN_PAGES_PER_SPLIT = 4  # below this a split's fixed costs (its queries, its heap) dominate
# The merge's cost grows with the splits (B = 1 x 1M: 528 splits 0.082 ms, 256 splits 0.055 ms,
# while the index kernel stays at 0.105 ms down to 256 splits and takes 0.160 ms at 128).
MAX_INDEX_SPLITS = 256


def index_splits(batch: int, max_pages: int, sms: int) -> int:
    """Splits of each request's context for the index kernel: ``batch * splits`` CTAs, at most
    ``INDEX_CTAS_PER_SM * sms`` (one wave; one split a request for large batches), each of at
    least ``MIN_PAGES_PER_SPLIT`` pages at the full ``max_pages``, at most
    ``MAX_INDEX_SPLITS``."""
    want = INDEX_CTAS_PER_SM * sms // batch
    return max(1, min(want, -(-max_pages // MIN_PAGES_PER_SPLIT), MAX_INDEX_SPLITS))


def attention_splits(batch: int, num_kv_heads: int, max_union: int, sms: int,
                     min_pages: int = 2) -> int:
    """Splits of the pages a (request, KV head) reads, for the attention kernel: at most
    ``CTAS_PER_SM * sms`` CTAs (one wave), each with at least ``min_pages`` pages of the union."""
    want = CTAS_PER_SM * sms // (batch * num_kv_heads)
    return max(1, min(want, -(-max_union // min_pages)))
