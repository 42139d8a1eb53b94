"""Platform plugins: which of the overlay's patches a plugin already carries,
and which it bypasses.

A platform plugin (vllm-ascend) ships its own subclasses of vLLM's classes
and its own replacements of their methods.  Where it already implements a
patch's behaviour, the overlay must not add it a second time ("carried");
where it replaces the very object a patch wraps (a subclass overriding the
method without calling it, or its own function assigned to the class), the
overlay's wrapper would never run, and applying it would report a
protection that does not exist ("bypassed": not applicable, with the
reason).  Everything else applies as on any platform (source fingerprints
against the vLLM underneath, as everywhere).

The rules read the plugin's *source* - never import it (vllm-ascend needs
torch_npu and an NPU to import): the installed distribution's files
(:class:`InstalledSource`) or a wheel (:class:`WheelSource`, the version
matrix).  Each rule (vllm-ascend's are in :mod:`.plugin_ascend`) is a
small structural check of a class or function, parsed with :mod:`ast`; what
it looked for is in its reason.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import zipfile
from typing import Any

#: Platform plugins the overlay has rules for, and the platform they serve.
KNOWN_PLUGINS = {"vllm-ascend": "npu"}


class PluginSource:
    """Read-only access to a plugin's files by path (``vllm_ascend/utils.py``)."""

    def read(self, path: str) -> str | None:
        raise NotImplementedError

    def names(self) -> list[str]:
        raise NotImplementedError

    # -- structural helpers ---------------------------------------------------
    def tree(self, path: str) -> ast.Module | None:
        text = self.read(path)
        if text is None:
            return None
        try:
            return ast.parse(text)
        except SyntaxError:
            return None

    def cls(self, path: str, name: str) -> ast.ClassDef | None:
        tree = self.tree(path)
        if tree is None:
            return None
        return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name),
                    None)

    def classes_based_on(self, path: str, base: str) -> list[ast.ClassDef]:
        """Top-level classes of ``path`` that name ``base`` among their bases."""
        tree = self.tree(path)
        if tree is None:
            return []
        return [n for n in tree.body if isinstance(n, ast.ClassDef)
                and any(_name(b) == base for b in n.bases)]

    def function(self, path: str, name: str) -> ast.FunctionDef | None:
        tree = self.tree(path)
        if tree is None:
            return None
        return next((n for n in tree.body if isinstance(n, ast.FunctionDef)
                     and n.name == name), None)

    def attribute_assignments(self, prefix: str, attr: str) -> list[str]:
        """Files under ``prefix`` that assign ``<something>.<attr> = ...`` at any depth."""
        out = []
        for path in self.names():
            if not (path.startswith(prefix) and path.endswith(".py")):
                continue
            text = self.read(path)
            if text is None or f".{attr}" not in text:
                continue
            tree = self.tree(path)
            for node in ast.walk(tree) if tree is not None else ():
                if isinstance(node, ast.Assign) and any(
                        isinstance(t, ast.Attribute) and t.attr == attr for t in node.targets):
                    out.append(path)
                    break
        return out


class WheelSource(PluginSource):
    """A plugin wheel, read in place."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._zip = zipfile.ZipFile(path)
        self._names = self._zip.namelist()

    def read(self, path: str) -> str | None:
        try:
            return self._zip.read(path).decode("utf-8", "replace")
        except KeyError:
            return None

    def names(self) -> list[str]:
        return self._names


class TreeSource(PluginSource):
    """A directory holding the plugin's package (site-packages, an unpacked wheel)."""

    def __init__(self, root: str) -> None:
        self.root = root

    def read(self, path: str) -> str | None:
        try:
            with open(os.path.join(self.root, path), encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return None

    def names(self) -> list[str]:
        out = []
        for d, _, files in os.walk(self.root):
            rel = os.path.relpath(d, self.root)
            out += [os.path.normpath(os.path.join(rel, f)).replace(os.sep, "/") for f in files]
        return out


class InstalledSource(TreeSource):
    """The installed distribution's files (found through its metadata, not imported)."""

    def __init__(self, dist: Any) -> None:
        super().__init__(str(dist.locate_file("")))


@dataclasses.dataclass(frozen=True)
class PluginBuild:
    """One platform plugin present in the environment (or under evaluation)."""

    name: str  # distribution, e.g. "vllm-ascend"
    version: str
    source: PluginSource = dataclasses.field(compare=False, repr=False)

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}"


@dataclasses.dataclass(frozen=True)
class PluginVerdict:
    """What a plugin means for one patch: ``carried``, ``bypassed`` or ``unused``."""

    kind: str
    detail: str


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def installed_plugins() -> tuple[PluginBuild, ...]:
    """The known platform plugins installed here (read from their metadata)."""
    from importlib import metadata

    out = []
    for name in KNOWN_PLUGINS:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        out.append(PluginBuild(name, dist.version, InstalledSource(dist)))
    return tuple(out)


def plugin_verdict(patch_id: str, plugins: tuple[PluginBuild, ...]) -> tuple[PluginBuild,
                                                                           PluginVerdict] | None:
    """The first installed plugin whose rule decides ``patch_id``."""
    from .plugin_ascend import ASCEND_RULES

    rules = {"vllm-ascend": ASCEND_RULES}  # patch id -> rule, per plugin
    for build in plugins:
        rule = rules.get(build.name, {}).get(patch_id)
        if rule is None:
            continue
        verdict = rule(build.source)
        if verdict is not None:
            return build, verdict
    return None
