"""A long prefill that survives the end of a sitting: the caches part way through a document.

A retrieval cell of the instrument at 16k tokens feeds one document for one to two hours (KVzip
reads it twice) before it asks its questions, longer than a sitting has left after its other
work. :class:`Checkpoint` keeps the caches every :attr:`Checkpoint.every` tokens in mlx-lm's
prompt-cache file (``save_prompt_cache``; Velox's ``load_prompt_cache`` reads it back and
checks the settings), with what the reader needs to go on: the tokens already fed, whether
the read is done (the method's compression pass included), and the seconds spent so far. A
rerun loads it and feeds the rest; the file is written whole to a temporary name and renamed,
so a run killed while saving leaves the previous checkpoint.

The caches a resumed read ends with equal those of a read never stopped (the smoke test
compares every array of their states); the file sits beside the results file, one per read,
and goes once the cell's row (or the RULER-style prompt's answer) is written.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

__all__ = ["Checkpoint", "Saved"]


@dataclass(frozen=True)
class Saved:
    """What a checkpoint file says about itself (its header, without the arrays)."""

    fed: int  # tokens of the document in the caches
    done: bool  # the read is finished (the method's compression pass included)
    seconds: float  # spent on the read so far, over every sitting


@dataclass(frozen=True)
class Checkpoint:
    """The caches of one read (``key``: the model and the cell, and the task's prompt where a
    cell reads several) in ``path``, kept every ``every`` tokens."""

    path: Path
    key: str
    every: int = 2048

    @classmethod
    def beside(cls, out: Path, model: str, key: str, every: int = 2048) -> Checkpoint:
        """The checkpoint of ``key`` beside the results file ``out`` (one file per key, so two
        processes on different cells do not meet)."""
        if every < 1:
            raise ValueError(f"every must be >= 1 token, got {every}")
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", key)
        path = out.with_name(f"{out.stem}.checkpoint.{name}.safetensors")
        return cls(path, f"{model}:{key}", every)

    def saved(self) -> Saved | None:
        """The header of this key's file, or ``None`` (no file, another key's, unreadable)."""
        meta = _header(self.path)
        if meta is None or meta.get("0.key") != self.key:
            return None
        try:
            return Saved(int(meta["0.fed"]), meta["0.done"] == "1", float(meta["0.seconds"]))
        except (KeyError, ValueError):
            return None

    def load(self, config: Any) -> tuple[list[Any], Saved] | None:
        """The saved caches and their header, or ``None`` when there is nothing to go on from
        (a file saved with other settings than ``config`` is set aside with a warning)."""
        from velox_mlx_lm import load_prompt_cache

        saved = self.saved()
        if saved is None:
            return None
        try:
            caches = load_prompt_cache(str(self.path), config)
        except ValueError as e:
            print(f"ignoring {self.path}: {e}", file=sys.stderr)
            return None
        # mx.load reads lazily, by the file's name: read every array now, before a later save
        # replaces the file under it
        mx.eval([c.state for c in caches])
        return caches, saved

    def save(self, caches: list[Any], saved: Saved) -> None:
        """Keep ``caches`` (evaluated) with ``saved``, replacing the file whole."""
        from mlx_lm.models.cache import save_prompt_cache

        tmp = self.path.with_name(self.path.stem + ".tmp.safetensors")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "key": self.key,
            "fed": str(saved.fed),
            "done": "1" if saved.done else "0",
            "seconds": repr(saved.seconds),
        }
        save_prompt_cache(str(tmp), caches, meta)
        os.replace(tmp, self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def _header(path: Path) -> dict[str, str] | None:
    """The ``__metadata__`` of a safetensors file (an 8-byte little-endian length, then that
    many bytes of JSON), without reading its arrays."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError):
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else None
