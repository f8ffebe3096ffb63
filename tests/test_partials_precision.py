"""benchmarks/dev/partials_precision.py and fp8_cache_precision.py at small sizes: the errors
they report are ordered as the formats' mantissas (float32 << fp16 < bf16 < e4m3 < e5m2), bf16
partials keep the maximum error at the bf16 output's own rounding, and an fp8 cache moves the
selection and the output beyond what bf16 does."""

import pytest

pytest.importorskip("torch", reason="torch not installed (pip install -e '.[torch]')")

from benchmarks.dev import partials_precision  # noqa: E402


def test_partials_precision_orders_the_formats():
    rows = partials_precision.measure(2048)["rows"]

    def err(fmt, output="combined in float32"):
        return rows[f"partials in {fmt}, {output}"]["max_abs_over_max_ref"]

    bf16_output = rows["bf16 output (what the forward returns)"]["max_abs_over_max_ref"]
    assert err("float32") < 1e-6
    assert err("float32") < err("float16") < err("bfloat16") < err("e4m3") < err("e5m2")
    assert 5e-4 < bf16_output < 5e-3  # bf16's 8-bit mantissa
    assert err("bfloat16", "bf16 output") <= 1.2 * bf16_output
    assert err("e4m3") > 1e-2  # above the benchmarks' 1.05% gate


def test_fp8_cache_precision_moves_beyond_bf16():
    from benchmarks.dev import fp8_cache_precision

    rows = fp8_cache_precision.measure(4096, 16)["rows"]
    bf16, keys, kv = rows["bf16 cache (today)"], rows["fp8 index keys"], rows["fp8 K and V"]
    assert 0.9 < keys["recall"] < bf16["recall"] <= 1.0
    assert kv["recall"] == bf16["recall"]  # K and V do not take part in the selection
    assert bf16["same_selection_max_abs_over_max_ref"] < 1e-2
    assert kv["same_selection_max_abs_over_max_ref"] > bf16["same_selection_max_abs_over_max_ref"]
