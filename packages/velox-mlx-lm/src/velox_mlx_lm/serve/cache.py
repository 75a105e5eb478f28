"""The server's prompt cache and its byte and token counts, with Velox caches in mind.

mlx-lm's ``LRUPromptCache`` assumes a trimmable cache trims any number of tokens: it reuses a
longer stored sequence by trimming it back, and drops a stored prefix once a longer trimmable
entry holds it. A Velox cache trims exactly, but only its last ``trim_window`` tokens (its undo
log), and an evicted row cannot come back. :class:`VeloxPromptCache` trims an entry only when
every layer can take back that many tokens exactly, keeps the prefixes it could not reach
again, counts the bytes a cache really holds (undo log included) against ``max_bytes``, and
always leaves at least one prompt token to feed (mlx-lm's ``BatchGenerator`` refuses an empty
prompt).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

from mlx_lm.models.cache import (
    CacheList,
    LRUPromptCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

from velox_mlx_lm.batch_cache import BatchVeloxKVCache
from velox_mlx_lm.cache import PolicyKVCache
from velox_mlx_lm.pins import pin_span
from velox_mlx_lm.serve.pins import PinTable

LOG = logging.getLogger("velox-serve")


def trimmable_tokens(caches: list[Any]) -> int:
    """How many of the last tokens every layer of ``caches`` can take back exactly."""
    reach = 1 << 62
    for cache in caches:
        if isinstance(cache, PolicyKVCache):
            reach = min(reach, cache.trimmable_tokens)
        elif callable(getattr(cache, "is_trimmable", None)) and cache.is_trimmable():
            reach = min(reach, int(cache.offset))  # mlx-lm's KVCache trims any suffix
        else:
            reach = 0
    return reach


def cache_nbytes(cache: Any) -> int:
    """Bytes one layer cache holds: for a Velox cache every array of its state (kept rows,
    positions, running scores, undo log); for mlx-lm's caches their ``nbytes`` (the allocation)."""
    if isinstance(cache, BatchVeloxKVCache):
        return sum(row["cache_bytes"] for row in cache.row_stats())
    if isinstance(cache, PolicyKVCache):
        return cache.held_nbytes
    return int(cache.nbytes)


def kept_rows(cache: Any) -> int:
    """Rows one layer cache keeps per KV head: a Velox cache's real rows (KVzip's pad slots
    left out), an mlx-lm cache's size."""
    return int(cache.tokens_kept if hasattr(cache, "tokens_kept") else cache.size())


def kv_stats(caches: list[Any]) -> dict[str, Any]:
    """One sequence's counters: tokens kept (the fullest layer), tokens seen, compression
    ratio, bytes of kept keys and values, and all bytes held (Velox: with the undo log)."""
    return combine_layers([layer_stats(c) for c in caches])


def layer_stats(cache: Any) -> dict[str, Any]:
    """One layer cache's counters (``tokens_seen`` is ``None`` where the offset is not an
    int), as ``BatchVeloxKVCache.row_stats`` gives them per row."""
    # tokens seen: a Velox cache's token index (its offset is compacted under compact positions)
    offset = (
        cache.token_offset if isinstance(cache, PolicyKVCache) else getattr(cache, "offset", None)
    )
    return {
        "tokens_seen": int(offset) if isinstance(offset, int) else None,
        "tokens_kept": kept_rows(cache),
        "pinned_tokens": cache.pinned_tokens if isinstance(cache, PolicyKVCache) else 0,
        "demoted_tokens": cache.demoted_tokens if isinstance(cache, PolicyKVCache) else 0,
        "kv_bytes": kept_bytes(cache),
        "cache_bytes": cache_nbytes(cache),
    }


def combine_layers(layers: list[dict[str, Any]]) -> dict[str, Any]:
    """A sequence's counters from its layers' (:func:`layer_stats`): the most seen and kept,
    the compression ratio of those, the bytes summed."""
    seen = [r["tokens_seen"] for r in layers if r["tokens_seen"] is not None]
    seen_max = max(seen) if seen else 0
    kept_max = max((r["tokens_kept"] for r in layers), default=0)
    return {
        "tokens_seen": seen_max,
        "tokens_kept": kept_max,
        "compression_ratio": round(seen_max / kept_max, 3) if kept_max else 1.0,
        "pinned_tokens": max((r.get("pinned_tokens", 0) for r in layers), default=0),
        "demoted_tokens": max((r.get("demoted_tokens", 0) for r in layers), default=0),
        "kv_bytes": sum(r["kv_bytes"] for r in layers),
        "cache_bytes": sum(r["cache_bytes"] for r in layers),
    }


def layer_roles(caches: list[Any]) -> dict[str, Any]:
    """Which layers evict (a Velox cache, alone or in a ``CacheList``) and which keep the
    model's own cache, by kind: ``{"evicting_layers": [5, 11, 17], "own_cache_layers":
    {"RotatingKVCache(max_size=512)": [0, 1, ...]}}`` for Gemma 3 270M."""
    evicting: list[int] = []
    own: dict[str, list[int]] = {}
    for i, cache in enumerate(caches):
        members = cache.caches if type(cache) is CacheList else [cache]
        if any(isinstance(m, PolicyKVCache | BatchVeloxKVCache) for m in members):
            evicting.append(i)
            continue
        kind = type(cache).__name__
        if isinstance(getattr(cache, "max_size", None), int):
            kind += f"(max_size={cache.max_size})"
        own.setdefault(kind, []).append(i)
    return {"evicting_layers": evicting, "own_cache_layers": own}


