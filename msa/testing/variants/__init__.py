"""Every default kernel variant of msa.cuda, by stage, for offline PTX checks.

Each stage module ``msa.testing.variants.<stage>`` has ``variants()``, yielding ``(name, kernel,
signature)``: the kernels a stage's launchers run by default on compute capability 9.0, on other
GPUs and in the simulator's kernel choice, at the paper's shapes (Bk = 128, D = Didx = 128,
G = 16, K = 16, bf16) and at small ones (the sizes the tests use), with the argument types the
launchers pass. ``python -m msa.testing.ptx`` fingerprints them; ``tests/cuda/test_ptx.py``
checks them for float64 instructions and local memory.
"""

from __future__ import annotations

import importlib

STAGES = ("index", "select", "csr", "schedule", "attention", "combine", "kl", "decode")


def of(stage: str):
    """``(name, kernel, signature)`` of every default kernel variant of ``stage``."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    return list(importlib.import_module(f"{__name__}.{stage}").variants())
