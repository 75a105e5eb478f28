"""Several independent sequences in one batch: each row is a single-sequence state.

Rows of a batch differ in length, position and evictions, so a batch is a tuple of
single-sequence (``B = 1``) states, one per row, each with its own undo log. A batched call
feeds ``[B, H_kv, L, D]`` keys/values in which row ``b``'s real tokens are the span
``left_padding[b] : left_padding[b] + lengths[b]``; the rest is padding, which is never stored,
scored, attended to or counted. Row ``b`` of a batched call is exactly the single-sequence call
on its span (row equivalence), and its attention output is zero at padded queries.

Operations: :func:`stack` single-sequence states into a batch, :meth:`BatchState.row` takes
one out, :meth:`BatchState.keep` keeps a subset of rows, :meth:`BatchState.concat` appends
another batch's rows, :func:`update` feeds a padded call and :func:`attend` attends it.

Packed rows (a batch's decode steps as one engine call) are :mod:`velox_cache_core.packed`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from velox_cache_core.attention import attend as attend_step
from velox_cache_core.declarations import PolicyState
from velox_cache_core.engine import Step
from velox_cache_core.policy import Policy
from velox_cache_core.store.rows import quant_of
from velox_cache_core.undo import UndoLog
from velox_cache_core.validation import check_kv

Span = tuple[int, int]  # (first, length) of a row's real tokens in a call


def row_signature(state: PolicyState) -> dict[str, Any]:
    """What rows of one batch must share: policy state type, settings and, once a row holds
    tokens, its KV heads, head dim and dtype."""
    sig: dict[str, Any] = {"policy state": type(state).__name__, **state.settings}
    if state.slots is not None:
        _, H, _, D = state.slots.keys.shape
        quant = quant_of(state.slots.keys)
        sig.update({"H_kv": H, "D": D, "dtype": str(state.slots.keys.dtype), "quant": quant})
    return sig


def check_compatible(signatures: Sequence[dict[str, Any]], what: str) -> None:
    """Raise ``ValueError`` naming every field where a row signature differs from those before
    it (a field only one of them has, like the dtype of a row not fed yet, is not a
    difference); ``what``: the two rows, formatted with the later one's index."""
    first = signatures[0]
    for i, other in enumerate(signatures[1:], 1):
        diff = [f"{k}: {v!r} != {other[k]!r}" for k, v in first.items() if other.get(k, v) != v]
        if first["policy state"] != other["policy state"]:
            diff = [f"policy state: {first['policy state']} != {other['policy state']}"]
        if diff:
            raise ValueError(f"cannot batch {what.format(i)}: they differ in " + "; ".join(diff))
        first = {**other, **first}


def check_single(state: PolicyState, name: str) -> None:
    """``ValueError`` unless ``state`` (called ``name``) holds one sequence (``B = 1``) or none."""
    if state.slots is not None and state.slots.keys.shape[0] != 1:
        raise ValueError(
            f"{name} holds {state.slots.keys.shape[0]} sequences in lockstep; a batch takes "
            "single-sequence rows (B = 1)"
        )


def check_index(index: Any, size: int, what: str) -> int:
    """``index`` (called ``what``) of a row of a batch of ``size``, from ``0``: ``TypeError``
    unless an int, ``IndexError`` unless in ``[-size, size)``."""
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"{what} must be an int, got {type(index).__name__}")
    if not -size <= index < size:
        raise IndexError(f"{what} {index} out of range for a batch of {size}")
    return index % size


