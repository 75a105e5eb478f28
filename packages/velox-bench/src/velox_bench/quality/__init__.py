"""Quality harness: streaming perplexity and planted-fact retrieval of the embedded model.

``python -m velox_bench.quality`` runs the full evaluation (``--quick`` for a small one) and
writes ``benchmarks/results/quality.json``, the figures and the quality part of
``docs/benchmarks.md``. This package imports no ``mlx`` at import time, so the entry point can
load OpenBLAS first (:func:`velox_blas.preload_openblas`).
"""
