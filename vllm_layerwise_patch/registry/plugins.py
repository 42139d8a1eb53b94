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
matrix).  Each rule is a small structural check of a class or function,
parsed with :mod:`ast`; what it looked for is in its reason.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import zipfile
from collections.abc import Callable
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


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _methods(cls: ast.ClassDef | None) -> dict[str, ast.FunctionDef]:
    if cls is None:
        return {}
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _calls(fn: ast.AST | None) -> list[ast.Call]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call)] if fn is not None else []


def _called(fn: ast.AST | None, name: str) -> list[ast.Call]:
    return [c for c in _calls(fn) if _name(c.func) == name]


def _calls_super(fn: ast.AST | None, method: str) -> bool:
    return any(_name(c.func) == method and isinstance(c.func, ast.Attribute)
               and isinstance(c.func.value, ast.Call) and _name(c.func.value.func) == "super"
               for c in _calls(fn))


def _hooks_layer(fn: ast.AST | None) -> bool:
    """``fn`` waits for its own layer's load (``wait_for_kv_layer_from_connector``
    with an argument that is not an empty string) and saves it."""
    waits = _called(fn, "wait_for_kv_layer_from_connector")
    saves = _called(fn, "maybe_save_kv_layer_to_connector")
    named = [w for w in waits if w.args and not (
        isinstance(w.args[0], ast.Constant) and w.args[0].value == "")]
    return bool(named and saves)


def _returns_early_on(fn: ast.FunctionDef | None, words: tuple[str, ...]) -> bool:
    """``fn`` has an ``if`` on one of ``words`` (a name or attribute) whose
    body only returns: the hybrid / aligned case is left alone."""
    for node in ast.walk(fn) if fn is not None else ():
        if isinstance(node, ast.If) and any(
                _name(n) in words for n in ast.walk(node.test)):
            body = [b for b in node.body if not isinstance(b, ast.Expr)]
            if body and all(isinstance(b, ast.Return) for b in body):
                return True
    return False


# -- vllm-ascend ---------------------------------------------------------------

_A = "vllm_ascend/"


def _ascend_hybrid_block_size(src: PluginSource) -> PluginVerdict | None:
    fn = src.function(_A + "utils.py", "refresh_block_size")
    if _returns_early_on(fn, ("is_hybrid", "mamba_page_size_padded")):
        return PluginVerdict("carried", "vllm-ascend's refresh_block_size (run by "
                             "NPUPlatform.check_and_update_config on every VllmConfig) returns "
                             "before touching a hybrid model's aligned block size")
    return None


def _ascend_deferred_precopy(src: PluginSource) -> PluginVerdict | None:
    path = _A + "worker/v2/model_states/mamba_hybrid.py"
    cls = src.cls(path, "AscendMambaHybridModelState")
    methods = _methods(cls)
    states = src.read(_A + "worker/v2/model_states/__init__.py")
    if cls is None and states is not None and "MambaHybrid" not in states:
        return PluginVerdict("unused", "vllm-ascend's Model Runner V2 builds its own model "
                             "state for every model (worker/v2/model_states/__init__.py), "
                             "never vLLM's MambaHybridModelState, whose align pre-copy the "
                             "patch defers")
    if "do_mamba_copy_for_layer" in methods and "preprocess_state" in methods:
        return PluginVerdict("carried", "vllm-ascend's AscendMambaHybridModelState defers the "
                             "align pre-copy per layer itself (preprocess_state, "
                             "do_mamba_copy_for_layer: vllm-ascend #15479)")
    if "preprocess_state" in methods and not _calls_super(methods["preprocess_state"],
                                                           "preprocess_state"):
        return PluginVerdict("bypassed", "vllm-ascend's AscendMambaHybridModelState overrides "
                             "preprocess_state without calling vLLM's and without a per-layer "
                             "pre-copy: the overlay's wrapper on vLLM's would never run")
    return None


def _ascend_gdn_hooks(src: PluginSource) -> PluginVerdict | None:
    path = _A + "ops/gdn.py"
    gdn = [c for base in ("GatedDeltaNetAttention", "QwenGatedDeltaNetAttention")
           for c in src.classes_based_on(path, base)]
    cores = [m for c in gdn for name, m in _methods(c).items() if name == "_forward_core"]
    if cores and all(_hooks_layer(m) for m in cores):
        return PluginVerdict("carried", "vllm-ascend's GDN layer (ops/gdn.py "
                             f"{gdn[0].name}._forward_core) waits for its layer's load before "
                             "the state is read and saves it after (vllm-ascend #15479)")
    if cores:
        assigned = src.attribute_assignments(_A + "patch/", "_forward_core")
        onto = (", also assigned onto vLLM's class by "
                + ", ".join(a.removeprefix(_A) for a in assigned) if assigned else "")
        return PluginVerdict("bypassed", f"vllm-ascend runs its own GDN layer ({gdn[0].name}"
                             f"._forward_core in ops/gdn.py{onto}) instead of vLLM's entry "
                             "points, so the overlay's wrappers never run; it does not wait "
                             "for its layer's load (no named wait_for_kv_layer_from_connector)")
    return None


