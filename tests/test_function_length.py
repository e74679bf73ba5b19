"""The style rule "no function over 70 lines outside @triton.jit kernels", checked over the whole package by AST.

A function's span is its first decorator (or `def`) line through its last line, docstring and comments included;
nested functions and methods count on their own and inside their parent.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pagedqvg"
MAX_LINES = 70

#: Files exempt from the rule (none: every module of the package is checked).
ALLOWED_FILES: frozenset[str] = frozenset()


def _allowed(rel: str) -> bool:
    return any(rel == a or (a.endswith("/") and rel.startswith(a)) for a in ALLOWED_FILES)


def _is_triton_jit(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if ast.unparse(target) in ("triton.jit", "jit"):
            return True
    return False


def function_spans(source: str) -> list[tuple[str, int, int]]:
    """(qualified name, first line, lines) of every function in `source`, @triton.jit kernels left out."""
    out: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                assert child.end_lineno is not None
                if not _is_triton_jit(child):
                    out.append((prefix + child.name, first, child.end_lineno - first + 1))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def test_the_checker_measures_spans_and_skips_triton_kernels() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(70))
    source = (
        f"def long():\n{body}\n\n"
        f"@triton.jit\ndef kernel():\n{body}\n\n"
        f"class A:\n    @staticmethod\n    def m():\n        pass\n"
    )
    spans = {name: n for name, _first, n in function_spans(source)}
    assert spans == {"long": 71, "A.m": 3}


def test_no_function_over_70_lines() -> None:
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if _allowed(rel):
            continue
        for name, first, n in function_spans(path.read_text(encoding="utf-8")):
            if n > MAX_LINES:
                too_long.append(f"pagedqvg/{rel}:{first} {name}: {n} lines")
    assert not too_long, "functions over 70 lines (split them into named pieces):\n" + "\n".join(too_long)


def test_the_cache_class_is_at_most_500_lines() -> None:
    """`PagedCausalKVCache` keeps the calls; packing (cache_packing.py), argument checks (cache_args.py) and the
    read-only surface (cache_readout.py) live in their own modules."""
    tree = ast.parse((PACKAGE / "cache" / "paged_cache.py").read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PagedCausalKVCache"]
    assert cls.end_lineno is not None
    assert cls.end_lineno - cls.lineno + 1 <= 500


def test_the_allow_list_names_existing_files() -> None:
    for entry in ALLOWED_FILES:
        assert (PACKAGE / entry).exists(), f"{entry} is in ALLOWED_FILES but does not exist"
