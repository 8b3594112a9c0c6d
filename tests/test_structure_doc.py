"""`docs/structure.md` stays true: its module table names every module of the package (and every
C++ source of the CPU kernels) and no file that is gone, and each Python row says what the
module's docstring says first."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| `([^`]+)` \| (.*) \|$")


def _rows() -> dict[str, str]:
    text = (ROOT / "docs" / "structure.md").read_text()
    table = text.split("## Modules", 1)[1]
    return {m.group(1): m.group(2) for line in table.splitlines() if (m := ROW.match(line))}


def _sources() -> list[str]:
    package = ROOT / "arborlm"
    files = [p for p in package.rglob("*") if p.suffix in (".py", ".cpp", ".h")]
    return sorted(str(p.relative_to(ROOT)) for p in files if "__pycache__" not in p.parts)


def _first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.splitlines()[0] if doc else ""


def test_every_module_has_a_row_and_every_row_a_module():
    rows, sources = _rows(), _sources()
    assert sorted(set(sources) - set(rows)) == [], "modules missing from docs/structure.md"
    assert sorted(set(rows) - set(sources)) == [], "docs/structure.md names files that are gone"


def test_python_rows_say_what_the_docstring_says_first():
    wrong = {name: (text, _first_line(ROOT / name)) for name, text in _rows().items()
             if name.endswith(".py") and (ROOT / name).exists()
             and text != _first_line(ROOT / name).replace("|", "\\|")}
    assert wrong == {}, "rows whose text is not the module docstring's first line"
