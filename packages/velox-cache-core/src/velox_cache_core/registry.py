"""The policy registry: one ``Policy`` record per eviction policy, the single source of truth.

Everything outside a policy's own module (the mlx-lm cache classes, ``KVCacheConfig``'s
``<policy>_<setting>`` fields, the CLI's ``--method`` choices, the benchmarks' method lists,
prompt-cache encoding) asks the record instead of naming policies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from velox_cache_core import undo
from velox_cache_core.engine import Call, Decision, Step, update
from velox_cache_core.lanes import GlobalRule, LaneRule
from velox_cache_core.settings import Setting, policy_settings
from velox_cache_core.slots import KVSlots
from velox_cache_core.state import PolicyState
from velox_cache_core.traits import Compressor, Traits
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
    traits: what its states say of themselves (signal, scope, prefill, budget, rows only masks
    hide), read by the engine and the adapters instead of probing states
    (:class:`~velox_cache_core.traits.Traits`; the defaults suit a policy without such settings).
    compressor: a model-driven phase, a pass through the model that a cache alone cannot run
    (KVzip's reconstruction, driven by ``velox_mlx_lm.compress``), or ``None``.
    help: one line per setting for ``--<policy>-<setting>`` flags and docs (optional).
    summary: method name -> one line saying what it keeps (``--method``'s help).
    evict_before: optional decode hook freeing a slot before the new token attends
    (StreamingLLM drops its oldest token first, as mlx-lm's ``RotatingKVCache`` does).
    presets: method name -> settings it fixes, for policies offered under several names
    (TOVA: ``tova``, ``tova_adapted``); the chosen name is passed to ``init`` as ``preset``.
    lane_rule: how the policy decides at every decode step over lanes, when an adaptive
    allocation gave its heads different row counts
    (:class:`~velox_cache_core.lanes.LaneRule`), or ``None``.
    global_rule: how a policy whose cut runs in one layer takes part in a model-wide
    ``global`` allocation (:class:`~velox_cache_core.lanes.GlobalRule`, driven by
    :class:`~velox_cache_core.model_shares.ModelShares`), or ``None``.
    upgrade: optional ``upgrade(settings) -> (settings, fix)`` for prompt caches saved by an
    older release: the saved settings (and scalar running fields) under today's names, and a
    function the loaded state goes through (or ``None``).
    packs_rows: whether rows of a batch at different positions can decode as one call
    (``update(..., row_start=...)``): the decode rule and ``evict_before`` read positions only
    from the slots and ``Call.newest``/``Call.positions``, and every running field but the
    counters is an array with the batch first (see :mod:`velox_cache_core.batch`); and a decode
    step whose candidates fit the state's ``budget`` scores and evicts nothing unless a running
    array asks for it (so rows below their budget can pack padded).
    compiled_decode: whether a steady decode step may run as compiled kernels
    (:mod:`velox_cache_core.fast_step`): the decode rule and ``evict_before`` read the state only
    through its settings and its array running fields (a trace would freeze an int counter),
    positions only through the slots and ``Call.positions``/``Call.newest``, and
    ``evict_before`` frees a slot exactly when the store holds ``budget`` rows.
    appends_now: for a policy that ``grows_after_prompt_end``, ``appends_now(state)`` says
    that the state is past its prompt end, where a decode step keeps every token and reads
    neither its queries nor its running fields: the fast path then appends the token into
    the store's reserved rows with no decision at all.
    """

    name: str
    state_type: type[PolicyState]
    init: Callable[..., Any]
    rule: Callable[[Any, Call, KVSlots, KVSlots], Decision]
    uses_queries: bool = True
    prompt_end: Callable[[Any], Any] | None = None
    grows_after_prompt_end: bool = False
    evict_before: Callable[[Any, KVSlots, Call], KVSlots] | None = None
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    packs_rows: bool = False
    traits: Traits = field(default_factory=Traits)
    compressor: Compressor | None = None
    help: Mapping[str, str] = field(default_factory=dict)
    summary: Mapping[str, str] = field(default_factory=dict)
    upgrade: (
        Callable[[dict[str, Any]], tuple[dict[str, Any], Callable[[Any], Any] | None]] | None
    ) = None
    lane_rule: LaneRule | None = None
    global_rule: GlobalRule | None = None
    compiled_decode: bool = False
    appends_now: Callable[[Any], bool] | None = None

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
        group: Any = None,
        row_start: Sequence[int] | None = None,
    ) -> Step:
        """Feed ``[B, H_kv, L, D]`` keys/values (and ``[B, H_q, L, D]`` queries); see
        :func:`velox_cache_core.engine.update` (``group``: tensor-parallel group;
        ``row_start``: per-row positions of a packed decode step)."""
        return update(
            self,
            state,
            keys=keys,
            values=values,
            queries=queries,
            scale=scale,
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
            step = self.update(
                s, keys=k, values=v, queries=q, scale=scale, check_finite=False, log=lg, group=group
            )
            return step.state, step.log

        return undo.trim(state, log, n, feed)

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

    def defaults(self) -> dict[str, Any]:
        """``init``'s default for every setting (``None`` where the method/preset decides)."""
        return {s.name: s.default for s in self.settings}

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
        if not isinstance(state, self.state_type):
            raise TypeError(
                f"state must be a {self.state_type.__name__}, got {type(state).__name__}"
            )
        return state if self.prompt_end is None else self.prompt_end(state)


POLICIES: dict[str, Policy] = {}
# Option strings (``--flag``) of the commands that generate ``--<policy>-<setting>`` flags,
# which no policy's flag may equal or abbreviate (argparse accepts unique prefixes); the
# integrations add theirs with :func:`reserve_flags`.
RESERVED_FLAGS: set[str] = set()
# Config fields every integration has besides ``<policy>_<setting>``.
RESERVED_FIELDS = {"method", "head_dim", "trim_window", "kv_bits", "kv_group_size", "kv_key_layout"}


def flag_name(policy: str, setting: str) -> str:
    """``--<policy>-<setting>`` with ``_`` as ``-`` (``--snapkv-window``)."""
    return f"--{policy}-{setting}".replace("_", "-")


def field_name(policy: str, setting: str) -> str:
    """``<policy>_<setting>``: a setting's name in a config (``tova_budget``)."""
    return f"{policy}_{setting}"


def _collisions(policy: Policy) -> list[str]:
    """What registering ``policy`` would make ambiguous: names, config fields, flags."""
    taken = {m for p in POLICIES.values() for m in p.methods} | set(POLICIES) | {"full"}
    out = [f"policy name {n!r}" for n in sorted(({policy.name} | set(policy.methods)) & taken)]
    fields = {field_name(p.name, s) for p in POLICIES.values() for s in p.setting_names}
    flags = {flag_name(p.name, s) for p in POLICIES.values() for s in p.setting_names}
    for setting in policy.setting_names:
        name, flag = field_name(policy.name, setting), flag_name(policy.name, setting)
        if name in fields or name in RESERVED_FIELDS:
            out.append(f"config field {name!r}")
        clashing = sorted(f for f in flags | RESERVED_FLAGS if f.startswith(flag))
        if clashing:
            out.append(f"flag {flag} (equals or abbreviates {', '.join(clashing)})")
    return out


def register(policy: Policy) -> Policy:
    """Add ``policy`` to :data:`POLICIES`. Its name and method names must be new, and none of
    its ``<policy>_<setting>`` config fields or ``--<policy>-<setting>`` flags may equal
    another's, nor a flag equal or abbreviate another or a reserved one."""
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a Policy, got {type(policy).__name__}")
    clash = _collisions(policy)
    if clash:
        raise ValueError(f"cannot register policy {policy.name!r}: {'; '.join(clash)} taken")
    POLICIES[policy.name] = policy
    return policy


def reserve_flags(flags: Iterable[str]) -> None:
    """Keep ``flags`` (option strings such as ``--max-tokens``) for a command's own use: a
    policy's generated flag may neither equal nor abbreviate one."""
    flags = set(flags)
    for policy in POLICIES.values():
        for setting in policy.setting_names:
            flag = flag_name(policy.name, setting)
            clashing = sorted(f for f in flags if f.startswith(flag))
            if clashing:
                raise ValueError(f"{flag} of policy {policy.name!r} abbreviates {clashing}")
    RESERVED_FLAGS.update(flags)


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
