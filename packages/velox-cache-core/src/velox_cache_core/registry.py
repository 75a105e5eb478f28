"""The policy registry: :data:`POLICIES`, :func:`register` and the lookups.

One :class:`~velox_cache_core.policy.Policy` record per eviction policy, the single source of
truth: everything outside a policy's own module (the mlx-lm cache classes, ``KVCacheConfig``'s
``<policy>_<setting>`` fields, the CLI's ``--method`` choices, the benchmarks' method lists,
prompt-cache encoding) asks the record instead of naming policies.
"""

from __future__ import annotations

from collections.abc import Iterable

from velox_cache_core.declarations import field_name, flag_name
from velox_cache_core.policy import Policy, check

POLICIES: dict[str, Policy] = {}
# Option strings (``--flag``) of the commands that generate ``--<policy>-<setting>`` flags,
# which no policy's flag may equal or abbreviate (argparse accepts unique prefixes); the
# integrations add theirs with :func:`reserve_flags`.
RESERVED_FLAGS: set[str] = set()
# Config fields every integration has besides ``<policy>_<setting>``.
RESERVED_FIELDS = {"method", "head_dim", "trim_window", "kv_bits", "kv_group_size", "kv_key_layout"}


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
    """Add ``policy`` to :data:`POLICIES`. Every field must be of its declared type
    (:func:`velox_cache_core.policy.check`: ``TypeError``/``ValueError`` naming the field), its
    name and method names must be new, and none of its ``<policy>_<setting>`` config fields or
    ``--<policy>-<setting>`` flags may equal another's, nor a flag equal or abbreviate another
    or a reserved one."""
    check(policy)
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
