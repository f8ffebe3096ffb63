"""msa: MiniMax Sparse Attention (arXiv 2606.13392).

``msa.reference`` is a NumPy implementation of every equation of the paper, written to be read;
``msa.cuda`` holds Numba CUDA kernels that compute the same functions with the same arguments.
``msa.problems.make_problem`` draws a consistent random problem for either.
"""

from . import reference
from .problems import Problem, make_problem

__version__ = "0.1.0"
__all__ = ["reference", "Problem", "make_problem", "__version__"]
