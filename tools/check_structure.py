"""Structure checks `nox -s lint` runs on every package's ``src``.

1. No import cycle inside a package, counting every import: module level, function-local and
   under ``TYPE_CHECKING`` (a cycle hidden behind either is still a cycle for a reader).
2. No function above cyclomatic complexity 15, as radon counts it.
3. velox-mlx-lm imports only public names of the core: ``from velox_cache_core import NAME``
   with ``NAME`` in ``velox_cache_core.__all__``, never a core submodule.

    python tools/check_structure.py [--max-complexity 15]

Exits 1 naming each cycle, each function over the limit and each private core import.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_COMPLEXITY = 15


def _modules(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``src``."""
    out = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module a ``from ... import`` names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its body."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, node, is_package)
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def _is_parent_package(a: str, b: str) -> bool:
    """A package's ``__init__`` importing its own submodule (or a submodule importing a name
    its parent re-exports) is how Python packages work, not a cycle between two modules."""
    return b.startswith(a + ".") or a.startswith(b + ".")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle found by depth-first search (one report per cycle)."""
    found: list[list[str]] = []
    seen: set[tuple[str, ...]] = set()

    def visit(node: str, path: list[str], on_path: set[str]) -> None:
        for nxt in sorted(graph[node]):
            if _is_parent_package(node, nxt):
                continue
            if nxt in on_path:
                cycle = path[path.index(nxt) :]
                key = tuple(sorted(cycle))
                if key not in seen:
                    seen.add(key)
                    found.append([*cycle, nxt])
                continue
            if len(path) < 12:
                visit(nxt, [*path, nxt], on_path | {nxt})

    for start in sorted(graph):
        visit(start, [start], {start})
    return found


def complex_functions(src: Path, limit: int) -> list[str]:
    """``path:line name (CC)`` for every function over ``limit`` (radon's count)."""
    from radon.complexity import cc_visit
    from radon.visitors import Function

    out = []
    for path in sorted(src.rglob("*.py")):
        blocks = cc_visit(path.read_text())
        methods = [m for b in blocks for m in getattr(b, "methods", [])]
        functions = {(b.lineno, b.fullname): b for b in [*blocks, *methods]}
        for block in functions.values():
            if isinstance(block, Function) and block.complexity > limit:
                where = path.relative_to(ROOT)
                out.append(f"{where}:{block.lineno} {block.fullname} ({block.complexity})")
    return out


def _public_core_names() -> set[str]:
    """``velox_cache_core.__all__``, read from its ``__init__.py`` without importing it."""
    init = ROOT / "packages/velox-cache-core/src/velox_cache_core/__init__.py"
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return set()


def private_core_imports(src: Path) -> list[str]:
    """``path:line what`` for every import under ``src`` of a core submodule or of a name
    ``velox_cache_core`` does not export."""
    public = _public_core_names()
    out = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                names = [a.name for a in node.names]
                if module.startswith("velox_cache_core."):
                    bad = [f"from {module} import {', '.join(names)}"]
                else:
                    bad = [n for n in names if module == "velox_cache_core" and n not in public]
            elif isinstance(node, ast.Import):
                bad = [f"import {a.name}" for a in node.names]
                bad = [b for b in bad if b.startswith("import velox_cache_core.")]
            else:
                continue
            out += [f"{path.relative_to(ROOT)}:{node.lineno} {b}" for b in bad]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-complexity", type=int, default=MAX_COMPLEXITY)
    args = parser.parse_args(argv)
    problems: list[str] = []
    for src in sorted(ROOT.glob("packages/*/src")):
        graph = imports(_modules(src))
        problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
        problems += [
            f"complexity over {args.max_complexity}: {f}"
            for f in complex_functions(src, args.max_complexity)
        ]
    mlx_lm = ROOT / "packages/velox-mlx-lm/src"
    problems += [
        f"velox-mlx-lm imports a private core name: {p}" for p in private_core_imports(mlx_lm)
    ]
    for line in problems:
        print(line)
    if problems:
        return 1
    print(
        f"no import cycle; no function over complexity {args.max_complexity}; "
        "velox-mlx-lm imports public core names only"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
