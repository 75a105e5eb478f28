"""The policy registry: one ``Policy`` record per eviction policy, the single source of truth.

Everything outside a policy's own module (the mlx-lm cache classes, ``KVCacheConfig``'s
``<policy>_<setting>`` fields, the CLI's ``--method`` choices, the benchmarks' method lists,
prompt-cache encoding) asks the record instead of naming policies.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from velox_cache_core import undo
from velox_cache_core.engine import Call, Decision, Step, update
from velox_cache_core.slots import KVSlots
from velox_cache_core.state import PolicyState
from velox_cache_core.undo import UndoLog


@dataclass(frozen=True)
class Policy:
    """A policy's declaration.

    name: registry key, and the method name unless ``presets`` says otherwise.
    state_type: its :class:`~velox_cache_core.state.PolicyState` dataclass.
    init: ``init(**settings) -> state``, validating every setting.
    rule: ``rule(state, call, slots, candidates) -> Decision``: which candidates survive a call
    (``slots`` before the call, ``candidates`` = ``retained + new`` as laid out by the engine).
    uses_queries: whether the rule can read the true queries (else it never looks at attention).
    prompt_end: optional step run once the prompt has been fed (SnapKV's cut); a no-op after.
    grows_after_prompt_end: whether the cache keeps every token after ``prompt_end``.
    prompt_end_needs_model: whether the prompt end is a pass through the model that a cache
    alone cannot run (KVzip's reconstruction, ``velox_mlx_lm.kvzip.compress``).
    evict_before: optional decode hook freeing a slot before the new token attends
    (StreamingLLM drops its oldest token first, as mlx-lm's ``RotatingKVCache`` does).
    presets: method name -> settings it fixes, for policies offered under several names
    (TOVA: ``tova``, ``tova_adapted``); the chosen name is passed to ``init`` as ``preset``.
    packs_rows: whether rows of a batch at different positions can decode as one call
    (``update(..., row_start=...)``): the decode rule and ``evict_before`` read positions only
    from the slots and ``Call.newest``/``Call.positions``, and every running field but the
    counters is an array with the batch first (see :mod:`velox_cache_core.batch`); and a decode
    step whose candidates fit the state's ``budget`` scores and evicts nothing unless a running
    array asks for it (so rows below their budget can pack padded).
    """

    name: str
    state_type: type[PolicyState]
    init: Callable[..., Any]
    rule: Callable[[Any, Call, KVSlots, KVSlots], Decision]
    uses_queries: bool = True
    prompt_end: Callable[[Any], Any] | None = None
    grows_after_prompt_end: bool = False
    prompt_end_needs_model: bool = False
    evict_before: Callable[[Any, KVSlots, Call], KVSlots] | None = None
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    packs_rows: bool = False

    def update(
        self,
        state: Any,
        keys: Any,
        values: Any,
        queries: Any = None,
        scale: Any = None,
        check_finite: bool = True,
        log: UndoLog | None = None,
        group: Any = None,
        row_start: Sequence[int] | None = None,
    ) -> Step:
        """Feed ``[B, H_kv, L, D]`` keys/values (and ``[B, H_q, L, D]`` queries); see
        :func:`velox_cache_core.engine.update` (``group``: tensor-parallel group;
        ``row_start``: per-row positions of a packed decode step)."""
        return update(
            self,
            state,
            keys,
            values,
            queries,
            scale,
            check_finite=check_finite,
            log=log,
            group=group,
            row_start=row_start,
        )

    def trim(self, state: Any, log: UndoLog, n: int, group: Any = None) -> tuple[Any, UndoLog]:
        """``(state, log)`` as if the last ``n`` tokens had never been fed (exact); raises
        ``ValueError`` when the log holds fewer (see :mod:`velox_cache_core.undo`). ``group``:
        the tensor-parallel group the re-fed calls decide over, as :meth:`update`'s."""
        if not isinstance(state, self.state_type):
            raise TypeError(
                f"state must be a {self.state_type.__name__}, got {type(state).__name__}"
            )
        if not isinstance(log, UndoLog):
            raise TypeError(f"log must be an UndoLog, got {type(log).__name__}")

        def feed(s: Any, k: Any, v: Any, q: Any, scale: float, lg: UndoLog) -> Any:
            step = self.update(s, k, v, q, scale, check_finite=False, log=lg, group=group)
            return step.state, step.log

        return undo.trim(state, log, n, feed)

    @property
    def methods(self) -> tuple[str, ...]:
        """The names users pick this policy by (``--method``, ``KVCacheConfig.method``)."""
        return tuple(self.presets) or (self.name,)

    @property
    def setting_names(self) -> tuple[str, ...]:
        """``init``'s keyword arguments a user sets (``preset`` is chosen by the method)."""
        params = inspect.signature(self.init).parameters
        return tuple(name for name in params if name != "preset")

    def defaults(self) -> dict[str, Any]:
        """``init``'s default for every setting (``None`` where the method/preset decides)."""
        params = inspect.signature(self.init).parameters
        return {name: params[name].default for name in self.setting_names}

    def init_for(self, method: str, **settings: Any) -> Any:
        """The empty state for ``method`` (one of :attr:`methods`) with ``settings``."""
        if self.presets:
            return self.init(preset=method, **settings)
        return self.init(**settings)

    def end_prompt(self, state: Any) -> Any:
        """The state after the prompt ends (unchanged for policies without a prompt-end step)."""
        if not isinstance(state, self.state_type):
            raise TypeError(
                f"state must be a {self.state_type.__name__}, got {type(state).__name__}"
            )
        return state if self.prompt_end is None else self.prompt_end(state)


POLICIES: dict[str, Policy] = {}


def register(policy: Policy) -> Policy:
    """Add ``policy`` to :data:`POLICIES` (its name and method names must be new)."""
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a Policy, got {type(policy).__name__}")
    taken = {m for p in POLICIES.values() for m in p.methods} | set(POLICIES) | {"full"}
    clash = sorted(({policy.name} | set(policy.methods)) & taken)
    if clash:
        raise ValueError(f"policy names already registered: {clash}")
    POLICIES[policy.name] = policy
    return policy


def unregister(name: str) -> None:
    """Remove a registered policy (for tests that register one of their own)."""
    del POLICIES[name]


def policy_for_method(method: str) -> Policy:
    """The registered policy offered as ``method``."""
    for policy in POLICIES.values():
        if method in policy.methods:
            return policy
    known = [m for p in POLICIES.values() for m in p.methods]
    raise ValueError(f"method must be one of {', '.join(map(repr, known))}, got {method!r}")
