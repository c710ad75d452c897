"""The package's shape rules: no source file over 400 lines, and no function in the engine, runner or cache
packages over 60 lines (from its `def` to its last line). That linear layers come only from flashvlm/layers is
tested in tests/models/test_linear_layers.py (test_no_nn_linear_outside_layers)."""

from __future__ import annotations

import ast
from pathlib import Path

import flashvlm

ROOT = Path(flashvlm.__file__).parent
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
FUNCTION_PACKAGES = ("engine", "runner", "cache")


def _sources(root: Path) -> list[Path]:
    return sorted(root.rglob("*.py"))


def test_no_file_over_the_line_limit() -> None:
    sizes = {p.relative_to(ROOT.parent): len(p.read_text().splitlines()) for p in _sources(ROOT)}
    over = {str(p): n for p, n in sizes.items() if n > MAX_FILE_LINES}
    assert not over, f"files over {MAX_FILE_LINES} lines: {over}"


def test_no_function_over_the_line_limit() -> None:
    over = {}
    for package in FUNCTION_PACKAGES:
        for path in _sources(ROOT / package):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    span = node.end_lineno - node.lineno + 1
                    if span > MAX_FUNCTION_LINES:
                        over[f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}"] = span
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: {over}"
