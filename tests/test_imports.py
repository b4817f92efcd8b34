"""The package's import graph: no loops between modules, no private name imported across modules, no module
importing one of a higher floor (docs/architecture.md).

The graph is read from the source with `ast`, not by importing, so it sees every import statement: at module
level, inside functions (lazy imports are edges too: a loop closed at call time is still a loop in the design)
and under `if TYPE_CHECKING:`. Relative imports are resolved; `from pkg import name` is an edge to the submodule
`pkg.name` when there is one, else to `pkg` (its `__init__`). Two things are not edges: the implicit
initialisation of a parent package when one of its submodules is imported (every package whose `__init__`
re-exports its modules would otherwise loop with each of them), and `importlib` look-ups by computed name (the
families registry finds its plug-ins by scanning its folder; the plug-ins import the registry's `Family`).

The allowlists name what is left to fix; they can only shrink: an entry that no longer occurs fails too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mtp_train

# Loops still in the graph, each as the sorted tuple of the modules of one strongly connected component.
ALLOWED_CYCLES: frozenset[tuple[str, ...]] = frozenset()
# Private names still imported across modules, as (importing module, defining module, name).
ALLOWED_PRIVATE: frozenset[tuple[str, str, str]] = frozenset()

PACKAGE_DIR = Path(mtp_train.__file__).parent

# Each top-level part of the package and its floor (docs/architecture.md, "Floors"): a module imports only its own
# floor and the floors below. The package's own `__init__` is the ground (it imports nothing).
FLOORS: dict[str, int] = {
    "mtp_train": 0,
    "config": 1, "fileio": 1, "processes": 1,
    "layers": 2, "fetch": 2, "dist": 2,
    "models": 3,
    "heads": 4, "data": 4,
    "engine": 5, "export": 5,
    # capture/: the modules vLLM's processes import read nothing of ours; its driver side (launch, endpoints, fleet)
    # reads rows, sampling and the OpenAI client, so the part as a whole sits beside precompute, its user
    "speculative": 6, "precompute": 6, "regenerate": 6, "remote": 6, "capture": 6,
    "train": 7, "eval": 7, "head_types": 7, "serve": 7,
    "cli": 8,
}


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name → file, for every .py file of the package (a package is its `__init__`)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _base_of(module: str, path: Path, node: ast.ImportFrom) -> str | None:
    """The absolute module a `from ... import` statement reads from (relative levels resolved)."""
    if not node.level:
        return node.module
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    parts = package.split(".")
    if node.level - 1 > len(parts) - 1:
        return None  # beyond the top of the package
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is one of our modules (None: not ours)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(package_dir: Path) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """(module → modules of the package it imports, [(importer, defining module, private name)])."""
    modules = module_files(package_dir)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private: list[tuple[str, str, str]] = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = _owner(alias.name, modules)
                    if target:
                        edges[module].add(target)
            elif isinstance(node, ast.ImportFrom):
                base = _base_of(module, path, node)
                target = _owner(base, modules) if base else None
                if target is None:
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in modules:  # `from pkg import submodule`
                        edges[module].add(sub)
                        continue
                    edges[module].add(target)
                    name = alias.name
                    if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
                        private.append((module, target, name))
        edges[module].discard(module)
    return edges, [p for p in private if p[0] != p[1]]


def cycles(edges: dict[str, set[str]]) -> dict[tuple[str, ...], list[str]]:
    """Every strongly connected component of more than one module (Tarjan), with one loop through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: dict[tuple[str, ...], list[str]] = {}

    def visit(v: str) -> None:  # the package's graph is shallow enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found[tuple(sorted(comp))] = _loop_through(sorted(comp), edges)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _loop_through(comp: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One loop from comp[0] back to itself inside the component (breadth first: a shortest one)."""
    members, start = set(comp), comp[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & members):
                if w == start:  # back home: walk the parents from v to start
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def _describe(loops: dict[tuple[str, ...], list[str]]) -> str:
    return "\n".join(" → ".join(loop) for loop in loops.values())


def test_the_package_has_no_import_loop():
    edges, _ = import_graph(PACKAGE_DIR)
    found = cycles(edges)
    new = {k: v for k, v in found.items() if k not in ALLOWED_CYCLES}
    assert not new, f"import loops (break them by structure, e.g. move what both need to a lower module):\n" \
                    f"{_describe(new)}"
    gone = ALLOWED_CYCLES - found.keys()
    assert not gone, f"these allowed loops are gone: remove them from ALLOWED_CYCLES: {sorted(gone)}"


