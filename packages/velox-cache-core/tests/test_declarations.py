"""What a policy declares, and what the registry checks of it at ``register()``.

The ``Policy`` record's capabilities are typed fields: a record whose field is not of its
declared type is refused when it is registered, with an error naming the field. The state base
declares what every state answers (``allocation``, ``holds_prompt``, ``lanes``), so nothing
probes a state for an attribute it may lack.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

import velox_cache_core
from velox_cache_core import POLICIES, Policy, PolicyState, register, unregister
from velox_cache_core.policy import check

SRC = Path(velox_cache_core.__file__).resolve().parent

WRONG: list[tuple[str, Any, str]] = [
    ("name", 3, "str"),
    ("state_type", int, "type[PolicyState]"),
    ("init", "init", "Callable"),
    ("rule", None, "Callable"),
    ("uses_queries", 1, "bool"),
    ("prompt_end", 7, "Callable"),
    ("grows_after_prompt_end", "yes", "bool"),
    ("evict_before", True, "Callable"),
    ("presets", {"x": 1}, "Mapping"),
    ("packs_rows", None, "bool"),
    ("traits", {}, "Traits"),
    ("compressor", "kvzip", "Compressor | None"),
    ("help", {"budget": 3}, "Mapping"),
    ("summary", ["tova"], "Mapping"),
    ("upgrade", 1.0, "Callable"),
    ("lane_rule", object(), "LaneRule | None"),
    ("global_rule", "global", "GlobalRule | None"),
    ("compiled_decode", 0, "bool"),
    ("appends_now", False, "Callable"),
    ("demote_scoring", "mean", "Literal"),
]


def _renamed(**changes: Any) -> Policy:
    """TOVA's record under a name no registered policy uses, with ``changes``."""
    fields: dict[str, Any] = {"name": "tova_declared", "presets": {}, **changes}
    return dataclasses.replace(POLICIES["tova"], **fields)


def test_every_registered_record_passes_its_own_checks() -> None:
    for policy in POLICIES.values():
        check(policy)


def test_wrong_lists_every_field() -> None:
    assert {name for name, _, _ in WRONG} == {f.name for f in dataclasses.fields(Policy)}


@pytest.mark.parametrize(("field", "value", "declared"), WRONG, ids=[w[0] for w in WRONG])
def test_register_refuses_a_field_of_the_wrong_type(field: str, value: Any, declared: str) -> None:
    record = _renamed(**{field: value})
    expected = f"field '{field}' must be {re.escape(declared)}"
    with pytest.raises(TypeError, match=expected):
        register(record)
    assert record.name not in POLICIES


def test_register_refuses_contradicting_capabilities() -> None:
    with pytest.raises(ValueError, match="field 'appends_now' needs grows_after_prompt_end"):
        register(_renamed(appends_now=lambda state: True, grows_after_prompt_end=False))
    with pytest.raises(ValueError, match="field 'name' must be an identifier"):
        register(_renamed(name="not a name"))
    with pytest.raises(TypeError, match="policy must be a Policy"):
        register({"name": "tova"})  # type: ignore[arg-type]


def test_register_accepts_a_well_typed_record() -> None:
    record = _renamed(packs_rows=False, compiled_decode=False, global_rule=None)
    try:
        assert register(record) is record
        assert POLICIES["tova_declared"] is record
    finally:
        unregister("tova_declared")


def test_the_state_base_declares_what_every_state_answers() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Plain(PolicyState):
        budget: int = 4

    state = Plain()
    assert state.allocation == "uniform"
    assert state.holds_prompt is False
    assert state.lanes is None
    assert state.settings == {"budget": 4}  # the declared answers are not settings
    tova = POLICIES["tova"].init_for("tova", budget=8, scope="head", allocation="head")
    assert tova.allocation == "head" and "allocation" in tova.settings
    assert tova.holds_prompt is True  # an adaptive allocation holds the prompt until its cut
    assert POLICIES["tova"].init_for("tova", budget=8).holds_prompt is False


def _literal_probes(path: Path) -> list[str]:
    """``getattr(obj, "literal", default)`` calls in ``path``: a probe for an attribute that
    a declaration should have named."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) == 3
            and isinstance(node.args[1], ast.Constant)
        ):
            out.append(f"{path.relative_to(SRC)}:{node.lineno} {ast.unparse(node)}")
    return out


def test_no_attribute_probe_in_the_core() -> None:
    assert [p for path in sorted(SRC.rglob("*.py")) for p in _literal_probes(path)] == []
