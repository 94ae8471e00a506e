"""Short runs of the benchmarks (``benchmarks/``): that they run and report."""
