"""The pool namespace: everything that makes a stored page valid for an
engine, and nothing else.  vLLM's prefix hashes chain token ids only - they
do not depend on the model - so every key carries a 16-byte fingerprint of:

* the model: path, revision, HF config (less the fields below), the
  weights' identity (:mod:`.weights`: every file's full-content digest by
  default), load format, quantization;
* the KV layout: each KV cache group's resolved spec (every field: dtypes,
  shapes, block size, page sizes), the layer names per group, vLLM's
  resolved physical KV cache layout (``kv_cache_layout``: the stride order of
  a page, e.g. LBNHC vs LBHNC - the same spec, other bytes) and the SSM conv
  state layout (``VLLM_SSM_CONV_STATE_LAYOUT``: SD vs DS), model, KV-cache and
  mamba conv/ssm cache dtypes, the hash granularity, TP size (the rank is in
  the key) and PP size;
* the prefix hashes: vLLM's hash algorithm and a digest of the seed vLLM
  derives its first hash from (never the seed itself);
* the vLLM release, the key format, and ``namespace_salt``.

Left out of the HF config (:data:`PAGE_NEUTRAL_CONFIG`, in the config and
in each sub-config), because no page depends on them and they change when
only transformers changes: ``transformers_version`` (the library that last
wrote the config: every transformers upgrade would empty the pool),
``_name_or_path`` and ``_commit_hash`` (where it was read from: path and
revision are named separately, the weights by content), transformers'
attention-implementation bookkeeping (vLLM runs its own kernels), the output
switches of an HF forward call (``use_cache``, ``output_attentions``,
``output_hidden_states``, ``return_dict``, ``torchscript``) and the
generation defaults transformers 4.x put in every config (sampling acts on
logits, after every page is computed; 5.x dropped them).  ``torch_dtype``
and ``dtype`` (its newer name) count as one field.  Training-only fields stay
in: they do not change with transformers, and one model's "init range" is
another's embedding scale (HRM-text).

LoRA adapters are named by content per request (:mod:`.adapters`).

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
from typing import Any

from ..backends.base import VERSION as VALUE_VERSION
from ..config import PoolConfigError
from ..keys import KEY_VERSION

#: part of every namespace: builds that disagree on the keys or on the value
#: header never share entries, so never delete each other's groups (header
#: version 3 once came under key format 3, the same namespaces as version 2)
FORMAT = (KEY_VERSION, VALUE_VERSION)

logger = logging.getLogger("vllm.layerwise_patch")

NON_CRYPTO_HASHES = ("xxhash", "xxhash_cbor")


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


# -- HF config --------------------------------------------------------------------

#: HF config fields no page depends on (see the module docstring)
PAGE_NEUTRAL_CONFIG = frozenset({
    "transformers_version", "_name_or_path", "_commit_hash",
    "_attn_implementation", "_attn_implementation_autoset",
    "_attn_implementation_internal", "attn_implementation",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "torchscript",
    # generation defaults (transformers 4.x wrote them into every config)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
    "output_scores", "return_dict_in_generate", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "forced_bos_token_id", "forced_eos_token_id",
})


def _page_relevant(value: Any, config_level: bool = True) -> Any:
    """``value`` without the page-neutral fields of every (sub-)config in it."""
    if isinstance(value, dict):
        level = config_level or "model_type" in value
        out = {k: _page_relevant(v, False) for k, v in value.items()
               if not (level and k in PAGE_NEUTRAL_CONFIG)}
        if level and "torch_dtype" in out:  # renamed "dtype" in transformers 4.56
            out.setdefault("dtype", out.pop("torch_dtype"))
        return out
    if isinstance(value, list):
        return [_page_relevant(v, False) for v in value]
    return value


def hf_config_identity(hf_config: Any) -> str:
    """A digest of the HF config's page-relevant fields (sub-configs too)."""
    try:
        text = hf_config.to_json_string(use_diff=False)
        data = _page_relevant(json.loads(text))
        text = json.dumps(data, sort_keys=True)
    except Exception:  # noqa: BLE001 - not a transformers config
        text = repr(hf_config)
    return hashlib.sha256(text.encode()).hexdigest()


def kv_cache_layout(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """vLLM's resolved physical KV cache layout (0.32 on; None before)."""
    layout = getattr(kv_cache_config, "kv_cache_layout", None)
    return layout or getattr(vllm_config.cache_config, "kv_cache_layout", None)


def conv_state_layout() -> str | None:
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
    except ImportError:  # releases with one layout
        return None
    return str(get_conv_state_layout())


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
                          salt: str = "", weights: dict[str, Any] | None = None
                          ) -> dict[str, Any]:
    """``weights``: the weights' identity (:func:`.weights.start`); computed
    here by the content rule when not given."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    load = getattr(vllm_config, "load_config", None)
    if weights is None:
        from .weights import start

        weights = start(vllm_config, "content").result()
    return {
        "format": FORMAT,
        "vllm": _vllm_release(),
        "model": str(mc.model),
        "revision": getattr(mc, "revision", None),
        "hf_config": hf_config_identity(mc.hf_config),
        "weights": weights,
        "load_format": str(getattr(load, "load_format", None)),
        "quantization": str(getattr(mc, "quantization", None)),
        "dtype": str(mc.dtype),
        "cache_dtype": str(cc.cache_dtype),
        "mamba_cache_dtype": str(getattr(cc, "mamba_cache_dtype", None)),
        "mamba_ssm_cache_dtype": str(getattr(cc, "mamba_ssm_cache_dtype", None)),
        "kv_cache_layout": kv_cache_layout(vllm_config, kv_cache_config),
        "conv_state_layout": conv_state_layout() if layout.has_state else None,
        "prefix_hash": prefix_hash_identity(cc),
        "layout": layout.describe(),
        "groups": [spec_description(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups],
        "salt": salt,
    }


def namespace_of(description: dict[str, Any]) -> bytes:
    """16-byte fingerprint of a namespace description."""
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).digest()[:16]
