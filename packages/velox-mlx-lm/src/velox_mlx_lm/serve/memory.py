"""``velox-serve --max-memory``: one bound on the KV bytes of live sequences and the prompt cache.

The bound counts what ``cache_bytes`` counts (kept rows, positions, running arrays, undo log),
not weights or activations. Each request is admitted at its *cost*, what its caches can grow
to (:class:`AdmissionCost`); the costs of admitted requests are reserved, and the prompt cache
is kept within what is left (:class:`BoundedPromptCache`, least-recently-used entries first).
A request that does not fit waits in a bounded FIFO queue, or is refused with 503 and
``Retry-After`` when the queue is full (:class:`MemoryGovernor`). Under ``mlx.launch`` every
rank loads its shard and measures its own geometry; rank 0 admits, so the bound is per rank.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from velox_cache_core import POLICIES, running_fields
from velox_mlx_lm.cache import PolicyKVCache
from velox_mlx_lm.serve.cache import VeloxPromptCache, cache_nbytes
from velox_mlx_lm.serve.errors import BadRequest

DEFAULT_FRACTION = 0.5  # of (machine RAM - weights), when --max-memory is not given
MARGIN = 1.25  # on the cost formula: policies' running arrays and bookkeeping
GROW_ROWS = 64  # rows a growing Velox store sets aside at a time (velox_cache_core.engine.GROW)
FULL_STEP = 256  # mlx-lm's KVCache allocates in steps of this many rows
DURATION_WEIGHT = 0.2  # of the newest request in the moving average of request durations
FIRST_DURATION_S = 1.0  # the average before any request has finished
SHUTTING_DOWN = "the server is shutting down"
UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "M": 10**6,
    "MB": 10**6,
    "G": 10**9,
    "GB": 10**9,
    "T": 10**12,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_max_memory(text: str) -> int | float:
    """``--max-memory``'s value: bytes (``6GB``, ``512MB``, ``1.5GiB``, ``1000000``) as an
    int, or a fraction in (0, 1) of the machine's RAM less the weights as a float."""
    match = _SIZE.match(str(text))
    if match is None or match.group(2).upper() not in UNITS:
        raise ValueError(
            f"--max-memory takes a size (6GB, 512MB, 1.5GiB, plain bytes) or a fraction in "
            f"(0, 1) of the RAM left after the weights; got {text!r}"
        )
    number, unit = float(match.group(1)), match.group(2).upper()
    if not unit and 0 < number < 1:
        return number
    size = int(number * UNITS[unit])
    if size < 1 or (not unit and not number.is_integer()):
        raise ValueError(
            f"--max-memory must be a size >= 1 byte or a fraction in (0, 1); got {text!r}"
        )
    return size


def machine_memory() -> int:
    """Bytes of physical memory on this machine."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError) as exc:
        raise ValueError(
            "cannot read this machine's memory size; give --max-memory as a size (e.g. 6GB)"
        ) from exc


def weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters (as loaded: quantized layers count packed)."""
    leaves: Any = tree_flatten(model.parameters())
    return sum(int(value.nbytes) for _, value in leaves)


def resolve_bound(spec: int | float | None, machine: int, weights: int) -> int:
    """The bound in bytes: a size as given; a fraction (default :data:`DEFAULT_FRACTION`) of
    ``machine - weights``."""
    if isinstance(spec, int):
        return spec
    fraction = DEFAULT_FRACTION if spec is None else spec
    free = machine - weights
    if free <= 0:
        raise ValueError(
            f"the model's weights ({weights / 1e9:.2f} GB) fill this machine's memory "
            f"({machine / 1e9:.2f} GB); give --max-memory as a size"
        )
    return max(1, int(fraction * free))


@dataclass(frozen=True)
class LayerGeometry:
    """One layer cache as the cost sees it.

    kind: ``"velox"`` (a Velox cache), ``"window"`` (bounded by ``max_size``, e.g. mlx-lm's
    ``RotatingKVCache``), ``"full"`` (mlx-lm's ``KVCache``) or ``"fixed"`` (a state of constant
    size, e.g. a recurrent layer's). row_bytes: keys + values of one token, all KV heads;
    query_row_bytes: one token's queries, all query heads (the undo log keeps a chunk's
    inputs); fixed_bytes: a ``"fixed"`` layer's bytes; max_size: a window's rows.
    """

    kind: str
    row_bytes: int = 0
    position_bytes: int = 0
    query_row_bytes: int = 0
    fixed_bytes: int = 0
    max_size: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    itemsize: int = 0


