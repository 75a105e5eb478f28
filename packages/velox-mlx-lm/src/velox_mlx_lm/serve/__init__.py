"""``velox-serve``: mlx-lm's OpenAI-compatible server with a Velox cache for every sequence.

The server itself is :mod:`velox_mlx_lm.serve.app`; the other modules are its parts:

- :mod:`~velox_mlx_lm.serve.auth`: ``--api-key``, checked on every route but ``/health``;
- :mod:`~velox_mlx_lm.serve.cache`: the prompt cache and the byte and token counts of caches;
- :mod:`~velox_mlx_lm.serve.errors`: the exception a route raises to refuse a request;
- :mod:`~velox_mlx_lm.serve.memory`: ``--max-memory``, admission and the bounded prompt cache;
- :mod:`~velox_mlx_lm.serve.messages`: ``POST /v1/messages`` (Anthropic's Messages API);
- :mod:`~velox_mlx_lm.serve.release`: freed buffers go back to the operating system.

``velox-serve`` and ``python -m velox_mlx_lm.serve`` run :func:`main`. The names below are the
app's own objects (a patch of ``VeloxModelProvider``'s methods takes effect in the server).
"""

from velox_mlx_lm.serve.app import VeloxHandler, VeloxModelProvider, build_parser, main

__all__ = ["VeloxHandler", "VeloxModelProvider", "build_parser", "main"]
