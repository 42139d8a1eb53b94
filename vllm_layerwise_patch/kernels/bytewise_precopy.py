"""Byte-wise mamba "align" pre-copy kernel (drop-in for vLLM's fused pre-copy).

``precopy_mamba_align_bytewise_kernel`` takes exactly the launch contract of
``vllm.v1.worker.mamba_utils.precopy_mamba_align_fused_kernel`` on vLLM 0.30-0.34
(parameter names, order, constexprs and defaults - 0.34's
``ZERO_TEMPORAL_TOKEN_BIAS`` included, default False as there; grid
``(num_reqs, num_states[, TEMPORAL_TILES])``) and copies the same bytes, but:

* every global load/store of state bytes is ``uint8`` (upstream vectorises the
  SD-conv and temporal copies through ``uint64`` and the DS-conv copy through
  ``uint16``/``uint32``, which the Ascend vector core cannot execute);
* each scalar base address is cast to a typed pointer exactly once, before any
  loop (``state_base -> uint8*``, ``block_table_row -> int32*``); loops only add
  ``int64`` byte offsets to those pointers, never cast a computed address.

Per program ``(batch_idx, state_idx, tile_idx)`` (``req = idx_mapping[batch_idx]``
when ``HAS_IDX_MAPPING``, else ``batch_idx``; nothing happens when
``batch_idx >= num_reqs``, ``req < 0``, ``src_col < 0`` or ``src_col == dst_col``;
``bt`` is row ``req`` of the block table of the state's group - row
``batch_idx`` with ``BLOCK_TABLE_ROW_IS_BATCH``, the semantics of vLLM
0.30/0.31, whose context holds batch-order tables; block ids are widened to
int64 before they are multiplied by the block stride; with
``ZERO_TEMPORAL_TOKEN_BIAS`` the temporal copy ignores the bias, as vLLM
0.34 does for ReplaySSM contexts):

================  ==========================================  ===========================
branch            source                                      bytes copied
================  ==========================================  ===========================
DS conv           ``bt[src]``, each dim row, from token       per dim row
(dim-first)       ``bias`` on                                 ``(width - bias) * elem``
SD conv           ``bt[src]`` from ``bias * inner * elem``    ``(width - bias) * inner * elem``
temporal          ``bt[src + bias]``                          ``inner * elem`` (not the
                                                              padded block stride)
================  ==========================================  ===========================

Conv copies run in tile 0 only; the temporal copy is split into
``TEMPORAL_TILES`` contiguous byte ranges (rounded up to ``COPY_BLOCK_SIZE``).
A conv shift whose source and destination are the same block (``bias > 0``)
overlaps itself; it is copied token by token from low to high, and every byte
position relative to its token is owned by the same lane in every token step,
so a byte is always read (as a source) by the lane that later overwrites it:
memmove-safe without a barrier.

Imports Triton, never vLLM.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["BatchRowLauncher", "precopy_mamba_align_bytewise_kernel"]


@triton.jit(do_not_specialize=["num_reqs"])
def precopy_mamba_align_bytewise_kernel(
    mamba_state_idx_ptr,  # [max_reqs] int32: destination block column
    src_col_ptr,  # [max_reqs] int32: source block column, -1 = fresh
    token_bias_ptr,  # [max_reqs] int32: accepted-token bias
    block_table_ptrs_ptr,  # [num_groups] int64: block-table base addresses
    block_table_stride_req: tl.int64,  # elements between block-table rows
    state_base_addrs_ptr,  # [num_states] int64: state tensor base addresses
    state_block_strides_ptr,  # [num_states] int64: bytes between blocks
    state_elem_sizes_ptr,  # [num_states] int32: element size in bytes
    state_inner_sizes_ptr,  # [num_states] int64: elements per token / per block
    state_conv_widths_ptr,  # [num_states] int32: conv width, 0 = temporal
    state_group_indices_ptr,  # [num_states] int32: index into block_table_ptrs
    state_dim_row_count_ptr,  # [num_states] int32: DS conv dim rows per block
    state_dim_row_stride_ptr,  # [num_states] int64: DS conv bytes between rows
    idx_mapping_ptr,  # [num_reqs] int32: batch row -> request slot (-1 skips)
    num_reqs,
    COPY_BLOCK_SIZE: tl.constexpr,
    CONV_STATE_DIM_FIRST: tl.constexpr,
    HAS_IDX_MAPPING: tl.constexpr = True,
    ZERO_TEMPORAL_TOKEN_BIAS: tl.constexpr = False,
    TEMPORAL_TILES: tl.constexpr = 1,
    BLOCK_TABLE_ROW_IS_BATCH: tl.constexpr = False,
):
    batch_idx = tl.program_id(0)
    state_idx = tl.program_id(1)
    tile_idx = tl.program_id(2)
    if batch_idx >= num_reqs:
        return
    if HAS_IDX_MAPPING:
        req_idx = tl.load(idx_mapping_ptr + batch_idx)
        if req_idx < 0:
            return
    else:
        req_idx = batch_idx

    src_col = tl.load(src_col_ptr + req_idx)
    dst_col = tl.load(mamba_state_idx_ptr + req_idx)
    if src_col < 0 or src_col == dst_col:
        return
    bias = tl.load(token_bias_ptr + req_idx).to(tl.int64)

    block_stride = tl.load(state_block_strides_ptr + state_idx).to(tl.int64)
    elem = tl.load(state_elem_sizes_ptr + state_idx).to(tl.int64)
    inner = tl.load(state_inner_sizes_ptr + state_idx).to(tl.int64)
    width = tl.load(state_conv_widths_ptr + state_idx).to(tl.int64)
    group = tl.load(state_group_indices_ptr + state_idx).to(tl.int64)

    # The only two address casts of the kernel, both on scalars, both hoisted.
    table_addr = tl.load(block_table_ptrs_ptr + group)
    if BLOCK_TABLE_ROW_IS_BATCH:
        table_row = batch_idx.to(tl.int64)
    else:
        table_row = req_idx.to(tl.int64)
    bt_row = table_addr.to(tl.pointer_type(tl.int32)) + (
        table_row * block_table_stride_req
    )
    state_bytes = tl.load(state_base_addrs_ptr + state_idx).to(
        tl.pointer_type(tl.uint8)
    )

    dst_block = tl.load(bt_row + dst_col).to(tl.int64)
    dst_base = dst_block * block_stride
    lane = tl.arange(0, COPY_BLOCK_SIZE).to(tl.int64)

    if width > 0:
        # Conv windows are small: tile 0 shifts them, the other tiles idle.
        if tile_idx > 0:
            return
        src_block = tl.load(bt_row + src_col).to(tl.int64)
        src_base = src_block * block_stride
        n_tokens = width - bias
        if CONV_STATE_DIM_FIRST:
            # [dim, width] per block: token t of dim row r lives at
            # r * row_stride + t * elem.  One token step moves that token of
            # every row; lane j owns byte (j % elem) of row (j // elem).
            rows = tl.load(state_dim_row_count_ptr + state_idx).to(tl.int64)
            row_stride = tl.load(state_dim_row_stride_ptr + state_idx).to(tl.int64)
            step_bytes = rows * elem
            for t in range(0, n_tokens):
                src_tok = src_base + (t + bias) * elem
                dst_tok = dst_base + t * elem
                for j0 in range(0, step_bytes, COPY_BLOCK_SIZE):
                    j = j0 + lane
                    r = j // elem
                    in_step = r * row_stride + (j - r * elem)
                    m = j < step_bytes
                    v = tl.load(state_bytes + (src_tok + in_step), mask=m)
                    tl.store(state_bytes + (dst_tok + in_step), v, mask=m)
        else:
            # [width, inner] per block: tokens are contiguous runs of
            # inner * elem bytes.
            token_bytes = inner * elem
            if src_block != dst_block or bias == 0:
                # Disjoint (or identical) ranges: one contiguous run.
                src_run = src_base + bias * token_bytes
                n_bytes = n_tokens * token_bytes
                for i in range(0, n_bytes, COPY_BLOCK_SIZE):
                    k = i + lane
                    m = k < n_bytes
                    v = tl.load(state_bytes + (src_run + k), mask=m)
                    tl.store(state_bytes + (dst_base + k), v, mask=m)
            else:
                # Left shift inside one block: low tokens first, stable
                # lane ownership of the byte position within a token.
                for t in range(0, n_tokens):
                    src_tok = src_base + (t + bias) * token_bytes
                    dst_tok = dst_base + t * token_bytes
                    for i in range(0, token_bytes, COPY_BLOCK_SIZE):
                        k = i + lane
                        m = k < token_bytes
                        v = tl.load(state_bytes + (src_tok + k), mask=m)
                        tl.store(state_bytes + (dst_tok + k), v, mask=m)
        return

    # Temporal state: the block of the accepted speculative column replaces
    # the destination block.  Only the natural data (inner * elem bytes) is
    # copied: the block stride may include page padding.
    if ZERO_TEMPORAL_TOKEN_BIAS:
        src_block = tl.load(bt_row + src_col).to(tl.int64)
    else:
        src_block = tl.load(bt_row + src_col + bias).to(tl.int64)
    src_base = src_block * block_stride
    n_bytes = inner * elem
    # Bytes per tile, rounded up to whole COPY_BLOCK_SIZE steps.  (Plain
    # integer arithmetic instead of tl.cdiv: the kernel calls no other
    # @triton.jit function, so it also runs as an ad-hoc InterpretedFunction.)
    per_tile = (n_bytes + TEMPORAL_TILES - 1) // TEMPORAL_TILES
    per_tile = (per_tile + COPY_BLOCK_SIZE - 1) // COPY_BLOCK_SIZE * COPY_BLOCK_SIZE
    start = tile_idx.to(tl.int64) * per_tile
    end = tl.minimum(start + per_tile, n_bytes)
    for i in range(start, end, COPY_BLOCK_SIZE):
        k = i + lane
        m = k < end
        v = tl.load(state_bytes + (src_base + k), mask=m)
        tl.store(state_bytes + (dst_base + k), v, mask=m)


class BatchRowLauncher:
    """``kernel`` launched with ``BLOCK_TABLE_ROW_IS_BATCH=True``: the object
    installed as vLLM 0.30/0.31's ``precopy_mamba_align_fused_kernel`` (their
    kernel reads block-table row ``batch_idx``; ``kernel[grid](...)`` callers
    pass no such argument)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            kwargs.setdefault("BLOCK_TABLE_ROW_IS_BATCH", True)
            return launch(*args, **kwargs)

        return run
