"""The shape of the code: imports point one way, modules and classes stay small, private names stay home.

Parsed with ``ast`` (nothing is imported): every ``import`` counts, also those inside functions.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ckptlib"
MAX_MODULE_LINES, MAX_CLASS_LINES = 500, 350


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    return {_module_name(p): (p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of ckptlib it imports}``; ``from pkg import name`` counts as importing
    ``pkg.name`` when that is a module, else ``pkg``; importing ``a.b.c`` also runs ``a`` and ``a.b``."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}

    def add(src: str, target: str) -> None:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):  # a package's __init__ runs before its modules
            name = ".".join(parts[:i])
            if name in mods and name != src and not src.startswith(name + "."):
                graph[src].add(name)

    for name, (path, tree) in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "ckptlib":
                        add(name, a.name)
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(name, is_pkg, node)
                if target.split(".")[0] != "ckptlib":
                    continue
                for a in node.names:
                    full = f"{target}.{a.name}"
                    add(name, full if full in mods else target)
    return graph


def find_cycle(graph: dict[str, set[str]]):
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_between_ckptlib_modules():
    graph = import_graph()
    assert graph["ckptlib.execute.runner"] >= {"ckptlib.plan", "ckptlib.execute.writers"}  # the parser sees imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_library_does_not_import_its_faces():
    """ui and cli sit on the public API (and the launcher, ``ckpt``'s entry point, on cli); nothing below
    them imports them."""
    graph = import_graph()
    for mod, targets in graph.items():
        if mod.startswith(("ckptlib.ui", "ckptlib.cli", "ckptlib.__main__")):
            continue
        assert not {t for t in targets if t.startswith(("ckptlib.ui", "ckptlib.cli", "ckptlib.__main__"))}, mod


def test_modules_and_classes_stay_small():
    big = []
    for name, (path, tree) in _modules().items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            big.append(f"{name}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                big.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not big, big


def private_reaches(modules: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    """``obj._name`` where ``_name`` is not defined in the same module (as an attribute set there, a
    function, method, class or variable of it): a private name reached from elsewhere."""
    offences = []
    for name, (path, tree) in modules.items():
        own = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                attr = node.attr
                if attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__")) and attr not in own:
                    offences.append(f"{name}:{node.lineno} .{attr}")
    return offences


def test_the_private_reach_finder_finds_them():
    a = ast.parse("class A:\n    def __init__(self):\n        self._x = 1\n    def _m(self):\n        return self._x\n")
    b = ast.parse("def f(a):\n    return a._x + a._m() + a.__class__.__name__.__len__()\n")
    assert sorted(private_reaches({"a": (Path("a.py"), a), "b": (Path("b.py"), b)})) == ["b:2 ._m", "b:2 ._x"]


def test_no_private_attribute_is_reached_from_another_module():
    offences = private_reaches(_modules())
    assert not offences, offences


#: ckptlib's layers, lowest first: a module imports only modules of its own layer and of the layers below
#: (each package's docstring says the same). The vocabulary at the package's top is the floor; the public
#: API (``ckptlib/__init__.py``, which loads its names lazily) and the faces (ui, cli, the launcher) the roof.
LAYERS = [
    ("vocabulary", ("ckptlib.errors", "ckptlib.units", "ckptlib.dtypes", "ckptlib.mesh", "ckptlib.progress",
                    "ckptlib.kinds")),
    ("layout", ("ckptlib.layout",)),
    ("plan", ("ckptlib.plan",)),
    ("system", ("ckptlib.system",)),
    ("io", ("ckptlib.io",)),
    ("formats", ("ckptlib.deepspeed", "ckptlib.dcp")),
    ("analysis", ("ckptlib.analysis",)),
    ("execute", ("ckptlib.execute",)),
    ("conversions", ("ckptlib.export", "ckptlib.reshard")),
    ("api", ("ckptlib",)),
    ("faces", ("ckptlib.ui", "ckptlib.cli", "ckptlib.__main__")),
]
ROOT_MODULES_MAX = 8


def layer_of(module: str) -> int:
    best, level = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    assert level is not None, f"{module} belongs to no layer: add it to LAYERS"
    return level


def layering_offences(graph: dict[str, set[str]]) -> list[str]:
    """Imports that point up: ``a -> b`` where b's layer is above a's."""
    return sorted(f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
                  for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def test_the_layering_check_finds_an_upward_import():
    graph = {"ckptlib.io.sinks": {"ckptlib.deepspeed.files"}, "ckptlib.deepspeed.files": {"ckptlib.io.sinks"}}
    assert layering_offences(graph) == ["ckptlib.io.sinks (io) imports ckptlib.deepspeed.files (formats)"]


def test_a_package_imports_only_its_own_layer_and_the_layers_below():
    graph = import_graph()
    assert all(layer_of(m) is not None for m in graph)  # every module has a layer
    assert graph["ckptlib.io.streaming"] >= {"ckptlib.layout.ranges", "ckptlib.plan"}  # edges across layers seen
    assert layering_offences(graph) == []


def test_the_root_holds_the_vocabulary_and_the_api_only():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= ROOT_MODULES_MAX, root
    for pkg in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()):
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text()))
        assert doc and "import" in doc, f"{pkg.name}/__init__.py: say what the package holds and what it may import"
