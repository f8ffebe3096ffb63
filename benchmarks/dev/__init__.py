"""Profiling helpers kept for the next optimisation, not benchmarks: each prints where one call's
time goes (torch.profiler, a host profile, or a launch for Nsight Compute). They call only public
``msa.cuda`` launchers and ``benchmarks.bench_attention``'s input helpers, and were last run on
an H200 before the stage layout (426fbbf); what they found is in docs/performance.md."""
