"""The runtime every inference method shares: the cached LM, the generic runner stack, the in-place slot buffer,
the KV segment store and cache surgery (RoPE re-rotation, assembly, selective recompute)."""
