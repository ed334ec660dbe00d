"""The package's code stays in rooms a reader can hold: no function over 80 lines, no class over 250 lines in
megatron_qarl/ (read from the source with ``ast``; a nested function counts inside its parent too). A longer one is
split at its seams (issue 28: Engine was 290 lines, gpu smoke's learner_checks 91)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 250


def sizes(root: Path) -> list[tuple[int, str, str]]:
    """(lines, 'def' or 'class', 'path:line name') of every function and class under ``root``, largest first."""
    rows = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "def"
                where = f"{path.relative_to(root.parent)}:{node.lineno} {node.name}"
                rows.append((node.end_lineno - node.lineno + 1, kind, where))
    return sorted(rows, reverse=True)


def too_long(rows: list[tuple[int, str, str]]) -> list[str]:
    limit = {"def": MAX_FUNCTION_LINES, "class": MAX_CLASS_LINES}
    return [f"{kind} {where}: {n} lines (limit {limit[kind]})" for n, kind, where in rows if n > limit[kind]]


def test_no_function_over_80_lines_and_no_class_over_250_in_the_package():
    rows = sizes(REPO / "megatron_qarl")
    assert len(rows) > 500  # the package was read
    assert not too_long(rows), "split these at their seams:\n" + "\n".join(too_long(rows))


def test_the_check_counts_lines_of_functions_and_classes(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    (pkg / "m.py").write_text(f"def ok():\n{body[:-len(chr(10) + '    x79 = 79')]}\n\ndef long():\n{body}\n")
    assert too_long(sizes(pkg)) == ["def pkg/m.py:82 long: 81 lines (limit 80)"]
