"""Decoding: the step-wise decoder with hooks and stopping criteria, sampling, speculative decoding, drafts, the
prefill -> decode drivers and stop tokens."""
