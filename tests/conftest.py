"""Shared test setup.

* Hypothesis profiles: ``ci`` (default, fast) and ``thorough``; pick with MSA_HYPOTHESIS_PROFILE.
* Under the simulator every block's shared memory starts as NaN bytes (``MSA_SIM_POISON_SHARED``,
  ``msa.cuda._core.simwarp``); ``tests/cuda/conftest.py`` poisons launchers' outputs too.
* Markers: ``gpu`` (needs a real GPU), ``big`` (production sizes, real GPU only) are skipped under
  ``NUMBA_ENABLE_CUDASIM=1`` or without a GPU; ``simulator`` (tests of the simulator add-on
  itself, e.g. its error messages) is skipped on a real GPU; ``sim_heavy`` (a case that takes
  half a minute or more in the simulator and whose code paths cheaper cases there also run)
  runs on a GPU, and in the simulator only with ``MSA_SIM_FULL=1``, so that CI stays short.
* ``backend``: runs a test once against ``msa.reference`` and once against ``msa.cuda``::

      def test_select(backend):
          I = backend.select.select_blocks(M, cu_q, cu_k, topk, block_size)

  A CUDA stage or function that does not exist yet skips with a reason naming it, as does the
  CUDA run where neither a GPU nor the simulator is available. Restrict one test with
  ``@pytest.mark.parametrize("backend", ["cuda"], indirect=True)``.
* The summary ends with the skipped tests counted by reason (``-rs`` lists them one by one);
  a test or file skipped because an optional library is missing (``pytest.importorskip``) says
  which one is not installed and which extra brings it.

Where the project's contract lives (layout, data contracts, test rules): docs/design.md.
"""

import os
import re
import sys
from collections import Counter

# Every simulated block starts with its shared memory full of NaN bytes (before msa.cuda's
# simulator add-on reads the setting): a kernel that reads shared memory its block never wrote
# fails here, as it could on a GPU. MSA_SIM_POISON_SHARED=0 turns it off.
os.environ.setdefault("MSA_SIM_POISON_SHARED", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from msa.testing.backends import (BACKENDS, SIMULATOR, Backend, cuda_runnable,  # noqa: E402
                                  gpu_available)

settings.register_profile(
    "ci", max_examples=20, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "thorough", max_examples=400, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("MSA_HYPOTHESIS_PROFILE", "ci"))

# The simulator runs every CUDA thread as a Python thread. At the interpreter's default switch
# interval (5 ms) a thread that would run on to its next barrier is preempted for others that
# can only wait there too; 0.2 s lets it run on. A decode step test took 16 s against 29 s, the
# paged prefill test 36 against 42 (one process, 2 cores). MSA_SIM_SWITCH_S sets another value.
if SIMULATOR:
    sys.setswitchinterval(float(os.environ.get("MSA_SIM_SWITCH_S", "0.2")))


SIM_FULL = os.environ.get("MSA_SIM_FULL", "0") == "1"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "simulator: exercises Numba's CUDA simulator itself (skipped on a real GPU)")
    config.addinivalue_line(
        "markers", "sim_heavy: slow in the simulator, where cheaper cases cover its code paths; "
                   "runs on a GPU, and in the simulator with MSA_SIM_FULL=1")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") or item.get_closest_marker("big"):
            if SIMULATOR:
                item.add_marker(
                    pytest.mark.skip(reason="needs a real GPU (NUMBA_ENABLE_CUDASIM=1)"))
            elif not gpu_available():
                item.add_marker(pytest.mark.skip(reason="needs a real GPU (none is visible)"))
        if item.get_closest_marker("simulator") and not SIMULATOR:
            item.add_marker(pytest.mark.skip(reason="tests the simulator (NUMBA_ENABLE_CUDASIM=1)"))
        if item.get_closest_marker("sim_heavy") and SIMULATOR and not SIM_FULL:
            item.add_marker(pytest.mark.skip(
                reason="slow in the simulator (cheaper cases cover it): runs on a GPU, or with "
                       "MSA_SIM_FULL=1"))


@pytest.fixture(params=BACKENDS)
def backend(request) -> Backend:
    """``msa.reference`` or ``msa.cuda`` as a ``Backend`` (stage modules as attributes)."""
    b = Backend(request.param)
    if b.is_cuda:
        ok, why = cuda_runnable()
        if not ok:
            pytest.skip(why)
    return b


# What brings each optional library: a skip for want of one names the extra to install.
EXTRAS = {"torch": "torch", "cupy": "cupy", "matplotlib": "notebooks", "jupytext": "notebooks",
          "nbformat": "notebooks", "nbclient": "notebooks"}
_NOT_INSTALLED = re.compile(r"could not import '([\w.]+)': No module named '([\w.]+)'")


def _not_installed(reason: str) -> str:
    """``importorskip``'s "could not import 'torch': No module named 'torch'" as "torch not
    installed (pip install -e '.[torch]')"; any other reason as it is."""
    match = _NOT_INSTALLED.search(reason)
    if not match or match.group(2).split(".")[0] == "msa":
        return reason
    name = match.group(2).split(".")[0]
    extra = EXTRAS.get(name)
    return f"{name} not installed" + (f" (pip install -e '.[{extra}]')" if extra else "")


def _reworded(report):
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        path, line, reason = report.longrepr
        report.longrepr = (path, line, _not_installed(reason))
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    return _reworded((yield))


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    return _reworded((yield))


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    three = isinstance(longrepr, (tuple, list)) and len(longrepr) == 3
    reason = longrepr[2] if three else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter):
    """Skipped tests counted by reason, a line each (a whole file skipped counts as a file)."""
    reports = terminalreporter.stats.get("skipped", [])
    if not reports:
        return
    tests = Counter(_skip_reason(r) for r in reports if not isinstance(r, pytest.CollectReport))
    files = Counter(_skip_reason(r) for r in reports if isinstance(r, pytest.CollectReport))
    terminalreporter.write_sep("-", "skipped, by reason")
    lines = [(n, f"{n} skipped: {why}") for why, n in tests.items()]
    lines += [(n, f"{n} file{'s' if n > 1 else ''} skipped: {why}") for why, n in files.items()]
    lines.sort(key=lambda line: -line[0])
    for _, line in lines[:12]:
        terminalreporter.write_line(line)
    if len(lines) > 12:
        rest = sum(n for n, _ in lines[12:])
        terminalreporter.write_line(f"{rest} more skipped for {len(lines) - 12} other reasons "
                                    "(pytest -rs lists every one)")
