"""Real code for streaming perplexity: the sources of one pinned package version.

The package is ``six`` 1.17.0 (``pip install --no-deps six==1.17.0``), one module of about 35 KB;
its file and sha256 are fixed here so every run scores the same bytes. The model may have seen
public code in training, so read the numbers as a comparison between caches, not as the model's
skill. The file is found through ``importlib.util.find_spec`` without importing it.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

__all__ = ["FILES", "INSTALL_COMMAND", "PACKAGE", "code_text"]

PACKAGE = "six"
VERSION = "1.17.0"
INSTALL_COMMAND = f"pip install --no-deps {PACKAGE}=={VERSION}"
# file name -> sha256, in the order they are concatenated
FILES = {"six.py": "c51c91f703d3d4b3696c923cb5fec213e05e75d9215393befac7f2fa6a3904df"}


def code_text() -> str:
    """The pinned files' text, concatenated in order. ``FileNotFoundError`` naming the install
    command when a file is missing, ``ValueError`` when its bytes are not the pinned ones."""
    spec = importlib.util.find_spec(PACKAGE)
    origin = Path(spec.origin) if spec is not None and spec.origin else None
    if origin is None:
        raise FileNotFoundError(f"{PACKAGE} is not installed; install it with: {INSTALL_COMMAND}")
    parts = []
    for name, digest in FILES.items():
        path = origin.parent / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found; install it with: {INSTALL_COMMAND}")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"{path} is not {PACKAGE} {VERSION}'s; install: {INSTALL_COMMAND}")
        parts.append(data.decode("utf-8"))
    return "\n".join(parts)
