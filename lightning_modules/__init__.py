"""LightningModules of litctx (one folder or file per trained method), shared layers, callbacks, I/O.

Imports point one way: this package may import ``litctx_kernels``; it never imports ``datamodules`` or ``recipes``.
"""
