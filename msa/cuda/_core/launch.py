"""Launching msa's kernels: arguments described once, the compiled kernel called directly.

``launch(kernel, grid, block, *args)`` is ``kernel[grid, block](*args)`` without Numba's
per-launch typing (arguments are ``Dev`` arrays and Python ints); ``launch_smem`` launches with
dynamic shared memory above 48 KB; ``upload_ints`` puts small host metadata (offsets) on the
device once per content; ``kernel_array`` turns an index array another msa launcher returned into
a kernel argument. In the simulator every one of them is the plain launch or the NumPy array.

Every launch goes on the launch stream of ``streams`` (the caller's current stream).
"""

from __future__ import annotations

import ctypes
import functools
import math

import numpy as np
from numba import cuda

from .arrays import SIMULATOR, device_constant, is_c_contiguous
from .mma import DEVICE_SMEM_LIMIT, STATIC_RESERVE, STATIC_SMEM_LIMIT
from .streams import core_stream, launch_handle, stream

THREADS = 128 if SIMULATOR else 256  # 1-D grid-stride kernels
MAX_GRID = 1 << 16  # grid-stride kernels launch at most this many blocks

# --- launches ---------------------------------------------------------------------------------
# At 128K tokens the whole build is a few hundred microseconds of GPU work, so what Numba does in
# Python per launch matters. A plain ``kernel[grid, block](*args)`` types every argument (for a
# torch tensor: a DLPack export or a __cuda_array_interface__ dict per argument), looks the
# overload up, then converts each array again into a strided view to marshal it. Here every array
# is described once per call (``Dev``: pointer, shape, strides, Numba type, read straight from
# the tensor), the compiled kernel of a signature is cached, and ``launch`` packs every parameter
# (each 8 bytes) into one buffer for one call of the driver's ``cuLaunchKernel`` (cuda.core's
# launch, the fallback, converts each of the tens of parameters in Python: ~100 us more for the
# seven launches of a 128K ``build_csr`` + ``build_schedule`` on an H200, docs/performance.md).
# In the simulator ``launch`` is the plain launch and ``dev`` returns its argument.


if not SIMULATOR:
    from numba.cuda import types as _nbtypes
    from numba.cuda.args import ArgHint as _ArgHint
    from numba.cuda.errors import normalize_kernel_dimensions as _dims
    from numba.cuda.np.numpy_support import from_dtype as _from_dtype

    try:
        from cuda.bindings import driver as _cudrv
        from cuda.core import LaunchConfig as _LaunchConfig
        from cuda.core import launch as _core_launch
    except ImportError:  # an older Numba: its dispatcher launches (FAST_LAUNCH emptied)
        _cudrv = _LaunchConfig = _core_launch = None
else:  # the simulator launches with its own arrays
    _ArgHint = object


class _Layout:
    """What Numba's argument packing reads of an array's layout (``_prepare_args``)."""

    def __init__(self, strides, c_contiguous):
        self.strides_in_bytes = strides
        self.is_contiguous_c = c_contiguous
        self.is_contiguous_f = False
        self.is_contiguous_any = c_contiguous


class Dev(_ArgHint):
    """One device array as a kernel argument, described once (GPU only; see above).

    An ``ArgHint`` whose ``to_device`` is itself: Numba's packing takes ``ptr``, ``shape``,
    ``size``, ``dtype`` and ``_layout`` from it; ``_numba_type_`` types it without a look at the
    array. ``value`` keeps the array alive while the launch is queued.
    """

    def __init__(self, x):
        self.value = x
        if type(x).__module__.split(".")[0] == "torch":
            itemsize = x.element_size()
            self.ptr = x.data_ptr()
            shape = tuple(x.shape)
            strides = tuple(st * itemsize for st in x.stride())
            dtype = _torch_dtype(x.dtype)
        elif hasattr(x, "device_ctypes_pointer"):  # a Numba device array
            self.ptr = x.device_ctypes_pointer.value or 0
            shape, strides, dtype = tuple(x.shape), tuple(x.strides), np.dtype(x.dtype)
        else:  # CuPy or any __cuda_array_interface__ array
            cai = x.__cuda_array_interface__
            dtype = np.dtype(cai["typestr"])
            self.ptr = cai["data"][0] or 0
            shape = tuple(cai["shape"])
            strides = cai.get("strides") or _c_strides(shape, dtype.itemsize)
            strides = tuple(strides)
        c_contiguous = strides == _c_strides(shape, dtype.itemsize) or 0 in shape
        self.shape = shape
        self.size = math.prod(shape)
        self.dtype = dtype
        self.ndim = len(shape)
        self._layout = _Layout(strides, c_contiguous)
        self._numba_type_ = _array_type(dtype, len(shape), c_contiguous)
        # What the kernel's parameter list holds for an array (Numba's ``_prepare_args``):
        # meminfo, parent, size, itemsize, data, shape..., strides...
        self.params = (0, 0, self.size, dtype.itemsize, self.ptr) + shape + strides

    def to_device(self, retr, stream=0):
        return self


