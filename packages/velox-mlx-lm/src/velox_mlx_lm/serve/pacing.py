"""Prefill chunks sized by time, so that one long prompt cannot starve the others (issue 50).

mlx-lm's ``BatchGenerator`` already alternates: each step decodes one token for every
generating sequence, then prefills one chunk of ``prefill_step_size`` tokens for every prompt
in its prompt batch, and a newly arrived prompt joins that batch (its tokens go through in
the same call as the long prompt's next chunk). What made a short request wait minutes was
the chunk's *duration*: on a busy 2-core CPU a 2,048-token chunk takes minutes (the issue
saw 18,432 tokens prefilled in about 20 minutes). A short request arriving during
such a prefill waited for the chunk in progress, then for a whole joint chunk, then a whole
chunk per generated token.

:class:`Pacer` picks each step's chunk length from the measured prefill time per token: at
most :data:`INTERLEAVE_S` of prefill per step while other sequences wait or generate, at
most :data:`ALONE_S` when the prompt batch is alone (a newcomer waits for at most that much
of the chunk in progress), never more than ``--prefill-step-size`` and never less than
:data:`MIN_CHUNK` tokens. Before the first measurement a chunk is :data:`PROBE_CHUNK` tokens,
and a chunk is at most :data:`GROWTH` times the one before: the time per token changes (the
attention span grows with the context, a cache passes its budget, other processes take the
CPU), and a chunk sized from cheaper tokens would overshoot. The time bound is therefore
approximate, by at most the growth factor.
The tokens and their order are the same; only the split of the prompt into chunks changes.
With the default ``sequential`` prefill the caches' results do not depend on it (the contract's
chunk-invariance test); a ``oneshot`` prefill depends on the cut, as on ``--prefill-step-size``.
"""

from __future__ import annotations

INTERLEAVE_S = 1.0  # the longest prefill chunk while other sequences wait or generate
ALONE_S = 10.0  # the longest prefill chunk when nothing else is live
MIN_CHUNK = 16  # tokens: below this a chunk's fixed cost dominates
PROBE_CHUNK = 64  # tokens, before the time per token is known
GROWTH = 2  # a chunk is at most this many times the one before


class Pacer:
    """Chunk lengths for one ``BatchGenerator``: :meth:`chunk` before a step,
    :meth:`measured` after it."""

    def __init__(self, max_chunk: int) -> None:
        if max_chunk < 1:
            raise ValueError(f"--prefill-step-size must be >= 1, got {max_chunk}")
        self.max_chunk = max_chunk
        self.seconds_per_token: float | None = None
        self.last = min(max_chunk, PROBE_CHUNK) // GROWTH  # the last chunk measured

    def chunk(self, others_live: bool) -> int:
        """Tokens per prompt in the next prefill chunk."""
        if self.seconds_per_token is None:
            return min(self.max_chunk, PROBE_CHUNK)
        target = INTERLEAVE_S if others_live else ALONE_S
        tokens = int(target / max(self.seconds_per_token, 1e-9))
        tokens = min(tokens, GROWTH * max(self.last, MIN_CHUNK))
        tokens = max(MIN_CHUNK, tokens - tokens % MIN_CHUNK)
        return min(self.max_chunk, tokens)

    def measured(self, tokens: int, seconds: float) -> None:
        """One step prefilled ``tokens`` positions per prompt in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        # The newest rate alone: an average with cheaper chunks before it (below the budget)
        # would size the next chunk for tokens it no longer has.
        self.last = tokens
        self.seconds_per_token = seconds / tokens
