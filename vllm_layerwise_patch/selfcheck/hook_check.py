"""Check a layer-hook patch's wrappers against vLLM's real connector state and
forward context, without running a model (used by self-checks and tests).

A :class:`RecordingConnector` (a real ``KVConnectorBase_V1`` subclass, built
without a vLLM config) is installed as the process's KV transfer group for the
duration of the check; a ``ForwardContext`` with attention metadata is set;
each wrapped method's wrapper is then called with a stand-in body.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Callable, Iterator
from typing import Any


def recording_connector_class():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    class RecordingConnector(KVConnectorBase_V1):
        """Records every per-layer hook call into ``events``."""

        def __init__(self, has_metadata: bool = True) -> None:  # no vLLM config needed
            self.events: list[tuple[str, str]] = []
            self._has_md = has_metadata

        def has_connector_metadata(self) -> bool:
            return self._has_md

        def wait_for_layer_load(self, layer_name: str) -> None:
            self.events.append(("wait", layer_name))

        def on_layer_compute_start(self, layer_name: str) -> None:
            self.events.append(("fence", layer_name))

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
            self.events.append(("save", layer_name))

        # abstract methods this check never reaches
        def start_load_kv(self, forward_context, **kwargs):
            raise NotImplementedError

        def wait_for_save(self):
            raise NotImplementedError

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            raise NotImplementedError

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            raise NotImplementedError

        def build_connector_meta(self, scheduler_output):
            raise NotImplementedError

    return RecordingConnector


@contextlib.contextmanager
def installed_connector(connector: Any, attn_metadata: Any) -> Iterator[None]:
    """Make ``connector`` the active transfer group and set a forward context."""
    from vllm.distributed.kv_transfer import kv_transfer_state as kts
    from vllm.forward_context import ForwardContext, override_forward_context

    saved = kts._KV_CONNECTOR_AGENT
    kts._KV_CONNECTOR_AGENT = connector
    fc = ForwardContext(no_compile_layers={}, attn_metadata=attn_metadata, slot_mapping={})
    try:
        with override_forward_context(fc):
            yield
    finally:
        kts._KV_CONNECTOR_AGENT = saved


def check_layer_hooks(cls_path: str, methods: list[str],
                      nested: tuple[str, str] | None = None) -> str:
    """Assert the hook protocol of the wrapped ``methods`` of ``cls_path``."""
    from ..registry import patch_marker

    module, _, qualname = cls_path.partition(":")
    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    layer = types.SimpleNamespace(prefix="model.layers.0.linear_attn", kv_cache=["conv", "ssm"])
    name = layer.prefix
    rec_cls = recording_connector_class()

    def wrapper_of(method: str):
        w = vars(cls)[method]
        assert patch_marker(w) is not None, f"{qualname}.{method} is not wrapped"
        return w._self_wrapper

    for method in methods:
        rec = rec_cls()
        body_ran: list[bool] = []

        def body():
            body_ran.append(True)
            rec.events.append(("body", name))
            return "result"

        with installed_connector(rec, {name: None}):  # idle layer: metadata None
            out = wrapper_of(method)(lambda: body(), layer, (), {})
        assert out == "result" and body_ran, f"{method}: body not run"
        expected = [("wait", name), ("fence", name), ("body", name), ("save", name)]
        assert rec.events == expected, f"{method}: hook order {rec.events}"
        # no connector metadata (profile / warm-up run): no hook at all
        rec = rec_cls(has_metadata=False)
        with installed_connector(rec, {name: None}):
            wrapper_of(method)(lambda: "r", layer, (), {})
        assert rec.events == [], f"{method}: hooks ran without connector metadata"
        # no attention metadata: no hook at all
        rec = rec_cls()
        with installed_connector(rec, None):
            wrapper_of(method)(lambda: "r", layer, (), {})
        assert rec.events == [], f"{method}: hooks ran without attention metadata"
    if nested is not None:
        outer, inner = nested
        rec = rec_cls()
        with installed_connector(rec, {name: None}):
            wrapper_of(outer)(lambda: wrapper_of(inner)(lambda: "r", layer, (), {}),
                              layer, (), {})
        assert [e for e, _ in rec.events] == ["wait", "fence", "save"], (
            f"nested {outer} -> {inner}: {rec.events}")
    return (f"{', '.join(methods)}: wait, fence, body, save in order; none without "
            "metadata" + ("; nested entry points hook once" if nested else ""))


def check_recoverssm_saves(target: Any, hooked: Any,
                           hook_inner: Callable[..., Any]) -> str:
    """The ``kda-k3-layer-hooks`` RecoverSSM path on the installed vLLM's own
    ``RecoverSSMState`` (``record_step`` / ``commit_step``, patched) and
    ``RecoverSSMMetadata``: a layer hooked as the patch hooks ``_forward``
    (same factory and save policy; a stand-in body, the real one needs CUDA
    kernels) holds its save while the step carries a RecoverSSM commit, and
    the save comes right after the release's ``commit_step`` ran the commit.
    Negative controls: ``commit_step`` without our wrapper commits but saves
    nothing; a commit_step that commits nothing drops the held save; a step
    without a commit saves at the layer's exit.

    ``hooked`` is the patch's hooked ``_forward`` found on ``target`` (None
    when there is none), ``hook_inner`` the patch's factory of such functions:
    the patch passes both, so this module imports no patch module."""
    import torch
    from vllm.v1.attention.backends.recoverssm_metadata import RecoverSSMMetadata
    from vllm.v1.worker.gpu.model_states.recoverssm import RecoverSSMState

    from ..layer_hooks import pending_saves, pending_saves_clear
    from ..registry import patch_marker

    policy = getattr(hooked, "_vlp_save_after_commit", None)
    assert policy is not None, f"{target.qualname}: hooked without the RecoverSSM save policy"
    commit_step = vars(RecoverSSMState)["commit_step"]
    pid = patch_marker(commit_step)
    assert pid is not None, "RecoverSSMState.commit_step is not wrapped"

    name = "model.layers.0.self_attn"
    rec = recording_connector_class()()

    class CommitMetadata(RecoverSSMMetadata):
        """Stand-in for KimiK3KDAMetadata: a step with speculative requests."""

        recoverssm_commit = "commit"

        def commit_recoverssm_state(self, num_accepted_tokens):
            rec.events.append(("commit", name))
            return None  # no align postprocess to launch

    class PlainMetadata(RecoverSSMMetadata):
        """Stand-in for a step without speculative requests."""

        recoverssm_commit = None

        def commit_recoverssm_state(self, num_accepted_tokens):
            return None  # KimiK3KDAMetadata: nothing to commit

    layer = types.SimpleNamespace(prefix=name, kv_cache=["conv", "recurrent"])
    forward = hook_inner(lambda self: rec.events.append(("body", name)), pid, policy)
    groups = [[types.SimpleNamespace(layer_names=[name])]]
    sampled, idx = torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)

    def step(md, commit) -> list[tuple[str, str]]:
        rec.events.clear()
        state = RecoverSSMState()
        with installed_connector(rec, {name: md}):
            forward(layer)
            state.record_step({name: md}, groups, for_capture=False)
            commit(state)
        return [e for e, _ in rec.events]

    run = lambda s: s.commit_step(sampled, idx, state_indices=None,  # noqa: E731
                                  num_accepted_tokens=sampled)
    got = step(CommitMetadata(), run)
    assert got == ["wait", "fence", "body", "commit", "save"], f"RecoverSSM step: {got}"
    assert pending_saves() == []
    bare = lambda s: commit_step.__wrapped__(s, sampled, idx, state_indices=None,  # noqa: E731
                                             num_accepted_tokens=sampled)
    got = step(CommitMetadata(), bare)
    assert got == ["wait", "fence", "body", "commit"], f"unwrapped commit_step: {got}"
    assert pending_saves() == [name], "the held save vanished without the wrapper"
    pending_saves_clear()
    none = lambda s: s.commit_step(0, idx, state_indices=None,  # noqa: E731
                                   num_accepted_tokens=sampled)
    from .. import layer_hooks

    quiet, logged = layer_hooks.logger.disabled, layer_hooks._dropped_logged
    layer_hooks.logger.disabled = True  # the drop below is expected here
    try:
        got = step(CommitMetadata(), none)
    finally:
        layer_hooks.logger.disabled, layer_hooks._dropped_logged = quiet, logged
    assert got == ["wait", "fence", "body"] and pending_saves() == [], (
        f"nothing committed: {got}, held {pending_saves()}")
    got = step(PlainMetadata(), run)
    assert got == ["wait", "fence", "body", "save"], f"step without a commit: {got}"
    return ("RecoverSSM: save held until RecoverSSMState.commit_step committed "
            "(wait, fence, body, commit, save); dropped when nothing was committed; "
            "saved at exit without a commit")
