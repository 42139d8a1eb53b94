"""Benchmark the pool's storage backends on this machine, side by side in one
run, as ratios to a memcpy of the same bytes measured in the same run:

* ``lmdb``: the embedded pool on /dev/shm;
* ``mooncake-tcp``: Mooncake Store, the memory in a separate segment holder
  (``mooncake_client``), reached over TCP loopback;
* ``mooncake-shm``: the same holder reached through shared memory
  (``client_address``: Mooncake's same-node path);
* ``mooncake-own``: this process holds a segment too (the holder still runs)
  and saves go there first (``prefer_local_segment``): its own hits are local
  copies, nothing crosses a socket;
* ``tcp-socket``: not a backend, the ceiling of anything over TCP loopback:
  one plain kernel socket streaming the same bytes into the same pages.

Loads go through the worker's real path (``LayerwisePipeline``: per-layer
``read_many`` batches, header and length checked, copied into KV pages - or,
where the backend can, read straight into the pages, registered as the worker
registers its KV cache, and checked there: Mooncake with a client of its own);
saves are the backend's ``put_many`` of packed pages (one step's worth).
``load_first`` is the first read after the put, ``load`` the next one (a
prefix is read many times; the reference measured warm reads); ``fetch`` is
what ../shared/reference/backends.md measured: the backend's per-layer batch reads into its own registered (pre-faulted) buffer, no copy
into the KV pages - on a GPU that buffer is where the host-to-device copy
starts; on this CPU-only harness the KV pages are host memory too, so a
``load`` that goes through the staging buffer copies every byte twice.
memcpy is one thread's copy of the same bytes (the reference's "1 process"
memcpy), taken after each pass; ratios are medians of per-pass ratios.
Pages of 160 KiB (the tiny model's) and 2 MiB.  A loopback master and holder
are started and stopped by the benchmark (``mooncake-local``).

    python benchmarks/bench_backends.py [--out benchmarks/results/backends.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from vllm_layerwise_patch.bench.transfer import memcpy_seconds
from vllm_layerwise_patch.pool.backends.base import pack
from vllm_layerwise_patch.pool.pipeline import LayerwisePipeline

import _results

NS = b"B" * 16
LAYERS = 8


def _open(kind: str, cluster, tmp: str, capacity: int):
    from vllm_layerwise_patch.pool.config import PoolConfig

    if kind == "lmdb":
        from vllm_layerwise_patch.pool.backends.lmdb import LmdbBackend

        return LmdbBackend(os.path.join(tmp, "lmdb"), capacity, pin_seconds=0)
    from vllm_layerwise_patch.pool.backends.mooncake import MooncakeBackend

    mc = {"master_address": cluster.master_address, "local_buffer_size": "128MiB",
          "global_segment_size": 0, "zero_copy_loads": True,  # the opt-in fast path
          "prefer_local_segment": True}  # (the default)
    if kind == "mooncake-shm":
        mc["client_address"] = cluster.holder_address
    if kind == "mooncake-own":
        mc["global_segment_size"] = capacity
    cfg = PoolConfig.from_extra({"backend": "mooncake", "mooncake": mc})
    be = MooncakeBackend(cfg.mooncake)
    if kind == "mooncake-own":
        be.mount_segment()
    return be


def run_case(kind: str, cluster, page: int, total: int, repeats: int, tmp: str) -> dict:
    blocks = max(1, total // (LAYERS * page))
    nbytes = LAYERS * blocks * page
    be = _open(kind, cluster, tmp, max(nbytes * (repeats + 2), 256 << 20))
    src = {f"model.layers.{i}.x": torch.randint(0, 256, (blocks, page), dtype=torch.uint8)
           for i in range(LAYERS)}
    dest = {n: torch.zeros_like(t) for n, t in src.items()}
    order = list(src)
    values = {(n, b): pack(NS, src[n][b].numpy().tobytes()) for n in order
              for b in range(blocks)}
    pipe = LayerwisePipeline(order, be, NS, prefetch=2, threads=2, check_crc=False)
    pipe.register_memory(dest.values())  # as the worker does with its KV cache
    pairs = [(dest[n], src[n]) for n in order]
    times: dict[str, list[tuple[float, float]]] = {"save": [], "load_first": [], "load": [],
                                                   "fetch": []}

    def timed(phase: str, fn) -> None:  # (seconds, memcpy seconds right after)
        t0 = time.perf_counter()
        fn()
        times[phase].append((time.perf_counter() - t0, memcpy_seconds(pairs)))

    def fetch(keys_by_layer) -> None:  # into the backend's buffer only
        for keys in keys_by_layer:
            be.read_many(keys, lambda *_: None, [len(values[(order[0], 0)])] * len(keys))

    fetches = kind.startswith("mooncake")
    for r in range(repeats):
        items = [(f"{kind}/{page}/{r}/{n}/{b}".encode(), values[(n, b)]) for n in order
                 for b in range(blocks)]
        timed("save", lambda: be.put_many(items))
        tasks = {n: [(f"{kind}/{page}/{r}/{n}/{b}".encode(), [dest[n][b]])
                     for b in range(blocks)] for n in order}
        for phase in ("load_first", "load"):  # right after the put, then warm
            for t in dest.values():
                t.zero_()
            timed(phase, lambda: pipe.load_all(tasks))
            assert all(torch.equal(dest[n], src[n]) for n in order), (kind, phase)
        if fetches:
            timed("fetch", lambda: fetch([[k for k, _ in tasks[n]] for n in order]))
        be.delete([k for k, _ in items])
    pipe.close()
    be.close()
    return summarize(kind, page, blocks, nbytes, repeats, times)


def summarize(kind: str, page: int, blocks: int, nbytes: int, repeats: int,
              times: dict[str, list[tuple[float, float]]]) -> dict:
    """One result row from each phase's (seconds, memcpy seconds) passes."""
    times = {k: v for k, v in times.items() if v}
    med = {k: statistics.median(t for t, _ in v) for k, v in times.items()}
    med["memcpy"] = statistics.median(m for v in times.values() for _, m in v)
    gb = nbytes / 1e9
    return {"backend": kind, "page_bytes": page, "pages_per_layer": blocks, "layers": LAYERS,
            "bytes_per_pass": nbytes, "repeats": repeats,
            "median_seconds": {k: round(v, 5) for k, v in med.items()},
            "GB_per_s": {k: round(gb / v, 3) for k, v in med.items()},
            "ratio_to_memcpy": {k: round(statistics.median(m / t for t, m in v), 3)
                                for k, v in times.items()}}


