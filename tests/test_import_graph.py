"""The package's import graph, read from the source with ``ast``: no
production module imports ``testing/`` (the engine, server and tiny-model
drivers of the tests, ``bench`` and the demo), and no import cycle between
the package's parts (each subpackage, and each top-level module, is one node).

Every ``import`` / ``from ... import`` counts, relative ones and ones inside
functions too: a function-level import is how a cycle hides at import time
and still ties the two parts together.  Negative controls run the same
checker on a small package written to ``tmp_path``.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_layerwise_patch"
#: Parts that drive engines for tests; ``bench`` and ``demo`` may use them.
TEST_DRIVERS = "testing"
MAY_IMPORT_DRIVERS = ("testing", "bench", "demo")


@dataclass(frozen=True)
class Edge:
    src: str  # importing module, dotted
    dst: str  # imported package-internal module, dotted
    where: str  # file:line of the import statement


def _modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every ``.py`` below ``root`` (the package dir)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` is or lies inside."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


@functools.lru_cache(maxsize=None)
def import_edges(root: Path) -> tuple[Edge, ...]:
    """Every import between modules of the package at ``root`` (read once)."""
    known = _modules(root)
    top = root.name
    edges = []
    for mod, path in known.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                # ``from pkg import sub`` imports the submodule ``pkg.sub``
                targets = [f"{stem}.{a.name}" for a in node.names] or [stem]
            for target in targets:
                if target.split(".")[0] != top:
                    continue
                dst = _resolve(target, known)
                if dst is not None and dst != mod:
                    edges.append(Edge(mod, dst, f"{path.relative_to(root.parent)}:{node.lineno}"))
    return tuple(dict.fromkeys(edges))


def node_of(module: str) -> str:
    """The part a module belongs to: ``pkg.sub.x`` -> ``sub``, ``pkg.x`` -> ``x``
    (the package's own ``__init__`` is ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycle(graph: dict[str, set[str]], members: set[str]) -> list[str]:
    """One cycle through the strongly connected ``members``: a shortest
    path from the first member back to itself."""
    start = min(members)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for n in frontier:
            for m in sorted(graph[n] & members):
                if m == start:
                    path = [n]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]  # start, ..., n, start
                if m not in prev:
                    prev[m] = n
                    nxt.append(m)
        frontier = nxt
    raise AssertionError(f"no cycle through {members}")


def _components(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components (Tarjan), those of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def node_graph(edges: tuple[Edge, ...]) -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """Node -> nodes it imports, and one import site per pair of nodes."""
    graph: dict[str, set[str]] = {}
    sites: dict[tuple[str, str], str] = {}
    for e in edges:
        a, b = node_of(e.src), node_of(e.dst)
        graph.setdefault(a, set())
        graph.setdefault(b, set())
        if a != b:
            graph[a].add(b)
            sites.setdefault((a, b), e.where)
    return graph, sites


def problems(root: Path) -> list[str]:
    """What the rules forbid in the package at ``root``, one line each."""
    edges = import_edges(root)
    out = []
    for e in edges:
        if node_of(e.dst) == TEST_DRIVERS and node_of(e.src) not in MAY_IMPORT_DRIVERS:
            out.append(f"production module {e.src} imports {e.dst} ({e.where})")
    graph, sites = node_graph(edges)
    for comp in _components(graph):
        path = _cycle(graph, comp)
        steps = ", ".join(f"{a} -> {b} ({sites[a, b]})" for a, b in zip(path, path[1:]))
        out.append(f"import cycle {' -> '.join(path)}: {steps}")
    return out


def test_the_package_imports_no_test_driver_from_production_and_has_no_cycle():
    found = problems(PACKAGE)
    assert not found, "\n".join(found)


def test_the_graph_is_read_from_the_source():
    """The checker sees the imports it must: a relative one inside a function
    (bootstrap's), an absolute one inside a function, and ``from . import sub``."""
    edges = import_edges(PACKAGE)
    pairs = {(e.src, e.dst) for e in edges}
    assert ("vllm_layerwise_patch.bootstrap", "vllm_layerwise_patch.cpu_emulation.cpu_v2") in pairs
    assert ("vllm_layerwise_patch.testing.engine_controls",
            "vllm_layerwise_patch.pool.layout") in pairs
    assert ("vllm_layerwise_patch.testing.engine_child",
            "vllm_layerwise_patch.testing.engine_controls") in pairs
    assert len({node_of(e.src) for e in edges}) >= 10


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_negative_control_a_production_import_of_testing_and_a_cycle_are_reported(tmp_path):
    pkg = _write(tmp_path / "pkg", {
        "__init__.py": "",
        "testing/__init__.py": "",
        "testing/drivers.py": "from ..core import thing\n",
        "core/__init__.py": "",
        # inside a function, relative: still an import of testing
        "core/thing.py": "def f():\n    from ..testing import drivers\n",
        "registry/__init__.py": "from pkg.patches import one\n",
        "patches/__init__.py": "",
        "patches/one.py": "import pkg.registry\n",
        "bench.py": "from .testing.drivers import thing\n",  # allowed
    })
    found = problems(pkg)
    assert any(p.startswith("production module pkg.core.thing imports pkg.testing.drivers "
                            "(pkg/core/thing.py:2)") for p in found), found
    assert not any("pkg.bench" in p and "production" in p for p in found), found
    cycles = [p for p in found if p.startswith("import cycle")]
    assert any("patches -> registry -> patches" in p and "pkg/patches/one.py:1" in p
               for p in cycles), found
    # core <-> testing is a cycle too (testing.drivers imports core)
    assert any("core -> testing -> core" in p for p in cycles), found


def test_negative_control_a_clean_package_passes(tmp_path):
    pkg = _write(tmp_path / "pkg", {
        "__init__.py": "",
        "testing/__init__.py": "from ..core import thing\n",
        "core/__init__.py": "",
        "core/thing.py": "from . import other\nimport os\n",
        "core/other.py": "",
    })
    assert problems(pkg) == []
