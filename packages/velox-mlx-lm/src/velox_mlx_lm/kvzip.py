"""KVzip for mlx-lm, under its documented name: :mod:`velox_mlx_lm.compress` drives the
model-driven phase of any policy that declares one (KVzip's reconstruction pass)."""

from velox_mlx_lm.compress import (
    CHUNK_SIZE,
    compress,
    prefill,
    reconstruction_chunks,
    reply_prefix,
)

__all__ = ["CHUNK_SIZE", "compress", "prefill", "reconstruction_chunks", "reply_prefix"]
