"""GPU benchmarks of msa against the baselines a user would otherwise pick (docs/design.md §6)."""
