"""benchmarks/bench_layer.py on the CPU at toy sizes: every phase runs and lands in the JSON.

The GPU run is one call of a fixed length, so its control flow is checked here: the sizes
smallest first, the ratios and the crossover, a size in a child process, the profile that says
why it has no GPU share, the warmup rows, the cold start's two fresh processes, the
torch.compile check, the budget that skips what would not fit, the summary and the figure.
"""

import json

import pytest

torch = pytest.importorskip("torch", reason="torch not installed (pip install -e '.[torch]')")

from benchmarks import bench_layer  # noqa: E402


def rows_of(payload, impl):
    return [r for r in payload["results"] if r.get("impl") == impl]


def test_crossover_interpolates_log_log_between_the_bracketing_sizes():
    n, how = bench_layer.crossover([(1024, 0.5), (4096, 2.0)])
    assert n == pytest.approx(2048.0) and "N=1K" in how and "N=4K" in how
    assert bench_layer.crossover([(1024, 1.2), (4096, 3.0)])[0] is None
    assert "slower" in bench_layer.crossover([(1024, 0.2), (4096, 0.9)])[1]


def test_union_counts_overlapping_kernels_once():
    busy = bench_layer.union_ns(bench_layer.clip([(0, 10), (5, 20), (30, 40), (45, 60)], 2, 50))
    assert busy == [[2, 20], [30, 40], [45, 50]]


def test_busy_share_is_the_union_of_kernels_over_the_step_and_gaps_name_the_host_ops():
    M = 1_000_000  # ns per ms
    spans = [("user_annotation", bench_layer.STEP_MARK, 0, 100 * M),
             ("gpu_user_annotation", bench_layer.STEP_MARK, 0, 100 * M),  # not a kernel
             ("kernel", "a", 10 * M, 30 * M), ("kernel", "b", 20 * M, 40 * M),  # overlap
             ("gpu_memset", "Memset", 40 * M, 45 * M), ("kernel", "c", 60 * M, 90 * M),
             ("kernel", "d", 95 * M, 120 * M),  # ends after the step: clipped
             ("cpu_op", "aten::mm", 0, 12 * M), ("cpu_op", "msa::kl_loss", 40 * M, 62 * M),
             ("cuda_runtime", "cudaLaunchKernel", 45 * M, 58 * M)]
    got = bench_layer.timeline_summary(spans)
    assert got["gpu_busy_ms"] == pytest.approx(65.0) and got["gpu_busy_share"] == pytest.approx(0.65)
    assert got["gpu_busy_share_with_memops"] == pytest.approx(0.70) and got["met"] is False
    assert [(g["at_ms"], g["ms"]) for g in got["idle_gaps"]] == [(45, 15), (0, 10), (90, 5)]
    assert [h["name"] for h in got["idle_gaps"][0]["host_ops"]] == ["cudaLaunchKernel",
                                                                   "msa::kl_loss"]
    assert [h["name"] for h in got["idle_gaps"][1]["host_ops"]] == ["aten::mm"]
    cpu = bench_layer.timeline_summary(spans[:1] + spans[7:], device="cpu")
    assert cpu["gpu_busy_share"] is None and "GPU only" in cpu["why_no_gpu_share"]


def test_tiny_run_every_phase(tmp_path):
    """Sizes 64-256 in this process, 512 in a child, two cold-start processes, one crossover
    probe below 64 is refused (under 4 blocks), the warmup at 128 and 256, the compile check."""
    out = tmp_path / "bench_layer.json"
    bench_layer.main(["--device", "cpu", "--tiny", "--out", str(out), "--sizes", "64,128,512",
                      "--dense-max-n", "128", "--isolate-above", "128", "--profile", "128",
                      "--warmup-sizes", "64,128", "--reps", "1", "--crossover-probes", "0",
                      "--budget-s", "600"])
    payload = json.loads(out.read_text())
    sparse = rows_of(payload, bench_layer.IMPL_SPARSE)
    assert [r["n"] for r in sparse] == [64, 128, 512]
    assert [r["process"] for r in sparse] == ["main", "main", "child"]
    assert all(r["finite"] and r["ms"] > 0 and r["pairs"] > 0 for r in sparse)
    dense = rows_of(payload, bench_layer.IMPL_DENSE)
    assert [r["n"] for r in dense] == [64, 128]  # not above --dense-max-n
    assert all(r["msa_speedup"] == pytest.approx(r["ms"] / s["ms"]) for r, s in zip(dense, sparse))
    warm = rows_of(payload, bench_layer.IMPL_WARMUP)
    assert [r["n"] for r in warm] == [64, 128]
    assert all("chunked PyTorch fallback" in r["main_branch"] and r["vs_sparse_step"] > 0
               and r["main_branch_ms"] > 0 and r["kl_ms"] > 0 for r in warm)
    prof = payload["profile"]
    assert prof["n"] == 128 and prof["gpu_busy_share"] is None
    assert "GPU only" in prof["why_no_gpu_share"] and prof["top_host_ops"]
    cold = payload["cold_start"]
    assert cold["n"] == 128 and cold["first"]["finite"] and cold["second"]["finite"]
    assert 0 < cold["first"]["first_step_s"] <= cold["first"]["total_s"] < cold["first"]["wall_s"]
    comp = payload["compile_check"]
    assert comp["backend"] == "aot_eager" and comp["equal"] is True, comp
    summary = payload["summary"]
    assert {t["what"] for t in summary["targets"]} >= {
        "step vs dense at N=32K", "step vs dense at N=128K", "N=512 forward and backward fit"}
    assert summary["crossover"]
    if payload["figure"].endswith(".png"):  # matplotlib installed
        assert (tmp_path / "bench_layer.png").stat().st_size > 0
    else:
        assert payload["figure"].startswith("not drawn")


def test_budget_skips_what_would_not_fit(tmp_path, monkeypatch):
    """An item whose estimate ends past the budget is a row that says so; with no time left
    at all every item is, and the JSON and its summary are still written."""
    out = tmp_path / "b.json"
    args = bench_layer.parse(["--device", "cpu", "--tiny", "--out", str(out), "--budget-s", "100"])
    run = bench_layer.Run(args, bench_layer.TINY)
    monkeypatch.setattr(run, "elapsed", lambda: 60.0)
    assert run.fits(None, 64, "a") and run.fits(40.0, 64, "b") and run.rows == []
    assert not run.fits(41.0, 128, "c")
    assert run.rows == [dict(case="N=128", n=128, impl="c", skipped=(
        "time budget: at 60 s, about 41 s more would pass the 100 s of --budget-s"))]
    bench_layer.main(["--device", "cpu", "--tiny", "--quick", "--out", str(out), "--budget-s",
                      "0", "--no-figure"])
    payload = json.loads(out.read_text())
    assert {(r["case"], r["impl"]) for r in payload["results"]} == {
        ("N=64", bench_layer.IMPL_SPARSE), ("N=128", bench_layer.IMPL_SPARSE),
        ("N=128", bench_layer.IMPL_WARMUP)}
    assert all(r["skipped"].startswith("time budget") for r in payload["results"])
    assert [t["met"] for t in payload["summary"]["targets"]][:2] == [None, None]
