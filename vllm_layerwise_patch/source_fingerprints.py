"""Patch-target fingerprints computed from vLLM *source files*, without importing vLLM.

The registry fingerprints a target as sha256 of ``inspect.getsource(obj)``
(:func:`vllm_layerwise_patch.registry.fingerprint`), which needs the target
imported.  That is impossible for releases that cannot be imported on the
machine at hand (e.g. CUDA builds of vLLM on a CPU-only CI runner, or a second
release next to the installed one).  This module computes the same digest from
an unpacked tree (a site-packages-like root) or directly from a wheel: it finds
the definition with :mod:`ast` and cuts the text the way ``inspect`` does,
using ``inspect.getblock`` itself (trailing comments indented at body level and
line continuations are handled exactly as in ``inspect.getsource``).

Stdlib only; never imports vLLM or torch.  Digests follow the conventions of
the running Python's ``inspect`` (same interpreter as the registry => same
digest).

Resolution rules (``qualname`` is dotted, e.g. ``Cls.method``):

- each component is looked up among the ``def``/``async def``/``class``
  statements of the enclosing body, including those nested in ``if``/``try``/
  ``with`` blocks; of several definitions at the body's own level the last
  wins (as at runtime), but several definitions of which any is nested (e.g.
  ``if TRITON3: def f ... else: def f ...``) raise :class:`Unresolvable`, since
  which one runs is decided at import time;
- a plain assignment ``name = other`` or ``name = f(other)`` / ``name =
  f(...)(other)`` (e.g. ``kernel = triton.jit(fn)``) is followed to the
  definition of ``other`` in the same body; other assignments raise
  :class:`Unresolvable` (their live fingerprint depends on runtime values),
  and so does a name bound by an import (fingerprint it where it is defined);
- a missing module or name gives ``None`` (absent).
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import io
import os
import tokenize
import zipfile

__all__ = [
    "Unresolvable",
    "fingerprint_in_tree",
    "fingerprint_in_wheel",
    "source_in_text",
]

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


class Unresolvable(LookupError):
    """The name exists but its source cannot be determined statically."""


def _lines(data: bytes) -> list[str]:
    """Lines as ``linecache`` holds them (``tokenize.open`` decoding,
    universal newlines, a final newline added when missing)."""
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    lines = io.TextIOWrapper(io.BytesIO(data), encoding).readlines()
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return lines


_BLOCKS = tuple(
    getattr(ast, n) for n in ("If", "Try", "TryStar", "With", "ExceptHandler") if hasattr(ast, n)
)


def _children(body: list[ast.stmt], nested: bool = False):
    """(statement, nested) pairs of ``body`` in source order, descending into
    if/try/with blocks (``nested``: inside one of them)."""
    for node in body:
        yield node, nested
        if isinstance(node, _BLOCKS):
            for field in ("body", "handlers", "orelse", "finalbody"):
                yield from _children(getattr(node, field, None) or [], True)


def _lookup(
    body: list[ast.stmt], name: str, final: bool = True, depth: int = 0
) -> ast.AST | None:
    found: list[tuple[ast.AST, bool]] = []
    for node, nested in _children(body):
        if isinstance(node, _DEFS) and node.name == name:
            found.append((node, nested))
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            (a.asname or a.name.partition(".")[0]) == name for a in node.names
        ):
            found.append((node, nested))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found.append((node, nested))
    if not found:
        return None
    if len(found) > 1 and any(nested for _, nested in found):
        # e.g. "if TRITON3: def f ... else: def f ...": decided at runtime.
        lines = ", ".join(str(n.lineno) for n, _ in found)
        raise Unresolvable(f"{name!r} is defined conditionally (lines {lines})")
    node = found[-1][0]  # sequential redefinitions: the last one wins
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        raise Unresolvable(f"{name!r} is imported here; fingerprint it where it is defined")
    if final and len(found) > 1 and isinstance(node, ast.ClassDef):
        # inspect finds a class by qualname: the first definition before
        # Python 3.13, the live one (__firstlineno__) from 3.13 on.
        raise Unresolvable(f"class {name!r} is defined more than once")
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        value = node.value
        while isinstance(value, ast.Call) and len(value.args) == 1 and not value.keywords:
            value = value.args[0]  # f(other), f(...)(other)
        if isinstance(value, ast.Name) and value.id != name and depth < 10:
            target = _lookup(body, value.id, final, depth + 1)
            if target is not None:
                return target
        raise Unresolvable(f"{name!r} is assigned a value that needs evaluating")
    return node


def source_in_text(data: bytes, qualname: str) -> str | None:
    """The text ``inspect.getsource`` would return for ``qualname`` defined in
    the module source ``data``, or None when it is not defined there."""
    lines = _lines(data)
    tree = ast.parse("".join(lines))
    node: ast.AST = tree
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, (ast.Module, ast.ClassDef)):
            return None  # not addressable: a name inside a function body
        found = _lookup(node.body, part, final=i == len(parts) - 1)
        if found is None:
            return None
        node = found
    if not isinstance(node, _DEFS):
        return None
    # First decorator line, as in co_firstlineno / inspect._ClassFinder; then
    # the block as inspect.getblock cuts it (not ast's end_lineno).
    start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    return "".join(inspect.getblock(lines[start:]))


def _digest(data: bytes | None, qualname: str) -> str | None:
    if data is None:
        return None
    src = source_in_text(data, qualname)
    return None if src is None else hashlib.sha256(src.encode()).hexdigest()


def _candidates(module: str) -> tuple[str, str]:
    base = module.replace(".", "/")
    return base + ".py", base + "/__init__.py"


def fingerprint_in_tree(root: str, module: str, qualname: str) -> str | None:
    """sha256 hex of ``inspect.getsource`` of ``module:qualname`` as found under
    ``root`` (a directory holding the top-level package, e.g. site-packages or
    an unpacked wheel); None when the module or the name is absent."""
    for rel in _candidates(module):
        path = os.path.join(root, *rel.split("/"))
        if os.path.isfile(path):
            with open(path, "rb") as f:
                return _digest(f.read(), qualname)
    return None


def fingerprint_in_wheel(wheel_path: str, module: str, qualname: str) -> str | None:
    """Like :func:`fingerprint_in_tree`, reading the module from a wheel (zip)."""
    with zipfile.ZipFile(wheel_path) as zf:
        names = set(zf.namelist())
        for rel in _candidates(module):
            if rel in names:
                return _digest(zf.read(rel), qualname)
    return None
