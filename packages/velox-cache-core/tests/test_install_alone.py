"""velox-cache-core installs and imports on its own, without mlx-lm.

Builds the wheel, installs it alone into a fresh virtualenv (its mlx dependency comes from the
package index) and imports it there. Uses uv when it is on PATH (fast, cached), else venv + pip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.network]

PROBE = """
import importlib.util
import sys

import velox_cache_core

assert importlib.util.find_spec("mlx_lm") is None, "mlx_lm is installed in the fresh venv"
assert "mlx_lm" not in sys.modules, "importing velox_cache_core imported mlx_lm"
assert importlib.util.find_spec("mlx") is not None, "the mlx dependency was not installed"
print(velox_cache_core.__file__)
print(velox_cache_core.__version__)
"""


def clean_env() -> dict[str, str]:
    """The environment minus anything that would leak this interpreter's packages."""
    env = dict(os.environ)
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"):
        env.pop(name, None)
    return env


def run(*args: str | Path, cwd: Path) -> str:
    result = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    assert result.returncode == 0, (
        f"command failed ({result.returncode}): {' '.join(map(str, args))}\n"
        f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )
    return result.stdout


def venv_python(venv: Path) -> Path:
    if sys.platform == "win32":
        return venv / "Scripts" / "python.exe"
    return venv / "bin" / "python"


def test_core_wheel_installs_and_imports_without_mlx_lm(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    venv = tmp_path / "venv"
    uv = shutil.which("uv")
    if uv:
        run(uv, "build", "--wheel", "--out-dir", dist, PACKAGE_DIR, cwd=tmp_path)
        run(uv, "venv", "--python", sys.executable, venv, cwd=tmp_path)
        python = venv_python(venv)
        wheels = sorted(dist.glob("velox_cache_core-*.whl"))
        assert len(wheels) == 1, wheels
        run(uv, "pip", "install", "--python", python, wheels[0], cwd=tmp_path)
    else:
        run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
        python = venv_python(venv)
        run(python, "-m", "pip", "wheel", "--no-deps", "-w", dist, PACKAGE_DIR, cwd=tmp_path)
        wheels = sorted(dist.glob("velox_cache_core-*.whl"))
        assert len(wheels) == 1, wheels
        run(python, "-m", "pip", "install", wheels[0], cwd=tmp_path)

    out = run(python, "-c", PROBE, cwd=tmp_path).splitlines()
    installed_at = Path(out[0]).resolve()
    assert venv.resolve() in installed_at.parents, f"imported from {installed_at}, not the venv"
    version = (PACKAGE_DIR.parents[1] / "VERSION").read_text().strip()
    assert out[1] == version
