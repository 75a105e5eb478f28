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

from velox_cache_core.attention import attend as attend_step
from velox_cache_core.attention_rule import History
from velox_cache_core.distributed import Recorder, Replay, StepSums
from velox_cache_core.engine import Laid, Step, decide, prepare
from velox_cache_core.registry import POLICIES, Policy
from velox_cache_core.slots import KVSlots, stored_fields
from velox_cache_core.state import running_fields
from velox_cache_core.undo import Entry, UndoLog, new_log
from velox_cache_core.validation import check_kv

_warned_no_hook: set[str] = set()

# Tokens a cache can take back by default: mlx-lm's speculative decoding trims up to
# num_draft_tokens (2 by default, 3 on its command line) per round.
TRIM_WINDOW = 16
# Queries per internal sub-chunk of a long sequential-mode chunk (mlx-lm prefills 2048 at once).
SUBCHUNK = 256


def _pack(value: Any, key: str, arrays: dict[str, mx.array]) -> Any:
    """A JSON skeleton of ``value`` whose arrays go to ``arrays`` (under ``key``-based names):
    dataclasses (by type name), tuples, dicts, arrays and JSON scalars."""
    if isinstance(value, mx.array):
        arrays[key] = value
        return {"array": key}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            "type": type(value).__name__,
            "fields": {
                f.name: _pack(getattr(value, f.name), f"{key}_{f.name}", arrays)
                for f in stored_fields(value)
            },
        }
    if isinstance(value, tuple):
        return {"tuple": [_pack(v, f"{key}_{i}", arrays) for i, v in enumerate(value)]}
    if isinstance(value, dict):
        return {"dict": {k: _pack(v, f"{key}_{k}", arrays) for k, v in value.items()}}
    return {"value": value}


_PACKED_TYPES = {t.__name__: t for t in (KVSlots, History, Entry, UndoLog)}


def _unpack(skeleton: Any, data: dict[str, Any]) -> Any:
    if "array" in skeleton:
        return data[skeleton["array"]]
    if "type" in skeleton:
        fields = {k: _unpack(v, data) for k, v in skeleton["fields"].items()}
        return _PACKED_TYPES[skeleton["type"]](**fields)
    if "tuple" in skeleton:
        return tuple(_unpack(v, data) for v in skeleton["tuple"])
    if "dict" in skeleton:
        return {k: _unpack(v, data) for k, v in skeleton["dict"].items()}
    return skeleton["value"]


def _encode(state: Any, log: UndoLog | None) -> dict[str, Any]:
    """Policy state and undo log -> arrays and one JSON string (what mlx-lm can save and
    ``mx.eval``).

    Settings and scalar running fields go to the JSON string; an array field is saved under its
    name, a dataclass of arrays (slots, history) as ``<field>_<member>``; ``None`` stays ``None``.
    The undo log is packed under ``undo_*`` names with its skeleton in the JSON string.
    """
    out: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    arrays = set(running_fields(state))
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if dataclasses.is_dataclass(value):
            for member in stored_fields(value):
                out[f"{f.name}_{member.name}"] = getattr(value, member.name)
        elif isinstance(value, mx.array) or (value is None and f.name in arrays):
            out[f.name] = value
        else:
            meta[f.name] = value
    undo: dict[str, mx.array] = {}
    skeleton = None if log is None else _pack(log, "undo", undo)
    out.update(undo)
    out["meta"] = json.dumps({**meta, "undo": skeleton}, sort_keys=True)
    return out


def _array_type(state_type: type, name: str) -> type | None:
    """The dataclass a running field holds (slots, history), from its type annotation."""
    import typing

    hint = typing.get_type_hints(state_type).get(name)
    for arg in typing.get_args(hint) or (hint,):
        if dataclasses.is_dataclass(arg):
            return arg  # type: ignore[return-value]
    return None


