"""NumPy reference of MSA (arXiv 2606.13392), one module per pipeline stage.

======================  ==========================================================
module                  paper
======================  ==========================================================
``blocks``              eq 3-4: GQA groups, KV blocks, packed-batch positions
``index``               eq 5-6, 11: index projections, token scores, causal block max
``select``              eq 7, §2.2, §3.2: exp-free top-k with the forced local block
``attention``           eq 1 (dense), eq 8 (restricted, Q-outer) and its gradient, K1 (§4.2)
``combine``             K2: exact log-sum-exp combine of partials (§4.2)
``csr``                 §4.2: q2k -> k2q CSR as histogram, exclusive scan, scatter
``schedule``            §4.2: hot-row scheduler (work items, chunk limit)
``kl``                  eq 9-11: sparse KL, its backward, the warmup support
``complexity``          eq 12-16: FLOPs, I/O, arithmetic intensity
``layer``               Algorithm 1: one MSA layer forward with L_KL
``decode``              §8: the paged KV cache and the decode step on it
======================  ==========================================================

Every function takes NumPy arrays, computes in float64 when given float64 (float32 otherwise),
and validates its inputs with errors that name the argument.
"""

from .attention import (attention_partials, dense_attention, sparse_attention,
                        sparse_attention_backward)
from .blocks import (block_partition, block_row_offsets, gqa_group, key_positions, local_blocks,
                     max_blocks, num_blocks, query_positions)
from .combine import combine_partials
from .complexity import (arithmetic_intensity, attention_flops, crossover_length, gqa_flops,
                         kv_outer_io, msa_flops, q_outer_io, speedup_limit)
from .csr import build_csr, csr_histogram, csr_scatter, exclusive_prefix_sum
from .index import block_scores, index_projections, index_scores
from .kl import kl_backward, kl_loss, kl_loss_and_backward, student_probs, teacher_probs
from .layer import MSAParams, init_params, msa_layer
from .schedule import build_schedule, schedule_stats
from .select import check_block_indices, fixed_blocks, nonempty_supports, select_blocks
from .decode import (append_to_cache, decode_attention, decode_block_indices, decode_step,
                     gather_cache, prefill_chunk)

__all__ = [
    "gqa_group", "num_blocks", "block_partition", "query_positions", "key_positions", "local_blocks",
    "block_row_offsets", "max_blocks",
    "index_projections", "index_scores", "block_scores",
    "select_blocks", "fixed_blocks", "check_block_indices", "nonempty_supports",
    "dense_attention", "sparse_attention", "sparse_attention_backward", "attention_partials",
    "combine_partials",
    "csr_histogram", "exclusive_prefix_sum", "csr_scatter", "build_csr",
    "build_schedule", "schedule_stats",
    "kl_loss", "kl_backward", "kl_loss_and_backward", "student_probs", "teacher_probs",
    "gqa_flops", "attention_flops", "msa_flops", "crossover_length", "speedup_limit",
    "q_outer_io", "kv_outer_io", "arithmetic_intensity",
    "MSAParams", "init_params", "msa_layer",
    "append_to_cache", "gather_cache", "decode_block_indices", "decode_attention", "decode_step",
    "prefill_chunk",
]
