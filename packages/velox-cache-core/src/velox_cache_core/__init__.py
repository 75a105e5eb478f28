"""Framework-neutral MLX KV-cache eviction primitives."""

__version__ = "0.1.0"
