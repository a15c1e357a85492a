"""The model: loading (SmolLM2, Gemma-3, HF folders, tiny-* architectures), surgery (attention and decoder-layer
replacement), the ``litctx`` attention function, and the causal-LM LightningModule."""
