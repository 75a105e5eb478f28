"""TOVAKVCache: a per-layer mlx-lm cache that keeps at most ``budget`` tokens.

Protocol (``mlx_lm/models/cache.py``): the model reads ``offset`` for RoPE, calls
``update_and_fetch`` with rotated keys/values ``[B, H_kv, L, D]`` and attends over what it
returns. With the attention hook installed (``velox_mlx_lm.hook``) the attention call comes back
here (``attend``) with the true queries, which is where signal ``query`` decides and where the
per-layer, per-head masks of sequential prefill are applied.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from velox_cache_core.policies.tova import TovaState, TovaStep, init_tova_state, tova_update
from velox_cache_core.slots import KVSlots
from velox_cache_core.validation import check_kv

_warned_no_hook = False


def _warn_no_hook() -> None:
    global _warned_no_hook
    if not _warned_no_hook:
        _warned_no_hook = True
        warnings.warn(
            "TOVAKVCache was used without the attention hook (KVCacheBuilder.for_model installs "
            "it): signal 'query' has no queries there, so eviction fell back to signal 'key'.",
            RuntimeWarning,
            stacklevel=3,
        )


class VeloxKVCache(_BaseCache):
    """Marker base: the attention hook hands attention calls for these caches to ``attend``."""

    def attend(
        self, queries: mx.array, scale: float, mask: Any, sinks: mx.array | None
    ) -> mx.array:
        raise NotImplementedError

    @classmethod
    def merge(cls, caches: list[Any]) -> Any:
        raise ValueError(
            f"{cls.__name__} does not support batched generation (BatchGenerator, mlx_lm.server) "
            "yet: batches need per-row eviction with left padding. Generate one prompt at a "
            "time, or use method='full' for batched serving."
        )


class TOVAKVCache(VeloxKVCache):
    """TOVA eviction as an mlx-lm layer cache (see ``velox_cache_core.tova_update``)."""

    def __init__(
        self,
        budget: int = 512,
        n_sink: int = 4,
        signal: str | None = None,
        scope: str | None = None,
        prefill: str | None = None,
        preset: str = "tova",
    ) -> None:
        self._state = init_tova_state(budget, n_sink, signal, scope, prefill, preset)  # type: ignore[arg-type]
        self._pending: tuple[mx.array, mx.array] | None = None
        self._step: TovaStep | None = None

    # -- what users read -------------------------------------------------------------------
    @property
    def tova_state(self) -> TovaState:
        """The core state after every pending eviction (arrays stay lazy)."""
        self._settle()
        return self._state

    @property
    def settings(self) -> dict[str, Any]:
        return self._state.settings

    @property
    def offset(self) -> int:
        """True absolute position of the next token (tokens seen, not tokens kept)."""
        pending = 0 if self._pending is None else self._pending[0].shape[2]
        return self._state.offset + pending

    @property
    def tokens_seen(self) -> int:
        return self.tova_state.tokens_seen

    @property
    def tokens_kept(self) -> int:
        return self.tova_state.tokens_kept

    @property
    def compression_ratio(self) -> float:
        return self.tova_state.compression_ratio

    @property
    def nbytes(self) -> int:
        return self.tova_state.nbytes

    @property
    def positions(self) -> mx.array | None:
        """int32 ``[B, H_kv, n_kept]`` absolute positions of the retained tokens."""
        return self.tova_state.positions

    def size(self) -> int:
        return self.tova_state.n_kept

    def empty(self) -> bool:
        return self._state.slots is None and self._pending is None

    # -- the model's calls -------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``[B, H_kv, L, D]`` rotated keys/values; return ``retained + new``.

        Signal ``key`` decides right here; signal ``query`` waits for the queries in ``attend``
        (or, without the hook, for the next call, which then falls back to signal ``key``).
        """
        self._settle()
        if self._state.signal == "query":
            # Check now: a bad chunk must not become pending (it would shift offset and poison
            # the next call); tova_update checks the same when the queries arrive.
            slots = self._state.slots
            if slots is None:
                check_kv(keys, values, expect=None, dtype=None)
            else:
                B, H, _, D = slots.keys.shape
                check_kv(keys, values, expect=(B, H, D), dtype=slots.keys.dtype)
            self._pending = (keys, values)
            if self._state.slots is None:
                return keys, values
            live = self._state.slots.compact()
            return (
                mx.concatenate([live.keys, keys], axis=2),
                mx.concatenate([live.values, values], axis=2),
            )
        self._step = tova_update(self._state, keys, values, check_finite=False)
        self._state = self._step.state
        return self._step.keys, self._step.values

    def attend(
        self, queries: mx.array, scale: float, mask: Any, sinks: mx.array | None
    ) -> mx.array:
        """Attention of ``queries [B, H_q, L, D]`` over this call's candidates, policy mask."""
        if self._pending is not None:
            keys, values = self._pending
            self._pending = None
            step = tova_update(self._state, keys, values, queries, scale, check_finite=False)
            self._state = step.state
        elif self._step is not None:
            step = self._step
        else:
            raise RuntimeError("attend() called before update_and_fetch()")
        self._step = None
        policy_mask = step.mask
        if policy_mask is not None and policy_mask.shape[1] not in (1, queries.shape[1]):
            policy_mask = mx.repeat(policy_mask, queries.shape[1] // policy_mask.shape[1], axis=1)
        return mx.fast.scaled_dot_product_attention(
            queries, step.keys, step.values, scale=scale, mask=policy_mask, sinks=sinks
        )

    def _settle(self) -> None:
        """Apply a chunk the hook never saw (no queries): evict by signal ``key``."""
        self._step = None
        if self._pending is None:
            return
        _warn_no_hook()
        keys, values = self._pending
        self._pending = None
        by_key = replace(self._state, signal="key")
        step = tova_update(by_key, keys, values, check_finite=False)
        self._state = replace(step.state, signal=self._state.signal)

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> Any:
        """Causal mask over ``retained + N`` (what the model sees without the hook)."""
        if window_size is not None:
            raise ValueError(
                f"TOVAKVCache cannot serve a sliding-window layer (window_size={window_size}); "
                "keep mlx-lm's RotatingKVCache there (KVCacheBuilder.for_model does)."
            )
        if N == 1:
            return None
        if not return_array:
            return "causal"
        n_kept = self.tova_state.n_kept
        return mx.arange(n_kept + N)[None, :] <= (mx.arange(N) + n_kept)[:, None]

    # -- trimming, serialisation ---------------------------------------------------------------
    def is_trimmable(self) -> bool:
        """False: after an eviction the last appends cannot all be undone exactly."""
        return False

    def trim(self, n: int) -> int:
        """Undo the last ``n`` appends; only possible while nothing has been evicted."""
        state = self.tova_state
        if n == 0:
            return 0
        if state.slots is None or state.n_kept != state.offset or not 0 < n <= state.offset:
            raise ValueError(
                f"cannot trim {n} tokens from a TOVA cache that has evicted tokens or holds fewer "
                "(eviction is not reversible; speculative decoding needs method='full')"
            )
        keep = state.offset - n
        s = state.slots
        slots = KVSlots(s.keys[:, :, :keep], s.values[:, :, :keep], s.positions[:, :, :keep])
        self._state = replace(state, slots=slots, offset=keep)
        return n

    @property
    def state(self) -> dict[str, Any]:  # type: ignore[override]
        """Arrays and scalars only (``mx.eval``-ed after prefill chunks, saved by mlx-lm)."""
        st = self.tova_state
        slots = st.slots
        return {
            "keys": None if slots is None else slots.keys,
            "values": None if slots is None else slots.values,
            "positions": None if slots is None else slots.positions,
            "free": None if slots is None else slots.free,
            "offset": st.offset,
            "tokens_seen": st.tokens_seen,
            "settings": json.dumps(st.settings, sort_keys=True),
        }

    @state.setter
    def state(self, v: dict[str, Any]) -> None:
        settings = json.loads(v["settings"])
        state = init_tova_state(**settings)
        if v["keys"] is not None:
            slots = KVSlots(v["keys"], v["values"], v["positions"].astype(mx.int32), v["free"])
            if slots.n_slots > state.budget + (0 if slots.free is None else 1):
                raise ValueError(f"saved TOVA state holds more rows than budget {state.budget}")
            state = replace(state, slots=slots)
        self._state = replace(state, offset=int(v["offset"]), tokens_seen=int(v["tokens_seen"]))
        self._pending = None
        self._step = None
