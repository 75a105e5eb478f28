"""Every ```python block in README.md and docs/**/*.md runs, each in a fresh interpreter.

A block is skipped when its fence reads ```python title="skip" or when the nearest non-blank
line above the fence is `<!-- skip-example -->`. Blocks run with the working directory set to a
temporary folder, so they must not rely on the repository layout.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>.*)$")
SKIP_MARKER = "<!-- skip-example -->"
TIMEOUT_S = 600


@dataclass(frozen=True)
class Example:
    path: Path
    number: int  # 1-based among the file's python blocks, skipped ones included
    line: int  # 1-based line of the opening fence
    code: str
    skip: bool

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}#{self.number}"


def is_python(info: str) -> bool:
    words = info.replace("{", " ").replace("}", " ").split()
    return bool(words) and words[0].lstrip(".") in {"python", "py"}


def skipped_by_info(info: str) -> bool:
    return re.search(r"""title\s*=\s*["']skip["']""", info) is not None


def examples_in(path: Path) -> list[Example]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Example] = []
    i = 0
    while i < len(lines):
        match = FENCE_OPEN.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info = match.group("fence"), match.group("info")
        start = i
        i += 1
        body: list[str] = []
        # The block ends at a line that is only a fence of the same kind, at least as long.
        while i < len(lines) and not (
            lines[i].strip().startswith(fence) and set(lines[i].strip()) == {fence[0]}
        ):
            body.append(lines[i])
            i += 1
        i += 1
        if not is_python(info):
            continue
        above = next((line.strip() for line in reversed(lines[:start]) if line.strip()), "")
        found.append(
            Example(
                path=path,
                number=len(found) + 1,
                line=start + 1,
                code=textwrap.dedent("\n".join(body)) + "\n",
                skip=skipped_by_info(info) or above == SKIP_MARKER,
            )
        )
    return found


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md"] if (ROOT / "README.md").exists() else []
    return files + sorted((ROOT / "docs").glob("**/*.md"))


EXAMPLES = [example for path in markdown_files() for example in examples_in(path)]


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_docs_example_runs(example: Example, tmp_path: Path) -> None:
    if example.skip:
        pytest.skip(f"{example.name} is marked skip")
    result = subprocess.run(
        [sys.executable, "-c", example.code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=TIMEOUT_S,
    )
    if result.returncode != 0:
        pytest.fail(
            f"{example.path.relative_to(ROOT)}: python block {example.number} "
            f"(line {example.line}) exited {result.returncode}\n"
            f"--- code\n{example.code}--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}",
            pytrace=False,
        )


def test_extraction_and_skip_rules(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        textwrap.dedent(
            """\
            ```python
            print("one")
            ```

            <!-- skip-example -->

            ```python
            raise SystemExit("two is skipped")
            ```

            ```python title="skip"
            raise SystemExit("three is skipped")
            ```

            ```bash
            echo not python
            ```

            !!! note
                ```python
                print("four, indented")
                ```
            """
        )
    )
    found = examples_in(page)
    assert [e.number for e in found] == [1, 2, 3, 4]
    assert [e.skip for e in found] == [False, True, True, False]
    assert found[0].code == 'print("one")\n'
    assert found[3].code == 'print("four, indented")\n'
    assert found[1].line == 7
