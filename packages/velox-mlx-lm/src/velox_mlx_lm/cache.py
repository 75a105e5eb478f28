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
import mlx_lm.models.cache as _mlx_cache
from mlx_lm.models.cache import _BaseCache

from velox_cache_core.engine import Step
from velox_cache_core.registry import POLICIES, Policy
from velox_cache_core.state import attention_fields, running_fields
from velox_cache_core.validation import check_kv

_warned_no_hook: set[str] = set()


def _encode(state: Any) -> dict[str, Any]:
    """Policy state -> arrays and one JSON string (what mlx-lm can save and ``mx.eval``).

    Settings and scalar running fields go to the JSON string; an array field is saved under its
    name, a dataclass of arrays (slots, history) as ``<field>_<member>``; ``None`` stays ``None``.
    """
    out: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    arrays = set(running_fields(state))
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if dataclasses.is_dataclass(value):
            for member in dataclasses.fields(value):
                out[f"{f.name}_{member.name}"] = getattr(value, member.name)
        elif isinstance(value, mx.array) or (value is None and f.name in arrays):
            out[f.name] = value
        else:
            meta[f.name] = value
    out["meta"] = json.dumps(meta, sort_keys=True)
    return out


def _array_type(state_type: type, name: str) -> type | None:
    """The dataclass a running field holds (slots, history), from its type annotation."""
    import typing

    hint = typing.get_type_hints(state_type).get(name)
    for arg in typing.get_args(hint) or (hint,):
        if dataclasses.is_dataclass(arg):
            return arg  # type: ignore[return-value]
    return None


def _decode(policy: Policy, data: dict[str, Any]) -> Any:
    meta = json.loads(data["meta"])
    state_type = policy.state_type
    fields = {f.name for f in dataclasses.fields(state_type)}
    unknown = set(meta) - fields
    if unknown:
        raise ValueError(f"saved {policy.name} state has unknown fields {sorted(unknown)}")
    running = set(running_fields(state_type))
    changes = {k: meta.pop(k) for k in running if k in meta}
    state = policy.init(**meta)  # validates the settings
    for name in running - set(changes):
        member_type = _array_type(state_type, name)
        if member_type is None:
            value = data.get(name)
        else:
            members = {
                m.name: data.get(f"{name}_{m.name}") for m in dataclasses.fields(member_type)
            }
            first = dataclasses.fields(member_type)[0].name
            value = None if members[first] is None else member_type(**members)
        if value is not None:
            changes[name] = value
    after = replace(state, **changes)
    if policy.prompt_end is None and after.n_kept > after.budget:
        raise ValueError(
            f"saved {policy.name} state holds more rows ({after.n_kept}) than budget {after.budget}"
        )
    return after


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
    """A core policy (``velox_cache_core.POLICIES[policy_name]``) as an mlx-lm layer cache.

    One subclass per registered policy (:func:`cache_class`); each is registered by name in
    ``mlx_lm.models.cache``, where ``load_prompt_cache`` looks classes up.
    """

    policy_name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "policy_name" in cls.__dict__:
            _CLASSES[cls.policy_name] = cls
            setattr(_mlx_cache, cls.__name__, cls)

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
        """Once a call's attention is built: the first single-token call ends the prompt
        (mlx-lm feeds the prompt's last token alone before decoding)."""
        if length == 1 and self._policy.prompt_end is not None:
            return self._policy.prompt_end(state)
        return state

    def finish_prefill(self) -> None:
        """End the prompt now (for callers that do not end it with a 1-token call); a no-op
        for policies without a prompt-end step (SnapKV's cut)."""
        self._settle()
        self._state = self._policy.end_prompt(self._state)

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
        carries = any(getattr(state, name) is not None for name in attention_fields(state))
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
        slots = replace(
            s,
            keys=s.keys[:, :, :keep],
            values=s.values[:, :, :keep],
            positions=s.positions[:, :, :keep],
        )
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


_CLASSES: dict[str, type[PolicyKVCache]] = {}


def cache_class(policy_name: str) -> type[PolicyKVCache]:
    """The mlx-lm cache class of a registered policy (made and registered on first use)."""
    if policy_name not in POLICIES:
        raise ValueError(f"no registered policy {policy_name!r}; registered: {sorted(POLICIES)}")
    if policy_name not in _CLASSES:
        name = "".join(part.capitalize() for part in policy_name.split("_")) + "KVCache"
        type(name, (PolicyKVCache,), {"policy_name": policy_name, "__module__": __name__})
    return _CLASSES[policy_name]


class TOVAKVCache(PolicyKVCache):
    """TOVA eviction as an mlx-lm layer cache (see ``velox_cache_core.tova_update``)."""

    policy_name = "tova"

    @property
    def tova_state(self) -> Any:
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
