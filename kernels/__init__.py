"""Attention kernels shared by every litctx method: pure-torch references and Triton kernels.

Layout (one folder per op, as in flash-linear-attention): ``reference.py`` (the CPU path and ground truth),
``triton.py`` (kernels and their autograd wrappers) and a dispatcher that picks Triton on CUDA and the
reference elsewhere (``LITCTX_KERNEL_BACKEND`` overrides). The ops arrive with the "Shared attention
kernels" issue; :mod:`kernels.testing` holds the comparison helper every parity test uses.

This package imports only torch (and triton, lazily); it never imports ``recipes``.
"""
