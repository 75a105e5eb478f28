"""What velox-serve pins: every conversation's system prompt and tool definitions.

The pinned span is the prompt's leading tokens the chat template renders for the request's
leading system messages and its tools: the longest common prefix of the prompt and the same
template rendered with those alone. The request handler measures it (a 400 naming
``--max-pinned`` when it is longer), :class:`PinTable` hands it to the generation thread by
prompt, and the prompt cache pins it in the cache the request decodes with
(``VeloxPromptCache.fetch_nearest_cache``), fresh or reused: a stored cache keeps its pins, so
the span stays pinned across turns.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from velox_cache_core import pin_room

SYSTEM_ROLES = ("system", "developer")
SHARE = 2
"""``--max-pinned``'s default: 1/``SHARE`` of the budget (within what the method can pin)."""


def config_room(config: Any) -> tuple[int, int] | None:
    """(budget, most tokens beyond the sinks it can pin: ``velox_cache_core.pin_room``) of
    ``config``'s method, or ``None`` for one that evicts nothing (mlx-lm's own cache)."""
    policy = config.record
    if policy is None:
        return None
    state = policy.init_for(config.method, **config.settings())
    room = pin_room(policy, state)
    budget = policy.traits.budget(state)
    if room is None or budget is None:
        return None
    return budget, max(0, room)


def default_max_pinned(config: Any) -> int:
    """1/:data:`SHARE` of the budget, within what it can pin (0 without a budget)."""
    found = config_room(config)
    if found is None:
        return 0
    budget, room = found
    return min(room, budget // SHARE)


def check_max_pinned(value: int | None, config: Any) -> int:
    """``--max-pinned`` (``None``: the default) checked against what the method can pin."""
    if value is None:
        return default_max_pinned(config)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"--max-pinned must be an int >= 0, got {value!r}")
    found = config_room(config)
    room = None if found is None else found[1]
    if room is not None and value > room:
        raise ValueError(
            f"--max-pinned {value} does not fit --method {config.method}'s budget: at most "
            f"{room} tokens can be pinned (the budget less its sinks, the rows it always keeps "
            "and one to evict)"
        )
    return value


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def system_span(request: Any, prompt: list[int], tokenize: Callable[[Any], list[int]]) -> int:
    """Leading tokens of ``prompt`` the template renders for the request's leading system
    messages and its tools (0: a request with neither, or a template that cannot render them
    alone). ``tokenize(request)``: the prompt tokens of a request, as the server makes them."""
    if request.request_type != "chat":
        return 0
    messages = list(request.messages or [])
    system = []
    for message in messages:
        if message.get("role") not in SYSTEM_ROLES:
            break
        system.append(message)
    if not system and not request.tools:
        return 0
    head = copy.copy(request)
    head.messages = system
    try:
        rendered = tokenize(head)
    except Exception:  # a template that needs a user turn: nothing pinned
        return 0
    return common_prefix(rendered, prompt)


class PinTable:
    """Spans to pin, by prompt: the handler puts, the generation thread pops (thread safe;
    only the newest :data:`LIMIT` are kept, for requests that never reach generation)."""

    LIMIT = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: OrderedDict[tuple[int, ...], int] = OrderedDict()

    def put(self, prompt: Sequence[int], span: int) -> None:
        with self._lock:
            self._spans[tuple(prompt)] = span
            while len(self._spans) > self.LIMIT:
                self._spans.popitem(last=False)

    def pop(self, prompt: Sequence[int]) -> int:
        with self._lock:
            return self._spans.pop(tuple(prompt), 0)
