"""NumPy reference of MSA, one module per pipeline stage (filled in as stages land)."""