def _kda_rule(base: str, what: str) -> Callable[[PluginSource], PluginVerdict | None]:
    def rule(src: PluginSource) -> PluginVerdict | None:
        path = _A + "ops/kimi_kda.py"
        own = [c for c in src.classes_based_on(path, base) if "_forward" in _methods(c)]
        if own and all(_hooks_layer(_methods(c)["_forward"]) for c in own):
            return PluginVerdict("carried", f"vllm-ascend's {own[0].name}._forward "
                                 f"(ops/kimi_kda.py) waits for and saves its layer ({what}; "
                                 "vllm-ascend #16320)")
        if own:
            return PluginVerdict("bypassed", f"vllm-ascend's {own[0].name} (ops/kimi_kda.py) "
                                 f"overrides {base}._forward, so the overlay's hooks on "
                                 "vLLM's never run; it calls no connector hook of its own")
        return None

    return rule


def _ascend_k3_hooks(src: PluginSource) -> PluginVerdict | None:
    verdict = _kda_rule("KimiK3DeltaAttention", "Kimi-K3")(src)
    if verdict is not None:
        return verdict
    model = src.read(_A + "models/kimi_k3.py")
    if model is not None and "KimiK3DeltaAttention" not in model:
        return PluginVerdict("unused", "vllm-ascend serves Kimi-K3 with its own model "
                             "(models/kimi_k3.py), which does not use vLLM's "
                             "KimiK3DeltaAttention (its KDA layers are kda-layer-hooks' "
                             "KimiGatedDeltaNetAttention)")
    return None


def _ascend_k3_amd(src: PluginSource) -> PluginVerdict | None:
    return PluginVerdict("unused", "vLLM selects this ROCm KDA layer only on ROCm; on NPU "
                         "the module is never imported")


def _ascend_bytewise(src: PluginSource) -> PluginVerdict | None:
    if src.read(_A + "ops/triton/mamba/precopy.py") is None:
        return None
    if src.attribute_assignments(_A + "patch/", "precopy_mamba_align_fused_kernel"):
        return PluginVerdict("carried", "vllm-ascend installs its own byte-wise pre-copy "
                             "(ops/triton/mamba/precopy.py) as "
                             "mamba_utils.precopy_mamba_align_fused_kernel (vllm-ascend #15479)")
    return None


def _ascend_multi_connector(src: PluginSource) -> PluginVerdict | None:
    path = _A + "distributed/kv_transfer/ascend_multi_connector.py"
    cls = src.cls(path, "AscendMultiConnector")
    if cls is None:
        return None
    text = src.read(path) or ""
    registered = "AscendMultiConnector" in (
        src.read(_A + "distributed/kv_transfer/__init__.py") or "")
    if "requires_mamba_state_copy_after_layer_load" in text:
        return PluginVerdict("carried", "vllm-ascend's AscendMultiConnector implements the "
                             "layerwise mamba copy protocol (vllm-ascend #15479)")
    if registered and "wait_for_layer_load" in _methods(cls):
        return PluginVerdict("bypassed", "vllm-ascend registers its AscendMultiConnector "
                             "under the name MultiConnector; it overrides "
                             "wait_for_layer_load, so the overlay's wrapper on vLLM's "
                             "MultiConnector never runs, and it has no mamba copy protocol")
    return None


def _ascend_scheduler(src: PluginSource) -> PluginVerdict | None:
    for path in src.attribute_assignments(_A + "patch/", "Scheduler"):
        tree = src.tree(path)
        for node in ast.walk(tree) if tree is not None else ():
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and any(
                    isinstance(t, ast.Attribute) and t.attr == "Scheduler"
                    for t in node.targets)):
                continue
            own = _methods(src.cls(path, node.value.id))
            replaced = [m for m in ("update_from_output", "_handle_invalid_blocks") if m in own]
            if replaced:
                return PluginVerdict("bypassed", f"vllm-ascend replaces vLLM's Scheduler with "
                                     f"its {node.value.id} ({path.removeprefix(_A)}), whose "
                                     f"own {', '.join(replaced)} the overlay's wrappers on "
                                     "vLLM's never reach")
    return None


#: patch id -> rule, per plugin
RULES: dict[str, dict[str, Callable[[PluginSource], PluginVerdict | None]]] = {
    "vllm-ascend": {
        "hybrid-block-size": _ascend_hybrid_block_size,
        "deferred-mamba-precopy": _ascend_deferred_precopy,
        "gdn-layer-hooks": _ascend_gdn_hooks,
        "kda-layer-hooks": _kda_rule("KimiGatedDeltaNetAttention", "Kimi-Linear"),
        "kda-k3-layer-hooks": _ascend_k3_hooks,
        "kda-k3-amd-layer-hooks": _ascend_k3_amd,
        "bytewise-precopy-kernel": _ascend_bytewise,
        "multi-connector-layer-copy": _ascend_multi_connector,
        "hybrid-load-recompute": _ascend_scheduler,
    },
}


def plugin_verdict(patch_id: str, plugins: tuple[PluginBuild, ...]) -> tuple[PluginBuild,
                                                                           PluginVerdict] | None:
    """The first installed plugin whose rule decides ``patch_id``."""
    for build in plugins:
        rule = RULES.get(build.name, {}).get(patch_id)
        if rule is None:
            continue
        verdict = rule(build.source)
        if verdict is not None:
            return build, verdict
    return None
