"""Numba CUDA kernels of MSA: same function names and arguments as ``msa.reference``.

Under ``NUMBA_ENABLE_CUDASIM=1`` the kernels run in Numba's simulator on NumPy arrays; the
warp operations the simulator lacks are supplied by ``msa.cuda._core.simwarp`` (installed here, once).
"""

from ._core import simwarp as _simwarp

_simwarp.install()  # warp operations for Numba's simulator; a no-op on a real GPU

from .attention import (attention_partials, msa_prefill, sparse_attention,
                        sparse_attention_backward)
from .combine import combine_partials
from .csr import build_csr, csr_histogram, csr_scatter, exclusive_prefix_sum
from .index import block_scores
from .kl import kl_backward, kl_loss, kl_loss_and_backward
from .schedule import build_schedule
from .select import select_blocks, select_blocks_fused

__all__ = ["block_scores", "select_blocks", "select_blocks_fused",
           "csr_histogram", "exclusive_prefix_sum", "csr_scatter", "build_csr", "build_schedule",
           "attention_partials", "combine_partials", "sparse_attention",
           "sparse_attention_backward", "msa_prefill",
           "kl_loss", "kl_backward", "kl_loss_and_backward"]
