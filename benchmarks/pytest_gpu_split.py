"""pytest plugin for the GPU test run: xdist worker ``gwN`` uses GPU ``N % MSA_NGPU``, and
every test gives its allocators' cached blocks back when it ends.

    python3 -m pytest -n 30 --dist worksteal -p benchmarks.pytest_gpu_split tests/cuda

Set ``MSA_NGPU`` to the number of GPUs (default: all that ``nvidia-smi -L`` lists, else 1). It is
imported before any test touches CUDA, so setting ``CUDA_VISIBLE_DEVICES`` here is early enough.
"""

import os
import subprocess
import sys


def _gpu_count() -> int:
    if "MSA_NGPU" in os.environ:
        return max(1, int(os.environ["MSA_NGPU"]))
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return 1
    return max(1, sum(line.startswith("GPU ") for line in out.stdout.splitlines()))


_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and "CUDA_VISIBLE_DEVICES" not in os.environ:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(int(_worker[2:]) % _gpu_count())


def pytest_runtest_teardown(item, nextitem):
    """Hands the blocks that torch's and CuPy's allocators cache back to the GPU after each test:
    the workers share it, and one worker's cache of a finished production-size test (60 GiB of an
    H100's 80) made 37 tests of the others fail for memory."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
