"""A policy state and its undo log as mlx-lm's prompt-cache files hold them: arrays plus one
JSON string of scalars (``save_prompt_cache``/``load_prompt_cache`` round-trip them losslessly,
positions and settings included). Quantized rows are saved as their packed words, scales and
biases (``slots_keys_packed``, ...), with ``kv_bits`` and ``kv_group_size`` in the JSON."""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import replace
from typing import Any

import mlx.core as mx

from velox_cache_core import (
    Entry,
    History,
    HistoryBefore,
    KRows,
    KVSlots,
    Lanes,
    LaneStep,
    Policy,
    PolicyState,
    QRows,
    Quant,
    Tier,
    TierSpec,
    UndoLog,
    quant_of,
    running_fields,
    stored_fields,
)


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


# Lanes: for files whose undo entries still carried the lanes among their running fields
# (before LaneStep); LaneStep: an undo entry of a call over lanes holds one per token;
# HistoryBefore: an undo entry's history, as the rows its call pushed out
_PACKED_TYPES = {
    t.__name__: t
    for t in (KVSlots, History, HistoryBefore, Entry, UndoLog, QRows, KRows, Lanes, LaneStep)
}


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


def encode(state: Any, log: UndoLog | None) -> dict[str, Any]:
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
                _put(out, f"{f.name}_{member.name}", getattr(value, member.name))
        elif isinstance(value, mx.array) or (value is None and f.name in arrays):
            out[f.name] = value
        else:
            meta[f.name] = value
    quant = quant_of_state(state)
    if quant is not None:
        meta.update(kv_bits=quant.bits, kv_group_size=quant.group_size)
        if quant.keys != "token":
            meta.update(kv_key_layout=quant.keys)
    undo: dict[str, mx.array] = {}
    skeleton = None if log is None else _pack(log, "undo", undo)
    out.update(undo)
    out["meta"] = json.dumps({**meta, "undo": skeleton}, sort_keys=True)
    return out


def _put(out: dict[str, Any], name: str, value: Any) -> None:
    """``value`` under ``name``; quantized rows as ``<name>_packed``/``_scales``/``_biases``
    (and, for keys quantized per channel, ``_window``/``_where``)."""
    if isinstance(value, (QRows, KRows)):
        parts = ("packed", "scales", "biases", "window", "where")
        for part, array in zip(parts, value.arrays(), strict=False):
            out[f"{name}_{part}"] = array
    else:
        out[name] = value


def _get(data: dict[str, Any], name: str, quant: Quant | None) -> Any:
    """What :func:`_put` saved under ``name`` (rows quantized as ``quant`` when given)."""
    if quant is None or f"{name}_packed" not in data:
        return data.get(name)
    packed, scales, biases = (data[f"{name}_{part}"] for part in ("packed", "scales", "biases"))
    if f"{name}_where" in data:
        window, where = data[f"{name}_window"], data[f"{name}_where"]
        return KRows(packed, scales, biases, window, where, quant.bits, quant.group_size)
    return QRows(packed, scales, biases, quant.bits, quant.group_size)


def quant_of_state(state: PolicyState) -> Quant | None:
    """How a state's rows are quantized (``None``: full precision or no rows yet)."""
    slots = state.slots
    return None if slots is None else quant_of(slots.keys)


def _array_type(state_type: type, name: str) -> type | None:
    """The dataclass a running field holds (slots, history), from its type annotation."""
    hint = typing.get_type_hints(state_type).get(name)
    for arg in typing.get_args(hint) or (hint,):
        if dataclasses.is_dataclass(arg):
            return arg  # type: ignore[return-value]
    return None


def decode(policy: Policy, data: dict[str, Any]) -> tuple[Any, UndoLog | None]:
    meta = json.loads(data["meta"])
    skeleton = meta.pop("undo", None)
    bits, group = meta.pop("kv_bits", None), meta.pop("kv_group_size", 64)
    quant = Quant.of(bits, group, meta.pop("kv_key_layout", "token"))
    fix = None
    if policy.upgrade is not None:  # saved by an older release
        meta, fix = policy.upgrade(meta)
    state_type = policy.state_type
    fields = {f.name for f in dataclasses.fields(state_type)}
    unknown = set(meta) - fields
    if unknown:
        raise ValueError(f"saved {policy.name} state has unknown fields {sorted(unknown)}")
    running = set(running_fields(state_type))
    changes = {k: meta.pop(k) for k in running if k in meta}
    state = policy.init(**meta)  # validates the settings
    for name in running - set(changes):
        value = _array_field(state_type, name, data, quant)
        if value is not None:
            changes[name] = value
    after = replace(state, **changes)
    if fix is not None:
        after = fix(after)
    _check_rows(policy, after)
    return after, None if skeleton is None else _unpack(skeleton, data)


def _array_field(state_type: type, name: str, data: dict[str, Any], quant: Quant | None) -> Any:
    """A running field saved as arrays: one array, or a dataclass of them (slots, lanes,
    history) saved as ``<field>_<member>``; ``None`` when it was ``None``."""
    member_type = _array_type(state_type, name)
    if member_type is None:
        return data.get(name)
    members = {m.name: _get(data, f"{name}_{m.name}", quant) for m in stored_fields(member_type)}
    first = stored_fields(member_type)[0].name
    return None if members[first] is None else member_type(**members)


def _check_rows(policy: Policy, state: Any) -> None:
    """A loaded state of a policy without a prompt end holds at most ``budget`` rows, unless
    it holds its prompt for an adaptive cut still to come."""
    budget = policy.traits.budget(state)
    if (
        policy.prompt_end is None
        and not state.holds_prompt
        and budget is not None
        and state.n_kept > budget
    ):
        raise ValueError(
            f"saved {policy.name} state holds more rows ({state.n_kept}) than budget {budget}"
        )


# A demoted tier's arrays in a prompt-cache file: keys per channel, values per token, rows'
# positions and scores (velox_cache_core.store.tier); its settings in the JSON string "tier".
_TIER_ARRAYS = (
    "keys_packed",
    "keys_scales",
    "keys_biases",
    "keys_window",
    "keys_where",
    "values_packed",
    "values_scales",
    "values_biases",
    "positions",
    "scores",
)


def tier_state(spec: TierSpec, tier: Tier | None) -> dict[str, Any]:
    """The file entries of a layer's tier: ``tier`` (its settings, JSON) and ``tier_*``
    arrays (none while the tier is empty)."""
    out: dict[str, Any] = {"tier": json.dumps(dataclasses.asdict(spec), sort_keys=True)}
    if tier is not None:
        for name, array in zip(_TIER_ARRAYS, tier.arrays(), strict=True):
            out[f"tier_{name}"] = array
    return out


def load_tier(data: dict[str, Any]) -> tuple[TierSpec | None, Tier | None]:
    """Pop a file's tier entries: (its settings, its rows), ``(None, None)`` without one."""
    saved = data.pop("tier", None)
    arrays = [data.pop(f"tier_{name}", None) for name in _TIER_ARRAYS]
    if saved is None:
        return None, None
    spec = TierSpec(**json.loads(saved))
    if any(a is None for a in arrays):
        return spec, None
    kp, ks, kb, kw, kwhere, vp, vs, vb, positions, scores = arrays
    keys = KRows(kp, ks, kb, kw, kwhere, spec.bits, spec.group_size)
    values = QRows(vp, vs, vb, spec.bits, spec.group_size)
    return spec, Tier(keys, values, positions, scores)
