"""tools/bump_version.py and tools/check_versions.py on a copy of the repository."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOLS / name), *args],
        capture_output=True,
        text=True,
        check=False,
    )


def version_files(root: Path) -> list[Path]:
    """The files that state the version (what bump must rewrite)."""
    files = [root / "VERSION"]
    files += sorted(root.glob("packages/*/pyproject.toml"))
    files += sorted(root.glob("packages/*/src/*/__init__.py"))
    return files


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    """VERSION, package pyproject files, package __init__ files and Markdown docs, copied."""
    copy = tmp_path / "repo"
    sources = version_files(ROOT) + sorted(ROOT.glob("packages/*/README.md"))
    sources += sorted(ROOT.glob("docs/**/*.md"))
    if (ROOT / "README.md").exists():
        sources.append(ROOT / "README.md")
    for source in sources:
        target = copy / source.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    return copy


def test_real_repository_passes_the_check() -> None:
    result = run_tool("check_versions.py", "--root", str(ROOT))
    assert result.returncode == 0, result.stderr


def test_bump_rewrites_every_version_file(repo_copy: Path) -> None:
    old = (repo_copy / "VERSION").read_text().strip()
    new = "0.2.0" if old != "0.2.0" else "0.3.0"
    before = {path: path.read_text() for path in version_files(repo_copy)}
    assert len(before) == 8  # VERSION + 3 pyproject + 4 __init__ (velox_blas ships in velox-mlx-lm)

    result = run_tool("bump_version.py", new, "--root", str(repo_copy))
    assert result.returncode == 0, result.stderr

    for path, text in before.items():
        after = path.read_text()
        assert after != text, f"{path.relative_to(repo_copy)} was not bumped"
        assert new in after
    mlx_lm = (repo_copy / "packages/velox-mlx-lm/pyproject.toml").read_text()
    assert f"velox-cache-core=={new}" in mlx_lm
    bench = (repo_copy / "packages/velox-bench/pyproject.toml").read_text()
    assert f"velox-mlx-lm=={new}" in bench
    # Only versions change: other lines (and the mlx-lm range) are untouched.
    assert "mlx-lm>=0.32,<0.33" in mlx_lm
    assert run_tool("check_versions.py", "--root", str(repo_copy)).returncode == 0


def test_check_names_a_hand_edited_pin(repo_copy: Path) -> None:
    assert run_tool("check_versions.py", "--root", str(repo_copy)).returncode == 0
    pyproject = repo_copy / "packages/velox-bench/pyproject.toml"
    version = (repo_copy / "VERSION").read_text().strip()
    text = pyproject.read_text()
    assert f"velox-mlx-lm=={version}" in text
    pyproject.write_text(text.replace(f"velox-mlx-lm=={version}", "velox-mlx-lm==9.9.9"))

    result = run_tool("check_versions.py", "--root", str(repo_copy))
    assert result.returncode == 1
    assert "packages/velox-bench/pyproject.toml" in result.stderr
    assert "velox-mlx-lm" in result.stderr
    assert "9.9.9" in result.stderr


def test_check_names_a_stale_dunder_version(repo_copy: Path) -> None:
    init = repo_copy / "packages/velox-cache-core/src/velox_cache_core/__init__.py"
    version = (repo_copy / "VERSION").read_text().strip()
    init.write_text(init.read_text().replace(f'"{version}"', '"0.0.1"'))

    result = run_tool("check_versions.py", "--root", str(repo_copy))
    assert result.returncode == 1
    assert "velox_cache_core/__init__.py" in result.stderr
    assert "__version__" in result.stderr


def test_bump_refuses_a_malformed_version(repo_copy: Path) -> None:
    before = (repo_copy / "VERSION").read_text()
    result = run_tool("bump_version.py", "two", "--root", str(repo_copy))
    assert result.returncode != 0
    assert (repo_copy / "VERSION").read_text() == before
