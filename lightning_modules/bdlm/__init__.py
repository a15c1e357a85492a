"""Block-diffusion language models: the ``bdlm`` training method (masked diffusion over block-causal attention)."""
