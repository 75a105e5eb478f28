"""Velox benchmarks and quality harness."""

__version__ = "0.4.0"
