"""Spawning a gloo process group on the CPU for the context-parallel tests (and the example).

``run(world_size, cases, workdir)`` starts ``world_size`` processes with
``torch.multiprocessing.spawn``; they meet through a file store in ``workdir`` (no TCP port),
run :func:`cp_step` on every case in turn and save what they computed to
``workdir/<case>.<rank>.pt``. :func:`one_device` computes the same step in this process, the
oracle the tests compare with.
"""

from __future__ import annotations

import datetime
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import msa.reference as R
from msa.distributed import ContextParallelMSA, all_reduce_gradients
from msa.torch import MSAAttention

# The tests' tiny layer: d_model 32, Hq 4, Hkv 2 (G = 2), D = Didx = 16, Bk 16, top-3, float64.
SHAPE = dict(d_model=32, num_q_heads=4, num_kv_heads=2, head_dim=16, index_dim=16)
BLOCK, TOPK, LAM = 16, 3, 0.7
WEIGHTS = ("w_q", "w_k", "w_v", "w_o", "w_q_idx", "w_k_idx")


def problem(case):
    """``(layer, x [T, d_model], g_out [T, d_model])`` of a case, the same in every process."""
    params = R.init_params(*SHAPE.values(), seed=case["seed"])
    layer = MSAAttention.from_params(params, block_size=BLOCK, topk=TOPK,
                                     warmup=case.get("warmup", False))
    rng = np.random.default_rng(case["seed"] + 1)
    t = int(case["cu"][-1])
    x = torch.from_numpy(rng.standard_normal((t, SHAPE["d_model"])))
    g_out = torch.from_numpy(rng.standard_normal((t, SHAPE["d_model"])))
    return layer, x, g_out


def one_device(case):
    """The oracle: one process's ``MSAAttention`` step, ``L = <output, g_out> + lam L_KL``."""
    layer, x, g_out = problem(case)
    x.requires_grad_()
    out = layer(x, case["cu"])
    ((out.output * g_out).sum() + LAM * out.loss_kl).backward()
    return dict(output=out.output.detach(), lse=out.lse, block_indices=out.block_indices,
                loss_kl=out.loss_kl.detach(), dx=x.grad,
                **{w: getattr(layer, w).grad for w in WEIGHTS})


def cp_step(case, group=None):
    """This rank's part of the same step through ``ContextParallelMSA``."""
    rank = dist.get_rank(group)
    layer, x, g_out = problem(case)
    cp = ContextParallelMSA(layer, group, chunk_size=case.get("chunk_size"),
                            pieces=case.get("pieces"))
    ids = torch.from_numpy(cp.shard(case["cu"]).token_ids(rank))
    x_local = x[ids].clone().requires_grad_()
    out = cp(x_local, case["cu"])
    ((out.output * g_out[ids]).sum() + LAM * out.loss_kl).backward()
    all_reduce_gradients(cp.parameters(), group)
    loss_kl = out.loss_kl.detach().clone()
    dist.all_reduce(loss_kl, group=group)
    return dict(ids=ids, output=out.output.detach(), lse=out.lse,
                block_indices=out.block_indices, loss_kl=loss_kl, dx=x_local.grad,
                **{w: getattr(layer, w).grad for w in WEIGHTS})


def _worker(rank, world_size, cases, workdir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(workdir, 'store')}",
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for case in cases:
            torch.save(cp_step(case), os.path.join(workdir, f"{case['name']}.{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run(world_size, cases, workdir):
    """Run every case on ``world_size`` gloo processes; returns ``{name: [per-rank dicts]}``."""
    mp.spawn(_worker, args=(world_size, cases, str(workdir)), nprocs=world_size, join=True)
    return {c["name"]: [torch.load(os.path.join(workdir, f"{c['name']}.{r}.pt"))
                        for r in range(world_size)] for c in cases}


def assemble(parts, key):
    """The global tensor of a per-row result from the ranks' rows (``ids`` say where)."""
    first = parts[0][key]
    out = first.new_empty((sum(p[key].shape[0] for p in parts),) + tuple(first.shape[1:]))
    for p in parts:
        out[p["ids"]] = p[key]
    return out
