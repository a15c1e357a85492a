"""L-CUBE (ICML 2026): Gaussian next-vector prediction and long-context utilization metrics."""
