"""Test-support modules (numpy references, helpers), loaded once by file path.

pytest runs in importlib mode, so tests/ is not on sys.path; the modules are exposed as
``velox_core_tests.<name>`` (``from velox_core_tests import helpers``).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

SUPPORT = ("helpers", "reference", "reference_siblings", "sibling_harness")


def _load_support() -> None:
    if "velox_core_tests" in sys.modules:
        return
    package = types.ModuleType("velox_core_tests")
    package.__path__ = []  # a namespace for `from velox_core_tests import name`
    sys.modules["velox_core_tests"] = package
    for name in SUPPORT:
        qualified = f"velox_core_tests.{name}"
        spec = importlib.util.spec_from_file_location(
            qualified, Path(__file__).with_name(f"{name}.py")
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
        setattr(package, name, module)


_load_support()