def _query_heads(model: Any, index: int, kv_heads: int) -> int:
    layers = getattr(model, "layers", [])
    attn = getattr(layers[index], "self_attn", None) if index < len(layers) else None
    for name in ("n_heads", "num_heads", "num_attention_heads"):
        value = getattr(attn, name, None)
        if isinstance(value, int):
            return value
    value = getattr(getattr(model, "args", None), "num_attention_heads", None)
    return value if isinstance(value, int) else kv_heads


def probe_geometry(model: Any) -> list[LayerGeometry]:
    """Each layer cache's geometry, read off the caches ``model.make_cache()`` builds after a
    one-token forward pass (so sharded heads, dtypes and head sizes are the real ones). Every
    rank of a distributed model must call it (the forward pass communicates)."""
    caches = model.make_cache()
    model(mx.array([[0]]), cache=caches)
    mx.eval([c.state for c in caches])
    layers = []
    for index, cache in enumerate(caches):
        keys: Any = getattr(cache, "keys", None)
        if not hasattr(keys, "shape") or len(keys.shape) != 4:
            layers.append(LayerGeometry("fixed", fixed_bytes=2 * cache_nbytes(cache)))
            continue
        _, kv_heads, _, head_dim = keys.shape
        itemsize = keys.dtype.size
        q_heads = _query_heads(model, index, kv_heads)
        geometry = {
            "row_bytes": 2 * kv_heads * head_dim * itemsize,
            "position_bytes": 8 * kv_heads,
            "query_row_bytes": q_heads * head_dim * itemsize,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "itemsize": itemsize,
        }
        if isinstance(cache, PolicyKVCache):
            layers.append(LayerGeometry("velox", **geometry))
        elif isinstance(getattr(cache, "max_size", None), int):
            layers.append(LayerGeometry("window", max_size=cache.max_size, **geometry))
        else:
            layers.append(LayerGeometry("full", **geometry))
    del caches
    return layers


