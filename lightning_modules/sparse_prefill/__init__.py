"""Sparse prefill for the causal LMs of :mod:`lightning_modules.llm`: block estimators (SALE, Prism, XAttention,
FlexPrefill, mean pooling) choose which (query block, key block) tiles of a long prefill to compute, and the
shared kernels compute only those.

* :mod:`~lightning_modules.sparse_prefill.config` - typed method configs that build the estimators.
* :mod:`~lightning_modules.sparse_prefill.session` - install an estimator on a model's prefill, always removed.
* :mod:`~lightning_modules.sparse_prefill.callbacks` - each method as a Lightning callback.

This file imports nothing: importing the package must stay free of side effects.
"""
