"""Device building blocks shared by msa.cuda's stages; imports nothing above it.

=============  =============================================================================
``arrays``     arrays in and out of launchers, whatever library the caller uses; constants
``launch``     kernel launches without Numba's per-launch typing; dynamic shared memory; uploads
``streams``    the launch stream: the caller's current torch or CuPy stream, read at each launch
``mma``        tensor-core ``mma.sync`` shims, bf16/fp16 conversions, ``exp2`` (inline PTX, and
               their pure-Numba twins for the simulator)
``wgmma``      Hopper ``wgmma`` shims (compute capability 9.0) and their simulator twins
``memops``     vector loads and stores, ``cp.async``, ``ldmatrix`` (and twins)
``warp``       warp reductions, scans and the warp-wide sort
``simwarp``    the warp operations Numba's simulator lacks (installed by ``msa.cuda``)
``scan``       prefix sums: serial, reduce-then-scan, decoupled look-back
``heap``       the per-thread min-heap of the top-k and the warp merge (paper §4.1)
``softmax``    the exponentials of an mma tile's two rows (K1, the decode attention)
``packed``     device functions over the packed batch: positions, CSR entries, work items
``finite``     non-finite 16-bit values kept out of tensor-core tiles (masking by selection)
``diskcache``  ``kernel_jit``: compiled kernels cached on disk across processes
=============  =============================================================================
"""
