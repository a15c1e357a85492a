"""The PCFG study: a causal transformer on strings of a fixed-depth PCFG, measured against the exact
next-token conditionals."""
