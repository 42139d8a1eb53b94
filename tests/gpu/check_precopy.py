"""The mamba align pre-copy on the GPU: vLLM's kernel and the overlay's
byte-wise kernel, in one bulk launch and in per-layer launches, byte for byte
and timed.

    python tests/gpu/check_precopy.py --vllm-src DIR [--json FILE] [--dry-run]

``DIR`` holds a release's ``vllm/`` sources (a wheel's ``.py`` files, or an
installed vLLM's site-packages).  From ``vllm/v1/worker/mamba_utils.py`` it
takes, by reading the source (``vllm_sources.extract_functions``: that
module imports the whole engine), ``precopy_mamba_align_fused_kernel`` with
the ``@triton.jit`` helpers it calls and ``_TEMPORAL_TILES``, and
``MambaSpecDecodeGPUContext.run_fused_precopy`` - vLLM's bulk launch - which
runs on a stand-in context holding the per-state arrays
``_populate_metadata`` would build for GDN layers (conv state, then the
temporal ssm state, in one padded page per block, every layer's pages in one
buffer).  The per-layer launches are the overlay's own code
(``copy_protocol.DeferredMambaCopy.copy_layer`` -> the step's
``PrecopyLauncher``, the state arrays sliced once), with vLLM's kernel and
then with the byte-wise kernel installed in its place (what
``bytewise-precopy-kernel`` does); their host time is also taken with the
launch that slices every time (``launch_precopy_rows``, the path before).

Checks, for the SD conv layout (vLLM's default) and the DS layout, and on a
release with ReplaySSM (0.34) also with ``ZERO_TEMPORAL_TOKEN_BIAS``: the four
ways (vLLM bulk, vLLM per layer, byte-wise bulk, byte-wise per layer) leave
the buffer equal to a torch reference of the pre-copy, byte for byte, and the
reference moved bytes (the DS case with at most 4 layers and a 512-wide conv
state: its reference copies one element row at a time).  Requests: one fresh (nothing to copy), one in the same
block, one with a speculative token bias, one batch row mapped out, the rest
crossing a block boundary.  Then, timed with CUDA events over ``--iters``
steps: one bulk launch vs ``--layers`` per-layer launches, GPU time per step
and per launch, and the host time to issue them (the forward thread pays it).

Exit 0: every check passed; 1: a check failed; 2: setup error.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_common  # noqa: E402
import vllm_sources  # noqa: E402


def load_release(src: Path):
    """vLLM's pre-copy kernel module and its bulk launch method, registered
    as ``vllm.v1.worker.mamba_utils`` (where the overlay's per-layer launch
    looks the kernel up)."""
    f = src / "vllm" / "v1" / "worker" / "mamba_utils.py"
    for name in ("vllm", "vllm.v1", "vllm.v1.worker"):
        sys.modules.setdefault(name, vllm_sources._bare_package(
            name, src.joinpath(*name.split("."))))
    mu = vllm_sources.extract_functions(f, ["precopy_mamba_align_fused_kernel"],
                                        ["_TEMPORAL_TILES"],
                                        module_name="vllm.v1.worker.mamba_utils")
    sys.modules["vllm.v1.worker"].mamba_utils = mu
    mu.DIM_FIRST = False
    mu.is_conv_state_dim_first = lambda: mu.DIM_FIRST
    run_fused = vllm_sources.extract_method(f, "MambaSpecDecodeGPUContext",
                                            "run_fused_precopy", mu)
    return mu, run_fused, f


class Ctx:
    """Stand-in for ``MambaSpecDecodeGPUContext``: the attributes
    ``run_fused_precopy`` and ``launch_precopy_rows`` read."""

    is_initialized = True


def build_case(dev, *, layers: int, reqs: int, conv_dim: int, width: int, heads: int,
               head_dim: int, dim_first: bool, seed: int):
    import torch

    cols = 4
    num_blocks = reqs * cols + 2
    conv_bytes = width * conv_dim * 2  # bf16
    ssm_bytes = heads * head_dim * head_dim * 4  # fp32 [H, V, K]
    page = (conv_bytes + ssm_bytes + 63) // 64 * 64 + 64  # padded page
    layer_bytes = num_blocks * page
    gen = torch.Generator().manual_seed(seed)
    # every layer's pages in one buffer, as vLLM allocates them
    dgen = torch.Generator(device=dev).manual_seed(seed)
    raw = torch.randint(0, 256, (layers * layer_bytes,), dtype=torch.uint8, device=dev,
                        generator=dgen)
    states, names = [], []
    i64 = dict(dtype=torch.int64)
    addrs, strides, elems, inners, widths, groups, rows_n, rows_s = ([] for _ in range(8))
    for li in range(layers):
        names.append(f"model.layers.{li}.linear_attn")
        base = li * layer_bytes
        # conv state: SD [width, dim] or DS [dim, width] per block, bf16
        if dim_first:
            conv = dict(off=base, stride=page, e=2, w=width, inner=1, rows=conv_dim,
                        row_stride=width * 2, group=0)
        else:
            conv = dict(off=base, stride=page, e=2, w=width, inner=conv_dim, rows=0,
                        row_stride=0, group=0)
        ssm = dict(off=base + conv_bytes, stride=page, e=4, w=0,
                   inner=heads * head_dim * head_dim, rows=0, row_stride=0, group=0)
        for st in (conv, ssm):
            states.append(st)
            addrs.append(raw.data_ptr() + st["off"])
            strides.append(st["stride"])
            elems.append(st["e"])
            inners.append(st["inner"])
            widths.append(st["w"])
            groups.append(0)
            rows_n.append(st["rows"])
            rows_s.append(st["row_stride"])
    ids = torch.randperm(num_blocks - 1, generator=gen)[: reqs * cols] + 1
    table = ids.view(reqs, cols).to(torch.int32)
    bt = table.to(dev)
    # slot 0 fresh, 1 same block, 2 spec bias 1, the rest cross 0 -> 1 (or 1 -> 2)
    src = [-1, 1, 1] + [i % 2 for i in range(reqs - 3)]
    dst = [0, 1, 2] + [i % 2 + 1 for i in range(reqs - 3)]
    bias = [0, 0, 1] + [0] * (reqs - 3)
    # batch rows: a permutation of the slots, the last row mapped out
    perm = torch.randperm(reqs, generator=gen).tolist()
    idx_mapping = perm[:-1] + [-1]
    ctx = Ctx()
    t = lambda v, **kw: torch.tensor(v, device=dev, **kw)  # noqa: E731
    ctx.num_states = len(states)
    ctx.block_table_ptrs = t([bt.data_ptr()], **i64)
    ctx.block_table_stride_req = bt.stride(0)
    ctx.state_base_addrs = t(addrs, **i64)
    ctx.state_block_strides = t(strides, **i64)
    ctx.state_elem_sizes = t(elems, dtype=torch.int32)
    ctx.state_inner_sizes = t(inners, **i64)
    ctx.state_conv_widths = t(widths, dtype=torch.int32)
    ctx.state_group_indices = t(groups, dtype=torch.int32)
    ctx.state_dim_row_count = t(rows_n, dtype=torch.int32)
    ctx.state_dim_row_stride = t(rows_s, **i64)
    rows = {n: (2 * i, 2 * i + 2) for i, n in enumerate(names)}
    return dict(raw=raw, init=raw.clone(), states=states, table=table, bt=bt, ctx=ctx,
                names=names, rows=rows, src=src, dst=dst, bias=bias, idx_mapping=idx_mapping,
                num_reqs=reqs, page=page,
                state_idx=t(dst, dtype=torch.int32), src_col=t(src, dtype=torch.int32),
                token_bias=t(bias, dtype=torch.int32),
                idx=t(idx_mapping, dtype=torch.int32), dim_first=dim_first)


def reference(case, zero_temporal: bool):
    from vllm_layerwise_patch.patches.bytewise_precopy_kernel import reference_precopy

    buf = case["init"].clone()
    reference_precopy(buf, case["states"], [case["table"]], case["src"], case["dst"],
                      case["bias"], case["idx_mapping"], case["num_reqs"],
                      case["dim_first"], zero_temporal_bias=zero_temporal)
    return buf


def launch_bulk(case, run_fused) -> None:
    run_fused(case["ctx"], case["num_reqs"], case["state_idx"], case["src_col"],
              case["token_bias"], case["idx"])


def launch_per_layer(case) -> None:
    from vllm_layerwise_patch.copy_protocol import DeferredMambaCopy

    handle = DeferredMambaCopy(ctx=case["ctx"], rows=case["rows"], num_reqs=case["num_reqs"],
                               state_idx=case["state_idx"], src_col=case["src_col"],
                               token_bias=case["token_bias"], idx_mapping=case["idx"])
    for name in case["names"]:
        handle.copy_layer(name)
    assert not handle.pending


def launch_per_layer_slicing(case) -> None:
    """The per-layer launches as before the step's launcher: every launch
    slices the state arrays (``launch_precopy_rows``) - for the host time."""
    from vllm_layerwise_patch.copy_protocol import launch_precopy_rows

    for name in case["names"]:
        start, end = case["rows"][name]
        launch_precopy_rows(case["ctx"], start, end, case["num_reqs"], case["state_idx"],
                            case["src_col"], case["token_bias"], case["idx"])


def time_launches(dev, fn, iters: int) -> dict:
    """GPU time per step (CUDA events around ``iters`` steps) and host time
    to issue one step; on CPU (dry run) wall time only."""
    import torch

    for _ in range(3):
        fn()
    gpu_common.sync(dev)
    host = []
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        per_step = []
        for _ in range(5):  # median of 5 blocks of `iters` steps
            start.record()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            host.append((time.perf_counter() - t0) / iters)
            end.record()
            end.synchronize()
            per_step.append(start.elapsed_time(end) / 1e3 / iters)
        return {"gpu_us_per_step": statistics.median(per_step) * 1e6,
                "host_us_per_step": statistics.median(host) * 1e6}
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    return {"gpu_us_per_step": None, "host_us_per_step": statistics.median(host) * 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-src", required=True, type=Path)
    ap.add_argument("--json")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny")
    ap.add_argument("--layers", type=int, default=36, help="GDN layers (Qwen3-Next-80B: 36)")
    ap.add_argument("--reqs", type=int, default=8)
    ap.add_argument("--conv-dim", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=100)
    a = ap.parse_args()
    if a.dry_run:
        a.layers, a.reqs, a.conv_dim, a.heads, a.head_dim, a.iters = 3, 5, 24, 2, 8, 2
    dev = gpu_common.device(a.dry_run)
    if dev is None:
        print("RESULT: SETUP ERROR - no CUDA device (use --dry-run on CPU)")
        return 2
    release = vllm_sources.version(a.vllm_src)
    print(f"pre-copy kernels, vLLM {release} sources, {dev}", flush=True)
    mu, run_fused, source = load_release(a.vllm_src)
    vllm_kernel = mu.precopy_mamba_align_fused_kernel
    from vllm_layerwise_patch.kernels.bytewise_precopy import precopy_mamba_align_bytewise_kernel
    zero_flag = "ZERO_TEMPORAL_TOKEN_BIAS" in vllm_kernel.arg_names
    kernels = {"vllm": vllm_kernel, "bytewise": precopy_mamba_align_bytewise_kernel}
    checks = gpu_common.Checks()
    result: dict = {"vllm_release": release, "kernel_source": str(source.relative_to(a.vllm_src)),
                    "sizes": {"layers": a.layers, "reqs": a.reqs, "conv_dim": a.conv_dim,
                              "ssm_heads": a.heads, "head_dim": a.head_dim},
                    "temporal_tiles": mu._TEMPORAL_TILES, "equality": [], "timing": {}}
    variants = [(False, False), (True, False)] + ([(False, True)] if zero_flag else [])
    timing_case = None
    for dim_first, zero_temporal in variants:
        mu.DIM_FIRST = dim_first
        # the torch reference copies a DS conv state one element row at a
        # time: that case is smaller (4 layers, conv_dim <= 512)
        layers, conv_dim = ((min(a.layers, 4), min(a.conv_dim, 512)) if dim_first
                            else (a.layers, a.conv_dim))
        case = build_case(dev, layers=layers, reqs=a.reqs, conv_dim=conv_dim, width=3,
                          heads=a.heads, head_dim=a.head_dim, dim_first=dim_first, seed=7)
        if zero_flag:
            case["ctx"].replayssm = object() if zero_temporal else None
        want = reference(case, zero_temporal)
        moved = int((want != case["init"]).sum())
        if zero_temporal:  # the flag must change what is copied, or the case proves nothing
            flag = int((reference(case, False) != want).sum())
            checks.check("ZERO_TEMPORAL_TOKEN_BIAS changes the reference's result here",
                         flag > 0, f"{flag} bytes")
        label = ("DS" if dim_first else "SD") + (" ZERO_TEMPORAL_TOKEN_BIAS" if zero_temporal
                                                 else "")
        row = {"layout": "DS" if dim_first else "SD", "zero_temporal_token_bias": zero_temporal,
               "layers": layers, "conv_dim": conv_dim,
               "bytes_changed_by_reference": moved, "page_bytes": case["page"],
               "differing_bytes": {}}
        checks.check(f"{label}: the reference pre-copy changes bytes", moved > 0, f"{moved}")
        for kname, kernel in kernels.items():
            mu.precopy_mamba_align_fused_kernel = kernel
            for how, fn in (("bulk", lambda c=case: launch_bulk(c, run_fused)),
                            ("per-layer", lambda c=case: launch_per_layer(c))):
                case["raw"].copy_(case["init"])
                try:
                    fn()
                    gpu_common.sync(dev)
                except Exception as exc:  # noqa: BLE001 - recorded, the others still run
                    checks.error(f"{label}: {kname} kernel, {how}: launched", exc)
                    row["differing_bytes"][f"{kname} {how}"] = None
                    continue
                diff = int((case["raw"] != want).sum())
                row["differing_bytes"][f"{kname} {how}"] = diff
                checks.check(f"{label}: {kname} kernel, {how}: equals the reference", diff == 0,
                             f"{diff} bytes differ")
        mu.precopy_mamba_align_fused_kernel = vllm_kernel
        result["equality"].append(row)
        if not dim_first and not zero_temporal:
            timing_case = case
        else:
            del case, want
    case = timing_case
    for kname, kernel in kernels.items():
        mu.precopy_mamba_align_fused_kernel = kernel
        mu.DIM_FIRST = False
        try:
            bulk = time_launches(dev, lambda: launch_bulk(case, run_fused), a.iters)
            per = time_launches(dev, lambda: launch_per_layer(case), a.iters)
            slicing = time_launches(dev, lambda: launch_per_layer_slicing(case), a.iters)
        except Exception as exc:  # noqa: BLE001
            checks.error(f"timing, {kname} kernel", exc)
            continue
        t = {"bulk_one_launch": bulk, "per_layer": per,
             "per_layer_launches": a.layers,
             # the launch before the step's launcher (slicing every time)
             "per_layer_slicing_each_launch": slicing,
             "per_layer_slicing_host_us_per_launch": slicing["host_us_per_step"] / a.layers}
        if per["gpu_us_per_step"] is not None:
            t["per_layer_gpu_us_per_launch"] = per["gpu_us_per_step"] / a.layers
            t["per_layer_over_bulk_gpu"] = per["gpu_us_per_step"] / bulk["gpu_us_per_step"]
        t["per_layer_host_us_per_launch"] = per["host_us_per_step"] / a.layers
        # issue #35's target (a timing: reported, not a check)
        t["per_layer_host_us_per_launch_at_most_10"] = t["per_layer_host_us_per_launch"] <= 10
        result["timing"][kname] = t
        g = per["gpu_us_per_step"]
        print(f"  time {kname}: bulk {bulk['gpu_us_per_step'] or 0:.1f} us GPU "
              f"({bulk['host_us_per_step']:.1f} us host); {a.layers} per-layer launches "
              f"{g or 0:.1f} us GPU ({per['host_us_per_step']:.1f} us host, "
              f"{t['per_layer_host_us_per_launch']:.1f} us per launch; slicing each launch "
              f"{t['per_layer_slicing_host_us_per_launch']:.1f} us)", flush=True)
    mu.precopy_mamba_align_fused_kernel = vllm_kernel
    # bytes a step moves (read and written; the changed bytes undercount by
    # the 1/256 that happen to be equal)
    moved = 2 * result["equality"][0]["bytes_changed_by_reference"]
    result["bytes_moved_per_step_approx"] = moved
    for t in result["timing"].values():
        for k in ("bulk_one_launch", "per_layer", "per_layer_slicing_each_launch"):
            g = t[k]["gpu_us_per_step"]
            t[k]["GB_per_s"] = moved / g / 1e3 if g else None
    result["checks"] = checks.rows
    result["passed"] = checks.passed
    gpu_common.write_json(a.json, "precopy", result)
    print(f"RESULT: {'PASS' if checks.passed else 'FAIL'}")
    return checks.exit_code()


if __name__ == "__main__":
    sys.exit(main())
