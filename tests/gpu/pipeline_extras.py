"""Two measurements beside the pool pipeline check (``check_pool_pipeline.py``),
in the same run:

* :func:`ceiling`: the synthetic streams-and-events pipeline
  (``benchmarks/bench_gpu_pipeline.py``: pinned buffers, its own copy
  streams, events, no pool) moving about the same bytes per step - what the
  link allows, the row the pool's own path is compared with;
* :func:`zero_staging` (CUDA only): a load's copy to the device from pinned
  staging - the pool's path (the values validated, copied into a load
  thread's pinned ring, then an asynchronous copy) - against copies straight
  from host memory registered with the device (``cudaHostRegister``): the
  LMDB map itself (tmpfs), and an anonymous buffer standing for Mooncake's
  staging buffer.  A backend's view is valid only during its read, so each
  registered copy completes before the read returns (per value, or - LMDB:
  its read transaction is still open - once after the last value).  GB/s of
  each, the one-off cost of registering, and whether the bytes arrived."""

from __future__ import annotations

import ctypes
import statistics
import sys
import time
from pathlib import Path


def _bench_module():
    """``benchmarks/bench_gpu_pipeline.py`` (in the repository, or carried
    to the GPU machine as ``gpu/bench/``), or None."""
    here = Path(__file__).resolve().parent
    for folder in (here.parent.parent / "benchmarks", here / "bench"):
        if (folder / "bench_gpu_pipeline.py").is_file():
            sys.path.insert(0, str(folder))
            import bench_gpu_pipeline

            return bench_gpu_pipeline
    return None


def ceiling(dev, layers: int, bytes_each_way: int, page_bytes: int, compute_ms: float,
            prefetch: int, repeats: int) -> dict:
    """The synthetic pipeline with ``layers`` layers of ``page_bytes`` pages,
    as many per layer as make about ``bytes_each_way``."""
    mod = _bench_module()
    if mod is None:
        return {"skipped": "benchmarks/bench_gpu_pipeline.py not found"}
    pages = max(1, round(bytes_each_way / layers / page_bytes))
    res = mod.run(layers, pages, page_bytes, compute_ms, prefetch, repeats, dev)
    compute = res["seconds"]["compute"]
    res["exposed_over_compute"] = {k: v / compute
                                   for k, v in res["exposed_transfer_seconds"].items()}
    return res


def _median(fn, repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _register(ptr: int, size: int) -> tuple[int, int, float, int]:
    """Register the pages around ``[ptr, ptr + size)``: (start, length,
    seconds, CUDA error code: 0 = registered)."""
    import torch

    start = ptr & ~4095
    length = ((ptr + size + 4095) & ~4095) - start
    t0 = time.perf_counter()
    rc = torch.cuda.cudart().cudaHostRegister(start, length, 0)
    return start, length, time.perf_counter() - t0, int(rc)


def zero_staging(dev, backend, ns: bytes, keys: list[bytes], nbytes: int,
                 repeats: int = 5) -> dict:
    """See the module doc; ``keys``: values of ``nbytes``-byte payloads in
    ``backend`` (an LmdbBackend)."""
    import numpy as np
    import torch

    from vllm_layerwise_patch.pool.backends.base import HEADER_SIZE, unpack
    from vllm_layerwise_patch.pool.worker.device import CudaOps, Lane

    if dev.type != "cuda":
        return {"skipped": "no CUDA device"}
    n = len(keys)
    total = n * nbytes
    dest = torch.empty(n, nbytes, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)
    lane = Lane(CudaOps(dev), 1 << 30)
    out: dict = {"values": n, "value_bytes": nbytes, "bytes": total}

    def staged() -> None:
        def consume(i, key, value):
            lane.fill([dest[i]], unpack(key, value, ns, nbytes, check_crc=False))
        with lane.active():
            lane.begin(total)
            backend.read_many(keys, consume)
        lane.finish().synchronize()

    out["staged_GB_per_s"] = total / _median(staged, repeats) / 1e9
    want = dest.clone()

    def direct(per_value: bool):
        def run() -> None:
            def consume(i, key, value):
                src = torch.frombuffer(unpack(key, value, ns, nbytes, check_crc=False),
                                       dtype=torch.uint8)
                with torch.cuda.stream(stream):
                    dest[i].copy_(src, non_blocking=True)
                if per_value or i == n - 1:  # (LMDB: the read transaction is still open)
                    stream.synchronize()
            backend.read_many(keys, consume)
        return run

    # the LMDB map: the pages around the values this step reads
    ptrs = []
    backend.read_many(keys, lambda i, k, v: ptrs.append(
        np.frombuffer(v, dtype=np.uint8).ctypes.data))
    lo, hi = min(ptrs), max(ptrs) + HEADER_SIZE + nbytes
    start, length, took, rc = _register(lo, hi - lo)
    lm = out["lmdb_map_registered"] = {"bytes_registered": length, "register_seconds": took,
                                       "cuda_error": rc}
    if rc == 0:
        try:
            probe = []
            backend.read_many(keys[:1], lambda i, k, v: probe.append(
                torch.frombuffer(v, dtype=torch.uint8).is_pinned()))
            lm["seen_as_pinned"] = bool(probe and probe[0])
            for name, per in (("sync_per_value", True), ("sync_once", False)):
                dest.zero_()
                lm[f"{name}_GB_per_s"] = total / _median(direct(per), repeats) / 1e9
                lm[f"{name}_bytes_identical"] = bool(torch.equal(dest, want))
        finally:
            torch.cuda.cudart().cudaHostUnregister(start)

    # an anonymous registered buffer (Mooncake's staging buffer), holding the values
    keep = (ctypes.c_ubyte * (total + 4096))()
    base = (ctypes.addressof(keep) + 4095) & ~4095
    host = np.frombuffer((ctypes.c_ubyte * total).from_address(base), dtype=np.uint8)
    host[:] = want.cpu().numpy().reshape(-1)
    start, length, took, rc = _register(base, total)
    mc = out["anonymous_registered"] = {"bytes_registered": length, "register_seconds": took,
                                        "cuda_error": rc}

    def from_buffer(staged_copy: bool):
        def run() -> None:
            if staged_copy:
                with lane.active():
                    lane.begin(total)
                    for i in range(n):
                        lane.fill([dest[i]], host[i * nbytes:(i + 1) * nbytes])
                lane.finish().synchronize()
                return
            src = torch.from_numpy(host)
            with torch.cuda.stream(stream):
                for i in range(n):
                    dest[i].copy_(src[i * nbytes:(i + 1) * nbytes], non_blocking=True)
                    stream.synchronize()  # (a region is valid only during its read)
        return run

    mc["staged_GB_per_s"] = total / _median(from_buffer(True), repeats) / 1e9
    if rc == 0:
        try:
            mc["seen_as_pinned"] = bool(torch.from_numpy(host).is_pinned())
            dest.zero_()
            mc["direct_GB_per_s"] = total / _median(from_buffer(False), repeats) / 1e9
            mc["direct_bytes_identical"] = bool(torch.equal(dest, want))
        finally:
            torch.cuda.cudart().cudaHostUnregister(start)
    del keep
    lane.close()
    return out
