"""Running one test against ``msa.reference`` and ``msa.cuda`` (docs/design.md §2, §5).

``Backend("reference")`` and ``Backend("cuda")`` expose the stage modules by name, so a test
body calls ``backend.select.select_blocks(...)`` whichever it runs; a CUDA stage or function that
does not exist yet makes the test skip with a reason naming it. ``to_numpy`` brings any result to
the host; ``poison``/``poison_value`` give kernel outputs values no kernel writes (NaN, the most
negative integer) so that an element a kernel forgot to write cannot pass a test.
"""

from __future__ import annotations

import functools
import importlib
import os

import numpy as np

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"
BACKENDS = ("reference", "cuda")


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    """True iff a real CUDA GPU is usable (never under ``NUMBA_ENABLE_CUDASIM=1``)."""
    if SIMULATOR:
        return False
    try:
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:  # no driver, no bindings: no GPU
        return False


def cuda_runnable() -> tuple[bool, str]:
    """``(can msa.cuda run here, why not)``: the simulator or a real GPU."""
    if SIMULATOR or gpu_available():
        return True, ""
    return False, "msa.cuda needs a GPU or NUMBA_ENABLE_CUDASIM=1 (neither is available)"


def _skip(reason: str):
    import pytest

    pytest.skip(reason)


class _Stage:
    """A stage module of one backend; a missing CUDA function skips the test that asks for it."""

    def __init__(self, backend: "Backend", stage: str, module):
        self._backend, self._stage, self._module = backend, stage, module

    def __getattr__(self, fn: str):
        try:
            return getattr(self._module, fn)
        except AttributeError:
            if self._backend.name == "cuda":
                _skip(f"msa.cuda.{self._stage}.{fn} is not implemented yet")
            raise

    def __repr__(self):
        return f"<{self._backend.name} stage {self._stage}>"


class Backend:
    """``msa.reference`` or ``msa.cuda`` by name: ``Backend('cuda').select.select_blocks``.

    Both take the same arguments in the same order (docs/design.md §2); the CUDA launchers accept NumPy
    arrays (copied to and from the GPU, or used as they are under the simulator) and return
    NumPy arrays for them, so a test can pass the same inputs to both.
    """

    def __init__(self, name: str):
        if name not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
        self.name = name

    @property
    def is_cuda(self) -> bool:
        return self.name == "cuda"

    def stage(self, stage: str) -> _Stage:
        """The module ``msa.<backend>.<stage>``; skips (CUDA only) if it does not exist yet."""
        full = f"msa.{self.name}.{stage}"
        try:
            module = importlib.import_module(full)
        except ModuleNotFoundError as e:
            if self.is_cuda and e.name == full:
                _skip(f"{full} is not implemented yet")
            raise
        return _Stage(self, stage, module)

    def __getattr__(self, stage: str) -> _Stage:
        if stage.startswith("_"):
            raise AttributeError(stage)
        return self.stage(stage)

    def __repr__(self):
        return f"Backend({self.name!r})"


def to_numpy(x):
    """A host NumPy array from NumPy, CuPy, torch (bf16 widened to float32) or Numba arrays."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if type(x).__module__.split(".")[0] == "torch":
        t = x.detach().cpu()
        if "bfloat16" in str(t.dtype):
            t = t.float()
        return t.numpy()
    if hasattr(x, "get"):  # CuPy
        return x.get()
    return np.asarray(x)


def poison_value(dtype):
    """What a kernel output holds before launch: NaN for floats, the dtype's minimum for ints."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return dtype.type(np.nan)
    if dtype.kind in "iu":
        return dtype.type(np.iinfo(dtype).min)
    if dtype.kind == "b":
        raise TypeError("bool arrays have no poison value")
    raise TypeError(f"no poison value for dtype {dtype}")


def poison(x):
    """Fill ``x`` (NumPy, CuPy, torch or Numba array) with ``poison_value`` in place; return it."""
    if type(x).__module__.split(".")[0] == "torch":
        if x.is_floating_point():
            x.fill_(float("nan"))
        else:
            x.fill_(int(np.iinfo(str(x.dtype).split(".")[-1]).min))
        return x
    from msa.cuda._core.arrays import fill

    return fill(x, poison_value(x.dtype))
