"""benchmarks/sanitize_smoke.py's arguments, checked before any GPU work (the script itself
needs a GPU: its runs are recorded in benchmarks/results/gpu_tests/README.md)."""

import pytest

pytest.importorskip("torch", reason="torch not installed (pip install -e '.[torch]')")

from benchmarks import sanitize_smoke  # noqa: E402


@pytest.mark.parametrize("argv, says", [
    (["--n", "512"], "--n"),  # a length without --paper
    (["--paper", "--n", "0"], "--n"),
    (["--stages", "attention,nope"], "nope"),
    (["--repeat", "0"], "--repeat"),
])
def test_bad_arguments_stop_before_any_work(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        sanitize_smoke.main(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err