@functools.lru_cache(maxsize=None)
def _torch_dtype(torch_dtype):
    return np.dtype(str(torch_dtype).rsplit(".", 1)[-1])


@functools.lru_cache(maxsize=None)
def _array_type(dtype, ndim, c_contiguous):
    """The Numba type of a device array (interned by Numba anyway; built once here)."""
    return _nbtypes.Array(_from_dtype(dtype), ndim, "C" if c_contiguous else "A")


def _c_strides(shape, itemsize):
    strides = []
    step = itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= max(int(extent), 1)
    return tuple(reversed(strides))


def dev(x):
    """The kernel argument for a device array (``Dev`` on a GPU, ``x`` in the simulator)."""
    if SIMULATOR or x is None or isinstance(x, Dev):
        return x
    return Dev(x)


_compiled: dict = {}


def karg(ctx, x):
    """The kernel argument for an array made by ``ctx.empty`` (``ctx.arg`` in the simulator)."""
    return ctx.arg(x) if SIMULATOR else Dev(x)


def kinput(ctx, name, x):
    """``ctx.input`` as a kernel argument, without the Numba array a tensor would become."""
    if SIMULATOR or ctx.lib not in ("torch", "cupy"):
        return dev(ctx.input(name, x))
    if not is_c_contiguous(x):
        raise ValueError(f"{name} must be contiguous")
    return Dev(x.detach() if ctx.lib == "torch" else x)


def launch(kernel, grid, block, *args):
    """``kernel[grid, block](*args)`` without Numba's per-launch typing and conversions.

    ``args``: ``Dev`` arrays and Python ints (typed int64, as Numba types them). The compiled
    kernel of each signature is kept in ``_compiled``, its CUDA function per device, and the
    parameter list is packed here from what ``Dev`` worked out (what Numba's ``launch`` would
    pack, without its context lookups and per-argument type dispatch).
    """
    if SIMULATOR:
        kernel[grid, block, stream()](*args)
        return
    params = []  # every parameter is 8 bytes: pointers, int64 sizes, shapes, strides, ints
    types = []
    for a in args:
        if isinstance(a, Dev):
            types.append(a._numba_type_)
            params.extend(a.params)
        elif isinstance(a, (int, np.integer)):
            types.append(int)
            params.append(int(a))
        else:
            raise TypeError(f"launch takes Dev arrays and ints, got {type(a).__name__}")
    types = tuple(types)
    entry = _compiled.get((kernel, types))
    if entry is None:
        sig = tuple(_nbtypes.int64 if t is int else t for t in types)
        entry = _compiled[(kernel, types)] = _Compiled(kernel.compile(sig))
    if FAST_LAUNCH:
        try:
            function = entry.function()
            if function is not None:
                if DRIVER_LAUNCH and _driver_launch(function[1], grid, block, params):
                    return
                _core_launch(core_stream(launch_handle()), _launch_config(grid, block),
                             function[0], *(ctypes.c_int64(p) for p in params))
                return
            entry.compiled.launch(args, *_dims(grid, block), core_stream(launch_handle()), 0)
            return
        except (TypeError, AttributeError, ImportError):
            # A Numba or cuda.core whose internals differ: this fails before anything is
            # queued; from now on use the dispatcher.
            FAST_LAUNCH.clear()
    kernel[grid, block, stream()](*args)


