"""Test support shared by msa's own suite and by users fuzzing their kernels: hypothesis
strategies that draw consistent MSA problems and tolerance helpers against a float64 oracle.
Needs the ``test`` extra (hypothesis)."""
# Modules: ``strategies`` (hypothesis), ``tolerance`` (float64-oracle comparisons),
# ``backends`` (run one test against msa.reference and msa.cuda, NaN poison), ``ptx`` (offline
# sm_90 compile checks of the kernels).
