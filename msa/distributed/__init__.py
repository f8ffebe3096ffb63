"""Context parallelism for MSA over ``torch.distributed`` (docs/design.md §9): the sharding."""

from .sharding import Round, Sharding, causal_work, shard_tokens

__all__ = ["shard_tokens", "Sharding", "Round", "causal_work"]
