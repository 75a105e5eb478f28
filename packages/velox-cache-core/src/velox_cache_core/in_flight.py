"""The call in flight on a :class:`velox_cache_core.layer.Layer`, and where its decisions are
taken (:class:`Mode`).

At most one thing is pending on a layer: a call :class:`Waiting` for its queries, one
:class:`Decided` at once whose attention may still come, or a decode step :class:`Deferred`
until the pass's layer-wide sums arrive (mode ``STEP_SUMS``). While the layer decodes on the
decode path (:mod:`velox_cache_core.decode`) the token in flight lives in its store instead,
and becomes one of these when something else reads the layer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from velox_cache_core.engine import Laid, Step
from velox_cache_core.store import rows

# Queries per internal sub-chunk of a long sequential-mode chunk (mlx-lm prefills 2048 at once):
# sequential mode does not depend on how a chunk is split, and sub-chunks keep the scan and the
# attention on ``retained + SUBCHUNK`` keys, not ``retained + L``.
SUBCHUNK = 256

# A chunk of at most this many tokens, at the budget on the decode path, runs as decode steps
# (velox_cache_core.decode: a speculative verify chunk).
STEPPED_CHUNK = 16


class Mode(enum.Enum):
    """Where a layer's decisions are taken (:mod:`velox_cache_core.layer` describes each)."""

    AT_ONCE = "at_once"
    QUERIES = "queries"
    STEP_SUMS = "step_sums"


@dataclass(frozen=True)
class Waiting:
    """A call laid out and waiting for its queries. keys/values ``[B, H_kv, L, D]``."""

    keys: rows.Rows
    values: rows.Rows


@dataclass(frozen=True)
class Decided:
    """A call decided at once; ``attend`` may still come for its masks and weights."""

    step: Step
    length: int


@dataclass(frozen=True)
class Deferred:
    """A decode step attended; its decision waits for the pass's layer-wide sums."""

    laid: Laid


Pending = Waiting | Decided | Deferred | None
