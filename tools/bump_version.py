"""Set one new version everywhere: VERSION, package versions, `velox-*==` pins, `__version__`.

    python tools/bump_version.py NEW_VERSION [--root DIR]

Rewrites exactly the places tools/check_versions.py checks, then runs that check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from check_versions import (
    DUNDER_VERSION,
    PIN,
    PROJECT_VERSION,
    TABLE,
    VERSION_FORMAT,
    find_sites,
    problems,
)


def bump_text(path: Path, text: str, new: str) -> str:
    """`text` of `path` with every version statement set to `new`."""
    lines = text.splitlines(keepends=True)
    table = ""
    for i, line in enumerate(lines):
        if path.name == "pyproject.toml":
            header = TABLE.match(line)
            if header:
                table = header.group("name").strip()
            if table == "project":
                line = PROJECT_VERSION.sub(rf"\g<key>{new}\g<end>", line)
        if path.name == "__init__.py":
            line = DUNDER_VERSION.sub(rf"\g<key>{new}\g<end>", line)
        lines[i] = PIN.sub(lambda m: f"{m.group('name')}=={new}", line)
    return "".join(lines)


def bump(root: Path, new: str) -> list[Path]:
    """Write `new` everywhere under `root`; return the files that changed."""
    changed: list[Path] = []
    version_file = root / "VERSION"
    if version_file.read_text(encoding="utf-8").strip() != new:
        version_file.write_text(new + "\n", encoding="utf-8")
        changed.append(version_file)
    for path in dict.fromkeys(site.path for site in find_sites(root)):
        old_text = path.read_text(encoding="utf-8")
        new_text = bump_text(path, old_text, new)
        if new_text != old_text:
            path.write_text(new_text, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version", help="new version, e.g. 0.2.0")
    parser.add_argument(
        "--root", type=Path, default=Path(__file__).resolve().parent.parent, help="repo root"
    )
    args = parser.parse_args(argv)
    if not VERSION_FORMAT.match(args.version):
        parser.error(f"{args.version!r} is not a version like 1.2.3")
    root = args.root.resolve()
    for path in bump(root, args.version):
        print(f"updated {path.relative_to(root)}")
    left = problems(root)
    if left:
        print("Still disagreeing after the bump:", *left, sep="\n  ", file=sys.stderr)
        return 1
    print(f"Version is now {args.version}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