FAST_LAUNCH = [True]  # emptied if Numba's or cuda.core's internals are not the expected ones
# Emptied if the driver's cuLaunchKernel cannot be loaded or refuses a launch (cuda.core's
# launch then runs, and raises if the launch itself is wrong).
DRIVER_LAUNCH = [True]
_CU_LAUNCH_PARAM_BUFFER_POINTER, _CU_LAUNCH_PARAM_BUFFER_SIZE = 1, 2


@functools.lru_cache(maxsize=None)
def _cu_launch_kernel():
    """The driver's ``cuLaunchKernel`` through ctypes (None where the library is not found)."""
    import sys

    try:
        lib = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
        fn = lib.cuLaunchKernel
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    fn.restype = ctypes.c_int
    return fn


_DIMS: dict = {}


def _driver_launch(handle, grid, block, params) -> bool:
    """Launch the ``CUkernel`` ``handle`` on the launch stream with ``params`` (ints, each an
    8-byte parameter) packed into one buffer, in one driver call (cuda.core's launch converts
    every parameter in Python: tens of them a launch). False, and the driver path disabled,
    where the driver is missing or refuses the launch."""
    fn = _cu_launch_kernel()
    if fn is None:
        DRIVER_LAUNCH.clear()
        return False
    dims = _DIMS.get((grid, block))
    if dims is None:
        griddim, blockdim = _dims(grid, block)
        dims = _DIMS[(grid, block)] = tuple(griddim) + tuple(blockdim)
    buf = (ctypes.c_int64 * len(params))(*params)
    size = ctypes.c_size_t(8 * len(params))
    extra = (ctypes.c_void_p * 5)(_CU_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(buf),
                                  _CU_LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(size), None)
    if fn(handle, *dims, 0, launch_handle(), None, extra) != 0:
        DRIVER_LAUNCH.clear()
        return False
    return True


class _Compiled:
    """A compiled kernel of one signature and its loaded CUDA function on each device."""

    def __init__(self, compiled):
        self.compiled = compiled
        self.functions = {}
        # Debug and cooperative kernels need what Numba's own launch does around the call.
        self.plain = not (getattr(compiled, "debug", True) or getattr(compiled, "cooperative",
                                                                         True))

    def function(self):
        """``(cuda.core kernel, CUkernel handle as an int)`` on the current device (None: use
        Numba's launch)."""
        if not self.plain:
            return None
        device = _current_device()
        f = self.functions.get(device)
        if f is None:
            cufunc = self.compiled._codelibrary.get_cufunc()
            f = self.functions[device] = (cufunc.kernel, int(cufunc.handle))
        return f


def _current_device():
    """The current context's device ordinal: one driver call (Numba's lookup costs ~10 us)."""
    err, dev = _cudrv.cuCtxGetDevice()
    if int(err) != 0:  # no current context yet: let Numba make it
        return cuda.get_current_device().id
    return int(dev)


_CONFIGS: dict = {}


def _launch_config(grid, block):
    config = _CONFIGS.get((grid, block))
    if config is None:
        griddim, blockdim = _dims(grid, block)
        from numba.cuda._compat import CUDA_CORE_GE_1_0

        coop = "is_cooperative" if CUDA_CORE_GE_1_0 else "cooperative_launch"
        config = _CONFIGS[(grid, block)] = _LaunchConfig(grid=griddim, block=blockdim,
                                                         shmem_size=0, **{coop: False})
    return config


