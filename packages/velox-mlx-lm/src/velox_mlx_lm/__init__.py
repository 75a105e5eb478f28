"""Velox for mlx-lm: drop-in KV-cache eviction caches."""

__version__ = "0.1.0"
