"""Layer-wide decisions under tensor parallelism (``mx.distributed``).

A tensor-parallel model (mlx-lm's ``model.shard(group)``) splits every attention layer's query
and KV heads over the ranks of ``group``: each rank's cache sees ``H_q / N`` query and
``H_kv / N`` KV heads. A decision per KV head (scope ``head``) only reads that head's own query
heads, which live on the same rank, so it needs no communication. A layer-wide decision (scope
``layer``: TOVA's ``tova`` preset, MorphKV, H2O with ``scope='layer'``) averages the weights of
*every* query head of the layer: each rank sums its local heads' weights per candidate, the sums
are ``all_sum``-ed over the group and divided by the global head count, so every rank holds the
unsharded model's weights and takes the same decision (ties go to the oldest position, so equal
weights give equal choices).

This module is the one place the core meets the group. The engine, the policies and their
rules never see it: the layer that holds it (:class:`velox_cache_core.layer.Layer`) enters
:func:`summing_over` around the calls it feeds the engine, and the rules average their heads
with :func:`decision_mean` (or over :func:`decision_group`), which span every rank's heads
for scope ``layer`` within it. Outside it, or with a group of one rank, nothing is
communicated and the arithmetic is the single-process one, bit for bit.

One ``all_sum`` per layer per decode step is a round trip through the group in the middle of
every layer. A decode step's decision is first needed when the *next* step writes over the
freed slot, so the layers of one forward pass can instead send their sums together
(:class:`StepSums`): each layer lays out its step once, builds it with a :class:`Recorder` in
place of the group (the attention does not depend on the decision), and once the pass's last
layer has arrived one ``all_sum`` carries every layer's sums and each layer decides again over
the same candidates with a :class:`Replay` of its share: the same decisions, one collective.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx


@runtime_checkable
class Group(Protocol):
    """What Velox reads of a tensor-parallel group: its size (an ``mx.distributed.Group``, or
    a stand-in with the same methods)."""

    def size(self) -> int: ...


def layer_group(group: Any, scope: str) -> Any:
    """The group a decision's head average spans: ``group`` for scope ``layer`` over two or
    more ranks, else ``None`` (rank-local)."""
    if group is None or scope != "layer" or group.size() == 1:
        return None
    return group


# the group the decisions taken now sum over (None: this process's heads only); a ContextVar,
# so that each thread (velox-serve's generation thread) has its own
_SUMMING: ContextVar[Any] = ContextVar("velox_cache_core_summing", default=None)


class summing_over:
    """``with summing_over(group):`` the layer-wide head averages of every decision taken in
    the block (:func:`decision_mean`) span the heads of every rank of ``group``: an
    ``mx.distributed.Group``, a :class:`Recorder` or :class:`Replay` standing in for one, or
    ``None`` (this process's heads only, what holds outside any block).

    A class, not a generator: the layer enters one per call it feeds the engine (about 0.8 us
    against 2 us for a generator)."""

    __slots__ = ("group", "token")

    def __init__(self, group: Any) -> None:
        self.group = group
        self.token: Token[Any] | None = None

    def __enter__(self) -> None:
        self.token = _SUMMING.set(self.group)

    def __exit__(self, *exc: object) -> None:
        assert self.token is not None
        _SUMMING.reset(self.token)
        self.token = None


def decision_group(scope: str) -> Any:
    """What a decision of ``scope`` averages its heads over now: the group of the enclosing
    :func:`summing_over` for scope ``layer`` over two or more ranks, else ``None``."""
    return layer_group(_SUMMING.get(), scope)


def decision_mean(x: mx.array, axis: int, scope: str) -> mx.array:
    """Mean of ``x`` over its head ``axis`` for a decision of ``scope`` (``[B, G, H_d, ...]``
    with ``axis`` 2 -> ``[B, G, ...]``): over every rank's heads within
    :func:`summing_over` for scope ``layer``, this process's heads otherwise."""
    return head_mean(x, axis, decision_group(scope))


def head_mean(x: mx.array, axis: int, group: Any = None) -> mx.array:
    """Mean of ``x`` over its head ``axis``, over the heads of every rank of ``group``.

    Without a group this is ``x.mean(axis)``. With one, the local sum is ``all_sum``-ed and
    divided by ``heads_here * group.size()``: exact because ``model.shard`` splits the heads
    evenly (it divides ``n_heads`` by the group size).
    """
    if group is None:
        return x.mean(axis=axis)
    total = x.shape[axis] * group.size()
    if isinstance(group, Replay):
        return group.take() / total
    local = x.sum(axis=axis)
    if isinstance(group, Recorder):
        group.sums.append(local)
        return local / total  # a placeholder: the caller decides again with a Replay
    return mx.distributed.all_sum(local, group=group) / total


class Recorder:
    """Stands in for ``group`` while a step is built before its sums exist: every
    :func:`head_mean` records its local head sum and returns it over the group's head count
    in place of the group's mean (a placeholder: what depends on it is decided again with a
    :class:`Replay`)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.sums: list[mx.array] = []

    def size(self) -> int:
        return int(self.group.size())


class Replay:
    """Stands in for ``group`` once the sums are known: the :func:`head_mean` calls of a step
    built again get the group's sums in the order a :class:`Recorder` took them."""

    def __init__(self, group: Any, sums: list[mx.array]) -> None:
        self.group = group
        self._sums = list(sums)

    def size(self) -> int:
        return int(self.group.size())

    def take(self) -> mx.array:
        if not self._sums:
            raise RuntimeError("the step asked for more head sums than were recorded")
        return self._sums.pop(0)


def all_sum_together(parts: list[mx.array], group: Any) -> list[mx.array]:
    """``[all_sum(p) for p in parts]`` in one collective: the parts (float32 head sums) are
    flattened, joined, summed over ``group`` once and split back into their shapes."""
    if not parts:
        return []
    total = mx.distributed.all_sum(mx.concatenate([p.reshape(-1) for p in parts]), group=group)
    out, start = [], 0
    for p in parts:
        out.append(total[start : start + p.size].reshape(p.shape))
        start += p.size
    return out


# finish(replay) decides a deferred step with its sums and returns arrays to evaluate with the
# forward pass that deferred it (its new state's, so they are not left lazy).
Finish = Callable[[Replay], list[mx.array]]


class StepSums:
    """One ``all_sum`` per forward pass for the layer-wide decisions of all ``layers`` layers
    of a tensor-parallel model (see the module docstring).

    A layer's cache calls :meth:`defer` with the sums its step recorded and a ``finish``
    callback, then :meth:`arrive` with its index (``0 .. layers - 1``, in the order the model
    runs them) once its attention is built. The last layer's arrival sends every deferred sum
    in one ``all_sum``, calls each ``finish`` with its share and returns what the callbacks
    returned, for the caller to tie to the pass's output (``mx.depends``). :meth:`flush` does
    the same at once; every rank must call it at the same point, like any collective.
    """

    def __init__(self, group: Any, layers: int) -> None:
        if not isinstance(group, Group):
            raise TypeError(f"group must be an mx.distributed.Group, got {type(group).__name__}")
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            raise ValueError(f"layers must be an int >= 1, got {layers!r}")
        self.group = group
        self.layers = layers
        self._pending: list[tuple[list[mx.array], Finish]] = []

    @property
    def pending(self) -> int:
        """How many layers wait for the next :meth:`flush`."""
        return len(self._pending)

    def defer(self, sums: list[mx.array], finish: Finish) -> None:
        self._pending.append((list(sums), finish))

    def arrive(self, layer: int) -> list[mx.array]:
        if not 0 <= layer < self.layers:
            raise ValueError(f"layer must be in [0, {self.layers}), got {layer}")
        return self.flush() if layer == self.layers - 1 else []

    def flush(self) -> list[mx.array]:
        pending, self._pending = self._pending, []
        parts = [s for sums, _ in pending for s in sums]
        summed = all_sum_together(parts, self.group)
        out: list[mx.array] = []
        start = 0
        for sums, finish in pending:
            out += finish(Replay(self.group, summed[start : start + len(sums)]))
            start += len(sums)
        return out
