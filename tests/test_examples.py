"""examples/train_retrieval.py at its CI size: the LM loss falls and the index branch learns."""

import importlib.util
import pathlib

import pytest

torch = pytest.importorskip("torch", reason="torch not installed (pip install -e '.[torch]')")

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train_retrieval.py"


def test_retrieval_training_learns_the_task_and_where_to_look():
    spec = importlib.util.spec_from_file_location("train_retrieval", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    history = mod.train(steps=150, warmup_steps=75, device="cpu", verbose=False)
    s = mod.summary(history, window=20)
    assert s["warmup_steps"] == 75
    assert s["lm_last"] < s["lm_first"] - 0.3, s  # the answer is learned
    assert s["recall_last"] > s["recall_first"] + 0.1, s  # the index finds the needle's block
    warm = [h["kl"] for h in history if h["warmup"]]
    assert sum(warm[-10:]) < 0.7 * sum(warm[:10]), s  # L_KL falls in the warmup
