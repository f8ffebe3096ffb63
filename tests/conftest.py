"""Hypothesis profiles: ``ci`` (default, fast) and ``thorough``; pick with MSA_HYPOTHESIS_PROFILE."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=20, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "thorough", max_examples=400, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("MSA_HYPOTHESIS_PROFILE", "ci"))
