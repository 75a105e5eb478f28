"""Puts this directory on ``sys.path`` so that tests import their support modules by name
(``import core_harness``, ``import core_reference``), whatever pytest's import mode.

Support modules are named ``core_*``: every package's tests run in one pytest process, and a
module name must not collide with another test directory's.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