class AdmissionCost:
    """What one request's caches can grow to, in bytes: ``cost(prompt_tokens, max_tokens)``.

    A Velox layer holds ``budget + 1`` rows (the dead slot of a decode step); a policy that
    grows after the prompt (``grows_after_prompt_end``) adds ``max_tokens`` and the rows a
    growing store sets aside, and one with a prompt-end step (a cut once the prompt is in)
    holds the whole prompt until then, as does an adaptive allocation that holds it for its cut
    (``holds_prompt``: TOVA and H2O with ``allocation="head"``). The undo log adds up to
    ``2 * trim_window`` rows with their queries, and for a policy with running scores per
    row (H2O) ``trim_window`` copies of them; a window of probe rows (MorphKV, Expected
    Attention) is held by the state and the log's newest entry; a demoted tier its bound
    (:meth:`velox_cache_core.TierSpec.max_nbytes`), twice while trims are on (the tier before
    the last call is kept for them). An mlx-lm ``KVCache`` (``--method full``)
    holds ``prompt + max_tokens`` rows in 256-row steps; a window ``max_size`` rows. The sum
    is taken times :data:`MARGIN`.
    """

    def __init__(self, layers: list[LayerGeometry], config: Any) -> None:
        self.layers = layers
        self.config = config
        policy = None if config.policy is None else POLICIES[config.policy]
        self.grows = bool(policy is not None and policy.grows_after_prompt_end)
        # a prompt-end step, or an adaptive allocation that holds the prompt until its end
        held = False
        self.scored = self.statistics = False
        self.history_rows = 0
        settings = config.settings()  # {} for the full cache
        if policy is not None and config.policy is not None:
            state = policy.init_for(config.method, **settings)
            held = bool(state.holds_prompt)
            running = running_fields(state)
            # running scores per row (H2O's): the undo log keeps them as they were before
            # each of its steps
            self.scored = "scores" in running
            # a window of probe rows (MorphKV's, Expected Attention's queries and their
            # statistics): the state's and the undo log's newest entry hold one each
            keep = settings.get("n_queries" if "queries" in running else "window")
            if "history" in running or "queries" in running:
                self.history_rows = int(keep) if isinstance(keep, int) else 0
            self.statistics = "cov" in running
        self.holds_prompt = bool(policy is not None and (policy.prompt_end is not None or held))
        budget = settings.get("budget")
        self.budget = int(budget) if isinstance(budget, int) else 0
        self.window = int(config.trim_window)

    def velox_rows(self, prompt_tokens: int, max_tokens: int) -> int:
        """Rows per KV head a Velox layer can hold at most."""
        rows = self.budget + 1
        if self.holds_prompt:
            rows = max(rows, prompt_tokens + 1)
        if self.grows:
            rows += max_tokens + GROW_ROWS
        return rows

    def layer_bytes(self, layer: LayerGeometry, prompt_tokens: int, max_tokens: int) -> int:
        if layer.kind == "fixed":
            return layer.fixed_bytes
        per_row = layer.row_bytes + layer.position_bytes
        if layer.kind == "window":
            return layer.max_size * per_row
        if layer.kind == "full":
            rows = math.ceil((prompt_tokens + max_tokens) / FULL_STEP) * FULL_STEP
            return rows * per_row
        undo = 2 * self.window * (layer.row_bytes + layer.query_row_bytes + layer.position_bytes)
        held_rows = self.velox_rows(prompt_tokens, max_tokens)
        if self.scored:  # float32 scores of every row, per KV head, before each step
            undo += self.window * 4 * layer.kv_heads * held_rows
        # the state's, and one more while trims are on (the log's newest entry; the tier
        # before the last call)
        copies = 2 if self.window else 1
        probe_row = layer.query_row_bytes
        if self.statistics:  # float32 queries, their mean and covariance
            probe_row = layer.query_row_bytes * 4 // max(layer.itemsize, 1)
            undo += (1 + layer.head_dim) * probe_row
        undo += copies * self.history_rows * probe_row
        rows = held_rows * per_row + undo
        tier = self.config.demote
        if tier is not None:  # the demoted tier's rows, and its copy before the last call
            rows += copies * tier.max_nbytes(layer.kv_heads, layer.head_dim, layer.itemsize)
        return rows

    def __call__(self, prompt_tokens: int, max_tokens: int) -> int:
        total = sum(self.layer_bytes(layer, prompt_tokens, max_tokens) for layer in self.layers)
        return math.ceil(total * MARGIN)