def socket_case(page: int, total: int, repeats: int) -> dict:
    """The same bytes through one loopback TCP stream (a sender thread, the
    receiver ``recv_into`` the destination pages): the kernel's ceiling."""
    import socket
    import threading

    blocks = max(1, total // (LAYERS * page))
    src = torch.randint(0, 256, (LAYERS, blocks * page), dtype=torch.uint8)
    dest = torch.zeros_like(src)
    listener = socket.create_server(("127.0.0.1", 0))

    def send() -> None:
        conn, _ = listener.accept()
        with conn:
            while conn.recv(1):
                for layer in src:
                    conn.sendall(layer.numpy())

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    times = []
    with socket.create_connection(listener.getsockname()) as sock:
        for _ in range(repeats):
            t0 = time.perf_counter()
            sock.sendall(b"g")
            for layer in dest:
                view, got = memoryview(layer.numpy()), 0
                while got < len(view):
                    got += sock.recv_into(view[got:])
            times.append((time.perf_counter() - t0, memcpy_seconds([(dest, src)])))
            assert torch.equal(dest, src)
    sender.join(10)
    listener.close()
    return summarize("tcp-socket", page, blocks, src.numel(), repeats, {"load": times})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                   "backends.json"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mib-per-pass", type=int, default=64)
    ap.add_argument("--backends",
                    default="lmdb,mooncake-tcp,mooncake-shm,mooncake-own,tcp-socket")
    args = ap.parse_args()
    kinds = args.backends.split(",")
    from vllm_layerwise_patch.mooncake_local import LocalMooncake, free_port

    tmp = tempfile.mkdtemp(prefix="vlp-bench-",
                           dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    cluster = None
    if any(k.startswith("mooncake") for k in kinds):
        cluster = LocalMooncake(os.path.join(tmp, "mc"), rpc_port=free_port(),
                                metrics_port=free_port(), holder=1 << 30,
                                holder_port=free_port()).start()
    results = []
    try:
        for page in (160 << 10, 2 << 20):
            for kind in kinds:
                total = args.mib_per_pass << 20
                r = (socket_case(page, total, args.repeats) if kind == "tcp-socket" else
                     run_case(kind, cluster, page, total, args.repeats, tmp))
                results.append(r)
                parts = ", ".join(f"{k} {r['GB_per_s'][k]:5.2f} GB/s "
                                  f"({r['ratio_to_memcpy'][k]:.2f}x)"
                                  for k in r["ratio_to_memcpy"])
                print(f"{kind:>13} {page >> 10:>5} KiB pages: {parts}; memcpy "
                      f"{r['GB_per_s']['memcpy']:.2f} GB/s", flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    _results.write(args.out, "pool backends: loads (LayerwisePipeline, into KV "
                   "pages), fetches (into the backend's registered buffer) and saves "
                   "(put_many) vs one thread's memcpy, same run", results)


if __name__ == "__main__":
    main()