def grid_size(n: int) -> int:
    return max(1, min(MAX_GRID, -(-n // THREADS)))


def upload_ints(host):
    """A small int32 host array as a kernel argument (the simulator indexes NumPy directly).

    Memoised by content (and device and launch stream): launchers are called again and again with the same
    ``cu_seqlens``, and each fresh upload would be a synchronous copy that stalls the host.
    """
    host = np.ascontiguousarray(host, dtype=np.int32)
    if SIMULATOR:
        return host
    return _cached_upload(host.tobytes(), cuda.get_current_device().id, launch_handle())


@functools.lru_cache(maxsize=64)
def _cached_upload(data: bytes, device_id: int, handle: int):
    """The ``Dev`` of ``device_constant``'s (memoised) upload: one upload cache for msa."""
    return Dev(device_constant(np.frombuffer(data, dtype=np.int32)))


def kernel_array(x):
    """A kernel argument for an index array made by another msa.cuda launcher.

    Those launchers ran on the launch stream, as the next kernel will: no stream sync needed.
    """
    if SIMULATOR or hasattr(x, "copy_to_host"):
        return x
    if isinstance(x, np.ndarray):
        return cuda.to_device(x, stream=stream())
    return cuda.as_cuda_array(x, sync=False)




# Launch with more than 48 KB of dynamic shared memory.
_raised: dict = {}


def launch_smem(kernel, grid, block, smem_bytes, *args):
    """``kernel[grid, block, 0, smem_bytes](*args)``, raising the kernel's shared-memory limit first.

    Above 48 KB, a launch fails with CUDA_ERROR_INVALID_VALUE until the kernel's
    ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` is raised; that needs the compiled
    ``CUkernel``, so the dispatcher is first specialised for the argument types. The attribute
    call goes through Numba's driver wrapper (the one ``set_shared_memory_carveout`` uses).
    Raises ValueError beyond ``DEVICE_SMEM_LIMIT``.
    """
    smem_bytes = int(smem_bytes)
    if smem_bytes > DEVICE_SMEM_LIMIT:
        raise ValueError(
            f"kernel {getattr(kernel, '__name__', kernel)} needs {smem_bytes} bytes of shared "
            f"memory, more than the {DEVICE_SMEM_LIMIT} a block may have")
    # The 48 KB default limit counts the kernel's static shared arrays too, so a launch whose
    # dynamic part alone is under 48 KB can still need the raised limit; only a launch whose
    # static reserve cannot push it over skips the attribute call.
    if SIMULATOR or smem_bytes + STATIC_RESERVE <= STATIC_SMEM_LIMIT:
        kernel[grid, block, stream(), smem_bytes](*args)
        return
    spec = _specialized(kernel, args)
    compiled = next(iter(spec.overloads.values()))
    cufunc = compiled._codelibrary.get_cufunc()
    # Keyed by the compiled function, which the entry keeps alive: an id() of a specialised
    # dispatcher can be reused by a later one once the first is collected, and then the new
    # kernel would launch without its raised limit.
    key = (id(cufunc), cufunc.device.id)
    if _raised.get(key, (0,))[0] < smem_bytes:
        _set_max_dynamic_smem(cufunc, smem_bytes)
        _raised[key] = (smem_bytes, cufunc)
    spec[grid, block, stream(), smem_bytes](*args)


def _set_max_dynamic_smem(cufunc, smem_bytes):
    from numba.cuda.cudadrv.driver import binding, driver

    attr = binding.CUfunction_attribute
    try:
        driver.cuKernelSetAttribute(attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    smem_bytes, cufunc.handle, cufunc.device.id)
        driver.cuKernelSetAttribute(attr.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                    100, cufunc.handle, cufunc.device.id)
    except Exception as exc:  # a private API: say exactly what failed
        raise RuntimeError(
            f"raising the dynamic shared memory limit of {cufunc!r} to {smem_bytes} bytes "
            f"failed ({type(exc).__name__}: {exc}); see msa/cuda/_core/launch.py::launch_smem") from exc


_specializations: dict = {}


def _specialized(kernel, args):
    """``kernel.specialize(*args)`` that keeps the kernel's disk cache (Numba's own
    specialisation is a fresh dispatcher without one, so it would compile in every process)."""
    from numba.cuda.dispatcher import CUDADispatcher

    argtypes = tuple(kernel.typeof_pyval(a) for a in args)
    key = (kernel, cuda.get_current_device().compute_capability, argtypes)
    spec = _specializations.get(key)
    if spec is None:
        spec = CUDADispatcher(kernel.py_func, targetoptions=kernel.targetoptions)
        spec._cache = kernel._cache
        spec.compile(argtypes)
        spec.disable_compile()
        spec._specialized = True
        _specializations[key] = spec
    return spec
