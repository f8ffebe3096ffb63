"""msa.cuda._core.diskcache: kernels cached on disk under a key that is the same in every process.

Numba's own closure key pickles device functions and intrinsics with a fresh uuid per process,
so a factory-made kernel would never be found again; ``stable_key`` must give every default
kernel variant (``msa.testing.variants``) the same text in two fresh processes. The processes
run without the simulator (the kernels are built, not compiled: no GPU needed).
"""

import json
import os
import subprocess
import sys

import pytest

from msa.cuda._core import diskcache

_KEYS = """
import hashlib, json
from msa.testing import variants
from msa.cuda._core.diskcache import stable_key
keys = {}
for stage in variants.STAGES:
    for name, kernel, sig in variants.of(stage):
        cells = tuple(c.cell_contents for c in (kernel.py_func.__closure__ or ()))
        keys[stage + "/" + name] = [hashlib.sha256(stable_key(cells).encode()).hexdigest(),
                                    type(kernel._cache).__name__]
print(json.dumps(keys))
"""


def _run(code, **env):
    full = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full,
                         timeout=600, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_every_kernel_variant_has_the_same_cache_key_in_two_processes():
    first, second = (json.loads(_run(_KEYS)) for _ in range(2))
    assert first == second
    assert len(first) > 100
    assert {cache for _, cache in first.values()} == {"_StableCache"}


def test_cache_folder_follows_the_sources_and_the_user():
    here = diskcache.source_hash()
    assert len(here) == 16 and here == diskcache.source_hash()
    code = "from msa.cuda._core import diskcache as d; print(d.cache_dir())"
    assert _run(code, NUMBA_CACHE_DIR="/tmp/user-cache") == "/tmp/user-cache"
    assert _run(code, MSA_DISK_CACHE="0") == "None"
    assert _run(code, XDG_CACHE_HOME="/tmp/xdg").startswith("/tmp/xdg/msa/kernels-")
    assert _run(code, XDG_CACHE_HOME="/tmp/xdg") != _run(code, XDG_CACHE_HOME="/tmp/xdg",
                                                        MSA_MMA="twin")


def test_stable_key_names_functions_by_code_not_identity():
    def make(n):
        def f(x):
            return x + n
        return f

    assert diskcache.stable_key((make(1),)) == diskcache.stable_key((make(1),))
    assert diskcache.stable_key((make(1),)) != diskcache.stable_key((make(2),))
    with pytest.raises(TypeError):
        diskcache.stable_key((object(),))
