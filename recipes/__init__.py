"""Entry points and the composition root of litctx: config, registry, run directories, fit/evaluate.

``python -m recipes.fit --recipe NAME``, ``python -m recipes.evaluate``, ``python -m recipes.ls``,
``python -m recipes.show``; ``recipes.api.build()`` for notebooks. This package imports the library
packages (``litctx_kernels``, ``lightning_modules``, ``datamodules``); they never import it.
"""
