"""Velox benchmarks and quality harness."""

__version__ = "0.12.0"
