"""Test and demo helpers: CPU emulation of Model Runner V2, tiny hybrid models.

Importing this package imports neither torch nor vLLM; the helpers import what
they need when called. ``install_cpu_v2_shim()`` must run before vLLM is
imported (the package bootstrap does it when ``VLLM_LAYERWISE_PATCH_CPU_V2=1``).
"""

from .cpu_v2 import (
    CPU_V2_ENV,
    cpu_v2_env,
    cpu_v2_llm_kwargs,
    install_cpu_v2_shim,
    is_installed,
)
from .tiny_model import (
    TINY_EOS_TOKEN_ID,
    build_tiny_qwen3_next,
    default_tiny_model_dir,
    tiny_prompt,
)

__all__ = [
    "CPU_V2_ENV",
    "TINY_EOS_TOKEN_ID",
    "build_tiny_qwen3_next",
    "cpu_v2_env",
    "cpu_v2_llm_kwargs",
    "default_tiny_model_dir",
    "install_cpu_v2_shim",
    "is_installed",
    "tiny_prompt",
]
