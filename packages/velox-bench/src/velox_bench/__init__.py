"""Velox benchmarks and quality harness."""

__version__ = "0.11.0"