class MemoryGovernor:
    """Reserves admitted requests' costs against ``bound``; waiters queue FIFO, at most
    ``max_queue`` of them. Thread-safe; the HTTP threads call :meth:`admitted`."""

    def __init__(self, bound: int, max_queue: int) -> None:
        if not isinstance(bound, int) or bound < 1:
            raise ValueError(f"--max-memory must be >= 1 byte, got {bound!r}")
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"--max-queue must be an int >= 0, got {max_queue!r}")
        self.bound = bound
        self.max_queue = max_queue
        self.cond = threading.Condition()
        self.reserved = 0
        self.running = 0
        self.waiting: deque[object] = deque()
        self.refused = 0
        self.admitted_total = 0
        self.live_bytes = 0
        self.peak_used = 0
        self.mean_duration: float | None = None  # moving average of admitted requests' time
        self.closed = False  # shutting down: waiters and new requests get 503

    def retry_after(self) -> int:
        """Seconds a refused request should wait (``Retry-After``): the requests waiting, one
        more, times the moving average of a request's duration, divided by the requests running
        at once; at least 1, rounded up."""
        with self.cond:
            mean = FIRST_DURATION_S if self.mean_duration is None else self.mean_duration
            wait = (len(self.waiting) + 1) * mean / max(self.running, 1)
        return max(1, math.ceil(wait))

    def _overloaded(self, message: str) -> BadRequest:
        self.refused += 1
        headers = {"Retry-After": str(self.retry_after())}
        return BadRequest(message, 503, "overloaded", headers=headers)

    def close(self) -> None:
        """Shut down: the requests waiting in the queue, and any that come, get 503."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def acquire(self, cost: int) -> None:
        """Reserve ``cost`` bytes, waiting in the queue while they do not fit; raises
        :class:`BadRequest` (400) for a request larger than the bound and (503) when the
        queue is full."""
        if cost > self.bound:
            raise BadRequest(
                f"this request may hold {cost / 1e6:.1f} MB of KV cache, more than the "
                f"server's --max-memory bound of {self.bound / 1e6:.1f} MB: lower max_tokens "
                f"or the prompt",
                400,
                "request_too_large",
            )
        with self.cond:
            if self.closed:
                raise self._overloaded(SHUTTING_DOWN)
            if not self.waiting and self.reserved + cost <= self.bound:
                self._reserve(cost)
                return
            if len(self.waiting) >= self.max_queue:
                raise self._overloaded(
                    f"the server is at its memory bound and its queue is full "
                    f"({self.max_queue} waiting); retry later"
                )
            ticket = object()
            self.waiting.append(ticket)
            try:
                while self.waiting[0] is not ticket or self.reserved + cost > self.bound:
                    self.cond.wait()
                    if self.closed:
                        raise self._overloaded(SHUTTING_DOWN)
                self._reserve(cost)
            finally:
                self.waiting.remove(ticket)
                self.cond.notify_all()

    def _reserve(self, cost: int) -> None:
        self.reserved += cost
        self.running += 1
        self.admitted_total += 1

    def release(self, cost: int, duration: float | None = None) -> None:
        """Give back a request's ``cost``; ``duration``: its seconds since admission, for the
        moving average ``Retry-After`` is estimated from."""
        with self.cond:
            self.reserved -= cost
            self.running -= 1
            if duration is not None:
                old = self.mean_duration
                new = duration if old is None else old + DURATION_WEIGHT * (duration - old)
                self.mean_duration = new
            self.cond.notify_all()

    @contextmanager
    def admitted(self, cost: int) -> Iterator[None]:
        self.acquire(cost)
        start = time.monotonic()
        try:
            yield
        finally:
            self.release(cost, time.monotonic() - start)

    def room(self) -> int:
        """Bytes the prompt cache may hold now: the bound less the reserved costs."""
        with self.cond:
            return max(0, self.bound - self.reserved)

    def observe(self, live_bytes: int | None, prompt_cache_bytes: int) -> None:
        """Record the bytes held now (generation thread): live sequences + prompt cache."""
        if live_bytes is not None:
            self.live_bytes = live_bytes
        self.peak_used = max(self.peak_used, self.live_bytes + prompt_cache_bytes)

    def snapshot(self, prompt_cache_bytes: int) -> dict[str, Any]:
        with self.cond:
            return {
                "bound_bytes": self.bound,
                "used_bytes": self.live_bytes + prompt_cache_bytes,
                "live_bytes": self.live_bytes,
                "prompt_cache_bytes": prompt_cache_bytes,
                "peak_used_bytes": self.peak_used,
                "reserved_bytes": self.reserved,
                "running": self.running,
                "queue": {"waiting": len(self.waiting), "max": self.max_queue},
                "admitted": self.admitted_total,
                "refused_503": self.refused,
            }


class BoundedPromptCache(VeloxPromptCache):
    """:class:`VeloxPromptCache` that also keeps within ``room()`` bytes (the memory bound
    less the admitted requests' reserved costs), evicting least-recently-used entries first
    (mlx-lm's order), before a lookup and after every insert. Used by the generation thread
    only, like mlx-lm's ``LRUPromptCache``."""

    def __init__(
        self,
        max_size: int,
        max_bytes: int,
        *,
        room: Callable[[], int],
        on_change: Callable[[int], None] | None = None,
        on_insert: Callable[[list[int], list[Any], str], None] | None = None,
    ) -> None:
        super().__init__(max_size=max_size, max_bytes=max_bytes, on_insert=on_insert)
        self.room = room
        self.on_change = on_change

    def fit(self) -> None:
        self.trim_to(n_bytes=min(self.max_bytes, self.room()))
        if self.on_change is not None:
            self.on_change(self.nbytes)

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        self.fit()  # the new request is reserved: make its room before copying an entry
        return super().fetch_nearest_cache(model, tokens)

    def insert_cache(
        self,
        model: Any,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        self.fit()
