"""examples/context_parallel.py: 2 gloo processes on the CPU match one process."""

import importlib
import pathlib

import pytest

torch = pytest.importorskip("torch", reason="torch not installed (pip install -e '.[torch]')")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available in this torch build",
                allow_module_level=True)

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def test_example_matches_one_process(monkeypatch):
    # imported by name, so that the spawned processes can unpickle its worker
    monkeypatch.syspath_prepend(str(EXAMPLES))
    mod = importlib.import_module("context_parallel")
    diffs, selection_equal = mod.run(2, verbose=False)
    assert selection_equal
    assert max(diffs.values()) < 1e-12, diffs
