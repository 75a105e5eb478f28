"""Check that every version in the repository agrees with the VERSION file.

    python tools/check_versions.py [--root DIR]

Checked: each package's `[project] version`, every `velox-*==X` pin (package pyproject files,
README.md, docs/**/*.md) and every `__version__` in packages/*/src/*/__init__.py.
Exits 1 naming each file and line that disagrees.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

VERSION_FORMAT = re.compile(r"^\d+\.\d+\.\d+(?:(?:a|b|rc)\d+)?(?:\.(?:post|dev)\d+)?$")
PIN = re.compile(r"(?P<name>\bvelox-[a-z0-9-]+)==(?P<version>[A-Za-z0-9.+!-]*[A-Za-z0-9])")
PROJECT_VERSION = re.compile(r'^(?P<key>version\s*=\s*")(?P<version>[^"]*)(?P<end>")')
DUNDER_VERSION = re.compile(r"^(?P<key>__version__\s*=\s*[\"'])(?P<version>[^\"']*)(?P<end>[\"'])")
TABLE = re.compile(r"^\s*\[(?P<name>[^\]]+)\]")


@dataclass(frozen=True)
class Site:
    """One place in one file that states the version."""

    path: Path
    line: int  # 1-based
    what: str  # e.g. "[project] version", "pin velox-cache-core", "__version__"
    version: str


def package_pyprojects(root: Path) -> list[Path]:
    return sorted(root.glob("packages/*/pyproject.toml"))


def package_inits(root: Path) -> list[Path]:
    return sorted(root.glob("packages/*/src/*/__init__.py"))


def pin_files(root: Path) -> list[Path]:
    files = package_pyprojects(root) + sorted(root.glob("docs/**/*.md"))
    readme = root / "README.md"
    if readme.exists():
        files.append(readme)
    files += sorted(root.glob("packages/*/README.md"))
    return files


def sites_in(path: Path) -> list[Site]:
    """Every version statement in `path`, in line order."""
    sites: list[Site] = []
    table = ""
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if path.name == "pyproject.toml":
            header = TABLE.match(text)
            if header:
                table = header.group("name").strip()
            match = PROJECT_VERSION.match(text)
            if table == "project" and match:
                sites.append(Site(path, number, "[project] version", match.group("version")))
        if path.name == "__init__.py":
            match = DUNDER_VERSION.match(text)
            if match:
                sites.append(Site(path, number, "__version__", match.group("version")))
        for pin in PIN.finditer(text):
            sites.append(Site(path, number, f"pin {pin.group('name')}", pin.group("version")))
    return sites


def find_sites(root: Path) -> list[Site]:
    files = dict.fromkeys(package_pyprojects(root) + package_inits(root) + pin_files(root))
    return [site for path in files for site in sites_in(path)]


def read_version(root: Path) -> str:
    return (root / "VERSION").read_text(encoding="utf-8").strip()


def problems(root: Path) -> list[str]:
    """Human-readable disagreements with VERSION; empty when everything agrees."""
    version_file = root / "VERSION"
    if not version_file.exists():
        return [f"{version_file}: missing (it is the single source of the version)"]
    version = read_version(root)
    found: list[str] = []
    if not VERSION_FORMAT.match(version):
        found.append(f"{version_file}: {version!r} is not a version like 1.2.3")
    sites = find_sites(root)
    for pyproject in package_pyprojects(root):
        if not any(s.path == pyproject and s.what == "[project] version" for s in sites):
            found.append(f'{pyproject.relative_to(root)}: no `version = "..."` in [project]')
    for init in package_inits(root):
        if not any(s.path == init and s.what == "__version__" for s in sites):
            found.append(f'{init.relative_to(root)}: no `__version__ = "..."`')
    for site in sites:
        if site.version != version:
            found.append(
                f"{site.path.relative_to(root)}:{site.line}: {site.what} is {site.version!r} "
                f"but VERSION is {version!r}"
            )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root", type=Path, default=Path(__file__).resolve().parent.parent, help="repo root"
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    found = problems(root)
    if found:
        print("Versions disagree with VERSION:", file=sys.stderr)
        for line in found:
            print(f"  {line}", file=sys.stderr)
        print("Fix with: python tools/bump_version.py NEW_VERSION", file=sys.stderr)
        return 1
    print(f"All versions agree: {read_version(root)} ({len(find_sites(root))} places checked).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
