"""The README's Python snippets run as written (the torch one needs torch; on a CPU it takes the
NumPy reference): a newcomer's first copy-paste must not raise."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_python_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("code", SNIPPETS, ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_snippet_runs(code):
    if "torch" in code:
        pytest.importorskip("torch", reason="torch not installed (pip install -e '.[torch]')")
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    if "out" in namespace:  # the training snippet: a loss and the selection it reports
        out = namespace["out"]
        assert out.output.shape == namespace["x"].shape
        assert out.block_indices.shape[-1] == namespace["layer"].topk
