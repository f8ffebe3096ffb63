"""GPU benchmarks of msa against the baselines a user would otherwise pick (DESIGN §6)."""
