"""LayerwisePoolConnector: a layerwise, hybrid-capable (SupportsHMA) KV
connector backed by an external pool.  This file is the facade; the
scheduler side lives in ``scheduler/`` (``planner.py``), the worker side in
``worker/`` (``forward.py``).

    --kv-transfer-config '{"kv_connector": "LayerwisePoolConnector",
      "kv_connector_module_path": "vllm_layerwise_patch.pool",
      "kv_role": "kv_both",
      "kv_connector_extra_config": {"path": "/dev/shm/pool", "capacity": "8GiB"}}'
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

try:  # vLLM's per-request load-failure channel (failed_recving), 0.32 on
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None

from .identity.adapters import AdapterKeys
from .backends.base import NoPool
from .config import PoolConfig, PoolConfigError
from .faults import faults
from .identity.namespace import namespace_description, namespace_of
from .layout import PoolLayout
from .metadata import AdapterReport
from .opening import open_backend
from .identity.weights import start as start_weights_identity

logger = logging.getLogger("vllm.layerwise_patch")


def async_loads_supported() -> bool:
    """vLLM takes a failed asynchronous load per request (``failed_recving``);
    without it a failed load could not be turned into a recompute."""
    fields = getattr(KVConnectorTransferResults, "__dataclass_fields__", {})
    return "failed_recving" in fields


def avoid_engine_stop(sched: Any) -> None:
    """Without ``hybrid-load-recompute`` in this process (overlay off,
    unverified vLLM) vLLM stops the engine when a synchronous load of a
    hybrid layout fails.  Then hits load asynchronously: vLLM takes a failed
    asynchronous load per request (``failed_recving``) and recomputes or
    fails that request by ``kv_load_failure_policy``; where this vLLM
    cannot, the pool is not looked up (saves go on).  Said once."""
    if not sched.loads_on or sched.load_async or sched.report_load_errors():
        return
    why = ("vllm-layerwise-patch pool: hybrid-load-recompute is not applied in the "
           "scheduler's process, so a failed layerwise load would stop the engine")
    if async_loads_supported():
        sched.load_async = True
        logger.warning("%s; hits are loaded asynchronously instead (as with load_async: "
                       "a failed load recomputes or fails only its request, by "
                       "kv_load_failure_policy)", why)
    else:
        sched.loads_on = False
        logger.warning("%s, and this vLLM reports no failed asynchronous load "
                       "(failed_recving); the pool is not looked up (saves go on)", why)


def _check_engine_config(vllm_config: Any) -> None:
    cc = vllm_config.cache_config
    mc = vllm_config.model_config
    hybrid = bool(getattr(mc, "is_hybrid", False))
    if hybrid and not cc.enable_prefix_caching:
        raise PoolConfigError(
            "LayerwisePoolConnector: a hybrid model needs --enable-prefix-caching "
            "(mamba_cache_mode 'align' keeps the boundary states the pool stores)")
    if hybrid and getattr(cc, "mamba_cache_mode", None) != "align":
        raise PoolConfigError(
            f"LayerwisePoolConnector: mamba_cache_mode is {cc.mamba_cache_mode!r}; "
            "the pool needs 'align'")
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp > 1:
        raise PoolConfigError(
            f"LayerwisePoolConnector: pipeline_parallel_size={pp} is not supported (pool "
            "keys and commit markers cover every layer of a block on one TP rank); "
            "use tensor parallelism only")


class LayerwisePoolConnector(KVConnectorBase_V1, SupportsHMA):
    #: Block load errors of a hybrid (several KV groups) layout may be reported
    #: to the scheduler when the ``hybrid-load-recompute`` patch is applied
    #: there; it maps them back to requests over every group.
    reports_hybrid_load_errors = True
    #: the ``lora-digest-at-load`` patch digests the LoRA adapters a worker
    #: of this connector loads (identity.adapters)
    checks_lora_adapters = True

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.pool_config = PoolConfig.from_extra(extra)
        if self.pool_config.load_async and not async_loads_supported():
            logger.warning("vllm-layerwise-patch pool: load_async needs vLLM's failed_recving "
                           "(vLLM >= 0.32), not found; loading synchronously")
            self.pool_config = self.pool_config.model_copy(update={"load_async": False})
        _check_engine_config(vllm_config)
        if kv_cache_config is None:
            raise PoolConfigError("LayerwisePoolConnector needs vLLM's kv_cache_config")
        weights = start_weights_identity(vllm_config, self.pool_config.weights_identity)
        self.layout = PoolLayout.from_vllm(vllm_config, kv_cache_config)
        is_scheduler = role == KVConnectorRole.SCHEDULER
        self.backend = open_backend(self.pool_config,
                                    "scheduler" if is_scheduler else "worker")
        try:  # (the weights are digested while the backend opens)
            self.namespace_description = namespace_description(
                vllm_config, kv_cache_config, self.layout, self.pool_config.namespace_salt,
                weights=weights.result())
        except BaseException:
            self.backend.close()
            raise
        self.ns = namespace_of(self.namespace_description)
        weights_seen = self.namespace_description["weights"]
        if not weights_seen["resolved"]:
            logger.warning("vllm-layerwise-patch pool: the pool cannot name the weights of %r "
                           "(%s); %s", vllm_config.model_config.model, weights_seen.get("why"),
                           "the namespace names them by model, revision and namespace_salt"
                           if self.pool_config.namespace_salt else "the pool is not used "
                           "(set namespace_salt to a name that changes whenever these "
                           "weights change, or serve weights files the pool can read)")
        self._adapters = AdapterKeys(files_only=faults().adapter_digest_at_lookup)
        self._sched = self._worker = self._weights = None
        # who holds the pool (`pool clear` asks): where it was opened (the
        # default path, or this user's fallback when another user holds it)
        self._held = getattr(self.backend, "path", None) \
            if self.pool_config.backend in ("lmdb", "tiered") else None
        if self._held:
            from .directory import holders

            holders.register(self._held, "scheduler" if is_scheduler else "worker",
                             str(vllm_config.model_config.model))
        if is_scheduler:
            from .scheduler.stats import SchedulerSideStats
            from .scheduler.planner import PoolScheduler

            self._sched = PoolScheduler(vllm_config=vllm_config, layout=self.layout,
                                        backend=self.backend, namespace=self.ns,
                                        config=self.pool_config)
            if isinstance(self.backend, NoPool):  # (said once, when it was opened)
                self._sched.loads_on = self._sched.saves_on = False
            from .scheduler.weight_changes import WeightChanges

            avoid_engine_stop(self._sched)
            self._weights = WeightChanges(
                self.namespace_description, vllm_config, self.pool_config,
                drafter=bool(self.layout.drafter_layers), apply=self._use_namespace,
                blind=self._sched.faults.weights_change_blind)
            self._sched_stats = SchedulerSideStats(
                lambda: self._sched.stats | self._sched.shared_loads.stats, self.backend,
                self.layout.block_size, failures=not self._sched.faults.stats_every_rank)
            self._describe_namespace()
        else:
            from .worker.forward import PoolWorker

            self._worker = PoolWorker(vllm_config=vllm_config, layout=self.layout,
                                      backend=self.backend, namespace=self.ns,
                                      config=self.pool_config)
        logger.info("vllm-layerwise-patch pool (%s): %s at %s, namespace %s, block %d "
                    "tokens, prefix hashes every %d, blocks routed in runs of %d",
                    role.name.lower(), self.pool_config.backend,
                    getattr(self.backend, "path", None), self.ns.hex(),
                    self.layout.block_size, self.layout.hash_block_size,
                    self.layout.route_span)

    def _describe_namespace(self) -> None:
        """Keep the namespace's description next to its entries (JSON), for
        whoever reads a dump of the pool; best effort."""
        import json

        from .backends.base import pack
        from .keys import namespace_key

        try:
            key = namespace_key(self.ns)
            if not self.backend.exists_many([key])[0]:
                text = json.dumps(self.namespace_description, sort_keys=True, indent=1)
                self.backend.put_many([(key, pack(self.ns, key, text.encode()))])
        except Exception:  # noqa: BLE001
            pass

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # per-layer hooks are skipped under FULL cudagraphs

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        from .stats import PoolStats

        return PoolStats(data=dict(data)) if data is not None else PoolStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]):
        from .prom import PoolPromMetrics

        return PoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self):
        """The worker's stats of this step (with per-step samples for the
        Prometheus histograms); on the scheduler side, its hits and the
        pool's fill (``.scheduler.stats``)."""
        if self._worker is not None:
            stats = self._worker.take_stats()
            return stats.sample_step() if stats is not None else None
        return self._sched_stats.take() if self._sched is not None else None

    # -- layerwise mamba copy protocol (worker) -------------------------------
    @property
    def requires_mamba_state_copy_after_layer_load(self) -> bool:
        return bool(self._worker is not None and self._worker.layerwise)

    def prepare_mamba_state_copy(self, model_state: Any) -> bool:
        return self._worker.prepare_mamba_state_copy(model_state) if self._worker else False

    def finish_mamba_state_copy(self) -> None:
        if self._worker is not None:
            self._worker.finish_mamba_state_copy()

    # -- worker side ------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.begin_step(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._worker.clear()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def on_layer_compute_start(self, layer_name: str) -> None:
        self._worker.on_layer_compute_start(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]):
        """(saves finished: none, the pool's saves are not asynchronous;
        requests whose asynchronous loads are done)."""
        if self._worker is None:
            return None, None
        done, _ = self._worker.transfer_results()
        return None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]):
        """Asynchronous loads done, and those of them that failed (vLLM
        recomputes or fails those requests by its kv_load_failure_policy)."""
        done, failed = self._worker.transfer_results() if self._worker else (set(), set())
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def build_connector_worker_meta(self):
        """The LoRA adapters this worker holds (identity.adapters)."""
        return self._worker.adapter_report() if self._worker is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        self.backend.close()
        if self._held:
            from .directory import holders

            holders.release(self._held)

    # -- weights changed at run time (scheduler side, .scheduler.weight_changes) --
    def on_weights_change(self, phase: str, method: str, args: tuple = (),
                          kwargs: dict | None = None, ok: bool = True) -> None:
        """``method``, a collective_rpc that changes the weights, is about to
        run (``phase`` "before"), or returned or raised ("after", ``ok``): the
        ``weight-update-namespace`` patch calls this."""
        if self._weights is not None:
            self._weights.on_change(phase, method, args, kwargs, ok)

    def reset_cache(self) -> bool | None:
        """vLLM drops its caches (``reset_prefix_cache(reset_connector=True)``):
        the pool's entries stay (other engines' pages, named by their
        weights); this engine stops using them until its weights are named
        again."""
        return self._weights.reset() if self._weights is not None else None

    def _use_namespace(self, ns: bytes | None, description: dict) -> None:
        self._sched.set_namespace(ns)
        if ns is not None:
            self.ns, self.namespace_description = ns, description
            self._describe_namespace()

    # -- scheduler side ---------------------------------------------------------
    # (a request runs through the pool as its adapter's view, .adapters)
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        if self._weights is not None:
            self._weights.follow()
        view = self._adapters.view(request, async_loads=self._sched.load_async)
        if view is None:  # an adapter that cannot be fingerprinted: no pool
            return 0, False
        return self._sched.get_num_new_matched_tokens(view, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        view = self._adapters.view(request)
        if view is not None:
            self._sched.update_state_after_alloc(view, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self._weights is not None:
            self._weights.follow()
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._sched is not None:
            report = getattr(connector_output, "kv_connector_worker_meta", None)
            if isinstance(report, AdapterReport):  # (the adapters the workers hold)
                self._adapters.learn(report)
            self._sched.update_connector_output(connector_output)

    def blocks_to_evict(self, invalid_block_ids: set[int]) -> set[int]:
        """(``hybrid-load-recompute``) The blocks of failed loads and every
        block computed from them, held by running requests or not."""
        return self._sched.blocks_to_evict(invalid_block_ids) if self._sched else set()

    def request_finished(self, request: Any, block_ids: list[int]):
        self._adapters.forget(request)
        self._sched.request_finished(request)
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]):
        self._adapters.forget(request)
        self._sched.request_finished(request)
        return False, None
