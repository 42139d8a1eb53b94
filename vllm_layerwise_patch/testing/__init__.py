"""What tests, the demo and ``bench`` use to drive engines: engine processes
(:mod:`.engines`), an OpenAI-compatible server (:mod:`.server`), the tiny
hybrid model and tokenizer, a tracing KV connector.  Nothing in production
imports this package (``tests/test_import_graph.py``); the CPU emulation it
runs engines under is :mod:`vllm_layerwise_patch.cpu_emulation`.

Importing this package imports neither torch nor vLLM; the helpers import what
they need when called.
"""

from .tiny_model import (
    TINY_EOS_TOKEN_ID,
    build_tiny_qwen3_next,
    default_tiny_model_dir,
    tiny_prompt,
)

__all__ = [
    "TINY_EOS_TOKEN_ID",
    "build_tiny_qwen3_next",
    "default_tiny_model_dir",
    "tiny_prompt",
]
