"""Plumbing shared by the msa notebooks (not part of msa): where kernels run, checks, tables.

Import it before anything that imports numba. It decides where ``msa.cuda`` runs, which numba
fixes at import time: on a real GPU when a CUDA driver is installed, otherwise in Numba's CUDA
simulator (``NUMBA_ENABLE_CUDASIM=1``). A value already in the environment wins, so
``NUMBA_ENABLE_CUDASIM=1 jupyter ...`` forces the simulator on a GPU machine.

* ``SIMULATOR`` / ``ON_GPU`` / ``DEVICE``: where kernels run (``ON_GPU`` picks larger sizes).
* ``cuda_function(stage, name)``: ``msa.cuda.<stage>.<name>``, or ``None`` and the reason
  (kernels are written stage by stage; a notebook never shows output it did not compute).
* ``check(claim, ok, detail)``: the agreement check that ends each section; raises when false.
* ``table(headers, rows)``: a plain-text table.
* ``savefig(fig, name)``: also writes ``docs/figures/<name>.png`` when ``MSA_EXPORT_FIGURES=1``.
"""

from __future__ import annotations

import ctypes.util
import importlib
import os
import sys
from pathlib import Path


def _cuda_driver_installed() -> bool:
    return ctypes.util.find_library("cuda") is not None or os.path.exists("/dev/nvidiactl")


if "numba" not in sys.modules:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0" if _cuda_driver_installed() else "1")

from msa.testing.backends import SIMULATOR, gpu_available  # noqa: E402  (after the choice above)

ON_GPU = gpu_available()
DEVICE = ("a real GPU" if ON_GPU else "Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)"
          if SIMULATOR else "nowhere (no GPU, and NUMBA_ENABLE_CUDASIM is not 1)")
FIGURES = Path(__file__).resolve().parent.parent / "docs" / "figures"


def cuda_function(stage: str, name: str):
    """``(fn, "")`` for ``msa.cuda.<stage>.<name>``, or ``(None, why)`` when it cannot run here."""
    if not (SIMULATOR or ON_GPU):
        return None, "msa.cuda cannot run here: no GPU, and NUMBA_ENABLE_CUDASIM is not 1"
    module_name = f"msa.cuda.{stage}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            return None, f"kernel not available yet: {module_name} does not exist"
        return None, f"kernel not available yet: {module_name} fails to import ({e})"
    except Exception as e:  # a module being written may not import yet
        return None, f"kernel not available yet: {module_name} fails to import ({type(e).__name__}: {e})"
    fn = getattr(module, name, None)
    if fn is None:
        return None, f"kernel not available yet: {module_name} has no {name}"
    return fn, ""


def check(claim: str, ok, detail: str = "") -> None:
    """Print ``OK claim [detail]``; raise ``AssertionError`` if ``ok`` is false."""
    ok = bool(ok)
    print(f"{'OK  ' if ok else 'FAIL'} {claim}" + (f"  [{detail}]" if detail else ""))
    if not ok:
        raise AssertionError(f"{claim} {detail}".strip())


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def table(headers, rows) -> None:
    """Print ``rows`` under ``headers`` as an aligned plain-text table."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    print("\n".join(lines))


def savefig(fig, name: str) -> None:
    """Write ``fig`` to ``docs/figures/<name>.png`` when ``MSA_EXPORT_FIGURES=1`` (the build does)."""
    if os.environ.get("MSA_EXPORT_FIGURES") == "1":
        FIGURES.mkdir(parents=True, exist_ok=True)
        fig.savefig(FIGURES / f"{name}.png", dpi=100, bbox_inches="tight")
