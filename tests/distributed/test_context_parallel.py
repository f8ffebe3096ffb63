"""Context parallelism equals one device (docs/design.md §9): 1, 2 and 4 gloo processes on CPU.

Each world size is one ``torch.multiprocessing.spawn`` (a file store in a tmp dir, no TCP port)
that runs every case of its table; the ranks save their rows and the all-reduced weight
gradients, and the tests compare them with one process's ``MSAAttention`` step
(``_spawn.one_device``): ``L = <output, g_out> + lambda L_KL`` on float64, Bk 16, top-3.

* The selection is equal exactly (each rank's index branch scores the same keys at the same
  positions as one device).
* Floats: only the order of the sums that span ranks changes (dK, dV, dK_idx summed by the
  reduce-scatter; weight gradients summed over ranks; L_KL as the sum of the ranks' shares), so
  the bound is that of a reordered float64 sum: ``T`` ulps of the result's scale, ``T`` (<= 128)
  being the most terms a reordered sum has here (float64 eps: 2**-52).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed (pip install -e '.[torch]')")
dist = pytest.importorskip("torch.distributed")

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available in this torch build",
                allow_module_level=True)

from msa.distributed import context_parallel_msa  # noqa: E402

from . import _spawn as S  # noqa: E402

EPS = float(np.finfo(np.float64).eps)

# Packed batches whose sequences span ranks, ranks holding several sequences, empty and short
# sequences, the zigzag, pieces (the GPU's overlapped gather, here synchronous), the warmup.
CASES = {
    2: [dict(name="packed", cu=[0, 45, 50, 100, 128], chunk_size=12, seed=0),
        dict(name="zigzag_pieces", cu=[0, 96], pieces=2, seed=1),
        dict(name="warmup", cu=[0, 37, 37, 90], chunk_size=8, pieces=3, warmup=True, seed=2)],
    4: [dict(name="packed_pieces", cu=[0, 70, 75, 76, 100, 128], chunk_size=8, pieces=2, seed=3),
        dict(name="zigzag", cu=[0, 128], seed=4)],
}
PARAMS = [pytest.param(w, c, id=f"W{w}-{c['name']}") for w, cs in CASES.items() for c in cs]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``{world_size: {case: [per-rank results]}}``, one spawn per world size."""
    return {w: S.run(w, cs, tmp_path_factory.mktemp(f"cp{w}")) for w, cs in CASES.items()}


def assert_reordered_sum_close(name, got, want, terms):
    got, want = got.double(), want.double()
    scale = max(float(want.abs().max()), EPS) if want.numel() else 1.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    bound = terms * EPS * scale
    assert err <= bound, f"{name}: max error {err:.3g} > {terms} ulps of {scale:.3g} ({bound:.3g})"


def check_against_one_device(case, parts):
    ref = S.one_device(case)
    t = int(case["cu"][-1])
    ids = np.sort(np.concatenate([p["ids"].numpy() for p in parts]))
    np.testing.assert_array_equal(ids, np.arange(t))  # every row on exactly one rank
    np.testing.assert_array_equal(S.assemble(parts, "block_indices").numpy(),
                                  ref["block_indices"].numpy())
    for key in ("output", "lse", "dx"):
        assert_reordered_sum_close(key, S.assemble(parts, key), ref[key], t)
    for r, p in enumerate(parts):
        assert_reordered_sum_close(f"L_KL (rank {r})", p["loss_kl"], ref["loss_kl"], t)
        for w in S.WEIGHTS:
            assert_reordered_sum_close(f"d{w} (rank {r})", p[w], ref[w], t)


@pytest.mark.parametrize("world_size, case", PARAMS)
def test_equals_one_device(results, world_size, case):
    check_against_one_device(case, results[world_size][case["name"]])


@pytest.fixture
def group_of_one(tmp_path):
    """A gloo group of this process alone (world size 1)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_one_rank_equals_one_device(group_of_one):
    """W = 1 in this process: rounds, the gather and its backward on one rank."""
    case = dict(name="one", cu=[0, 20, 21, 60], chunk_size=8, pieces=2, seed=5)
    check_against_one_device(case, [S.cp_step(case)])


def test_rows_must_be_this_ranks(group_of_one):
    layer, x, _ = S.problem(dict(cu=[0, 40], seed=0))
    with pytest.raises(ValueError, match=r"x_local must have shape \[n_r, d_model\] = \[40, 32\]"):
        context_parallel_msa(layer, x[:39], [0, 40])
    with pytest.raises(TypeError, match="x_local must have the layer's dtype"):
        context_parallel_msa(layer, x.float(), [0, 40])
    with pytest.raises(TypeError, match="layer must be an msa.torch.MSAAttention"):
        context_parallel_msa(object(), x, [0, 40])
    with pytest.raises(ValueError, match="pieces must be >= 1"):
        context_parallel_msa(layer, x, [0, 40], pieces=0)


def test_the_layer_with_a_process_group_runs_context_parallel(group_of_one):
    """``MSAAttention(process_group=...)`` (here ``layer.process_group``) is the same step as
    ``context_parallel_msa``, and at W = 1 the same as the layer without a group."""
    cu = [0, 20, 21, 60]
    layer, x, _ = S.problem(dict(cu=cu, seed=5))
    plain = layer(x, cu)
    layer.process_group, layer.cp_chunk_size = dist.group.WORLD, 8
    grouped = layer(x, cu)
    want = context_parallel_msa(layer, x, cu, dist.group.WORLD, chunk_size=8)
    assert torch.equal(grouped.output, want.output)
    assert torch.equal(grouped.block_indices, plain.block_indices)
    torch.testing.assert_close(grouped.output, plain.output, rtol=1e-12, atol=1e-12)
