"""The package's import graph, read from the source with ``ast``: no
production module imports ``testing/`` (the engine, server and tiny-model
drivers of the tests, ``bench`` and the demo), and no import cycle between
the package's parts (each subpackage, and each top-level module, is one node).

Inside ``pool/`` the same graph is read one level down: each subpackage
(``scheduler``, ``worker``, ``identity``, ``directory``, ``backends``) and
each top-level module of ``pool`` is a node, and

* no cycle between those nodes; ``backends`` is *one* node there, because
  it is one layer below both sides: ``base`` (the interface and the value
  header), ``generation``, ``lmdb/`` and ``mooncake/`` are versions of one
  thing, so a top-level module may not sit between two of them (imported by
  ``lmdb/`` and importing ``base``).  Inside ``backends`` its parts
  (``base``, ``generation``, ``lmdb``, ``mooncake``) form no cycle either;
* the scheduler side (``pool.scheduler``, the engine-core process) never
  reaches the worker side (``pool.worker``, each worker process) and vice
  versa - what both use lives below them;
* ``pool.backends`` reaches nothing of ``pool.scheduler``, ``pool.worker``
  or ``pool.connector``.

"Reaches" is a chain of imports between those nodes, a direct import being
the shortest: a side that imports a shared module which imports the other
side is tied to it just the same.  Each finding names the file:line of
every import on the chain.

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
#: The pool subpackage, and the packages inside it whose parts are layered.
POOL = "pool"
POOL_LAYERED = ("pool", "pool.backends")
#: pool node -> pool nodes it may not reach by any chain of imports.
POOL_APART = {
    "scheduler": ("worker",),
    "worker": ("scheduler",),
    "backends": ("scheduler", "worker", "connector"),
}


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


def node_of(module: str, within: str | None = None) -> str | None:
    """The part of package ``within`` (default: the top package) a module
    belongs to: its name's next component below ``within`` -
    ``pkg.sub.x`` -> ``sub``, ``pkg.x`` -> ``x``, ``within`` itself ->
    ``__init__``; None for a module outside ``within``."""
    parts = module.split(".")
    base = within.split(".") if within else parts[:1]
    if parts[: len(base)] != base:
        return None
    rest = parts[len(base):]
    return rest[0] if rest else "__init__"


def _path(graph: dict[str, set[str]], start: str, goals: set[str],
          members: set[str] | None = None) -> list[str] | None:
    """A shortest path of at least one step from ``start`` to one of
    ``goals`` through ``members`` (default: every node), or None."""
    allowed = set(graph) if members is None else members
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for n in frontier:
            for m in sorted(graph[n] & allowed):
                if m in goals:
                    path = [n]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1] + [m]  # start, ..., n, m
                if m not in prev:
                    prev[m] = n
                    nxt.append(m)
        frontier = nxt
    return None


def _cycle(graph: dict[str, set[str]], members: set[str]) -> list[str]:
    """One cycle through the strongly connected ``members``: a shortest
    path from the first member back to itself."""
    start = min(members)
    path = _path(graph, start, {start}, members)
    if path is None:
        raise AssertionError(f"no cycle through {members}")
    return path


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


def node_graph(edges: tuple[Edge, ...], within: str | None = None,
               ) -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """Node -> nodes it imports, and one import site per pair of nodes; the
    nodes are the parts of ``within`` (default: the top package), imports
    from or to a module outside it are left out."""
    graph: dict[str, set[str]] = {}
    sites: dict[tuple[str, str], str] = {}
    for e in edges:
        a, b = node_of(e.src, within), node_of(e.dst, within)
        if a is None or b is None:
            continue
        graph.setdefault(a, set())
        graph.setdefault(b, set())
        if a != b:
            graph[a].add(b)
            sites.setdefault((a, b), e.where)
    return graph, sites


def _steps(path: list[str], sites: dict[tuple[str, str], str]) -> str:
    return ", ".join(f"{a} -> {b} ({sites[a, b]})" for a, b in zip(path, path[1:]))


def _cycles(graph: dict[str, set[str]], sites: dict[tuple[str, str], str],
            within: str | None = None) -> list[str]:
    where = f" in {within}" if within else ""
    return [f"import cycle {' -> '.join(path)}{where}: {_steps(path, sites)}"
            for path in (_cycle(graph, comp) for comp in _components(graph))]


def problems(root: Path) -> list[str]:
    """What the rules forbid in the package at ``root``, one line each."""
    edges = import_edges(root)
    out = []
    for e in edges:
        if node_of(e.dst) == TEST_DRIVERS and node_of(e.src) not in MAY_IMPORT_DRIVERS:
            out.append(f"production module {e.src} imports {e.dst} ({e.where})")
    return out + _cycles(*node_graph(edges))


def pool_problems(root: Path) -> list[str]:
    """What the pool's layering forbids in the package at ``root`` (nothing
    if it has no ``pool`` subpackage), one line each."""
    if not (root / POOL).is_dir():
        return []
    edges = import_edges(root)
    out = []
    for layered in POOL_LAYERED:
        out += _cycles(*node_graph(edges, f"{root.name}.{layered}"), f"{root.name}.{layered}")
    pool = f"{root.name}.{POOL}"
    graph, sites = node_graph(edges, pool)
    for src, banned in POOL_APART.items():
        for dst in banned:
            if src in graph and dst in graph:
                path = _path(graph, src, {dst})
                if path is not None:
                    out.append(f"{pool}.{src} reaches {pool}.{dst}: {_steps(path, sites)}")
    return out


def test_the_package_imports_no_test_driver_from_production_and_has_no_cycle():
    found = problems(PACKAGE)
    assert not found, "\n".join(found)


def test_the_pool_sides_stay_apart_and_its_parts_have_no_cycle():
    found = pool_problems(PACKAGE)
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
    # the pool's nodes: its subpackages and top-level modules, backends whole
    graph, _ = node_graph(edges, "vllm_layerwise_patch.pool")
    assert {"scheduler", "worker", "identity", "directory", "backends",
            "connector", "keys", "metadata"} <= set(graph), sorted(graph)
    assert not any("." in n for n in graph), sorted(graph)
    assert {"scheduler", "worker"} <= graph["connector"]
    assert node_of("vllm_layerwise_patch.pool.backends.lmdb.eviction",
                   "vllm_layerwise_patch.pool") == "backends"
    assert node_of("vllm_layerwise_patch.layout", "vllm_layerwise_patch.pool") is None


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


#: A pool laid out as the rules want: both sides use what lies below them,
#: the connector alone ties the two sides together.
CLEAN_POOL = {
    "__init__.py": "",
    "pool/__init__.py": "def __getattr__(name):\n    from .connector import C\n",
    "pool/connector.py": "from .scheduler import planner\nfrom .worker import forward\n",
    "pool/keys.py": "",
    "pool/side.py": "from . import keys\n",
    "pool/metadata.py": "from .keys import x\n",
    "pool/scheduler/__init__.py": "",
    "pool/scheduler/planner.py": "from ..metadata import M\nfrom ..side import S\n"
                                 "from ..backends import base\nfrom ..identity import namespace\n",
    "pool/worker/__init__.py": "",
    "pool/worker/forward.py": "from ..metadata import M\nfrom .. import side\n"
                              "from ..backends.lmdb import backend\n",
    "pool/identity/__init__.py": "",
    "pool/identity/namespace.py": "from ..directory import paths\n",
    "pool/directory/__init__.py": "",
    "pool/directory/paths.py": "",
    "pool/backends/__init__.py": "",
    "pool/backends/base.py": "",
    "pool/backends/lmdb/__init__.py": "",
    "pool/backends/lmdb/backend.py": "from ..base import B\nfrom ...keys import group_of\n"
                                     "from ...directory import paths\n",
}


def test_negative_control_a_clean_pool_passes(tmp_path):
    pkg = _write(tmp_path / "pkg", CLEAN_POOL)
    assert pool_problems(pkg) == []
    assert problems(pkg) == []


def test_negative_control_a_scheduler_worker_import_is_reported(tmp_path):
    pkg = _write(tmp_path / "pkg", {
        **CLEAN_POOL,
        # inside a function, relative: still ties the scheduler to the worker
        "pool/scheduler/lookup.py": "import os\n\ndef f():\n    from ..worker import pages\n",
        "pool/worker/pages.py": "",
        # absolute, at the top of the module
        "pool/worker/loads.py": "from pkg.pool.scheduler.planner import P\n",
    })
    found = pool_problems(pkg)
    assert any(p.startswith("pkg.pool.scheduler reaches pkg.pool.worker: ")
               and "scheduler -> worker (pkg/pool/scheduler/lookup.py:4)" in p
               for p in found), found
    assert any(p.startswith("pkg.pool.worker reaches pkg.pool.scheduler: ")
               and "worker -> scheduler (pkg/pool/worker/loads.py:1)" in p
               for p in found), found


def test_negative_control_a_side_reached_through_a_shared_module_is_reported(tmp_path):
    pkg = _write(tmp_path / "pkg", {
        **CLEAN_POOL,
        "pool/side.py": "from . import keys\n\ndef f():\n    from .worker import forward\n",
    })
    found = pool_problems(pkg)
    assert any(p == "pkg.pool.scheduler reaches pkg.pool.worker: "
                    "scheduler -> side (pkg/pool/scheduler/planner.py:2), "
                    "side -> worker (pkg/pool/side.py:4)" for p in found), found


def test_negative_control_a_backend_scheduler_import_is_reported(tmp_path):
    pkg = _write(tmp_path / "pkg", {
        **CLEAN_POOL,
        "pool/backends/lmdb/eviction.py": "from ...scheduler.pins import Pins\n",
        "pool/scheduler/pins.py": "",
        "pool/backends/base.py": "import pkg.pool.connector\n",
    })
    found = pool_problems(pkg)
    assert any(p.startswith("pkg.pool.backends reaches pkg.pool.scheduler: ")
               and "backends -> scheduler (pkg/pool/backends/lmdb/eviction.py:1)" in p
               for p in found), found
    assert any(p == "pkg.pool.backends reaches pkg.pool.connector: "
                    "backends -> connector (pkg/pool/backends/base.py:1)" for p in found), found


def test_negative_control_a_cycle_in_the_pool_is_reported(tmp_path):
    # two subpackages: directory -> identity -> directory
    pkg = _write(tmp_path / "subpackages" / "pkg", {
        **CLEAN_POOL,
        "pool/directory/holders.py": "def f():\n    from ..identity.namespace import N\n",
    })
    found = pool_problems(pkg)
    assert found == ["import cycle directory -> identity -> directory in pkg.pool: "
                     "directory -> identity (pkg/pool/directory/holders.py:2), "
                     "identity -> directory (pkg/pool/identity/namespace.py:1)"], found
    # the package-wide check sees the pool as one node: no cycle there
    assert problems(pkg) == []

    # a top-level module between two parts of backends: lmdb -> keys -> base
    pkg = _write(tmp_path / "layer" / "pkg", {
        **CLEAN_POOL, "pool/keys.py": "from .backends.base import VERSION\n",
    })
    assert pool_problems(pkg) == [
        "import cycle backends -> keys -> backends in pkg.pool: "
        "backends -> keys (pkg/pool/backends/lmdb/backend.py:2), "
        "keys -> backends (pkg/pool/keys.py:1)"]

    # inside backends: base -> lmdb -> base
    pkg = _write(tmp_path / "backends" / "pkg", {
        **CLEAN_POOL, "pool/backends/base.py": "def f():\n    from .lmdb import backend\n",
    })
    assert pool_problems(pkg) == [
        "import cycle base -> lmdb -> base in pkg.pool.backends: "
        "base -> lmdb (pkg/pool/backends/base.py:2), "
        "lmdb -> base (pkg/pool/backends/lmdb/backend.py:1)"]
