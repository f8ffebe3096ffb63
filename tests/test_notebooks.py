"""The notebooks: every source runs without error, and every committed .ipynb matches it.

Each ``notebooks/NN_name.py`` (jupytext percent format) runs as a script in a fresh Python process,
under the same environment as the tests (``NUMBA_ENABLE_CUDASIM=1`` in CI, so the kernel sections
run in the simulator at tiny sizes; on a GPU machine they run on the GPU). A notebook ends each
section with ``nbtools.check`` agreement checks, which raise, so a wrong result fails here too.

The committed ``NN_name.ipynb`` must have the same cells as its source (run
``python notebooks/build.py NN`` after editing a source) and must have been executed without
error, so that it renders with its outputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
IDS = [p.stem for p in SOURCES]
# Runs of a notebook that take a minute or more in the simulator, whose code paths the test suite
# runs there too (sim_heavy: on a GPU, or with MSA_SIM_FULL=1; the .ipynb sync check still runs).
# 07: its kernels are tests/cuda's test_csr, test_schedule, test_attention_partials,
# test_combine, test_attention_sparse, test_attention_prefill and test_attention_backward (v1
# with rows cut into parts, v2 on fp16), its reference steps tests/reference's test_complexity
# (the intensities), test_csr (the paper's k2q example), test_schedule and test_combine.
SIM_HEAVY_NOTEBOOKS = {"07_kv_outer"}
RUNS = [pytest.param(p, id=p.stem, marks=pytest.mark.sim_heavy) if p.stem in SIM_HEAVY_NOTEBOOKS
        else pytest.param(p, id=p.stem) for p in SOURCES]


def test_there_are_notebooks():
    assert len(SOURCES) >= 8, f"expected one notebook per paper section in {NOTEBOOKS}, found {IDS}"


@pytest.mark.parametrize("source", RUNS)
def test_notebook_runs(source):
    pytest.importorskip("matplotlib",
                        reason="matplotlib not installed (pip install -e '.[notebooks]')")
    env = dict(os.environ, MPLBACKEND="Agg", MSA_EXPORT_FIGURES="0")
    run = subprocess.run([sys.executable, source.name], cwd=NOTEBOOKS, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, (
        f"{source.name} failed (exit {run.returncode})\n--- stdout (tail) ---\n{run.stdout[-4000:]}"
        f"\n--- stderr (tail) ---\n{run.stderr[-4000:]}")
    assert "FAIL" not in run.stdout, f"{source.name} printed a failed check:\n{run.stdout[-4000:]}"


def _cells(nb):
    return [(cell.cell_type, cell.source.strip()) for cell in nb.cells]


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_ipynb_matches_its_source_and_was_executed(source):
    why = "not installed: the .ipynb sync check needs the 'notebooks' extra"
    jupytext = pytest.importorskip("jupytext", reason=f"jupytext {why}")
    nbformat = pytest.importorskip("nbformat", reason=f"nbformat {why}")
    target = source.with_suffix(".ipynb")
    assert target.exists(), f"{target.name} is missing: run python notebooks/build.py {source.stem[:2]}"
    committed = nbformat.read(target, as_version=4)
    assert _cells(committed) == _cells(jupytext.read(source)), (
        f"{target.name} is out of date with {source.name}: run python notebooks/build.py {source.stem[:2]}")
    code = [cell for cell in committed.cells if cell.cell_type == "code"]
    unexecuted = [i for i, cell in enumerate(code) if cell.execution_count is None]
    assert not unexecuted, f"{target.name}: code cells {unexecuted} have no outputs (not executed)"
    errors = [out.get("ename") for cell in code for out in cell.outputs if out.output_type == "error"]
    assert not errors, f"{target.name} was committed with errors: {errors}"
