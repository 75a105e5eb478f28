"""Velox caches for mlx-lm: one layer cache class per core policy, on one implementation.

Protocol (``mlx_lm/models/cache.py``): the model reads ``offset`` for RoPE, calls
``update_and_fetch`` with rotated keys/values ``[B, H_kv, L, D]`` and attends over what it
returns. With the attention hook installed (``velox_mlx_lm.hook``) the attention call comes back
here (``attend``) with the true queries: a policy that reads them (signal ``query``) decides
there, and the per-layer, per-head masks of sequential prefill are applied there. Any other
policy decides at once in ``update_and_fetch``. Without the hook a pending query-signal chunk is
settled at the next call with signal ``key`` (and a warning). State round-trips through
mlx-lm's prompt-cache files as arrays plus one JSON string of scalars.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import replace
from typing import Any, ClassVar

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from velox_cache_core.current_step import History
from velox_cache_core.engine import RUNNING_FIELDS, Step
from velox_cache_core.policies import POLICIES, Policy, snapkv_compress
from velox_cache_core.policies.tova import TovaState
from velox_cache_core.slots import KVSlots
from velox_cache_core.validation import check_kv

_warned_no_hook: set[str] = set()


def _encode(state: Any) -> dict[str, Any]:
    """Policy state -> arrays and one JSON string (what mlx-lm can save and ``mx.eval``)."""
    out: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if f.name == "slots":
            for name in ("keys", "values", "positions", "free"):
                out[f"slots_{name}"] = None if value is None else getattr(value, name)
        elif f.name == "history":
            out["history_probes"] = None if value is None else value.probes
            out["history_positions"] = None if value is None else value.positions
        elif isinstance(value, mx.array) or (value is None and f.name == "scores"):
            out[f.name] = value
        else:
            meta[f.name] = value
    out["meta"] = json.dumps(meta, sort_keys=True)
    return out


def _decode(policy: Policy, data: dict[str, Any]) -> Any:
    meta = json.loads(data["meta"])
    settings_fields = {f.name for f in dataclasses.fields(policy.state_type)}
    counters = {k: meta.pop(k) for k in RUNNING_FIELDS if k in meta}
    unknown = set(meta) - settings_fields
    if unknown:
        raise ValueError(f"saved {policy.name} state has unknown fields {sorted(unknown)}")
    state = policy.init(**meta)  # validates the settings
    changes: dict[str, Any] = dict(counters)
    if data.get("slots_keys") is not None:
        slots = KVSlots(
            data["slots_keys"],
            data["slots_values"],
            data["slots_positions"].astype(mx.int32),
            None if data.get("slots_free") is None else data["slots_free"].astype(mx.int32),
        )
        grows = getattr(state, "compressed", False) or policy.name == "snapkv"
        if not grows and slots.n_kept > state.budget:
            raise ValueError(
                f"saved {policy.name} state holds more rows ({slots.n_kept}) than budget "
                f"{state.budget}"
            )
        changes["slots"] = slots
    if data.get("history_probes") is not None:
        changes["history"] = History(
            data["history_probes"], data["history_positions"].astype(mx.int32)
        )
    if "scores" in settings_fields and data.get("scores") is not None:
        changes["scores"] = data["scores"]
    return replace(state, **changes)


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


class PolicyKVCache(VeloxKVCache):
    """A core policy (``velox_cache_core.POLICIES[policy_name]``) as an mlx-lm layer cache."""

    policy_name: ClassVar[str]

    def __init__(self, **settings: Any) -> None:
        self._state = self._policy.init(**settings)
        self._pending: tuple[mx.array, mx.array] | None = None
        self._step: Step | None = None
        self._step_length = 0

    @property
    def _policy(self) -> Policy:
        return POLICIES[self.policy_name]

    # -- what users read -------------------------------------------------------------------
    @property
    def policy_state(self) -> Any:
        """The core state after every pending decision (arrays stay lazy)."""
        self._settle()
        return self._state

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self._state.settings)

    @property
    def offset(self) -> int:
        """True absolute position of the next token (tokens seen, not tokens kept)."""
        pending = 0 if self._pending is None else self._pending[0].shape[2]
        return int(self._state.offset) + pending

    @property
    def tokens_seen(self) -> int:
        return int(self.policy_state.tokens_seen)

    @property
    def tokens_kept(self) -> int:
        return int(self.policy_state.tokens_kept)

    @property
    def compression_ratio(self) -> float:
        return float(self.policy_state.compression_ratio)

    @property
    def nbytes(self) -> int:
        return int(self.policy_state.nbytes)

    @property
    def positions(self) -> mx.array | None:
        """int32 ``[B, H_kv, n_kept]`` absolute positions of the retained tokens."""
        return self.policy_state.positions

    def size(self) -> int:
        return int(self.policy_state.n_kept)

    def empty(self) -> bool:
        return self._state.slots is None and self._pending is None

    # -- the model's calls -------------------------------------------------------------------
    def _defers(self) -> bool:
        return getattr(self._state, "signal", None) == "query"

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``[B, H_kv, L, D]`` rotated keys/values; return ``retained + new``."""
        self._settle()
        if self._defers():
            slots = self._state.slots
            expect = None if slots is None else (*slots.keys.shape[:2], slots.keys.shape[3])
            check_kv(keys, values, expect=expect, dtype=None if slots is None else slots.keys.dtype)
            self._pending = (keys, values)
            if slots is None:
                return keys, values
            live = slots.compact()
            return (
                mx.concatenate([live.keys, keys], axis=2),
                mx.concatenate([live.values, values], axis=2),
            )
        self._step = self._policy.update(self._state, keys, values, check_finite=False)
        self._step_length = keys.shape[2]
        self._state = self._step.state
        return self._step.keys, self._step.values

    def attend(
        self, queries: mx.array, scale: float, mask: Any, sinks: mx.array | None
    ) -> mx.array:
        """Attention of ``queries [B, H_q, L, D]`` over this call's candidates, policy mask."""
        if self._pending is not None:
            keys, values = self._pending
            self._pending = None
            step = self._policy.update(
                self._state, keys, values, queries, scale, check_finite=False
            )
        elif self._step is not None:
            step = self._step
        else:
            raise RuntimeError("attend() called before update_and_fetch()")
        self._step = None
        self._state = self._after_call(step.state, queries.shape[2])
        policy_mask = step.mask
        if policy_mask is not None and policy_mask.shape[1] not in (1, queries.shape[1]):
            policy_mask = mx.repeat(policy_mask, queries.shape[1] // policy_mask.shape[1], axis=1)
        return mx.fast.scaled_dot_product_attention(
            queries, step.keys, step.values, scale=scale, mask=policy_mask, sinks=sinks
        )

    def _after_call(self, state: Any, length: int) -> Any:
        """Policy hook run once a call's attention is built (SnapKV's prompt end)."""
        return state

    def _settle(self) -> None:
        """Decide a chunk the hook never saw: signal ``key`` stands in for the queries."""
        if self._step is not None:  # decided in update_and_fetch, attention never came back
            self._state = self._after_call(self._state, self._step_length)
        self._step = None
        if self._pending is None:
            return
        if self.policy_name not in _warned_no_hook:
            _warned_no_hook.add(self.policy_name)
            warnings.warn(
                f"{type(self).__name__} was used without the attention hook "
                "(KVCacheBuilder.for_model installs it): eviction fell back to signal 'key'.",
                RuntimeWarning,
                stacklevel=3,
            )
        keys, values = self._pending
        self._pending = None
        signal = self._state.signal
        step = self._policy.update(
            replace(self._state, signal="key"), keys, values, check_finite=False
        )
        self._state = self._after_call(replace(step.state, signal=signal), keys.shape[2])

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        """Causal mask over ``retained + N`` (what the model sees without the hook)."""
        if window_size is not None:
            raise ValueError(
                f"{type(self).__name__} cannot serve a sliding-window layer "
                f"(window_size={window_size}); keep mlx-lm's RotatingKVCache there "
                "(KVCacheBuilder.for_model does)."
            )
        if N == 1:
            return None
        if not return_array:
            return "causal"
        n_kept = self.policy_state.n_kept
        return mx.arange(n_kept + N)[None, :] <= (mx.arange(N) + n_kept)[:, None]

    def is_trimmable(self) -> bool:
        """False: evictions cannot be undone, so the last appends cannot always be trimmed."""
        return False

    def trim(self, n: int) -> int:
        """Undo the last ``n`` appends; only while nothing has been evicted, and only for
        policies whose state is just the slots (TOVA, StreamingLLM): running scores (H2O) or
        remembered queries (MorphKV, SnapKV) already hold the trimmed tokens' attention."""
        state = self.policy_state
        if n == 0:
            return 0
        carries = any(getattr(state, name, None) is not None for name in ("scores", "history"))
        if (
            carries
            or state.slots is None
            or state.n_kept != state.offset
            or not 0 < n <= state.offset
        ):
            raise ValueError(
                f"cannot trim {n} tokens from this {type(self).__name__}: eviction is not "
                "reversible, and running scores or remembered queries cannot be rolled back "
                "(speculative decoding needs method='full')"
            )
        keep = state.offset - n
        s = state.slots
        slots = KVSlots(s.keys[:, :, :keep], s.values[:, :, :keep], s.positions[:, :, :keep])
        self._state = replace(state, slots=slots, offset=keep)
        return n

    @property
    def state(self) -> dict[str, Any]:
        """Arrays and one JSON string (``mx.eval``-ed after prefill chunks, saved by mlx-lm)."""
        return _encode(self.policy_state)

    @state.setter
    def state(self, v: dict[str, Any]) -> None:
        self._state = _decode(self._policy, v)
        self._pending = None
        self._step = None
        self._step_length = 0


class TOVAKVCache(PolicyKVCache):
    """TOVA eviction as an mlx-lm layer cache (see ``velox_cache_core.tova_update``)."""

    policy_name = "tova"

    def __init__(
        self,
        budget: int = 512,
        n_sink: int = 4,
        signal: str | None = None,
        scope: str | None = None,
        prefill: str | None = None,
        preset: str = "tova",
    ) -> None:
        super().__init__(
            budget=budget, n_sink=n_sink, signal=signal, scope=scope, prefill=prefill, preset=preset
        )

    @property
    def tova_state(self) -> TovaState:
        """The core state after every pending eviction (arrays stay lazy)."""
        return self.policy_state


class H2OKVCache(PolicyKVCache):
    """H2O: evict the lowest accumulated attention (sinks and a recent window kept)."""

    policy_name = "h2o"


class StreamingLLMKVCache(PolicyKVCache):
    """StreamingLLM: sinks plus the most recent tokens."""

    policy_name = "streaming_llm"


class MorphKVCache(PolicyKVCache):
    """MorphKV: TOVA's weights fused over the last ``window`` queries."""

    policy_name = "morphkv"


class SnapKVCache(PolicyKVCache):
    """SnapKV: cut the prompt once at its end, then grow.

    The prompt ends with the first single-token call (mlx-lm feeds the prompt's last token
    alone before decoding), or when ``finish_prefill()`` is called.
    """

    policy_name = "snapkv"

    def _after_call(self, state: Any, length: int) -> Any:
        if length == 1 and not state.compressed:
            return snapkv_compress(state)
        return state

    def finish_prefill(self) -> None:
        """Compress the prompt now (for callers that do not end it with a 1-token call)."""
        self._settle()
        self._state = snapkv_compress(self._state)
