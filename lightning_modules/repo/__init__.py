"""RePo: language models with context re-positioning (learned per-head positions fed into RoPE), trained by
continued pretraining. ``config.py`` (RePoConfig), ``attention.py`` (the surgery), ``module.py`` (the CPT
LightningModule)."""
