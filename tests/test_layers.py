"""The import rule of docs/architecture.md: specrl's packages form layers, and imports only go down.

Every `.py` file under specrl/ is parsed with `ast` (nothing is imported), and every `import specrl...` /
`from specrl... import ...` is collected, at module level and inside functions alike (a function-local import is
still a dependency; it only runs later). A module may import from its own package or from a package of strictly
lower rank; two different packages of equal rank (rl and sim) may not import each other. Importing the bare
`specrl` facade from inside the package is upward too: import the module that defines the name. The module
graph must also be free of cycles.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "specrl"

# package (or top-level module) -> rank; a module may import its own package and strictly lower ranks only
LAYERS = {
    "specrl.errors": 0,
    "specrl.fileio": 0,
    "specrl.plugins": 1,
    "specrl.cpu": 1,
    "specrl.device": 1,
    "specrl.observability": 1,
    "specrl.checkpoint": 1,
    "specrl.model": 2,
    "specrl.data": 2,
    "specrl.rollout": 3,
    "specrl.algorithms": 4,
    "specrl.drafters": 5,
    "specrl.backends": 6,
    "specrl.config": 2,
    "specrl.trainer": 8,
    "specrl.parallel": 9,
    "specrl.sim": 9,
    "specrl.run": 10,
    "specrl.cluster": 11,
    "specrl.cli": 12,
    "specrl.api": 12,
    "specrl.integrations": 13,
}
FACADE = "specrl"  # specrl/__init__.py: a lazy facade for users, exempt as importer, forbidden as imported


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    where: str = ""  # file:line, for the failure message

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported}" + (f"  ({self.where})" if self.where else "")


# ---------------------------------------------------------------------------------------------- collection
def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def discover(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _resolve(target: str, known: set[str]) -> str:
    """The module an import of `target` loads: the longest known module prefix (or `target` itself)."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        if name in known:
            return name
    return target


def imports_of_source(module: str, source: str, known: set[str], is_package: bool = False,
                      filename: str = "<src>") -> list[Edge]:
    """The specrl modules `module` imports anywhere in `source`.

    `from specrl.x import y` is an import of specrl.x.y when that is a module, else of specrl.x (a package's
    __init__ counts as the package module); relative imports are resolved against `module`.
    """
    edges = []

    def add(target: str, node: ast.AST) -> None:
        if target == FACADE or target.startswith(FACADE + "."):
            edges.append(Edge(module, _resolve(target, known), f"{filename}:{node.lineno}"))

    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for alias in node.names:
                sub = f"{src}.{alias.name}"
                add(sub if sub in known else src, node)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            add(node.args[0].value, node)
    return list(dict.fromkeys(edges))  # one edge per statement, however many names it imports


def collect(root: Path = ROOT) -> list[Edge]:
    mods = discover(root)
    known = set(mods)
    edges = []
    for name, path in mods.items():
        rel = str(path.relative_to(root.parent))
        edges += imports_of_source(name, path.read_text(), known, path.name == "__init__.py", rel)
    return edges


# ---------------------------------------------------------------------------------------------- the rules
def layer_of(module: str) -> str | None:
    """The layer table entry a module belongs to (None: the facade itself, or a module the table lacks)."""
    for pkg in sorted(LAYERS, key=len, reverse=True):
        if module == pkg or module.startswith(pkg + "."):
            return pkg
    return None


def layer_violations(edges: list[Edge]) -> list[tuple[Edge, str]]:
    """(edge, reason) for every import that is not downward or within its own package."""
    bad = []
    for e in edges:
        if e.importer == FACADE:
            continue
        src, dst = layer_of(e.importer), layer_of(e.imported)
        if src is None:
            bad.append((e, f"{e.importer} is in no layer: add its package to LAYERS and docs/architecture.md"))
        elif e.imported == FACADE:
            bad.append((e, "imports the `specrl` facade: import the module that defines the name"))
        elif dst is None:
            bad.append((e, f"{e.imported} is in no layer"))
        elif src != dst and LAYERS[dst] >= LAYERS[src]:
            kind = "same rank" if LAYERS[dst] == LAYERS[src] else "upward"
            bad.append((e, f"{kind}: {src} (rank {LAYERS[src]}) may not import {dst} (rank {LAYERS[dst]})"))
    return bad


def cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module in the import graph (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.importer != e.imported:
            graph.setdefault(e.importer, set()).add(e.imported)
            graph.setdefault(e.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def cycle_report(edges: list[Edge]) -> list[str]:
    lines = []
    for comp in cycles(edges):
        members = set(comp)
        lines.append(f"cycle among {', '.join(comp)}:")
        lines += [f"  {e}" for e in edges if e.importer in members and e.imported in members
                  and e.importer != e.imported]
    return lines


def edges_from(graph: dict[str, set[str] | list[str]]) -> list[Edge]:
    return [Edge(a, b) for a, bs in graph.items() for b in sorted(bs)]


# ---------------------------------------------------------------------------------------------- tests
def test_imports_only_go_down_the_layers():
    bad = layer_violations(collect())
    assert not bad, "imports against the layer rule (docs/architecture.md):\n" + "\n".join(
        f"  {e}: {why}" for e, why in bad)


def test_no_import_cycles():
    report = cycle_report(collect())
    assert not report, "import cycles (function-local imports included):\n" + "\n".join(report)


def test_every_package_folder_says_what_it_owns():
    missing = []
    for d in sorted({p.parent for p in ROOT.rglob("*.py")}):
        if d.name == "__pycache__":
            continue
        init = d / "__init__.py"
        rel = init.relative_to(ROOT.parent)
        if not init.exists():
            missing.append(f"{rel}: missing")
            continue
        doc = (ast.get_docstring(ast.parse(init.read_text())) or "").strip()
        pkg = module_name(init)
        words = doc.replace(pkg, "").split()
        if len(words) < 6 or "." not in doc.replace(pkg, ""):
            missing.append(f"{rel}: docstring {doc[:60]!r} is not a sentence saying what the folder owns")
    assert not missing, "package folders without an owning docstring:\n" + "\n".join(f"  {m}" for m in missing)


# self-tests: the checker must catch what it claims to, or the rule tests above could pass vacuously
def test_checker_catches_a_synthetic_upward_import_and_cycle():
    graph = {
        "specrl.model.transformer": {"specrl.errors", "specrl.model.presets"},  # down, own package: fine
        "specrl.model.presets": {"specrl.model.transformer", "specrl.rollout.engine"},  # cycle + upward
        "specrl.trainer.sync_trainer": {"specrl.sim.pipeline", "specrl", "specrl.rollout.engine"},  # same rank, facade
        "specrl.cli": {"specrl.run.loop", "specrl.sim"},
        "specrl": {"specrl.cli"},  # the facade may import anything
    }
    bad = {(e.importer, e.imported) for e, _ in layer_violations(edges_from(graph))}
    assert bad == {("specrl.model.presets", "specrl.rollout.engine"),
                   ("specrl.trainer.sync_trainer", "specrl.sim.pipeline"), ("specrl.trainer.sync_trainer", "specrl")}
    assert cycles(edges_from(graph)) == [["specrl.model.presets", "specrl.model.transformer"]]
    longer = {"specrl.rl.a": {"specrl.rl.b"}, "specrl.rl.b": {"specrl.rl.c"}, "specrl.rl.c": {"specrl.rl.a"},
              "specrl.rl.d": {"specrl.rl.a"}}
    assert cycles(edges_from(longer)) == [["specrl.rl.a", "specrl.rl.b", "specrl.rl.c"]]
    report = cycle_report(edges_from(longer))
    assert "  specrl.rl.c -> specrl.rl.a" in report and not any("specrl.rl.d" in line for line in report)


def test_collector_sees_function_local_submodule_and_relative_imports():
    known = {"specrl", "specrl.errors", "specrl.trainer", "specrl.trainer.producer", "specrl.drafters",
             "specrl.drafters.base"}
    src = (
        "import os\n"
        "from specrl.errors import SpecRLError\n"
        "def f():\n"
        "    from specrl.trainer import producer\n"   # a submodule: an edge to specrl.trainer.producer
        "    from specrl.trainer import something\n"  # a name of the package __init__: an edge to specrl.trainer
        "    import specrl\n"
        "    from . import base\n"
        "    from .base import x\n"
    )
    got = {e.imported for e in imports_of_source("specrl.drafters.init_cli", src, known)}
    assert got == {"specrl.errors", "specrl.trainer.producer", "specrl.trainer", "specrl", "specrl.drafters.base"}
    bad = {(e.imported, why.split(":")[0]) for e, why in
           layer_violations(imports_of_source("specrl.drafters.init_cli", src, known))}
    assert bad == {("specrl.trainer.producer", "upward"), ("specrl.trainer", "upward"),
                   ("specrl", "imports the `specrl` facade")}
