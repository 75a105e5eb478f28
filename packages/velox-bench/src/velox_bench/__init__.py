"""Velox benchmarks and quality harness."""

__version__ = "0.6.0"
