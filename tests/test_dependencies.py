"""Every third-party module the `arborlm` package imports is installed by `pip install .`.

The README's main job installs the package without its `dev` extra, so a module that only the
dev extra brings (jsonschema once was: the semantic guard validates with it, and the server did
not start) fails only there, never in the test environment. The imports are read statically
with `ast` (function-level ones included, as the import-graph test does), mapped to their
distributions with `importlib.metadata`, and each must be a requirement of the project itself
or of one of its feature extras (`gpu`: GPU-only packages; `openai`: the DSL's OpenAI backend,
which names the package when it is missing) — not of `dev`.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Modules installed by a declared requirement's own requirements or wheel (fastapi is built on
# starlette and requires it), or a feature extra's modules not installed on this machine.
COMES_WITH = {"starlette": "fastapi", "torchgen": "torch", "flashinfer": "flashinfer-python",
              "triton": "triton"}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0].lower().replace("_", "-")
            for r in requirements}


def _imported_top_levels() -> dict[str, str]:
    """Top-level module name -> one file importing it, over every module of `arborlm`."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "arborlm").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_third_party_import_is_a_declared_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _names(project["dependencies"])
    for extra, requirements in project["optional-dependencies"].items():
        if extra != "dev":
            declared |= _names(requirements)
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for module, where in sorted(_imported_top_levels().items()):
        if module == "arborlm" or module in sys.stdlib_module_names:
            continue
        dists = {d.lower().replace("_", "-") for d in distributions.get(module, [])}
        if module in COMES_WITH:
            dists = {COMES_WITH[module]}
        if not dists:
            missing.append(f"{module} ({where}): not installed here, so not declared")
        elif not dists & declared:
            missing.append(f"{module} ({where}) from {sorted(dists)}")
    assert not missing, ("imported by arborlm but not a dependency of `pip install .`: "
                         + "; ".join(missing))
