"""Execute the notebook sources and write the ``.ipynb`` files with their outputs and figures.

    python notebooks/build.py              # every notebooks/NN_*.py
    python notebooks/build.py 03 07        # the sources whose name starts with 03 or 07
    python notebooks/build.py --scripts    # run each source as a plain script, write nothing

``--scripts`` needs no Jupyter (only matplotlib): it is how the notebooks are checked on a GPU
machine, where ``nbtools`` picks the larger GPU sizes; it exits non-zero if any source fails.

Each ``NN_name.py`` (jupytext percent format, the file to edit) is executed in a fresh Jupyter
kernel with ``notebooks/`` as working directory, and ``NN_name.ipynb`` is written with the outputs
so that it renders without running; figures are also written to ``docs/figures/`` (``nbtools``'
``MSA_EXPORT_FIGURES``). Kernels run where ``nbtools`` decides: set ``NUMBA_ENABLE_CUDASIM=1`` to
force Numba's simulator, as CI does. Needs the ``notebooks`` extra (jupytext, nbclient, ipykernel,
matplotlib) and a Jupyter kernel named ``python3`` for this interpreter
(``python -m ipykernel install --sys-prefix``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parent


def sources(prefixes=()) -> list[Path]:
    """The notebook sources ``NN_*.py``, in order, optionally only those starting with a prefix."""
    found = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    return [p for p in found if not prefixes or p.name.startswith(tuple(prefixes))]


def build(source: Path, timeout: int = 1800) -> Path:
    """Execute ``source`` in a Jupyter kernel and write ``source.with_suffix('.ipynb')``."""
    import jupytext
    import nbformat
    from nbclient import NotebookClient

    nb = jupytext.read(source)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    target = source.with_suffix(".ipynb")
    nbformat.write(nb, target)
    return target


def run_script(source: Path, timeout: int = 1800) -> tuple[bool, str]:
    """Run ``source`` as a plain Python script in ``notebooks/`` (Agg backend, no figure export);
    ``(ok, last lines of its output)``."""
    import subprocess

    env = dict(os.environ, MPLBACKEND="Agg")
    env.pop("MSA_EXPORT_FIGURES", None)
    done = subprocess.run([sys.executable, source.name], cwd=NOTEBOOKS, env=env, timeout=timeout,
                          capture_output=True, text=True)
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
    return done.returncode == 0, tail


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--scripts" in args:
        args.remove("--scripts")
        failed = 0
        for source in sources(args):
            start = time.perf_counter()
            ok, tail = run_script(source)
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {source.name}  ({time.perf_counter() - start:.0f} s)")
            print("    " + tail.replace("\n", "\n    "))
        return 1 if failed else 0
    os.environ["MSA_EXPORT_FIGURES"] = "1"
    os.environ.pop("MPLBACKEND", None)  # the kernel's inline backend embeds the figures
    for source in sources(args):
        start = time.perf_counter()
        target = build(source)
        print(f"{target.relative_to(NOTEBOOKS.parent)}  ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
