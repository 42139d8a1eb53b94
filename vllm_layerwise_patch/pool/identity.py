"""The pool namespace: everything that makes a stored page valid for an
engine.  vLLM's prefix hashes chain token ids only - they do not depend on the
model - so every key carries a 16-byte fingerprint of:

* the model: path, revision, HF config, the weights' identity (safetensors
  headers, file names and sizes, and a few KiB sampled from each weights file:
  new weights under the same path and config give another namespace, without
  reading the weights), load format, quantization;
* the KV layout: each KV cache group's resolved spec (every field: dtypes,
  shapes, block size, page sizes), the layer names per group, model, KV-cache
  and mamba conv/ssm cache dtypes, the hash granularity, TP size (the rank is
  in the key) and PP size;
* the prefix hashes: vLLM's hash algorithm and a digest of the seed vLLM
  derives its first hash from (never the seed itself);
* the vLLM release, the key format, and ``namespace_salt``.

vLLM seeds its non-cryptographic prefix hashes (``xxhash``, ``xxhash_cbor``)
with random bytes per process unless ``PYTHONHASHSEED`` is set: no engine
could ever hit another's entries.  :func:`prefix_hash_identity` refuses that
configuration with the fix.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import os
import struct
from typing import Any

from .config import PoolConfigError
from .keys import FORMAT

logger = logging.getLogger("vllm.layerwise_patch")

NON_CRYPTO_HASHES = ("xxhash", "xxhash_cbor")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".ckpt")
_SAMPLES, _SAMPLE_BYTES = 8, 4096


# -- prefix hash algorithm and seed ---------------------------------------------

def hash_seed_problem(cache_config: Any, environ: Any = None) -> str | None:
    """Why vLLM's prefix hashes cannot match across processes, or None."""
    environ = os.environ if environ is None else environ
    algo = str(getattr(cache_config, "prefix_caching_hash_algo", "sha256"))
    if algo in NON_CRYPTO_HASHES and environ.get("PYTHONHASHSEED") is None:
        return (f"prefix_caching_hash_algo={algo!r} without PYTHONHASHSEED: vLLM seeds "
                "these prefix hashes with random bytes per process, so no engine "
                "could hit another engine's (or its own earlier) pool entries. Fix: "
                "set PYTHONHASHSEED to one value for every engine sharing the pool "
                "(e.g. export PYTHONHASHSEED=0; it is a shared secret: keep it "
                "private), or use --prefix-caching-hash-algo sha256")
    return None


def _default_seed() -> str:
    try:
        from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED
    except ImportError:  # releases that hash a fixed seed without naming it
        return "vllm-default"
    return str(DEFAULT_NONE_HASH_SEED)


def prefix_hash_identity(cache_config: Any) -> dict[str, str]:
    """The hash algorithm and a digest of vLLM's hash seed (raises
    PoolConfigError when hashes would be random per process)."""
    problem = hash_seed_problem(cache_config)
    if problem is not None:
        raise PoolConfigError(f"LayerwisePoolConnector: {problem}")
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        seed = _default_seed()
    algo = str(getattr(cache_config, "prefix_caching_hash_algo", "sha256"))
    digest = hashlib.sha256(b"vllm-layerwise-pool seed\0" + seed.encode()).hexdigest()
    return {"algo": algo, "seed_digest": digest[:32]}


# -- weights ---------------------------------------------------------------------

def _model_dir(model: str, revision: str | None) -> str | None:
    if os.path.isdir(model) or os.path.isfile(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True)
    except Exception:
        return None


def _safetensors_data_start(f: Any, size: int) -> tuple[bytes, int]:
    head = f.read(8)
    if len(head) < 8:
        return b"", 0
    (n,) = struct.unpack("<Q", head)
    if n > min(size - 8, 100 << 20):
        return b"", 0
    return f.read(n), 8 + n


def _file_identity(path: str, h: Any) -> None:
    size = os.path.getsize(path)
    h.update(f"{os.path.basename(path)}\0{size}\0".encode())
    with open(path, "rb") as f:
        start = 0
        if path.endswith(".safetensors"):
            header, start = _safetensors_data_start(f, size)
            h.update(header)
        span = size - start
        if span <= _SAMPLES * _SAMPLE_BYTES:
            f.seek(start)
            h.update(f.read())
            return
        for i in range(_SAMPLES):  # evenly spaced, the last one ends the file
            f.seek(start + (span - _SAMPLE_BYTES) * i // (_SAMPLES - 1))
            h.update(f.read(_SAMPLE_BYTES))


def weights_identity(model: str, revision: str | None = None) -> dict[str, Any]:
    """A cheap fingerprint of the weights behind ``model`` (a directory, a
    file or a Hugging Face id already in the local cache): names, sizes,
    safetensors headers, index files, and 8 x 4 KiB sampled from each weights
    file.  Never reads the weights in full."""
    where = _model_dir(model, revision)
    if where is None:
        return {"resolved": False, "model": model, "revision": revision}
    if os.path.isfile(where):
        files = [where]
    else:
        files = sorted(os.path.join(where, n) for n in os.listdir(where)
                       if n.endswith(_WEIGHT_SUFFIXES) or n.endswith("index.json"))
    h = hashlib.sha256()
    for path in files:
        _file_identity(path, h)
    return {"resolved": True, "files": len(files), "digest": h.hexdigest()}


# -- KV cache specs ----------------------------------------------------------------

def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)  # torch dtypes and the like


def spec_description(spec: Any) -> dict[str, Any]:
    """Every field of a KV cache spec, and its class."""
    out = {"class": type(spec).__name__}
    out.update(_plain(spec) if dataclasses.is_dataclass(spec) else {"repr": repr(spec)})
    for name in ("page_size_bytes", "real_page_size_bytes"):
        try:
            out[name] = int(getattr(spec, name))
        except Exception:
            pass
    return out


def _vllm_release() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # pragma: no cover - vLLM is always there with the pool
        return "unknown"


def namespace_description(vllm_config: Any, kv_cache_config: Any, layout: Any,
                          salt: str = "") -> dict[str, Any]:
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    try:
        hf = mc.hf_config.to_json_string(use_diff=False)
    except Exception:
        hf = repr(mc.hf_config)
    load = getattr(vllm_config, "load_config", None)
    return {
        "format": FORMAT,
        "vllm": _vllm_release(),
        "model": str(mc.model),
        "revision": getattr(mc, "revision", None),
        "hf_config": hashlib.sha256(hf.encode()).hexdigest(),
        "weights": weights_identity(str(mc.model), getattr(mc, "revision", None)),
        "load_format": str(getattr(load, "load_format", None)),
        "quantization": str(getattr(mc, "quantization", None)),
        "dtype": str(mc.dtype),
        "cache_dtype": str(cc.cache_dtype),
        "mamba_cache_dtype": str(getattr(cc, "mamba_cache_dtype", None)),
        "mamba_ssm_cache_dtype": str(getattr(cc, "mamba_ssm_cache_dtype", None)),
        "prefix_hash": prefix_hash_identity(cc),
        "layout": layout.describe(),
        "groups": [spec_description(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups],
        "salt": salt,
    }


def namespace_of(description: dict[str, Any]) -> bytes:
    """16-byte fingerprint of a namespace description."""
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).digest()[:16]