def test_no_private_name_is_imported_across_modules():
    _, private = import_graph(PACKAGE_DIR)
    new = sorted(set(private) - ALLOWED_PRIVATE)
    assert not new, "private names imported across modules (make them public where they are defined, or move " \
                    "them to a module both import):\n" + "\n".join(f"{a} imports {c} from {b}" for a, b, c in new)
    gone = ALLOWED_PRIVATE - set(private)
    assert not gone, f"these allowed private imports are gone: remove them from ALLOWED_PRIVATE: {sorted(gone)}"


def part_of(module: str) -> str:
    """The top-level part of the package a dotted module name belongs to (`mtp_train.export.layouts` → export)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def floor_violations(edges: dict[str, set[str]], floors: dict[str, int]) -> list[tuple[str, int, str, int]]:
    """Every (module, its floor, imported module, its floor) where a module imports one of a higher floor."""
    return sorted((a, floors[part_of(a)], b, floors[part_of(b)]) for a, targets in edges.items() for b in targets
                  if floors[part_of(b)] > floors[part_of(a)])


def test_every_part_of_the_package_has_a_floor():
    parts = {part_of(m) for m in module_files(PACKAGE_DIR)}
    assert not parts - FLOORS.keys(), f"parts of the package without a floor: {sorted(parts - FLOORS.keys())}; " \
                                      "give each its floor in FLOORS and in docs/architecture.md (Floors)"
    assert not FLOORS.keys() - parts, f"FLOORS names parts the package no longer has: {sorted(FLOORS.keys() - parts)}"


def test_no_module_imports_a_higher_floor():
    """Lazy and TYPE_CHECKING imports count; a plug-in found by computed name (importlib: the head types, the
    families) is no edge."""
    edges, _ = import_graph(PACKAGE_DIR)
    up = floor_violations(edges, FLOORS)
    assert not up, "imports of a higher floor (move what the lower module needs down, or look it up through a " \
                   "registry):\n" + "\n".join(f"{a} (floor {fa}) imports {b} (floor {fb})" for a, fa, b, fb in up)


def test_a_floor_violation_is_found():
    edges = {"pkg.low.a": {"pkg.high.b"}, "pkg.high.b": {"pkg.low.a"}, "pkg": set()}
    assert floor_violations(edges, {"low": 1, "high": 2, "pkg": 0}) == [("pkg.low.a", 1, "pkg.high.b", 2)]


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """A made-up package: lazy, relative, TYPE_CHECKING and submodule imports are edges; a loop and a private
    import are reported; imports of other packages and a module's own private names are not."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.a import A\n",
        "a.py": "import os\nfrom typing import TYPE_CHECKING\nA = 1\n_own = 2\nx = _own\n"
                "if TYPE_CHECKING:\n    from pkg.sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": "def f():\n    from ..c import _helper\n    return _helper\n",
        "c.py": "from . import a\nfrom .sub import b as _b\n_helper = 3\n",
        "d.py": "import pkg.sub.b\nfrom pkg import a\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    edges, private = import_graph(pkg)
    assert edges["pkg"] == {"pkg.a"}
    assert edges["pkg.a"] == {"pkg.sub.b"}  # os and typing are not ours; TYPE_CHECKING counts
    assert edges["pkg.sub.b"] == {"pkg.c"}  # a lazy, relative import
    assert edges["pkg.c"] == {"pkg.a", "pkg.sub.b"}
    assert edges["pkg.d"] == {"pkg.sub.b", "pkg.a"}
    assert private == [("pkg.sub.b", "pkg.c", "_helper")]  # `import ... as _b` renames, it imports nothing private
    found = cycles(edges)
    assert list(found) == [("pkg.a", "pkg.c", "pkg.sub.b")]
    loop = found[("pkg.a", "pkg.c", "pkg.sub.b")]
    assert loop[0] == loop[-1] == "pkg.a" and len(loop) == 4
    assert all(b in edges[a] for a, b in zip(loop, loop[1:]))
    assert cycles({"x": {"y"}, "y": set()}) == {}

