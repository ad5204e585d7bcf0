"""rl/ reads top to bottom: no function (or method) in rl/ is longer than MAX_LINES lines,
decorators excluded; a longer one is split into named steps."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 60


def _functions(path: Path) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every def in the file, nested ones included."""
    tree = ast.parse(path.read_text(), str(path))
    return [(n.name, n.lineno, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


@pytest.mark.parametrize("path", sorted((ROOT / "rl").rglob("*.py")), ids=lambda p: p.name)
def test_no_function_in_rl_is_longer_than_the_limit(path):
    long = [f"{path.relative_to(ROOT)}:{line}: {name} is {length} lines"
            for name, line, length in _functions(path) if length > MAX_LINES]
    assert not long, f"split into named steps (at most {MAX_LINES} lines):\n" + "\n".join(long)


def test_the_measure_counts_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "f.py").write_text(f"def long():\n{body}\n\n\ndef short():\n    return 1\n")
    assert [(n, length) for n, _, length in _functions(tmp_path / "f.py")] == [
        ("long", MAX_LINES + 1), ("short", 2)]
