"""``velox-generate``: generate with a Velox cache, optionally side by side with the full cache.

The command itself is :mod:`velox_mlx_lm.cli.app`; the other modules are its parts:

- :mod:`~velox_mlx_lm.cli.batch`: several prompts as one batch through ``BatchGenerator``;
- :mod:`~velox_mlx_lm.cli.document`: a policy with a model-driven phase (KVzip): prefill the
  document, compress it, answer the question;
- :mod:`~velox_mlx_lm.cli.generation`: one generation with stats, and the tables it prints.

``velox-generate`` and ``python -m velox_mlx_lm.cli`` run :func:`main`.
"""

from velox_mlx_lm.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