@dataclass(frozen=True)
class BatchState:
    """``B`` sequences of one policy. ``rows[b]``: row ``b``'s state (``B = 1``); ``logs[b]``:
    its undo log or ``None``."""

    rows: tuple[Any, ...]
    logs: tuple[UndoLog | None, ...]

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def offsets(self) -> list[int]:
        """Tokens seen per row (the true position of each row's next token)."""
        return [int(s.offset) for s in self.rows]

    @property
    def tokens_kept(self) -> list[int]:
        """Retained tokens per row (per KV head); padding is never counted."""
        return [int(s.tokens_kept) for s in self.rows]

    @property
    def nbytes(self) -> int:
        """Bytes of every row's retained keys and values (no padding)."""
        return sum(int(s.nbytes) for s in self.rows)

    def row(self, index: int) -> tuple[Any, UndoLog | None]:
        """Row ``index``'s single-sequence state and undo log (``IndexError`` if absent)."""
        b = check_index(index, self.batch_size, "row")
        return self.rows[b], self.logs[b]

    def keep(self, indices: Sequence[int]) -> BatchState:
        """The batch of rows ``indices``, in that order (``IndexError`` for a missing row)."""
        picked = [self.row(int(i)) for i in indices]
        return BatchState(tuple(s for s, _ in picked), tuple(lg for _, lg in picked))

    def concat(self, other: BatchState) -> BatchState:
        """This batch's rows followed by ``other``'s (``ValueError`` if they cannot share a
        batch: different policy, settings, heads, head dim or dtype)."""
        if not isinstance(other, BatchState):
            raise TypeError(f"other must be a BatchState, got {type(other).__name__}")
        return stack([*self.rows, *other.rows], [*self.logs, *other.logs])


def stack(states: Sequence[Any], logs: Sequence[UndoLog | None] | None = None) -> BatchState:
    """One batch from single-sequence states (each ``B = 1`` or empty) of one policy with the
    same settings; ``logs``: their undo logs (default none). Raises ``ValueError`` naming what
    differs; the inputs are never changed."""
    if not states:
        raise ValueError("states must hold at least one state")
    logs = [None] * len(states) if logs is None else list(logs)
    if len(logs) != len(states):
        raise ValueError(f"logs must have one entry per state ({len(states)}), got {len(logs)}")
    for i, state in enumerate(states):
        if not isinstance(state, PolicyState):
            raise TypeError(f"states[{i}] must be a PolicyState, got {type(state).__name__}")
        check_single(state, f"states[{i}]")
    check_compatible([row_signature(s) for s in states], "states[0] and states[{}]")
    return BatchState(tuple(states), tuple(logs))


def spans(
    batch_size: int,
    length: int,
    lengths: Sequence[int] | None = None,
    left_padding: Sequence[int] | None = None,
) -> list[Span]:
    """Each row's real tokens in a call of ``length`` tokens: ``(first, count)`` with
    ``first = left_padding[b]`` and ``count = lengths[b]`` (default: every token after the
    padding). Raises ``ValueError`` when a span does not fit the call."""
    pads = [0] * batch_size if left_padding is None else [int(p) for p in left_padding]
    if len(pads) != batch_size:
        raise ValueError(f"left_padding must have {batch_size} entries, got {len(pads)}")
    counts = [length - p for p in pads] if lengths is None else [int(n) for n in lengths]
    if len(counts) != batch_size:
        raise ValueError(f"lengths must have {batch_size} entries, got {len(counts)}")
    for b, (p, n) in enumerate(zip(pads, counts, strict=True)):
        if p < 0 or n < 0 or p + n > length:
            raise ValueError(
                f"row {b}: left_padding ({p}) and lengths ({n}) must be >= 0 with sum <= the "
                f"call's {length} tokens"
            )
    return list(zip(pads, counts, strict=True))


def scatter(
    parts: Sequence[mx.array | None], row_spans: Sequence[Span], like: mx.array
) -> mx.array:
    """Per-row outputs ``[1, H, n_b, D]`` (``None`` for a row without real tokens) placed at
    their spans of a zero ``[B, H, L, D]`` array shaped like ``like`` (``D``: the parts' own,
    which is the values' width)."""
    _B, H, L, D = like.shape
    D = next((int(p.shape[3]) for p in parts if p is not None), D)
    rows = [
        mx.zeros((1, H, L, D), dtype=like.dtype)
        if part is None or count == 0
        else mx.pad(part.astype(like.dtype), [(0, 0), (0, 0), (first, L - first - count), (0, 0)])
        for part, (first, count) in zip(parts, row_spans, strict=True)
    ]
    return mx.concatenate(rows, axis=0) if len(rows) > 1 else rows[0]


