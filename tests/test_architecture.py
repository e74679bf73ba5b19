"""The package's shape, checked from its source (every import statement counted: module level, in functions and under
`TYPE_CHECKING`): no import cycle, no module over 600 lines, no folder with more than 12 modules, each folder's
`__init__` saying its job, and the layers importing only downward (docs/ARCHITECTURE.md draws them)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "pagedqvg"
MAX_MODULE_LINES = 600
MAX_FOLDER_MODULES = 12
#: Layers, lowest first: a module may import its own layer and the layers before it (docs/ARCHITECTURE.md).
LAYERS = (
    ("pagedqvg.errors", "pagedqvg.validation", "pagedqvg.debug", "pagedqvg.env", "pagedqvg.sizes", "pagedqvg.view"),
    ("pagedqvg.quant", "pagedqvg.layout"),
    ("pagedqvg.allocator",),
    ("pagedqvg.kernels",),
    ("pagedqvg.store",),
    ("pagedqvg.attention",),
    ("pagedqvg.cache",),
    ("pagedqvg.planning",),
    ("pagedqvg.serving",),
    ("pagedqvg.integrations",),
    ("pagedqvg.cli",),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every pagedqvg module `path` imports, by any import statement anywhere in the file."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known}
            found.update(subs)
            if len(subs) < len(node.names):  # names defined in `mod` itself (`from pkg import sub` names only sub)
                found.add(mod)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of module imports (a package's `__init__` counts as its own module), or None. O(V + E)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def layer_of(name: str) -> int | None:
    for i, members in enumerate(LAYERS):
        if any(name == m or name.startswith(m + ".") for m in members):
            return i
    return None


def test_the_checker_finds_a_cycle_and_relative_imports(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    src = tmp_path / "pagedqvg" / "x"
    src.mkdir(parents=True)
    (src / "m.py").write_text("def f():\n    from ..y import z\n    from . import n\n")
    known = {"pagedqvg.y", "pagedqvg.y.z", "pagedqvg.x", "pagedqvg.x.n"}
    assert imports_of("pagedqvg.x.m", src / "m.py", known) == {"pagedqvg.y.z", "pagedqvg.x.n"}
    (src / "m.py").write_text("from ..y import z, CONSTANT\n")
    assert imports_of("pagedqvg.x.m", src / "m.py", known) == {"pagedqvg.y", "pagedqvg.y.z"}


def test_no_import_cycle_counting_every_import_statement():
    assert find_cycle(graph()) is None


def test_layers_import_only_downward():
    upward = []
    for name, targets in graph().items():
        here = layer_of(name)
        if here is None:
            continue
        upward += [f"{name} -> {t}" for t in targets if (layer_of(t) or 0) > here]
    assert upward == []


def test_every_package_module_has_a_layer():
    unplaced = [m for m in modules() if m != "pagedqvg" and layer_of(m) is None]
    assert unplaced == []


def test_no_module_over_600_lines():
    long = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_folder_holds_more_than_12_modules_and_each_init_says_its_job():
    crowded, silent = {}, []
    for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").exists())]:
        n = len([p for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")])
        if n > MAX_FOLDER_MODULES:
            crowded[str(folder.relative_to(REPO))] = n
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        if not doc or len(doc.split()) < 8:
            silent.append(str(folder.relative_to(REPO)))
    assert crowded == {} and silent == []


def test_the_library_does_not_import_the_developer_tools():
    assert not [n for n, p in modules().items() if "tools." in p.read_text() and "from tools" in p.read_text()]
