"""The layerwise mamba copy protocol: the contract between the
``deferred-mamba-precopy`` patch and KV connectors (DESIGN §4).

A connector that loads mamba state layer by layer implements:

* ``requires_mamba_state_copy_after_layer_load: bool`` - when False (or absent)
  nothing changes: vLLM runs its bulk align pre-copy before the forward;
* ``prepare_mamba_state_copy(model_state) -> bool`` - called from the patched
  ``MambaHybridModelState.preprocess_state`` after the decision kernel ran;
  True means "I will trigger the per-layer copies this step";
* inside ``wait_for_layer_load(layer_name)``, after the connector's own load of
  that layer completed: ``model_state.do_mamba_copy_for_layer(layer_name)``
  (a no-op for non-mamba layers and for a layer already copied);
* optionally, once it knows that no layer of this step loads anything (its
  step metadata is bound after ``preprocess_state``):
  ``model_state.do_mamba_copy_all()`` - the whole step's pre-copy now, in
  vLLM's one bulk launch (what stock vLLM runs), instead of one launch per
  layer; the per-layer calls that follow are no-ops;
* ``finish_mamba_state_copy()`` - called once by the next step's
  ``preprocess_state`` after it verified that every deferred layer was copied
  (a layer left pending raises ``RuntimeError`` naming it); idempotent.

Optional, used by the GDN/KDA layer hooks (``layer_hooks``):

* ``on_layer_compute_start(layer_name)`` - called right after
  ``wait_for_layer_load`` returns, when the layer is about to touch its state:
  the compute-start fence that lets later layers' prefetch begin.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: The patches a GDN hybrid's layerwise path needs in a worker (the pool
#: connector checks the same pair before choosing layerwise over bulk).
LAYERWISE_PATCHES = ("deferred-mamba-precopy", "gdn-layer-hooks")

REQUIRES_ATTR = "requires_mamba_state_copy_after_layer_load"
PREPARE = "prepare_mamba_state_copy"
FINISH = "finish_mamba_state_copy"
COPY_FOR_LAYER = "do_mamba_copy_for_layer"
COPY_ALL = "do_mamba_copy_all"
#: where the patched model state keeps this step's DeferredMambaCopy
DEFERRED_ATTR = "_vlp_deferred_mamba_copy"
COMPUTE_START = "on_layer_compute_start"


def active_connector() -> Any | None:
    """The worker-side v1 KV connector of this process, or None."""
    try:
        from vllm.distributed.kv_transfer import (
            get_kv_transfer_group,
            has_kv_transfer_group,
            is_v1_kv_transfer_group,
        )
    except ImportError:
        return None
    if not has_kv_transfer_group() or not is_v1_kv_transfer_group():
        return None
    return get_kv_transfer_group()


def requires_layerwise_copy(connector: Any) -> bool:
    return bool(connector is not None and getattr(connector, REQUIRES_ATTR, False))


def layer_state_rows(kv_cache_config: Any, mamba_group_ids: list[int],
                     copy_funcs: Any, forward_context: Any = None) -> dict[str, tuple[int, int]]:
    """Map each mamba layer to its ``[start, end)`` rows in the
    ``MambaSpecDecodeGPUContext`` per-state arrays.

    Same enumeration as ``MambaSpecDecodeGPUContext._populate_metadata``:
    mamba groups, then each group's layer names, then the state copy
    functions of the layer (GDN: conv, then temporal).  From vLLM 0.34 a
    layer's rows are what ``_get_mamba_gpu_state_copy_funcs(spec, layer,
    copy_funcs)`` returns (FlashInfer ReplaySSM Mamba2 layers add three ring
    states); it needs the layer object, from ``forward_context``."""
    from vllm.v1.worker import mamba_utils as mu

    per_layer = getattr(mu, "_get_mamba_gpu_state_copy_funcs", None)
    rows: dict[str, tuple[int, int]] = {}
    idx = 0
    for gid in mamba_group_ids:
        group = kv_cache_config.kv_cache_groups[gid]
        for name in group.layer_names:
            spec = mu._get_mamba_spec_for_layer(group, name)
            if per_layer is not None and forward_context is not None:
                n = len(per_layer(spec, forward_context[name], copy_funcs))
            else:
                n = len(copy_funcs[spec.mamba_type])
            rows[name] = (idx, idx + n)
            idx += n
    return rows


def launch_precopy_rows(ctx: Any, start: int, end: int, num_reqs: int,
                        state_idx: Any, src_col: Any, token_bias: Any,
                        idx_mapping: Any) -> None:
    """Launch vLLM's align pre-copy kernel on rows ``[start, end)`` only.

    The arguments of ``MambaSpecDecodeGPUContext.run_fused_precopy`` (vLLM
    0.30-0.34), with the per-state metadata sliced (a sliced view passes an
    offset data pointer) and the full block-table pointers; nothing when the
    context is not initialized (as ``run_fused_precopy``).  From 0.34 the
    context has ``replayssm`` and the launch passes
    ``ZERO_TEMPORAL_TOKEN_BIAS=ctx.replayssm is not None``, as
    ``run_fused_precopy`` does there.  The kernel is looked up on the module
    at call time, so a kernel override (``bytewise-precopy-kernel``) is
    honoured.  No CPU-GPU sync.  The per-layer copies of a step launch
    through :class:`PrecopyLauncher`, which passes the same arguments with
    the slicing done once."""
    from vllm.v1.worker import mamba_utils as mu

    if num_reqs == 0 or end <= start or not getattr(ctx, "is_initialized", True):
        return
    tiles = getattr(mu, "_TEMPORAL_TILES", 1)
    extra = {}
    if hasattr(ctx, "replayssm"):  # vLLM >= 0.34
        extra["ZERO_TEMPORAL_TOKEN_BIAS"] = ctx.replayssm is not None
    mu.precopy_mamba_align_fused_kernel[(num_reqs, end - start, tiles)](
        state_idx,
        src_col,
        token_bias,
        ctx.block_table_ptrs,
        ctx.block_table_stride_req,
        ctx.state_base_addrs[start:end],
        ctx.state_block_strides[start:end],
        ctx.state_elem_sizes[start:end],
        ctx.state_inner_sizes[start:end],
        ctx.state_conv_widths[start:end],
        ctx.state_group_indices[start:end],
        ctx.state_dim_row_count[start:end],
        ctx.state_dim_row_stride[start:end],
        idx_mapping,
        num_reqs,
        COPY_BLOCK_SIZE=1024,
        CONV_STATE_DIM_FIRST=mu.is_conv_state_dim_first(),
        HAS_IDX_MAPPING=idx_mapping is not None,
        TEMPORAL_TILES=tiles,
        **extra,
    )


#: ``MambaSpecDecodeGPUContext``'s per-state arrays, in the kernel's order
STATE_ARRAYS = ("state_base_addrs", "state_block_strides", "state_elem_sizes",
                "state_inner_sizes", "state_conv_widths", "state_group_indices",
                "state_dim_row_count", "state_dim_row_stride")
#: where a context keeps its :class:`RowViews`
_VIEWS_ATTR = "_vlp_precopy_row_views"


def _identity(ctx: Any) -> tuple:
    """What the cached views depend on: each state array, its address and
    its shape (the views are slices of exactly these tensors)."""
    out = []
    for name in STATE_ARRAYS:
        t = getattr(ctx, name)
        out.append((t, t.data_ptr(), tuple(t.shape), tuple(t.stride())))
    return tuple(out)


class RowViews:
    """A context's state arrays sliced per row range, once: a per-layer
    launch passes views made in an earlier step instead of slicing eight
    tensors again (the host time of a launch).  Valid while the context
    holds the same tensors at the same addresses and shapes (checked once
    per step, :func:`row_views`); the views are of those tensors, so what
    vLLM writes into them in place is what the kernel reads."""

    def __init__(self, ctx: Any) -> None:
        self.key = _identity(ctx)
        self._arrays = [k[0] for k in self.key]
        self._views: dict[tuple[int, int], tuple] = {}

    def matches(self, ctx: Any) -> bool:
        key = _identity(ctx)
        return len(key) == len(self.key) and all(
            a[0] is b[0] and a[1:] == b[1:] for a, b in zip(key, self.key))

    def get(self, start: int, end: int) -> tuple:
        views = self._views.get((start, end))
        if views is None:
            views = self._views[(start, end)] = tuple(t[start:end] for t in self._arrays)
        return views


def row_views(ctx: Any) -> RowViews:
    """The context's :class:`RowViews`, made again when its arrays changed
    (kept in the context's ``__dict__``; a context without one gets new
    views each step)."""
    store = getattr(ctx, "__dict__", {})
    cached = store.get(_VIEWS_ATTR)
    if cached is None or not cached.matches(ctx):
        cached = store[_VIEWS_ATTR] = RowViews(ctx)
    return cached


class PrecopyLauncher:
    """One step's per-layer launches of vLLM's align pre-copy kernel: what
    :func:`launch_precopy_rows` passes, with the step's arguments, the
    constexprs and the row views (:class:`RowViews`) prepared once, so a
    launch only looks the kernel up (an override is honoured) and calls it.
    The same arguments as :func:`launch_precopy_rows`, byte for byte."""

    def __init__(self, ctx: Any, num_reqs: int, state_idx: Any, src_col: Any,
                 token_bias: Any, idx_mapping: Any) -> None:
        from vllm.v1.worker import mamba_utils as mu

        self.mu, self.ctx = mu, ctx
        self.live = num_reqs != 0 and getattr(ctx, "is_initialized", True)
        self.num_reqs = num_reqs
        self.head = (state_idx, src_col, token_bias)
        self.tail = (idx_mapping, num_reqs)
        self.tiles = getattr(mu, "_TEMPORAL_TILES", 1)
        self.views = row_views(ctx) if self.live else None
        self.constexprs = dict(COPY_BLOCK_SIZE=1024,
                               CONV_STATE_DIM_FIRST=mu.is_conv_state_dim_first(),
                               HAS_IDX_MAPPING=idx_mapping is not None,
                               TEMPORAL_TILES=self.tiles)
        if hasattr(ctx, "replayssm"):  # vLLM >= 0.34
            self.constexprs["ZERO_TEMPORAL_TOKEN_BIAS"] = ctx.replayssm is not None

    def launch(self, start: int, end: int) -> None:
        """Rows ``[start, end)``; nothing when the step has no request, the
        context is not initialized or the range is empty."""
        if not self.live or end <= start:
            return
        ctx = self.ctx
        self.mu.precopy_mamba_align_fused_kernel[(self.num_reqs, end - start, self.tiles)](
            *self.head, ctx.block_table_ptrs, ctx.block_table_stride_req,
            *self.views.get(start, end), *self.tail, **self.constexprs)


@dataclasses.dataclass
class DeferredMambaCopy:
    """One step's pre-copy, deferred to the per-layer loads.

    Holds the buffers the decision kernel wrote (valid until the next
    ``preprocess_state``) and the set of layers still to copy."""

    ctx: Any
    rows: dict[str, tuple[int, int]]
    num_reqs: int
    state_idx: Any
    src_col: Any
    token_bias: Any
    idx_mapping: Any
    pending: set[str] = dataclasses.field(default_factory=set)
    launched: int = 0
    launcher: Any = None  # the step's PrecopyLauncher, made at the first copy

    def __post_init__(self) -> None:
        if not self.pending:
            self.pending = set(self.rows)

    def copy_layer(self, layer_name: str) -> bool:
        """Launch the copy for ``layer_name`` once; False for anything else."""
        if layer_name not in self.pending:
            return False
        start, end = self.rows[layer_name]
        if self.launcher is None:
            self.launcher = PrecopyLauncher(self.ctx, self.num_reqs, self.state_idx,
                                            self.src_col, self.token_bias, self.idx_mapping)
        self.launcher.launch(start, end)
        self.pending.discard(layer_name)
        self.launched += 1
        return True

    def copy_all(self) -> bool:
        """Every layer still pending at once, with vLLM's own bulk launch
        (``run_fused_precopy``: what the step would have run unpatched);
        False when a layer was already copied (the rest stay per layer)."""
        if self.pending != set(self.rows) or not self.pending:
            return False
        self.ctx.run_fused_precopy(self.num_reqs, self.state_idx, self.src_col,
                                   self.token_bias, self.idx_mapping)
        self.pending.clear()
        self.launched += 1
        return True


def deferred_copy(model_state: Any) -> DeferredMambaCopy | None:
    """This step's deferred pre-copy of ``model_state``, if any."""
    return vars(model_state).get(DEFERRED_ATTR)