def attend_rows(
    queries: mx.array,
    row_spans: Sequence[Span],
    attend_row: Callable[[int, mx.array], mx.array],
) -> mx.array:
    """``[B, H_q, L, D]``: ``attend_row(b, q)`` of each row's real queries ``q``
    ``[1, H_q, n_b, D]`` (rows with none are not asked), at their spans; zero at padded
    queries."""
    parts = [
        attend_row(b, queries[b : b + 1, :, first : first + count]) if count else None
        for b, (first, count) in enumerate(row_spans)
    ]
    return scatter(parts, row_spans, queries)


@dataclass(frozen=True)
class BatchStep:
    """One batched call: ``steps[b]`` is row ``b``'s :class:`Step` (``None`` when the row had
    no real token in the call), ``spans[b]`` where its tokens were, ``state`` the batch after."""

    steps: tuple[Step | None, ...]
    spans: tuple[Span, ...]
    state: BatchState


def update(
    policy: Policy,
    batch: BatchState,
    keys: Any,
    values: Any,
    queries: Any = None,
    scale: Any = None,
    *,
    lengths: Sequence[int] | None = None,
    left_padding: Sequence[int] | None = None,
    check_finite: bool = True,
) -> BatchStep:
    """Feed a padded call to every row: keys/values ``[B, H_kv, L, D]``, queries
    ``[B, H_q, L, D]``; row ``b`` gets its span (see :func:`spans`) as one single-sequence
    :func:`velox_cache_core.engine.update`. States are immutable: a call that raises leaves
    ``batch`` as it was."""
    if not isinstance(batch, BatchState):
        raise TypeError(f"batch must be a BatchState, got {type(batch).__name__}")
    check_kv(keys, values, expect=None, dtype=None)
    B, _, L, _ = keys.shape
    if batch.batch_size != B:
        raise ValueError(f"keys B ({B}) differs from the batch's {batch.batch_size} rows")
    row_spans = spans(B, L, lengths, left_padding)
    steps: list[Step | None] = []
    rows, logs = list(batch.rows), list(batch.logs)
    for b, (first, count) in enumerate(row_spans):
        if count == 0:
            steps.append(None)
            continue
        part = (slice(b, b + 1), slice(None), slice(first, first + count))
        step = policy.update(
            rows[b],
            keys=keys[part],
            values=values[part],
            queries=None if queries is None else queries[part],
            scale=scale,
            check_finite=check_finite,
            log=logs[b],
        )
        steps.append(step)
        rows[b], logs[b] = step.state, step.log
    return BatchStep(tuple(steps), tuple(row_spans), BatchState(tuple(rows), tuple(logs)))


def attend(
    queries: mx.array, step: BatchStep, scale: float, sinks: mx.array | None = None
) -> mx.array:
    """``[B, H_q, L, D]``: each row's queries over its own step (its own keys, positions and
    mask: rows never see each other's padding); zero at padded queries."""

    def attend_row(b: int, q: mx.array) -> mx.array:
        row_step = step.steps[b]
        assert row_step is not None  # a row with real queries has a step
        return attend_step(q, row_step, scale, sinks)

    return attend_rows(queries, step.spans, attend_row)


def end_prompt(
    policy: Policy, batch: BatchState, indices: Sequence[int] | None = None
) -> BatchState:
    """The batch after rows ``indices`` (default: all) end their prompts (SnapKV's cut; a
    no-op for policies without a prompt-end step)."""
    chosen = range(batch.batch_size) if indices is None else [int(i) for i in indices]
    rows, logs = list(batch.rows), list(batch.logs)
    for b in chosen:
        state, log = batch.row(b)
        ended = policy.end_prompt(state)
        if ended is not state and log is not None:  # the cut cannot be undone
            logs[b] = log.cleared()
        rows[b] = ended
    return BatchState(tuple(rows), tuple(logs))
