"""Development scripts kept for the next optimisation, not benchmarks (GPU unless said).

- Where time goes: ``profile_index``, ``profile_kl``, ``profile_backward`` (torch.profiler
  kernel tables, ``--ncu`` launches for Nsight Compute), ``idle_gaps``, ``host_profile`` (a
  launcher's Python, by function, and each per-launch primitive).
- A/B of a knob in one process, each config gated against the first: ``backward_parts``
  (``part_size``, ``max_partial_bytes``: public keywords), ``kl_tiles`` (the KL grad tile's
  height: module constants, ``--save``/``--against`` for two trees' outputs bitwise),
  ``decode_knobs`` (the decode planners' constants), ``decode_merge`` (one warp a row against
  the wide merge), ``decode_page_order`` (does the pool's page order cost bandwidth).
- Precision, NumPy only: ``partials_precision``, ``fp8_cache_precision``.

What they found is in docs/performance.md, with the run that found it.
"""
