"""examples/train_retrieval.py at its CI size: the LM loss falls and the index branch learns."""

import importlib.util
import pathlib

import pytest

torch = pytest.importorskip("torch", reason="torch not installed (pip install -e '.[torch]')")

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train_retrieval.py"


def example():
    spec = importlib.util.spec_from_file_location("train_retrieval", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_retrieval_training_learns_the_task_and_where_to_look():
    mod = example()
    history = mod.train(steps=150, warmup_steps=75, device="cpu", verbose=False)
    s = mod.summary(history, window=20)
    assert s["warmup_steps"] == 75
    assert s["lm_last"] < s["lm_first"] - 0.3, s  # the answer is learned
    assert s["recall_last"] > s["recall_first"] + 0.1, s  # the index finds the needle's block
    warm = [h["kl"] for h in history if h["warmup"]]
    assert sum(warm[-10:]) < 0.7 * sum(warm[:10]), s  # L_KL falls in the warmup


def test_with_the_teacher_fixed_the_sparse_kl_does_not_rise_and_the_index_still_learns():
    """``freeze_main``: after the warmup only the index branch trains, by the KL on its own
    selection. With its teacher fixed ``L_KL`` does not rise (in the full recipe it does, as the
    main branch sharpens) and the needle's block is found more often."""
    mod = example()
    history = mod.train(steps=150, warmup_steps=75, device="cpu", verbose=False, freeze_main=True)
    s = mod.summary(history, window=20)
    assert s["kl_sparse_last"] <= 1.02 * s["kl_sparse_first"], s
    assert s["recall_last"] > s["recall_first"] + 0.1, s