def _decode(policy: Policy, data: dict[str, Any]) -> tuple[Any, UndoLog | None]:
    meta = json.loads(data["meta"])
    skeleton = meta.pop("undo", None)
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
            members = {m.name: data.get(f"{name}_{m.name}") for m in stored_fields(member_type)}
            first = stored_fields(member_type)[0].name
            value = None if members[first] is None else member_type(**members)
        if value is not None:
            changes[name] = value
    after = replace(state, **changes)
    if policy.prompt_end is None and after.n_kept > after.budget:
        raise ValueError(
            f"saved {policy.name} state holds more rows ({after.n_kept}) than budget {after.budget}"
        )
    return after, None if skeleton is None else _unpack(skeleton, data)


class _Shared:
    """Holds an object that copies of a cache share instead of copying (an
    ``mx.distributed.Group`` cannot be deep-copied, and mlx-lm's server deep-copies caches)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __copy__(self) -> _Shared:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _Shared:
        return self


class VeloxKVCache(_BaseCache):
    """Marker base: the attention hook hands attention calls for these caches to ``attend``."""

    def attend(
        self, queries: mx.array, scale: float, mask: Any, sinks: mx.array | None
    ) -> mx.array:
        raise NotImplementedError

    @classmethod
    def merge(cls, caches: list[Any]) -> Any:
        """One batched cache (``velox_mlx_lm.batch_cache``) from single-sequence caches of one
        layer, as ``mlx_lm.generate.BatchGenerator`` asks; the caches are not changed."""
        from velox_mlx_lm.batch_cache import merge

        return merge(caches)


class PolicyKVCache(VeloxKVCache):
    """A core policy (``velox_cache_core.POLICIES[policy_name]``) as an mlx-lm layer cache.

    One subclass per registered policy (:func:`cache_class`); each is registered by name in
    ``mlx_lm.models.cache``, where ``load_prompt_cache`` looks classes up.
    """

    policy_name: ClassVar[str]
    # Class defaults: a cache rebuilt by ``from_state`` (a loaded prompt cache) skips __init__.
    _group_ref: _Shared | None = None
    _sums_ref: _Shared | None = None  # the model's StepSums, shared by its layers' caches
    _layer = 0  # this cache's index among them
    _deferred: Laid | None = None  # a decode step waiting for the pass's one all_sum

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "policy_name" in cls.__dict__:
            _CLASSES[cls.policy_name] = cls
            setattr(_mlx_cache, cls.__name__, cls)

    def __init__(self, trim_window: int = TRIM_WINDOW, group: Any = None, **settings: Any) -> None:
        self._state = self._policy.init(**settings)
        self._log = new_log(trim_window)
        self._pending: tuple[mx.array, mx.array] | None = None
        self._step: Step | None = None
        self._step_length = 0
        self.group = group

    @property
    def group(self) -> Any:
        """The tensor-parallel group (``mx.distributed.Group``) of a sharded model's layer, or
        ``None``: layer-wide decisions ``all_sum`` the heads' weights over it (see
        ``docs/distributed.md``). A group of one rank is stored as ``None``."""
        return None if self._group_ref is None else self._group_ref.value

    @group.setter
    def group(self, group: Any) -> None:
        if group is not None and not callable(getattr(group, "size", None)):
            raise TypeError(f"group must be an mx.distributed.Group, got {type(group).__name__}")
        self._settle()
        self._group_ref = None if group is None or group.size() == 1 else _Shared(group)
        self._sums_ref = None

    @property
    def step_sums(self) -> StepSums | None:
        """The :class:`velox_cache_core.distributed.StepSums` this cache's decode steps send
        their layer-wide sums through (one ``all_sum`` per forward pass for all layers), or
        ``None``: one ``all_sum`` per layer. ``KVCacheBuilder.for_model`` sets it."""
        return None if self._sums_ref is None else self._sums_ref.value

    def share_step_sums(self, sums: StepSums | None, layer: int = 0) -> None:
        """Send this cache's decode-step sums through ``sums`` as layer ``layer`` of the model
        (``None``: one ``all_sum`` per layer again). ``sums.group`` must be this cache's."""
        if sums is not None:
            if not isinstance(sums, StepSums):
                raise TypeError(f"sums must be a StepSums, got {type(sums).__name__}")
            if sums.group is not self.group:
                raise ValueError("sums must communicate over this cache's group")
            if not isinstance(layer, int) or not 0 <= layer < sums.layers:
                raise ValueError(f"layer must be an int in [0, {sums.layers}), got {layer!r}")
        self._settle()
        self._sums_ref = None if sums is None else _Shared(sums)
        self._layer = layer

    def _feed(
        self,
        state: Any,
        keys: mx.array,
        values: mx.array,
        queries: mx.array | None = None,
        scale: float | None = None,
    ) -> Step:
        """One core update, recorded in the undo log."""
        step = self._policy.update(
            state, keys, values, queries, scale, False, self._log, self.group
        )
        self._log = step.log
        return step

    @property
    def _policy(self) -> Policy:
        return POLICIES[self.policy_name]

    def _quiet(self) -> bool:
        """No call in flight, no deferred decision and no shared step sums: the state can be
        handed to a batched cache that decodes its rows packed (``batch_cache``)."""
        return (
            self._pending is None
            and self._step is None
            and self._deferred is None
            and self._sums_ref is None
        )

    def _restore(self, state: Any, log: UndoLog | None) -> None:
        """Take back the state and undo log a packed batch decoded for this row."""
        self._state, self._log = state, log

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
        return int(self._state.offset) + pending + (self._deferred is not None)

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

    @property
    def keys(self) -> mx.array | None:
        """``[B, H_kv, n_kept, D]`` retained keys (``None`` while empty)."""
        return self.policy_state.keys

    @keys.setter
    def keys(self, value: Any) -> None:
        """Tie ``value`` to the stored keys without changing them.

        mlx-lm's pipeline-parallel models end a rank's forward pass with
        ``cache[-1].keys = mx.depends(cache[-1].keys, h)`` so that evaluating the caches' state
        (as prefill does after every chunk) also runs the ``send`` of ``h`` to the next rank.
        The retained rows stay exactly what they were; only the dependency is kept.
        """
        self._settle()
        slots = self._state.slots
        if slots is None or not isinstance(value, mx.array):
            return
        tied = mx.depends([slots.keys], [value])[0]
        self._state = replace(self._state, slots=replace(slots, keys=tied))

    def size(self) -> int:
        return int(self.policy_state.n_kept)

    def empty(self) -> bool:
        return self._state.slots is None and self._pending is None and self._deferred is None

    # -- the model's calls -------------------------------------------------------------------
    def _defers(self, length: int) -> bool:
        """Whether to decide in ``attend`` (with the queries): always for signal ``query``,
        and for every chunk, which ``attend`` may split (see ``SUBCHUNK``)."""
        return length > 1 or getattr(self._state, "signal", None) == "query"

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``[B, H_kv, L, D]`` rotated keys/values; return ``retained + new`` (for one
        token written over an evicted slot: the same rows in slot order)."""
        self._settle()
        if self._defers(keys.shape[2]):
            slots = self._state.slots
            expect = None if slots is None else (*slots.keys.shape[:2], slots.keys.shape[3])
            check_kv(keys, values, expect=expect, dtype=None if slots is None else slots.keys.dtype)
            self._pending = (keys, values)
            if slots is None:
                return keys, values
            if keys.shape[2] == 1 and slots.free is not None:
                # One token into the dead slot: the same rows as ``retained + new`` in slot order
                # (one token's attention does not depend on it), and fewer ops to build than a
                # compaction plus a concatenation, which the hook then ignores.
                laid_out = slots.write_free(keys, values, self._state.offset)
                return laid_out.keys, laid_out.values
            live = slots.compact()
            return (
                mx.concatenate([live.keys, keys], axis=2),
                mx.concatenate([live.values, values], axis=2),
            )
        self._step = self._feed(self._state, keys, values)
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
            L = keys.shape[2]
            if L > SUBCHUNK and getattr(self._state, "prefill", None) == "sequential":
                # Sequential mode does not depend on how a chunk is split: sub-chunks keep the
                # scan and the attention on ``retained + SUBCHUNK`` keys, not ``retained + L``.
                outs = []
                for s in range(0, L, SUBCHUNK):
                    part = slice(s, s + SUBCHUNK)
                    q = queries[:, :, part]
                    step = self._feed(self._state, keys[:, :, part], values[:, :, part], q, scale)
                    self._state = step.state
                    outs.append(attend_step(q, step, scale, sinks))
                self._state = self._after_call(self._state, L)
                return mx.concatenate(outs, axis=2)
            if L == 1 and self._sums_ref is not None:
                return self._attend_deferring(keys, values, queries, scale, sinks)
            step = self._feed(self._state, keys, values, queries, scale)
        elif self._step is not None:
            step = self._step
        else:
            raise RuntimeError("attend() called before update_and_fetch()")
        self._step = None
        self._state = self._after_call(step.state, queries.shape[2])
        return attend_step(queries, step, scale, sinks)

    def _attend_deferring(
        self,
        keys: mx.array,
        values: mx.array,
        queries: mx.array,
        scale: float,
        sinks: mx.array | None,
    ) -> mx.array:
        """A decode step whose layer-wide sums go out with the other layers' (``step_sums``):
        attend now, decide when the pass's last layer has arrived (``_finish_deferred``)."""
        sums = self._sums_ref.value  # type: ignore[union-attr]
        recorder = Recorder(self.group)
        laid = prepare(
            self._policy, self._state, keys, values, queries, scale,
            check_finite=False, group=recorder,
        )  # fmt: skip
        step = decide(self._policy, laid, self._log)
        if recorder.sums:  # the decision waits for the sums; the attention does not
            self._deferred = laid
            sums.defer(recorder.sums, self._finish_deferred)
            step = replace(step, values=laid.candidates.values)
        else:  # nothing was summed over the group: this is the decision
            self._log = step.log
            self._state = self._after_call(step.state, 1)
        out = attend_step(queries, step, scale, sinks)
        tied = sums.arrive(self._layer)
        return mx.depends([out], tied)[0] if tied else out

    def _finish_deferred(self, replay: Replay) -> list[mx.array]:
        """Decide the deferred step with the group's sums; its new arrays, to evaluate with
        the forward pass (the log's rows then hold no lazy read of slots written in place)."""
        laid, self._deferred = self._deferred, None
        assert laid is not None
        step = decide(self._policy, laid.regroup(replay), self._log)
        self._log = step.log
        self._state = self._after_call(step.state, 1)
        tied = self._state.slots.arrays()
        if step.log is not None and step.log.entries:
            tied += step.log.entries[-1].arrays()
        return tied

    def _after_call(self, state: Any, length: int) -> Any:
        """Once a call's attention is built: the first single-token call ends the prompt
        (mlx-lm feeds the prompt's last token alone before decoding)."""
        if length == 1 and self._policy.prompt_end is not None:
            return self._end_prompt(state)
        return state

    def _end_prompt(self, state: Any) -> Any:
        ended = self._policy.end_prompt(state)
        if ended is not state and self._log is not None:  # the cut cannot be undone
            self._log = self._log.cleared()
        return ended

    def finish_prefill(self) -> None:
        """End the prompt now (for callers that do not end it with a 1-token call); a no-op
        for policies without a prompt-end step (SnapKV's cut)."""
        self._settle()
        self._state = self._end_prompt(self._state)

    def _settle(self) -> None:
        """Decide a chunk the hook never saw: signal ``key`` stands in for the queries; send a
        deferred decode step's sums now (a collective: every rank reaches this point alike)."""
        if self._deferred is not None:
            self._sums_ref.value.flush()  # type: ignore[union-attr]
        unseen = self._step is not None or self._pending is not None
        if unseen and getattr(self._state, "padded", False):
            self._step = self._pending = None
            # The model attended by itself, over KVzip's pad slots too: refuse to go on.
            raise RuntimeError(
                "this KVzip cache holds pad slots (allocation 'global' or 'layer') that only "
                "the attention hook hides, and the last call ran without it: install it "
                "(velox_mlx_lm.install_attention_hook(model); compress() and "
                "KVCacheBuilder.for_model do) or use allocation='head'"
            )
        if self._step is not None:  # decided in update_and_fetch, attention never came back
            self._state = self._after_call(self._state, self._step_length)
        self._step = None
        if self._pending is None:
            return
        query = getattr(self._state, "signal", None) == "query"
        if query and self.policy_name not in _warned_no_hook:
            _warned_no_hook.add(self.policy_name)
            warnings.warn(
                f"{type(self).__name__} was used without the attention hook "
                "(KVCacheBuilder.for_model installs it): eviction fell back to signal 'key'.",
                RuntimeWarning,
                stacklevel=3,
            )
        keys, values = self._pending
        self._pending = None
        if getattr(self._state, "signal", None) != "query":  # decided as the hook would have
            step = self._feed(self._state, keys, values)
            self._state = self._after_call(step.state, keys.shape[2])
            return
        step = self._feed(replace(self._state, signal="key"), keys, values)
        self._state = self._after_call(replace(step.state, signal="query"), keys.shape[2])

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

    @property
    def trim_window(self) -> int:
        """Tokens the undo log keeps for exact trims (0: not trimmable)."""
        return 0 if self._log is None else self._log.window

    @property
    def undo_nbytes(self) -> int:
        """Bytes held by the undo log (apart from ``nbytes``, the kept rows)."""
        self._settle()
        return 0 if self._log is None else self._log.nbytes

    @property
    def held_nbytes(self) -> int:
        """Every byte the cache holds: the state's (``PolicyState.held_nbytes``: rows held,
        their positions, running arrays) and the undo log's."""
        return int(self.policy_state.held_nbytes) + self.undo_nbytes

    @property
    def trimmable_tokens(self) -> int:
        """How many of the last tokens ``trim`` can take back now: those the undo log holds
        (at most ``trim_window``; 0 without a log)."""
        self._settle()
        return 0 if self._log is None else self._log.tokens

    def is_trimmable(self) -> bool:
        """True when the cache keeps an undo log (``trim_window > 0``): ``trim(n)`` then
        works for up to the last ``trim_window`` tokens (more raises ``ValueError``)."""
        return self._log is not None

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens exactly: the state is the one the cache would have had
        without them (same kept positions, keys/values bit for bit, running state). Raises
        ``ValueError`` and changes nothing if the undo log does not reach back ``n`` tokens."""
        self._settle()
        if self._log is None:
            raise ValueError(
                f"cannot trim {type(self).__name__}: it keeps no undo log (trim_window=0)"
            )
        self._state, self._log = self._policy.trim(self._state, self._log, n, self.group)
        return n

    @property
    def state(self) -> dict[str, Any]:
        """Arrays and one JSON string (``mx.eval``-ed after prefill chunks, saved by mlx-lm)."""
        return _encode(self.policy_state, self._log)

    @state.setter
    def state(self, v: dict[str, Any]) -> None:
        self._state, self._log = _decode(self._policy, v)
        self._pending = None
        self._deferred = None
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


# -- KVzip: a scoring mode for the reconstruction pass (velox_mlx_lm.kvzip drives it) ---------


class KVzipKVCache(PolicyKVCache):
    """KVzip: the context is kept whole until ``velox_mlx_lm.kvzip.compress`` scores it by a
    reconstruction pass and cuts it to ``budget`` per KV head (``probe="latest"``: cut at the
    prompt's end by its last query, like TOVA's oneshot cut).

    In scoring mode (``start_scoring`` .. ``finish_scoring``) a forward pass is a
    reconstruction chunk: its keys and values are attended to but never stored, its queries
    score the context rows ``score_chunk(start, end)`` names, and ``offset`` stays the
    context's length, so every chunk is rotated right after the context.
    """

    policy_name = "kvzip"
    # Class defaults: a cache rebuilt by ``from_state`` skips ``__init__``.
    _kvzip_scores: list[mx.array] | None = None
    _kvzip_chunk: tuple[int, int] | None = None
    _kvzip_recon: tuple[mx.array, mx.array] | None = None

    @property
    def scoring(self) -> bool:
        return self._kvzip_scores is not None

    def start_scoring(self) -> None:
        """Enter scoring mode (the context must be whole: not compressed yet)."""
        from velox_cache_core.policies.kvzip import _context

        self._settle()
        _context(self._state)  # raises on a compressed or empty state
        self._kvzip_scores = []

    def score_chunk(self, start: int, end: int) -> None:
        """The next forward pass reconstructs context rows ``start..end-1``."""
        if not self.scoring:
            raise RuntimeError("score_chunk() outside scoring mode (call start_scoring())")
        self._kvzip_chunk = (start, end)

    def chunk_scores(self) -> mx.array | None:
        """The scores of the last scored chunk (``None`` before the first)."""
        return self._kvzip_scores[-1] if self._kvzip_scores else None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if not self.scoring:
            return super().update_and_fetch(keys, values)
        live = _kvzip_live(self._state)
        B, H, _, D = live.keys.shape
        check_kv(keys, values, expect=(B, H, D), dtype=live.keys.dtype)
        self._kvzip_recon = (keys, values)
        return (
            mx.concatenate([live.keys, keys.astype(live.keys.dtype)], axis=2),
            mx.concatenate([live.values, values.astype(live.values.dtype)], axis=2),
        )

    def attend(
        self, queries: mx.array, scale: float, mask: Any, sinks: mx.array | None
    ) -> mx.array:
        if not self.scoring:
            return super().attend(queries, scale, mask, sinks)
        from velox_cache_core.masks import chunk_causal
        from velox_cache_core.policies.kvzip import reconstruction_scores

        if self._kvzip_recon is None or self._kvzip_chunk is None:
            raise RuntimeError("attend() in scoring mode needs score_chunk() and a forward call")
        keys, values = self._kvzip_recon
        self._kvzip_recon = None
        assert self._kvzip_scores is not None
        start, end = self._kvzip_chunk
        self._kvzip_scores.append(
            reconstruction_scores(self._state, queries, keys, start, end, scale)
        )
        live = _kvzip_live(self._state)
        dtype = live.keys.dtype
        all_keys = mx.concatenate([live.keys, keys.astype(dtype)], axis=2)
        all_values = mx.concatenate([live.values, values.astype(dtype)], axis=2)
        L = keys.shape[2]
        causal = None if L == 1 else chunk_causal(live.n_slots, L)[None, None]
        return mx.fast.scaled_dot_product_attention(
            queries, all_keys, all_values, scale=scale, mask=causal, sinks=sinks
        ).astype(queries.dtype)

    def scores(self) -> mx.array:
        """float32 ``[B, H_kv, n]``: every context row's score so far (the chunks, in order)."""
        if not self._kvzip_scores:
            raise ValueError("no reconstruction chunk was scored")
        return mx.concatenate(self._kvzip_scores, axis=-1)

    def finish_scoring(self, budget: int | None = None, total: int | None = None) -> None:
        """Leave scoring mode: cut the context to ``budget`` (default: the cache's) by the
        scores of every chunk, in order (they must cover the context once). ``total``: the
        layer's row total under ``allocation="global"`` (``velox_cache_core.policies.kvzip.
        global_totals``); without it a ``global`` or ``layer`` cut keeps ``budget * H_kv``."""
        from velox_cache_core.policies.kvzip import kvzip_compress

        if not self.scoring:
            raise RuntimeError("finish_scoring() outside scoring mode")
        scores = self.scores()
        state = kvzip_compress(self._with_budget(budget), scores, total)  # raises: unchanged
        self._kvzip_scores = None
        self._kvzip_chunk = self._kvzip_recon = None
        self._state = state
        if self._log is not None:  # the cut cannot be undone
            self._log = self._log.cleared()

    def compress_latest(self, budget: int | None = None) -> None:
        """Cut now by the last context query (``probe="latest"``)."""
        self._settle()
        self._state = self._with_budget(budget)
        self.finish_prefill()

    def _with_budget(self, budget: int | None) -> Any:
        if budget is None or budget == self._state.budget:
            return self._state
        self._policy.init(**{**self._state.settings, "budget": budget})  # validates
        return replace(self._state, budget=budget)


def _kvzip_live(state: Any) -> KVSlots:
    if state.slots is None:
        raise ValueError("the KVzip cache holds no context to score")
    return state.slots.compact()
