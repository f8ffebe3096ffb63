"""Context parallelism for MSA over ``torch.distributed`` (docs/design.md §9).

An MSA layer across the ranks of a process group: the queries stay on their rank, in chunks
balanced by causal work (:func:`shard_tokens`, each rank gets early and late chunks); ``K``,
``V`` and ``K_idx`` are all-gathered (one collective, its backward a reduce-scatter); each rank
runs the index branch, top-k, sparse attention and KL of its own queries against the gathered
keys with ``msa.torch``'s functions. Results equal one device's up to the order of the float
sums that span ranks; the selection is equal exactly. docs/context_parallel.md has the design::

    import torch.distributed as dist
    from msa.distributed import ContextParallelMSA, all_reduce_gradients

    cp = ContextParallelMSA(layer, group)                 # layer: an msa.torch.MSAAttention
    ids = cp.shard(cu_seqlens).token_ids(dist.get_rank(group))
    out = cp(x[ids], cu_seqlens)                          # this rank's rows; global cu_seqlens
    (lm_loss_share(out.output) + lam * out.loss_kl).backward()
    all_reduce_gradients(cp.parameters(), group)          # the one-device weight gradients

Needs the ``torch`` extra; gloo runs it on CPUs (the NumPy reference), NCCL on GPUs.
"""

from .attention import ContextParallelMSA, all_reduce_gradients, context_parallel_msa
from .comm import gather_keys, wait_for_pieces
from .sharding import Round, Sharding, causal_work, shard_tokens

__all__ = ["ContextParallelMSA", "context_parallel_msa", "all_reduce_gradients", "shard_tokens",
           "Sharding", "Round", "causal_work", "gather_keys", "wait_for_pieces"]
