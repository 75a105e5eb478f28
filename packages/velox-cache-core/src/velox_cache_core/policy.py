"""The ``Policy`` record: one per eviction policy, everything the rest of Velox knows of it.

Each field is a typed declaration, documented where it is declared. The registry
(:func:`velox_cache_core.registry.register`) checks every field against its declared type
(:func:`check`), so a record with a wrong capability fails at ``register()`` naming the field,
not at its first decode step; nothing reads a capability by probing for an attribute.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from velox_cache_core import undo
from velox_cache_core.declarations import Compressor, PolicyState, Setting, Traits, policy_settings
from velox_cache_core.engine import Call, Decision, Step, update
from velox_cache_core.lanes import GlobalRule, LaneRule
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.undo import UndoLog

Rule = Callable[[Any, Call, KVSlots, KVSlots], Decision]
EvictBefore = Callable[[Any, KVSlots, Call], KVSlots]
Upgrade = Callable[[dict[str, Any]], tuple[dict[str, Any], Callable[[Any], Any] | None]]


@dataclass(frozen=True)
class Policy:
    """A policy's declaration: what it is called, its state, its rule and its capabilities
    (each field's own docstring says what it declares)."""

    name: str
    """Registry key, and the method name unless :attr:`presets` says otherwise."""
    state_type: type[PolicyState]
    """Its state dataclass, deriving from :class:`~velox_cache_core.declarations.PolicyState`."""
    init: Callable[..., Any]
    """``init(**settings) -> state``, validating every setting; its typed keyword arguments
    are the policy's settings (:attr:`settings`)."""
    rule: Rule
    """``rule(state, call, slots, candidates) -> Decision``: which candidates survive a call
    (``slots`` before the call, ``candidates`` = ``retained + new`` as laid out by the
    engine)."""
    uses_queries: bool = True
    """Whether the rule can read the true queries (else it never looks at attention)."""
    prompt_end: Callable[[Any], Any] | None = None
    """Optional step run once the prompt has been fed (SnapKV's cut); a no-op after."""
    grows_after_prompt_end: bool = False
    """Whether the cache keeps every token after :attr:`prompt_end`."""
    evict_before: EvictBefore | None = None
    """Optional decode hook freeing a slot before the new token attends (StreamingLLM drops
    its oldest token first, as mlx-lm's ``RotatingKVCache`` does)."""
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Method name -> settings it fixes, for policies offered under several names (TOVA:
    ``tova``, ``tova_adapted``); the chosen name is passed to ``init`` as ``preset``."""
    packs_rows: bool = False
    """Whether rows of a batch at different positions can decode as one call
    (``update(..., row_start=...)``): the decode rule and ``evict_before`` read positions only
    from the slots and ``Call.newest``/``Call.positions``, and every running field but the
    counters is an array with the batch first (see :mod:`velox_cache_core.batch`); and a
    decode step whose candidates fit the state's ``budget`` scores and evicts nothing unless a
    running array asks for it (so rows below their budget can pack padded)."""
    traits: Traits = field(default_factory=Traits)
    """What its states say of themselves (signal, scope, prefill, budget, rows only masks
    hide), read by the engine and the adapters (:class:`~velox_cache_core.declarations.Traits`;
    the defaults suit a policy without such settings)."""
    compressor: Compressor | None = None
    """A model-driven phase, a pass through the model that a cache alone cannot run (KVzip's
    reconstruction, driven by ``velox_mlx_lm.compress``), or ``None``."""
    help: Mapping[str, str] = field(default_factory=dict)
    """Setting name -> one line, for ``--<policy>-<setting>`` flags and docs (optional)."""
    summary: Mapping[str, str] = field(default_factory=dict)
    """Method name -> one line saying what it keeps (``--method``'s help)."""
    upgrade: Upgrade | None = None
    """Optional ``upgrade(settings) -> (settings, fix)`` for prompt caches saved by an older
    release: the saved settings (and scalar running fields) under today's names, and a
    function the loaded state goes through (or ``None``)."""
    lane_rule: LaneRule | None = None
    """How the policy decides at every decode step over lanes, when an adaptive allocation
    gave its heads different row counts (:class:`~velox_cache_core.lanes.LaneRule`), or
    ``None``."""
    global_rule: GlobalRule | None = None
    """How a policy whose cut runs in one layer takes part in a model-wide ``global``
    allocation (:class:`~velox_cache_core.lanes.GlobalRule`, driven by
    :class:`~velox_cache_core.model_shares.ModelShares`), or ``None``."""
    compiled_decode: bool = False
    """Whether a steady decode step may run on the decode path (:mod:`velox_cache_core.decode`,
    kernels in :mod:`velox_cache_core.fast_step`): the decode rule and ``evict_before`` read
    the state only through its settings and its array running fields (a trace would freeze an
    int counter), positions only through the slots and ``Call.positions``/``Call.newest``, and
    ``evict_before`` frees a slot exactly when the store holds ``budget`` rows."""
    appends_now: Callable[[Any], bool] | None = None
    """For a policy that :attr:`grows_after_prompt_end`: ``appends_now(state)`` says that the
    state is past its prompt end, where a decode step keeps every token and reads neither its
    queries nor its running fields; the decode path then appends the token into the store's
    reserved rows with no decision at all (:class:`velox_cache_core.decode.Appending`)."""
    demote_scoring: Literal["weights", "accumulated", "recency"] = "weights"
    """How a demoted tier ranks the rows this policy evicts into it
    (:data:`velox_cache_core.store.tier.SCORING`): the last weight the call's query gave
    them (a memoryless rule), the weights summed over every call (H2O's inertia), or their
    position (StreamingLLM: the newest stay)."""

    @property
    def prompt_end_needs_model(self) -> bool:
        """Whether the prompt end is a pass through the model (:attr:`compressor`)."""
        return self.compressor is not None

    def update(
        self,
        state: Any,
        keys: Any,
        values: Any,
        queries: Any = None,
        scale: Any = None,
        check_finite: bool = True,
        log: UndoLog | None = None,
        row_start: Sequence[int] | None = None,
    ) -> Step:
        """Feed ``[B, H_kv, L, D]`` keys/values (and ``[B, H_q, L, D]`` queries); see
        :func:`velox_cache_core.engine.update` (``row_start``: per-row positions of a packed
        decode step)."""
        return update(
            self,
            state,
            keys,
            values,
            queries,
            scale,
            check_finite=check_finite,
            log=log,
            row_start=row_start,
        )

    def trim(self, state: Any, log: UndoLog, n: int) -> tuple[Any, UndoLog]:
        """``(state, log)`` as if the last ``n`` tokens had never been fed (exact); raises
        ``ValueError`` when the log holds fewer (see :mod:`velox_cache_core.undo`). The re-fed
        calls decide as :meth:`update`'s (under tensor parallelism, within
        :func:`velox_cache_core.distributed.summing_over`)."""
        self._check_state(state)
        if not isinstance(log, UndoLog):
            raise TypeError(f"log must be an UndoLog, got {type(log).__name__}")

        def feed(s: Any, k: Any, v: Any, q: Any, scale: float, lg: UndoLog) -> Any:
            step = self.update(
                s, keys=k, values=v, queries=q, scale=scale, check_finite=False, log=lg
            )
            return step.state, step.log

        return undo.trim(state, log, n, feed)

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, self.state_type):
            raise TypeError(
                f"state must be a {self.state_type.__name__}, got {type(state).__name__}"
            )

    @property
    def methods(self) -> tuple[str, ...]:
        """The names users pick this policy by (``--method``, ``KVCacheConfig.method``)."""
        return tuple(self.presets) or (self.name,)

    @property
    def settings(self) -> tuple[Setting, ...]:
        """Every setting a user sets (``init``'s keyword arguments but ``preset``), typed."""
        return policy_settings(self.init, self.help)

    @property
    def setting_names(self) -> tuple[str, ...]:
        """``init``'s keyword arguments a user sets (``preset`` is chosen by the method)."""
        return tuple(s.name for s in self.settings)

    def rebudget(self, state: Any, budget: int | None) -> Any:
        """``state`` with another ``budget`` (validated like a new state); unchanged for
        ``None`` or the same budget."""
        if budget is None or budget == self.traits.budget(state):
            return state
        self.init_for(self.methods[0], **{**state.settings, "budget": budget})  # validates
        return replace(state, budget=budget)

    def init_for(self, method: str, **settings: Any) -> Any:
        """The empty state for ``method`` (one of :attr:`methods`) with ``settings``."""
        if self.presets:
            return self.init(preset=method, **settings)
        return self.init(**settings)

    def end_prompt(self, state: Any) -> Any:
        """The state after the prompt ends (unchanged for policies without a prompt-end step)."""
        self._check_state(state)
        return state if self.prompt_end is None else self.prompt_end(state)


def _type_name(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__name__
    return re.sub(r"\b[a-z_]+\.", "", str(hint))  # GlobalRule | None, not lanes.GlobalRule


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the declared type ``hint`` (the kinds a ``Policy`` field
    declares: a class, ``type[X]``, a ``Callable``, a ``Mapping`` of them, ``X | None``)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if origin is type:
        (base,) = typing.get_args(hint)
        return isinstance(value, type) and issubclass(value, base)
    if hint is Callable or origin is Callable:
        return callable(value)
    if origin is Mapping:
        key, item = typing.get_args(hint)
        return isinstance(value, Mapping) and all(
            _matches(k, key) and _matches(v, item) for k, v in value.items()
        )
    if origin is Literal:
        return value in typing.get_args(hint)
    if hint is bool:
        return isinstance(value, bool)
    return isinstance(value, hint)


_HINTS: dict[str, Any] = typing.get_type_hints(Policy)


def check(policy: Any) -> None:
    """Check a record before it is registered: ``TypeError`` naming the first field whose
    value is not of its declared type; ``ValueError`` naming a field whose value contradicts
    another (a capability that needs one the record does not declare)."""
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a Policy, got {type(policy).__name__}")
    for f in fields(Policy):
        value = getattr(policy, f.name)
        if not _matches(value, _HINTS[f.name]):
            raise TypeError(
                f"policy {policy.name!r}: field {f.name!r} must be "
                f"{_type_name(_HINTS[f.name])}, got {type(value).__name__} ({value!r})"
            )
    if not policy.name.isidentifier():
        raise ValueError(f"policy field 'name' must be an identifier, got {policy.name!r}")
    if policy.appends_now is not None and not policy.grows_after_prompt_end:
        raise ValueError(
            f"policy {policy.name!r}: field 'appends_now' needs grows_after_prompt_end=True "
            "(only a cache that keeps every token after its prompt end appends without deciding)"
        )
