"""LoSA: locality-aware sparse attention for the denoising steps of block-diffusion LMs, and its baselines."""
