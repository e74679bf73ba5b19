"""Tests reach the library's private state only through tests/helpers.py.

An AST scan of every Python file under tests/ (helpers.py, the one helper module allowed to, excepted): no attribute
access `x._name` (read, write or monkeypatch target) where `_name` is a private attribute or method of a pagedqvg
class — a name assigned as `self._name` or defined in a class body anywhere in pagedqvg/ — except on `self`/`cls`.
Private names of third-party objects that pagedqvg only hooks (SGLang's `_allocate_causal_kv_cache`) are allowed.
Module-level private functions and constants are out of scope here (a module is not an instance whose state moves).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "pagedqvg"
#: Files allowed to read private state: the one helper module.
ALLOWED = {"helpers.py"}
#: Private names of third-party objects (SGLang's stage method that the integration hooks), not pagedqvg state.
THIRD_PARTY = {"_allocate_causal_kv_cache"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_class_names(source: str) -> set[str]:
    """Private attribute and method names of the classes in `source`: `self._x` stores, and private names defined in
    class bodies (methods, class attributes, annotated fields)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name):
                    names.add(item.name)
                targets = item.targets if isinstance(item, ast.Assign) else [item.target] if isinstance(
                    item, ast.AnnAssign) else []  # fmt: skip
                names |= {t.id for t in targets if isinstance(t, ast.Name) and _private(t.id)}
        is_self_store = (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                         and isinstance(node.value, ast.Name) and node.value.id == "self")  # fmt: skip
        if is_self_store and _private(node.attr):
            names.add(node.attr)
    return names


def private_reads(source: str, private: set[str]) -> list[str]:
    """`line: expression` of every access to a name of `private` on something other than `self` / `cls`, including
    `monkeypatch.setattr(obj, "_name", ...)` and `getattr(obj, "_name")`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        on_self = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in (
            "self", "cls")  # fmt: skip
        if isinstance(node, ast.Attribute) and node.attr in private and not on_self:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in ("setattr", "getattr", "delattr") and node.args[1].value in private:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _package_private() -> set[str]:
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        names |= private_class_names(path.read_text(encoding="utf-8"))
    return names - THIRD_PARTY


def test_no_test_file_reads_a_private_attribute_of_a_pagedqvg_object():
    private = _package_private()
    assert {"_seq", "_io", "_packer", "_owner_pages", "_plans"} <= private  # the scan sees the cache's state
    bad = []
    for path in sorted(TESTS.glob("*.py")):
        if path.name not in ALLOWED:
            bad += [f"tests/{path.name}:{hit}" for hit in private_reads(path.read_text(encoding="utf-8"), private)]
    assert not bad, "private state read outside tests/helpers.py (add a helper there):\n" + "\n".join(bad)


def test_the_scan_finds_what_it_should():
    """The scan itself: it reports reads, writes and monkeypatch targets of private names on other objects, and
    nothing on `self`, public names or names it was not given."""
    private = private_class_names("class A:\n    _k = 1\n    def __init__(self):\n        self._x = 0\n"
                                  "    def _m(self):\n        return self._x\n")  # fmt: skip
    assert private == {"_k", "_x", "_m"}
    source = ("a._x\nb._m()\nc._k = 2\nmonkeypatch.setattr(d, '_x', 1)\ngetattr(e, '_m')\n"
              "self._x\nf.x\ng._other\nh.__dict__\n")  # fmt: skip
    assert sorted(int(hit.split(":")[0]) for hit in private_reads(source, private)) == [1, 2, 3, 4, 5]
