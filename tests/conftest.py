"""Shared test setup.

* Hypothesis profiles: ``ci`` (default, fast) and ``thorough``; pick with MSA_HYPOTHESIS_PROFILE.
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
"""

import os

import pytest
from hypothesis import HealthCheck, settings

from msa.testing.backends import BACKENDS, SIMULATOR, Backend, cuda_runnable, gpu_available

settings.register_profile(
    "ci", max_examples=20, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "thorough", max_examples=400, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("MSA_HYPOTHESIS_PROFILE", "ci"))


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
