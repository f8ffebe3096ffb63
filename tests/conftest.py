"""Shared test setup.

* Hypothesis profiles: ``ci`` (default, fast) and ``thorough``; pick with MSA_HYPOTHESIS_PROFILE.
* Markers: ``gpu`` (needs a real GPU), ``big`` (production sizes, real GPU only) are skipped under
  ``NUMBA_ENABLE_CUDASIM=1`` or without a GPU; ``simulator`` (tests of the simulator add-on
  itself, e.g. its error messages) is skipped on a real GPU.
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


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "simulator: exercises Numba's CUDA simulator itself (skipped on a real GPU)")


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


@pytest.fixture(params=BACKENDS)
def backend(request) -> Backend:
    """``msa.reference`` or ``msa.cuda`` as a ``Backend`` (stage modules as attributes)."""
    b = Backend(request.param)
    if b.is_cuda:
        ok, why = cuda_runnable()
        if not ok:
            pytest.skip(why)
    return b
