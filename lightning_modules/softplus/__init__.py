"""Softplus attention (LSSA / LSSAR) as a model-level attention setting, and the ``lssa_lm`` training method."""
