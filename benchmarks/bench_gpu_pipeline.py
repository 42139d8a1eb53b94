"""The worker's per-layer load/save pipeline on synthetic layers, torch only (no
vLLM, no pool backend): how much transfer time the layerwise overlap hides.

Each of ``--layers`` layers has ``--pages`` KV pages of ``--page-mib`` MiB on
the device and, for loads, the same in pinned host memory (what the pool's
load threads hand over); a simulated per-layer compute (matmuls calibrated to
``--compute-ms``) stands in for the forward.  Side by side, in one run:

* ``compute``: the layers' compute alone;
* ``bulk``: every layer's pages host -> device, then the forward, then every
  layer's pages device -> host (what the bulk path does);
* ``layerwise``: a load stream copies layer i+1.. ahead (``--prefetch``) while
  layer i computes, each layer waits only for its own copy (an event), and a
  save stream copies each layer out as soon as it is computed.

Reported: wall times (medians of ``--repeats``), exposed transfer time (wall
minus compute) of each path, its ratio, and the copies' GB/s alone.  On a CUDA
device the copies are real H2D/D2H on their own streams; on CPU the "device"
is host memory and the streams are threads (it runs, it is not the point).

    python benchmarks/bench_gpu_pipeline.py [--device cuda] [--out results/gpu-pipeline.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write  # noqa: E402


class Streams:
    """CUDA streams and events, or threads and futures on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.load, self.save = torch.cuda.Stream(), torch.cuda.Stream()
        else:
            self.pool = cf.ThreadPoolExecutor(2)

    def copy(self, kind: str, dst: torch.Tensor, src: torch.Tensor, after=None):
        """Copy on the ``kind`` stream (after ``after``); a handle to wait on."""
        if self.cuda:
            s = self.load if kind == "load" else self.save
            if after is not None:
                s.wait_event(after)
            with torch.cuda.stream(s):
                dst.copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(s)
            return ev
        return self.pool.submit(lambda: (after.result() if after is not None else None,
                                         dst.copy_(src)))

    def wait(self, handle) -> None:
        if self.cuda:
            torch.cuda.current_stream().wait_event(handle)
        else:
            handle.result()

    def mark(self):
        """A handle for 'the compute so far is done'."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream())
            return ev
        done: cf.Future = cf.Future()
        done.set_result(None)
        return done

    def sync(self, device: torch.device) -> None:
        if self.cuda:
            torch.cuda.synchronize(device)


def calibrate(device: torch.device, ms: float) -> tuple[torch.Tensor, int]:
    """A matrix and a matmul count whose product takes about ``ms``."""
    n = 2048 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ a
    sync()
    t0 = time.perf_counter()
    reps = 20
    for _ in range(reps):
        a @ a
    sync()
    per = (time.perf_counter() - t0) / reps
    return a, max(1, round(ms / 1e3 / per))


def compute(a: torch.Tensor, count: int) -> None:
    for _ in range(count):
        a @ a


def run(layers: int, pages: int, page_bytes: int, compute_ms: float, prefetch: int,
        repeats: int, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    dev = [torch.empty(pages, page_bytes, dtype=torch.uint8, device=device)
           for _ in range(layers)]
    host_in = [torch.full((pages, page_bytes), i % 251, dtype=torch.uint8, pin_memory=cuda)
               for i in range(layers)]
    host_out = [torch.empty(pages, page_bytes, dtype=torch.uint8, pin_memory=cuda)
                for _ in range(layers)]
    a, count = calibrate(device, compute_ms)
    st = Streams(device)

    def p_compute():
        for _ in range(layers):
            compute(a, count)
        st.sync(device)

    def p_bulk():
        loads = [st.copy("load", dev[i], host_in[i]) for i in range(layers)]
        for h in loads:
            st.wait(h)
        for _ in range(layers):
            compute(a, count)
        done = st.mark()
        saves = [st.copy("save", host_out[i], dev[i], after=done) for i in range(layers)]
        for h in saves:
            st.wait(h)
        st.sync(device)

    def p_layerwise():
        loads = {i: st.copy("load", dev[i], host_in[i]) for i in range(min(prefetch, layers))}
        saves = []
        for i in range(layers):
            if i + prefetch < layers:
                loads[i + prefetch] = st.copy("load", dev[i + prefetch], host_in[i + prefetch])
            st.wait(loads.pop(i))
            compute(a, count)
            saves.append(st.copy("save", host_out[i], dev[i], after=st.mark()))
        for h in saves:
            st.wait(h)
        st.sync(device)

    def p_copies():  # transfer alone: loads then saves, no compute
        for h in [st.copy("load", dev[i], host_in[i]) for i in range(layers)]:
            st.wait(h)
        st.sync(device)
        t = time.perf_counter()
        for h in [st.copy("save", host_out[i], dev[i]) for i in range(layers)]:
            st.wait(h)
        st.sync(device)
        return t

    paths = {"compute": p_compute, "bulk": p_bulk, "layerwise": p_layerwise}
    times: dict[str, list[float]] = {k: [] for k in (*paths, "loads", "saves")}
    for _ in range(repeats + 1):  # the first round warms up
        for name, fn in paths.items():  # interleaved: noise hits all alike
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        mid = p_copies()
        t1 = time.perf_counter()
        times["loads"].append(mid - t0)
        times["saves"].append(t1 - mid)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    assert all(torch.equal(host_out[i], host_in[i]) for i in range(layers)), "copies lost bytes"
    gb = layers * pages * page_bytes / 1e9
    exposed = {k: max(0.0, med[k] - med["compute"]) for k in ("bulk", "layerwise")}
    transfer = med["loads"] + med["saves"]
    return {
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if cuda else ""),
        "layers": layers, "pages_per_layer": pages, "page_bytes": page_bytes,
        "compute_ms_per_layer": med["compute"] / layers * 1e3, "prefetch": prefetch,
        "seconds": med, "GB_each_way": gb,
        "GB_per_s": {"load": gb / med["loads"], "save": gb / med["saves"]},
        "exposed_transfer_seconds": exposed,
        "exposed_fraction_of_transfer": {k: v / transfer for k, v in exposed.items()},
        "layerwise_vs_bulk_wall": med["layerwise"] / med["bulk"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--pages", type=int, default=16, help="pages per layer")
    ap.add_argument("--page-mib", type=float, default=2.0)
    ap.add_argument("--compute-ms", type=float, default=4.0, help="simulated compute per layer")
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON path (default: results/gpu-pipeline-"
                                                "<device>.json next to this script)")
    ns = ap.parse_args()
    device = torch.device(ns.device)
    res = run(ns.layers, ns.pages, int(ns.page_mib * (1 << 20)), ns.compute_ms, ns.prefetch,
              ns.repeats, device)
    out = ns.out or str(Path(__file__).resolve().parent / "results"
                        / f"gpu-pipeline-{device.type}.json")
    write(out, "bench_gpu_pipeline", [res])
    s = res["seconds"]
    print(f"{res['device']}: {ns.layers} layers x {ns.pages} pages x {ns.page_mib} MiB; "
          f"compute {s['compute'] * 1e3:.1f} ms, bulk {s['bulk'] * 1e3:.1f} ms, layerwise "
          f"{s['layerwise'] * 1e3:.1f} ms")
    for k, v in res["exposed_transfer_seconds"].items():
        print(f"  exposed transfer, {k}: {v * 1e3:.1f} ms "
              f"({res['exposed_fraction_of_transfer'][k]:.2f} of the copies' own time)")
    print(f"  copies alone: load {res['GB_per_s']['load']:.1f} GB/s, "
          f"save {res['GB_per_s']['save']:.1f} GB/s; (JSON above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
