"""The benchmarks, run from the repository root as modules: ``python -m bench.<name> [--help]``.

Each module only parses arguments, calls the packages (``litctx_kernels``, ``lightning_modules``, ``datamodules``,
``recipes``) and writes its section of ``docs/results.md`` through :mod:`bench._report`. Importing a benchmark
does no work: no ``sys.path`` edits, no global torch settings, no model loading (``tests/bench/test_bench_imports.py``).
"""