def kept_bytes(cache: Any) -> int:
    """Bytes of the kept keys and values: a Velox cache's rows as held (packed words, scales
    and biases when quantized); mlx-lm's ``KVCache`` and ``QuantizedKVCache`` allocate in
    256-token steps, so for them count the rows in use."""
    if isinstance(cache, PolicyKVCache):
        return cache.nbytes
    keys: Any = getattr(cache, "keys", None)
    values: Any = getattr(cache, "values", None)
    if not isinstance(getattr(cache, "offset", None), int) or keys is None:
        return int(cache.nbytes)
    arrays = [*keys, *values] if isinstance(keys, tuple) else [keys, values]
    allocated = int(arrays[0].shape[2])
    rows = min(int(cache.offset), allocated)  # QuantizedKVCache has no size()
    return int(sum(a.nbytes for a in arrays) * rows // max(allocated, 1))


class VeloxPromptCache(LRUPromptCache):
    """``LRUPromptCache`` whose reuse is exact for Velox caches (see the module docstring).

    ``on_insert(tokens, caches, cache_type)`` is called for every cache the server stores
    (``cache_type="assistant"``: a finished request's cache), before it is stored.
    """

    def __init__(
        self,
        max_size: int = 10,
        max_bytes: int = 1 << 63,
        on_insert: Callable[[list[int], list[Any], str], None] | None = None,
    ) -> None:
        super().__init__(max_size=max_size, max_bytes=max_bytes)
        self.on_insert = on_insert
        # the spans to pin, by prompt (filled by the request handler), and fresh caches for a
        # prompt nothing stored starts (serve/pins.py)
        self.pins = PinTable()
        self.make: Callable[[], list[Any]] | None = None

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        """The nearest stored cache (see the module docstring), its leading span pinned when
        the handler asked for one: a stored cache that lost some of that span is not reused."""
        cache, rest = self._nearest(model, tokens)
        span = self.pins.pop(tokens)
        if not span or self.make is None:
            return cache, rest
        if cache is not None:
            try:
                pin_span(cache, 0, span)
                return cache, rest
            except ValueError as exc:
                LOG.info("not reusing a stored cache: %s", exc)
        cache = self.make()
        pin_span(cache, 0, span)
        return cache, tokens

    def _nearest(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        # Look up all but the last token: the last one is always fed (it gives the logits).
        if len(tokens) < 2:
            return None, tokens
        wanted = tokens[:-1]
        result = self._trie.search(model, wanted)
        if result.exact is not None:
            entry = self._trie.get(result.model, result.exact)
            return copy.deepcopy(entry.prompt_cache), tokens[len(wanted) :]
        short = len(result.shorter) if result.shorter is not None else 0
        if result.longer is not None and result.common_prefix > short:
            entry = self._trie.get(result.model, result.longer)
            prefix = result.common_prefix
            extra = len(result.longer) - prefix
            if can_trim_prompt_cache(entry.prompt_cache) and (
                trimmable_tokens(entry.prompt_cache) >= extra
            ):
                cache = copy.deepcopy(entry.prompt_cache)
                trim_prompt_cache(cache, extra)
                return cache, tokens[prefix:]
        if short > 0:
            entry = self._trie.get(result.model, result.shorter or [])
            return copy.deepcopy(entry.prompt_cache), tokens[short:]
        return None, tokens

    def insert_cache(
        self,
        model: Any,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        if self.on_insert is not None:
            self.on_insert(tokens, prompt_cache, cache_type)
        entry = LRUPromptCache.CacheEntry(
            prompt_cache, sum(cache_nbytes(c) for c in prompt_cache), cache_type
        )
        self._n_bytes += entry.nbytes
        self._n_bytes_by_type[cache_type] += entry.nbytes
        prev = self._trie.add(model, tokens, entry)
        if prev is not None:
            self._forget(prev)
            self._lru.remove(model, tokens)
        self._lru.push(model, tokens, cache_type)
        # A stored prefix is redundant only if this entry can be trimmed back to it exactly.
        if can_trim_prompt_cache(prompt_cache):
            reach = trimmable_tokens(prompt_cache)
            for n in range(max(1, len(tokens) - reach), len(tokens)):
                try:
                    old = self._trie.get(model, tokens[:n])
                except KeyError:
                    continue
                self._trie.pop(model, tokens[:n])
                self._forget(old)
                self._lru.remove(model, tokens[:n])
        while len(self._lru) > self.max_size or self._n_bytes > self.max_bytes:
            if not len(self._lru):
                break
            model, tokens = self._lru.pop()
            self._forget(self._trie.pop(model, tokens))

    def _forget(self, entry: Any) -> None:
        self._n_bytes -= entry.nbytes
        self._n_bytes_by_type[entry.cache_type] -= entry.nbytes
