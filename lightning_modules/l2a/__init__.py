"""L2A: learning when to attend. Sliding-window local attention plus token-wise routed global attention, trained
by continued pretraining; global paths that rarely fire are pruned afterwards. ``config.py`` (L2AConfig),
``layer.py`` (the surgery), ``prune.py`` (post-training pruning, KV accounting), ``module.py`` (the CPT
LightningModule)."""
