"""LightningDataModules of litctx; ``synth/`` holds the offline generators behind the embedded defaults.

A DataModule knows no model: this package imports neither ``lightning_modules`` nor ``recipes``.
"""
