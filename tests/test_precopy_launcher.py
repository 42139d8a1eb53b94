"""The per-layer pre-copy launches with the state arrays sliced once
(``copy_protocol.PrecopyLauncher`` / ``RowViews``) against the launch that
slices them every time (``launch_precopy_rows``): the same kernel arguments,
the same bytes moved (the CPU emulation's torch pre-copy standing in for
vLLM's Triton kernel), and views made again whenever the context's arrays
change.  On a real ``MambaSpecDecodeGPUContext`` of the installed vLLM
(``selfcheck.precopy_check.build_case``).  Host time per launch is printed
by ``benchmarks/bench_precopy_launch.py``, not asserted here."""

from __future__ import annotations

import pytest
import torch

mu = pytest.importorskip("vllm.v1.worker.mamba_utils")

from vllm_layerwise_patch import copy_protocol as cp  # noqa: E402
from vllm_layerwise_patch.cpu_emulation.torch_precopy_install import (  # noqa: E402
    TorchPrecopyKernel,
)
from vllm_layerwise_patch.selfcheck import precopy_check as pc  # noqa: E402


class RecordingKernel:
    """Records every launch (grid, positional arguments, constexprs)."""

    def __init__(self) -> None:
        self.launches: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((grid, args, kw))


def _rows(case):
    return cp.layer_state_rows(case["kv_cache_config"], list(case["ctx"].mamba_group_ids),
                               case["copy_funcs"], case["layers"])


def _handle(case, rows):
    return cp.DeferredMambaCopy(ctx=case["ctx"], rows=rows, num_reqs=case["num_reqs"],
                                state_idx=case["state_idx"], src_col=case["src_col"],
                                token_bias=case["token_bias"],
                                idx_mapping=case["idx_mapping"])


def _old_launches(case, rows):
    for name in case["names"]:
        start, end = rows[name]
        cp.launch_precopy_rows(case["ctx"], start, end, case["num_reqs"], case["state_idx"],
                               case["src_col"], case["token_bias"], case["idx_mapping"])


def _describe(arg):
    if isinstance(arg, torch.Tensor):
        return ("tensor", arg.data_ptr(), tuple(arg.shape), arg.stride(), arg.dtype,
                arg.cpu().tolist())
    return ("value", arg)


def test_launcher_passes_what_the_slicing_launch_passes(monkeypatch):
    case = pc.build_case(3, num_layers=4)
    rows = _rows(case)
    rec = RecordingKernel()
    monkeypatch.setattr(mu, "precopy_mamba_align_fused_kernel", rec)
    _old_launches(case, rows)
    old, rec.launches = rec.launches, []
    handle = _handle(case, rows)
    for name in case["names"]:
        assert handle.copy_layer(name)
        assert not handle.copy_layer(name)  # once per step
    new = rec.launches
    assert len(old) == len(new) == 4
    for (g0, a0, k0), (g1, a1, k1) in zip(old, new):
        assert g0 == g1 and k0 == k1
        assert [_describe(a) for a in a0] == [_describe(a) for a in a1]
    # and a step without requests launches nothing, as before
    empty = cp.DeferredMambaCopy(ctx=case["ctx"], rows=rows, num_reqs=0, state_idx=None,
                                 src_col=None, token_bias=None, idx_mapping=None)
    rec.launches = []
    empty.copy_layer(case["names"][0])
    assert rec.launches == []


def test_per_layer_launches_move_the_same_bytes(monkeypatch):
    monkeypatch.setattr(mu, "precopy_mamba_align_fused_kernel", TorchPrecopyKernel())
    old, new, bulk = (pc.build_case(5) for _ in range(3))
    before = old["raw"].clone()
    _old_launches(old, _rows(old))
    handle = _handle(new, _rows(new))
    for name in new["names"]:
        handle.copy_layer(name)
    pc.run_bulk(bulk)
    assert int((old["raw"] != before).sum()) > 0  # the copies moved bytes
    assert torch.equal(old["raw"], new["raw"]) and torch.equal(new["raw"], bulk["raw"])


def test_views_are_kept_across_steps_and_made_again_when_the_arrays_change(monkeypatch):
    monkeypatch.setattr(mu, "precopy_mamba_align_fused_kernel", TorchPrecopyKernel())
    a = pc.build_case(7)
    rows = _rows(a)
    first = _handle(a, rows)
    first.copy_layer(a["names"][0])
    views = cp.row_views(a["ctx"])
    second = _handle(a, rows)  # the next step: the same views, not new slices
    second.copy_layer(a["names"][0])
    assert cp.row_views(a["ctx"]) is views
    start, end = rows[a["names"][1]]
    assert views.get(start, end) is views.get(start, end)

    # vLLM rebuilds an array: the launch must follow it.  Here the state
    # addresses of another buffer (a second case) are swapped in: the copy
    # must land there, not in the buffer the old views point to.
    def swap_and_copy(check_matches: bool):
        x, y = pc.build_case(9), pc.build_case(9)
        rows_x = _rows(x)
        _handle(x, rows_x).copy_layer(x["names"][0])  # views of x's arrays cached
        before_x, before_y = x["raw"].clone(), y["raw"].clone()
        for name in cp.STATE_ARRAYS[:1]:
            setattr(x["ctx"], name, getattr(y["ctx"], name).clone())
        with pytest.MonkeyPatch.context() as m:
            if not check_matches:  # negative control: the cache never notices
                m.setattr(cp.RowViews, "matches", lambda self, ctx: True)
            h = _handle(x, rows_x)
            for n in x["names"]:
                h.copy_layer(n)
        return (int((y["raw"] != before_y).sum()), int((x["raw"] != before_x).sum()))

    into_y, into_x = swap_and_copy(check_matches=True)
    assert into_y > 0 and into_x == 0  # the new addresses were used
    stale_y, stale_x = swap_and_copy(check_matches=False)
    assert stale_y == 0 and stale_x > 0  # a stale cache writes the old buffer


def test_in_place_changes_need_no_new_views(monkeypatch):
    # Values vLLM writes into its arrays in place are what the views show.
    a = pc.build_case(11)
    rows = _rows(a)
    rec = RecordingKernel()
    monkeypatch.setattr(mu, "precopy_mamba_align_fused_kernel", rec)
    _handle(a, rows).copy_layer(a["names"][1])
    views = cp.row_views(a["ctx"])
    a["ctx"].state_block_strides.add_(1)
    _handle(a, rows).copy_layer(a["names"][1])
    assert cp.row_views(a["ctx"]) is views
    start, end = rows[a["names"][1]]
    sliced = rec.launches[-1][1][6]  # state_block_strides[start:end]
    assert sliced.tolist() == a["ctx"].state_block_strides[start:end].tolist()
