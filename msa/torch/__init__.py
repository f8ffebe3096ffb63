"""MSA for PyTorch training: autograd functions and the :class:`MSAAttention` layer.

Needs the ``torch`` extra. CUDA tensors run the msa.cuda kernels, CPU tensors the NumPy
reference (slow, exact: what the tests and ``torch.autograd.gradcheck`` use)::

    from msa.torch import MSAAttention
    layer = MSAAttention(d_model, 64, 4, 128, 128, block_size=128, topk=16,
                         device="cuda", dtype=torch.bfloat16)
    out = layer(x, cu_seqlens)          # out.output, out.loss_kl, out.block_indices, out.lse
    (lm_loss(out.output) + lam * out.loss_kl).backward()

``torch.compile(layer)`` traces the forward in one graph: msa's pieces are custom operators
(:mod:`msa.torch.ops`, ``torch.ops.msa.*``) with fake kernels and registered backwards.
"""

from . import ops  # noqa: F401  (registers the torch.ops.msa custom operators)
from .functional import dense_attention, kl_loss, sparse_attention, sparse_attention_backward
from .cache import CapturedDecode, PagedKVCache, decode_attention_step
from .layer import MSAAttention, MSAOutput

__all__ = ["MSAAttention", "MSAOutput", "dense_attention", "kl_loss", "sparse_attention",
           "sparse_attention_backward", "PagedKVCache", "CapturedDecode", "decode_attention_step"]
