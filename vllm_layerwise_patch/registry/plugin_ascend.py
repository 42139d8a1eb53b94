"""vllm-ascend's rules for :mod:`.plugins`: per patch, a small structural
check of vllm-ascend's source (parsed with :mod:`ast`, never imported) that
says whether it carries the patch's behaviour, bypasses the object the patch
wraps, or neither; what each looked for is in its reason."""

from __future__ import annotations

import ast
from collections.abc import Callable

from .plugins import PluginSource, PluginVerdict, _name


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


def _ascend_mamba_manager(src: PluginSource) -> PluginVerdict | None:
    for path in src.attribute_assignments(_A + "patch/", "MambaManager"):
        tree = src.tree(path)
        for node in ast.walk(tree) if tree is not None else ():
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and any(
                    isinstance(t, ast.Attribute) and t.attr == "MambaManager"
                    for t in node.targets)):
                continue
            fn = _methods(src.cls(path, node.value.id)).get("get_num_blocks_to_allocate")
            adds_one = any(isinstance(n, ast.AugAssign) and isinstance(n.op, ast.Add)
                           and isinstance(n.value, ast.Constant) and n.value.value == 1
                           for n in ast.walk(fn)) if fn is not None else False
            if adds_one and _calls_super(fn, "get_num_blocks_to_allocate"):
                return PluginVerdict("carried", f"vllm-ascend replaces vLLM's MambaManager with "
                                     f"its {node.value.id} ({path.removeprefix(_A)}), whose "
                                     "get_num_blocks_to_allocate adds the external hit's "
                                     "block to vLLM's estimate (vllm-ascend #11129); the "
                                     "overlay's wrapper would count it twice")
    return None


#: patch id -> rule
ASCEND_RULES: dict[str, Callable[[PluginSource], PluginVerdict | None]] = {
    "hybrid-block-size": _ascend_hybrid_block_size,
    "deferred-mamba-precopy": _ascend_deferred_precopy,
    "gdn-layer-hooks": _ascend_gdn_hooks,
    "kda-layer-hooks": _kda_rule("KimiGatedDeltaNetAttention", "Kimi-Linear"),
    "kda-k3-layer-hooks": _ascend_k3_hooks,
    "kda-k3-amd-layer-hooks": _ascend_k3_amd,
    "bytewise-precopy-kernel": _ascend_bytewise,
    "multi-connector-layer-copy": _ascend_multi_connector,
    "hybrid-load-recompute": _ascend_scheduler,
    "mamba-external-hit-blocks": _ascend_mamba_manager,
}


