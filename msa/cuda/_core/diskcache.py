"""Compiled kernels cached on disk across processes (Numba's kernel cache), never stale.

Every msa kernel is decorated with ``kernel_jit`` (``@cuda.jit`` plus this cache), so a second
process loads its cubins from disk instead of compiling them again (a training step's first
call compiles some twenty kernels). Two things make Numba's own ``cache=True`` unfit as it is:

* it keys a kernel on its bytecode and a pickle of its closure, and most msa kernels are built by
  factories whose closures hold device functions and intrinsics: their pickles carry a fresh
  uuid in every process, so the key never matches again. ``StableCache`` keys the closure by
  what it means instead (``stable_key``: values as they are, functions by module, name, code
  and their own closures);
* it ignores the device functions a kernel calls, so an edit to a shared device function
  (``_core/mma.py``, say) could hand back a stale cubin: msa points Numba's cache at a folder
  named after a hash of every source file of ``msa.cuda``, so that any change there starts an
  empty cache.

``configure()`` runs once, from ``msa.cuda``'s ``__init__`` before any kernel is defined:

* ``NUMBA_CACHE_DIR`` set by the user: left alone (the user manages it);
* ``MSA_DISK_CACHE=0``: no disk cache (kernels compile in every process);
* otherwise ``$XDG_CACHE_HOME/msa/kernels-<hash>`` (default ``~/.cache``), the hash of the
  sources and of the ``MSA_*`` environment variables (``source_hash``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib

_CUDA_ROOT = pathlib.Path(__file__).resolve().parent.parent  # msa/cuda

ENABLED = os.environ.get("MSA_DISK_CACHE", "1") != "0"
JIT = {"cache": True} if ENABLED else {}  # the options every msa kernel is compiled with


def source_hash() -> str:
    """16 hex digits of the SHA-256 of msa.cuda's sources (paths and contents) and of the
    ``MSA_*`` environment variables (``MSA_MMA=twin`` selects other device functions)."""
    h = hashlib.sha256()
    for key in sorted(k for k in os.environ if k.startswith("MSA_") and k != "MSA_DISK_CACHE"):
        h.update(f"{key}={os.environ[key]}".encode())
    for path in sorted(_CUDA_ROOT.rglob("*.py")):
        h.update(str(path.relative_to(_CUDA_ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def cache_dir() -> str | None:
    """Where the kernels are cached, or None when the disk cache is off (computed once)."""
    if not ENABLED:
        return None
    if os.environ.get("NUMBA_CACHE_DIR"):
        return os.environ["NUMBA_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "msa", f"kernels-{source_hash()}")


@functools.cache
def configure() -> str | None:
    """Point Numba's CUDA kernel cache at ``cache_dir()`` (once); returns it."""
    path = cache_dir()
    if path is None or os.environ.get("NUMBA_CACHE_DIR"):
        return path
    try:
        from numba.cuda.core import config
    except ImportError:  # an older numba-cuda: its cache folder is the default one
        return None
    config.CACHE_DIR = path
    return path


def stable_key(value, _seen=None) -> str:
    """A text that names ``value`` the same way in every process (closure cells of kernels).

    Plain values as their ``repr``; tuples and lists element by element; functions, Numba
    dispatchers and intrinsics by module, qualified name, bytecode, constants and, recursively,
    their own closures. Anything else raises TypeError (the kernel is then not cached).
    """
    seen = set() if _seen is None else _seen
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(stable_key(v, seen) for v in value) + ")"
    import numpy as np

    if isinstance(value, (np.dtype, np.generic)) or (isinstance(value, type)
                                                     and issubclass(value, np.generic)):
        return f"np:{value!r}"
    fn = getattr(value, "py_func", None) or getattr(value, "_defn", None) or value
    code = getattr(fn, "__code__", None)
    if code is None:
        from numba.core import types as nbtypes

        if isinstance(value, nbtypes.Type):
            return f"nb:{value}"
        text = repr(value)  # e.g. an llvmlite type; never an address, which changes per process
        if " at 0x" in text or "object at" in text:
            raise TypeError(f"no stable key for {type(value).__name__}")
        return f"{type(value).__module__}.{type(value).__qualname__}:{text}"
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
    if id(fn) in seen:  # a recursive reference: the name is enough
        return name
    seen.add(id(fn))
    cells = tuple(c.cell_contents for c in (fn.__closure__ or ()))
    consts = tuple(c for c in code.co_consts if not hasattr(c, "co_code"))
    body = hashlib.sha256(code.co_code + repr(consts).encode()).hexdigest()[:16]
    return f"{name}[{body}]{stable_key(cells, seen)}"


def kernel_jit(fn=None, **options):
    """``@cuda.jit(**options)`` for a kernel, cached on disk with ``StableCache`` (see above).

    Usable bare (``@kernel_jit``) or with options (``@kernel_jit(max_registers=128)``). In the
    simulator, or with ``MSA_DISK_CACHE=0``, it is plain ``cuda.jit``.
    """
    from numba import cuda

    from .arrays import SIMULATOR

    def wrap(f):
        kernel = cuda.jit(**options)(f)
        if ENABLED and not SIMULATOR and configure() is not None:
            try:
                kernel._cache = StableCache(kernel.py_func)
            except Exception:  # no cache locator for this file (read-only install): uncached
                pass
        return kernel

    return wrap(fn) if fn is not None else wrap


def _stable_cache_class():
    from numba.cuda.dispatcher import CUDACache

    class _StableCache(CUDACache):
        """Numba's CUDA kernel cache, its index keyed by ``stable_key`` of the closure."""

        def _index_key(self, sig, codegen):
            import numba_cuda

            py_func = self._py_func
            try:
                cells = stable_key(tuple(c.cell_contents for c in (py_func.__closure__ or ())))
            except TypeError:  # unknown closure contents: a key that never matches again
                import uuid

                cells = uuid.uuid4().hex
            code = hashlib.sha256(py_func.__code__.co_code).hexdigest()
            return (sig, codegen.magic_tuple(), numba_cuda.__version__,
                    (code, hashlib.sha256(cells.encode()).hexdigest()))

    return _StableCache


def StableCache(py_func):  # noqa: N802 (a class built on first use: numba.cuda imports late)
    global _STABLE_CACHE
    if _STABLE_CACHE is None:
        _STABLE_CACHE = _stable_cache_class()
    return _STABLE_CACHE(py_func)


_STABLE_CACHE = None
