"""A policy's settings as typed records, read once from its ``init`` signature.

``init(budget: int = 512, signal: Literal["query", "key"] | None = None, ...)`` declares every
setting a user can give: its name, its type (``int``, ``float``, ``str``, ``bool``), its
choices (a ``Literal``) and its default (``None``: the method's preset decides). Configs,
command-line flags (``--<policy>-<setting>``) and docs are generated from these records.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


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
        Setting(s.name, s.kind, s.default, s.choices, help.get(s.name, COMMON_HELP.get(s.name, "")))
        for s in _settings(init)
    )
