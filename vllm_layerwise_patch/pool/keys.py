"""Pool namespace, key format and commit markers.

One value per (namespace, kind, block-hash chain, TP rank, layer):

    <ns>/a/<hash>/<tp>/<layer>   attention page of a block
    <ns>/m/<hash>/<tp>/<layer>   linear-attention state at the block's end
    <ns>/A/<hash>/<tp>           commit marker: every attention page saved
    <ns>/M/<hash>/<tp>           commit marker: every boundary state saved

vLLM's block hashes chain the whole prefix and do not depend on the model, so
the namespace carries model identity, dtypes, block size, page layout and TP
size: two models or layouts never share entries.  Lookups check markers only;
markers are written in the same transaction as the pages they cover.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

FORMAT = 1
ATTN, MAMBA = "a", "m"
_MARKER = {ATTN: "A", MAMBA: "M"}


_LAYER = re.compile(r"^(.*?)layers\.(\d+)\.")


def layer_id(name: str) -> str:
    """The layer's id in pool keys: ``"N"`` for the target model's
    ``model.layers.N.*`` (and any ``layers.N.*`` at the top), otherwise the
    module prefix and the number (``mtp.layers.0.*`` -> ``"mtp.0"``), so a
    drafter layer never shares keys with a target layer.  Unnumbered layers
    keep their full name."""
    m = _LAYER.match(name)
    if m is None:
        return name
    prefix = m.group(1).rstrip(".")
    if prefix in ("", "model", "model.model", "language_model.model"):
        return m.group(2)
    return f"{prefix}.{m.group(2)}"


def forward_order(name: str) -> tuple[int, int, str]:
    """Sort key: target-model layers by number, then drafter and other layers
    (which run after the target forward)."""
    lid = layer_id(name)
    if lid.isdigit():
        return (0, int(lid), name)
    m = _LAYER.match(name)
    return (1, int(m.group(2)) if m else 0, name)


def check_unique_ids(names: list[str]) -> None:
    seen: dict[str, str] = {}
    for n in names:
        other = seen.setdefault(layer_id(n), n)
        if other != n:
            raise ValueError(f"layers {other!r} and {n!r} map to the same pool key "
                             f"id {layer_id(n)!r}")


def group_kinds(kv_cache_config: Any) -> list[str]:
    """ATTN or MAMBA for each KV cache group."""
    from vllm.v1.kv_cache_interface import MambaSpec, UniformTypeKVCacheSpecs

    kinds = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = next(iter(spec.kv_cache_specs.values()))
        kinds.append(MAMBA if isinstance(spec, MambaSpec) else ATTN)
    return kinds


def layout_description(kv_cache_config: Any) -> list[dict[str, Any]]:
    out = []
    for kind, group in zip(group_kinds(kv_cache_config), kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        out.append({"kind": kind, "layers": list(group.layer_names),
                    "block_size": getattr(spec, "block_size", None),
                    "page_size": getattr(spec, "page_size_bytes", None),
                    "spec": type(spec).__name__})
    return out


def namespace(vllm_config: Any, kv_cache_config: Any, salt: str = "") -> bytes:
    """16-byte fingerprint of everything that makes pages interchangeable."""
    mc = vllm_config.model_config
    try:
        hf = mc.hf_config.to_json_string(use_diff=False)
    except Exception:
        hf = repr(mc.hf_config)
    desc = {
        "format": FORMAT,
        "model": str(mc.model),
        "revision": getattr(mc, "revision", None),
        "hf_config": hashlib.sha256(hf.encode()).hexdigest(),
        "dtype": str(mc.dtype),
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "mamba_ssm_dtype": str(getattr(vllm_config.cache_config, "mamba_ssm_cache_dtype", "")),
        "block_size": vllm_config.cache_config.block_size,
        "layout": layout_description(kv_cache_config),
        "tp": vllm_config.parallel_config.tensor_parallel_size,
        "pp": vllm_config.parallel_config.pipeline_parallel_size,
        "salt": salt,
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).digest()[:16]


def hash_hex(block_hash: Any) -> str:
    return bytes(block_hash).hex()


def page_key(ns: bytes, kind: str, block_hash: Any, tp: int, layer: str) -> bytes:
    return f"{ns.hex()}/{kind}/{hash_hex(block_hash)}/{tp}/{layer}".encode()


def marker_key(ns: bytes, kind: str, block_hash: Any, tp: int) -> bytes:
    return f"{ns.hex()}/{_MARKER[kind]}/{hash_hex(block_hash)}/{tp}".encode()
