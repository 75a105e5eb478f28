"""What a policy declares: its state, its settings, its traits, its model-driven phase.

Everything the engine, the layer lifecycle and the adapters know about a policy they read from
these declarations (and from its :class:`~velox_cache_core.policy.Policy` record), never by
probing an object for an attribute it may lack:

- **State.** A policy's layer state is a frozen, keyword-only dataclass deriving from
  :class:`PolicyState`. Its own fields are either settings (plain fields, validated by the
  policy's ``init``) or running state (declared with :func:`running`): whatever changes as
  tokens arrive. Prompt-cache encoding, trim and the settings view read that marking instead
  of a list of names. The base also declares what every state answers (``holds_prompt``,
  ``allocation``, ``lanes``), with the answer of a policy that has no such feature.
- **Settings.** ``init(budget: int = 512, signal: Literal["query", "key"] | None = None, ...)``
  declares every setting a user can give: its name, its type (``int``, ``float``, ``str``,
  ``bool``), its choices (a ``Literal``) and its default (``None``: the method's preset
  decides). :func:`policy_settings` reads them once into :class:`Setting` records; configs
  (:func:`field_name`), command-line flags (:func:`flag_name`) and docs are generated from them.
- **Traits.** Typed questions about one of a policy's states (which attention signal it scores
  with, whether it decides per layer or per head, how it prefills, its budget, whether it holds
  rows only masks hide), each with the default that a policy without such a setting gets.
- **Compressor.** A model-driven phase: KVzip's reconstruction pass is one, and any policy that
  scores its context by a pass through the model declares its own;
  ``velox_mlx_lm.compress`` drives it for every such policy.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Literal

import mlx.core as mx

from velox_cache_core.lanes import Lanes
from velox_cache_core.scoring import Scope as Scope
from velox_cache_core.store.channel_keys import KRows
from velox_cache_core.store.rows import concat, dense, row_bytes
from velox_cache_core.store.slots import KVSlots, stored_fields

# -- the state --------------------------------------------------------------------------------

_RUNNING = "velox_running"


def running(default: Any = None) -> Any:
    """A running-state field: state that changes as tokens arrive (not a setting)."""
    return dataclasses.field(default=default, metadata={_RUNNING: True})


def running_fields(state: Any) -> tuple[str, ...]:
    """Names of the running-state fields of a state (or state type)."""
    return tuple(f.name for f in dataclasses.fields(state) if f.metadata.get(_RUNNING))


def setting_fields(state: Any) -> tuple[str, ...]:
    """Names of the settings fields (every field that is not running state)."""
    return tuple(f.name for f in dataclasses.fields(state) if not f.metadata.get(_RUNNING))


@dataclass(frozen=True, kw_only=True)
class PolicyState:
    """Base of every policy's layer state.

    slots: the retained tokens (``None`` until the first call fixes ``B``, ``H_kv``, ``D`` and
    dtype); offset: tokens seen so far, the true position of the next token; tokens_seen:
    ``B * H_kv * L`` summed over calls.

    Three more answers are declared here with the value of a policy without the feature:
    :attr:`allocation`, :attr:`lanes` and :attr:`holds_prompt`. A policy offering the feature
    overrides them (``allocation`` as a setting field and ``lanes`` as a running field, each
    with a default; ``holds_prompt`` as a property), so every caller reads them from any state
    without probing, and a policy without adaptive allocation carries no ``lanes`` field.
    """

    slots: KVSlots | None = running()
    offset: int = running(0)
    tokens_seen: int = running(0)
    # the sequence's pinned token spans, int32 [B, P, 2] [start, stop) (velox_cache_core.pins):
    # never evicted, by any policy (each reads them where it reads its sinks); None: no pins
    pins: mx.array | None = running()

    @property
    def allocation(self) -> str:
        """How the budget is shared among the KV heads: ``"uniform"`` (``budget`` rows each),
        ``"head"`` (AdaKV: one layer's heads share ``budget * H_kv`` rows) or ``"global"``
        (the model's layers share one total; :mod:`velox_cache_core.lanes`). ``"uniform"``
        here; a policy with the setting declares it as a field (with a default)."""
        return "uniform"

    @property
    def lanes(self) -> Lanes | None:
        """The rows a ``head``/``global`` allocation shared out, its heads holding different
        counts (:class:`~velox_cache_core.lanes.Lanes`; ``slots`` then holds the rows that came
        after the cut). ``None`` here; a policy that offers the allocation declares it as a
        running field (``lanes: Lanes | None = running()``)."""
        return None

    @property
    def holds_prompt(self) -> bool:
        """Whether the state holds its whole prompt for a cut still to come (an adaptive
        allocation shares the rows out at the prompt's end), so it may hold more than
        ``budget`` rows and no decode step may take the fast path yet. ``False`` here."""
        return False

    @property
    def settings(self) -> dict[str, Any]:
        """The policy's settings (every dataclass field that is not running state)."""
        return {name: getattr(self, name) for name in setting_fields(self)}

    def _live(self) -> KVSlots | None:
        """The retained rows per head: with :attr:`lanes`, every head's lane rows padded to
        the fullest head (zero rows at position :data:`~velox_cache_core.lanes.PAD`), then
        the rows after the cut (a view to read, never what attention runs over)."""
        if self.slots is None:
            return None
        live = self.slots.compact()
        if self.lanes is None:
            return live
        heads = self.lanes.per_head(int(live.positions.shape[1]))
        return KVSlots(
            keys=concat([heads.keys, dense(live.keys)], axis=2),
            values=concat([heads.values, dense(live.values)], axis=2),
            positions=mx.concatenate([heads.positions, live.positions], axis=2),
        )

    @property
    def keys(self) -> mx.array | None:
        """``[B, H_kv, n_kept, D]`` retained keys, rows in slot order (same as ``positions``);
        dequantized when the store holds quantized rows; with :attr:`lanes`, each head padded
        as :meth:`_live` says."""
        live = self._live()
        return None if live is None else dense(live.keys)

    @property
    def values(self) -> mx.array | None:
        """``[B, H_kv, n_kept, D]`` retained values (dequantized when quantized)."""
        live = self._live()
        return None if live is None else dense(live.values)

    @property
    def positions(self) -> mx.array | None:
        """int32 ``[B, H_kv, n_kept]`` absolute positions of the retained rows."""
        live = self._live()
        return None if live is None else live.positions

    @property
    def n_kept(self) -> int:
        return 0 if self.slots is None else self.slots.n_kept

    @property
    def tokens_kept(self) -> int:
        """Retained tokens per (batch row, KV head), averaged over the heads when an adaptive
        allocation gave them different counts (:attr:`lanes`)."""
        if self.lanes is None or self.slots is None:
            return self.n_kept
        heads = int(self.slots.positions.shape[1])
        rows = self.lanes.n_lanes * self.lanes.width - (0 if self.lanes.free is None else heads)
        return self.n_kept + rows // heads

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values the state holds: the :attr:`lanes` rows, if any, and
        ``n_held`` rows of keys and values per (batch row, KV head), where ``n_held``
        (:attr:`KVSlots.n_held`) is the kept rows plus the dead slot a decode step leaves and
        the rows a growing store reserves. A row is ``(D + D_v) * itemsize`` bytes at full
        precision; quantized, its packed words plus its scales and biases
        (:func:`~velox_cache_core.store.rows.row_bytes`)."""
        if self.slots is None:
            return 0
        lanes = 0 if self.lanes is None else self.lanes.nbytes
        keys = self.slots.keys
        if isinstance(keys, KRows):  # groups, window and row map: what the arrays hold
            room = self.slots.reserve
            if room is not None and self.slots.n_held > self.slots.n_slots:
                keys = room.keys  # a growing store: its reserved rows are held too
            values = self.slots.n_held * row_bytes(self.slots.values)
            return keys.nbytes + values + lanes
        per_row = row_bytes(self.slots.keys) + row_bytes(self.slots.values)
        return self.slots.n_held * per_row + lanes

    @property
    def held_nbytes(self) -> int:
        """Every byte the state holds: ``nbytes``, the positions of the rows held and the dead
        slot's index, and the policy's running arrays (H2O's scores, MorphKV's probe rows)."""
        total = self.nbytes
        if self.slots is not None:
            B, H = self.slots.positions.shape[:2]
            total += B * H * self.slots.n_held * self.slots.positions.dtype.size
            total += 0 if self.slots.free is None else int(self.slots.free.nbytes)
        if self.lanes is not None:  # their keys and values are in nbytes already
            total += int(self.lanes.positions.nbytes) + int(self.lanes.owner.nbytes)
        for name in running_fields(self):
            if name not in ("slots", "lanes"):
                total += sum(int(a.nbytes) for a in arrays_in(getattr(self, name)))
        return total

    @property
    def compression_ratio(self) -> float:
        """Tokens seen per head over tokens kept (1.0 until something is evicted)."""
        kept = self.tokens_kept
        return self.offset / kept if kept else 1.0


def arrays_in(value: Any) -> list[mx.array]:
    """Every array in ``value``: an array, a dataclass of arrays (its stored fields), or
    tuples, lists and dicts of them; anything else holds none."""
    if isinstance(value, mx.array):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [a for f in stored_fields(value) for a in arrays_in(getattr(value, f.name))]
    if isinstance(value, (tuple, list)):
        return [a for v in value for a in arrays_in(v)]
    if isinstance(value, dict):
        return [a for v in value.values() for a in arrays_in(v)]
    return []


# -- settings --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One setting of a policy: ``kind`` is ``int``, ``float``, ``str`` or ``bool``;
    ``choices`` the accepted values of a ``Literal`` setting (else ``None``)."""

    name: str
    kind: type
    default: Any
    choices: tuple[Any, ...] | None = None
    help: str = ""


def _kind(hint: Any) -> tuple[type, tuple[Any, ...] | None]:
    """(type, choices) of an annotation, ``None`` and ``Optional`` stripped."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"a setting must have one type, got {hint!r}")
        return _kind(args[0])
    if origin is typing.Literal:
        choices = typing.get_args(hint)
        return type(choices[0]), tuple(choices)
    if hint in (int, float, str, bool):
        return hint, None
    raise TypeError(f"a setting must be int, float, str, bool or a Literal, got {hint!r}")


@functools.cache
def _settings(init: Callable[..., Any]) -> tuple[Setting, ...]:
    hints = typing.get_type_hints(init)
    out = []
    for name, param in inspect.signature(init).parameters.items():
        if name == "preset":  # chosen by the method name, not set by the user
            continue
        if name not in hints:
            raise TypeError(f"setting {name!r} of {init.__qualname__} has no type annotation")
        kind, choices = _kind(hints[name])
        out.append(Setting(name, kind, param.default, choices))
    return tuple(out)


def flag_name(policy: str, setting: str) -> str:
    """``--<policy>-<setting>`` with ``_`` as ``-`` (``--snapkv-window``)."""
    return f"--{policy}-{setting}".replace("_", "-")


def field_name(policy: str, setting: str) -> str:
    """``<policy>_<setting>``: a setting's name in a config (``tova_budget``)."""
    return f"{policy}_{setting}"


# Help lines of the settings many policies share; a policy's own ``help`` overrides them.
COMMON_HELP = {
    "budget": "tokens kept per KV head",
    "n_sink": "first positions never evicted",
    "signal": "what scores the tokens: the true queries, or the new keys as a stand-in",
    "scope": "one eviction per layer (every head drops the same token) or per KV head",
    "prefill": "during the prompt, evict token by token (sequential) or once per chunk",
}


def policy_settings(init: Callable[..., Any], help: Mapping[str, str]) -> tuple[Setting, ...]:
    """Every setting ``init`` takes (``preset`` excepted), with ``help`` lines attached (the
    policy's own, else :data:`COMMON_HELP`'s)."""
    return tuple(
        dataclasses.replace(s, help=help.get(s.name, COMMON_HELP.get(s.name, "")))
        for s in _settings(init)
    )


# -- traits and the model-driven phase --------------------------------------------------------

Signal = Literal["query", "key"]
Prefill = Literal["sequential", "oneshot"]


@dataclass(frozen=True)
class Traits:
    """Typed questions about one of a policy's states, each with a default.

    signal: what scores candidates: ``"query"`` (the true queries, which only the attention
    hook brings), ``"key"`` (the new keys) or ``None`` (the rule reads no attention).
    scope: ``"layer"`` (one decision, the same positions in every head; the chunk mask is
    shared by every head) or ``"head"`` (one decision per KV head).
    prefill: ``"sequential"`` (a chunk decides token by token, so it may be split anywhere),
    ``"oneshot"`` or ``None`` (the policy has no such setting).
    budget: the rows per head a decode step evicts down to (``None``: no budget).
    hides_rows: whether the state holds rows that only the policy's masks hide (KVzip's pad
    slots): a model attending by itself, without the hook, would see them.
    n_sink: the first positions it never evicts (its attention sinks).
    reserved: rows per head the policy always keeps besides its sinks and pins (H2O's
    ``recent`` window, SnapKV's observation ``window``): a pin fits when sinks, pins and these
    leave a row to evict (:mod:`velox_cache_core.pins`).
    """

    signal: Callable[[Any], Signal | None] = lambda state: None
    scope: Callable[[Any], Scope] = lambda state: "layer"
    prefill: Callable[[Any], Prefill | None] = lambda state: None
    budget: Callable[[Any], int | None] = lambda state: None
    hides_rows: Callable[[Any], bool] = lambda state: False
    n_sink: Callable[[Any], int] = lambda state: 0
    reserved: Callable[[Any], int] = lambda state: 0


def read_settings(*names: str, **others: Callable[[Any], Any]) -> Traits:
    """Traits answered by the state's settings of the same names (``"signal"``, ``"scope"``,
    ``"prefill"``, ``"budget"``, ``"n_sink"``), plus ``others`` given as functions of the state."""
    known = {f.name for f in dataclasses.fields(Traits)}
    unknown = sorted((set(names) | set(others)) - known)
    if unknown:
        raise ValueError(f"traits must be among {sorted(known)}, got {unknown}")
    return Traits(**{name: attrgetter(name) for name in names}, **others)


# score(state, queries, keys, start, end, scale) -> float32 [B, H_kv, end - start]: the scores
# one pass chunk gives context rows start..end-1 (queries [B, H_q, L, D] and the chunk's own
# keys [B, H_kv, L, D], which are attended to but never stored).
ScoreChunk = Callable[[Any, mx.array, mx.array, int, int, float], mx.array]


@dataclass(frozen=True)
class Compressor:
    """A model-driven phase: the context is scored by a pass through the model that a cache
    alone cannot run, then cut.

    needs_pass(state): whether this state is compressed by such a pass (else its prompt end
    does the cut by itself, and the phase is only ``Policy.end_prompt``).
    check(state): raises ``ValueError`` unless the state can enter the phase (a whole,
    uncompressed context).
    score: see :data:`ScoreChunk`; the pass's chunks must cover the context once, in order.
    cut(state, scores, total): the state cut by ``scores`` (float32 ``[B, H_kv, n]``, every
    context row's); ``total``: the layer's share of a model-wide row total, or ``None``.
    shares(scores, state): per layer, the row total a model-wide allocation gives it, from
    every layer's scores (``[None] * layers`` when each layer cuts on its own).
    """

    needs_pass: Callable[[Any], bool]
    check: Callable[[Any], None]
    score: ScoreChunk
    cut: Callable[[Any, mx.array, int | None], Any]
    shares: Callable[[list[mx.array], Any], list[int | None]]
