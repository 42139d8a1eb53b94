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
  one plain kernel socket streaming the same bytes into the same pages;
* ``memcpy-2threads``: not a backend, the ceiling of any load that writes
  every byte once: two threads copying half the bytes each (memory
  bandwidth, not one core, sets it).

Loads go through the worker's real path (``LayerwisePipeline``: per-layer
``read_many`` batches, header and length checked, copied into KV pages - or,
where the backend can, read straight into the pages, registered as the worker
registers its KV cache, and checked there: Mooncake with a client of its own);
saves are the backend's ``put_many`` of pages packed as the worker's send
thread packs them (:class:`~vllm_layerwise_patch.pool.worker.send_thread.PackArena`,
its memory offered to the backend; one step's worth).
``load_first`` is the first read after the put, ``load`` the next one (a
prefix is read many times; the reference measured warm reads); ``fetch`` is
what ../shared/reference/backends.md measured: the backend's per-layer batch reads into its own registered (pre-faulted) buffer, no copy
into the KV pages - on a GPU that buffer is where the host-to-device copy
starts; on this CPU-only harness the KV pages are host memory too, so a
``load`` that goes through the staging buffer copies every byte twice.
memcpy is one thread's copy of the same bytes (the reference's "1 process"
memcpy), taken after each pass; ratios are medians of per-pass ratios.
Pages of 160 KiB (the tiny model's) and 2 MiB, models of 8 and 48 layers.  A
loopback master and holder are started and stopped by the benchmark
(``mooncake-local``).

Mooncake runs in both key layouts, side by side: ``per-layer`` (key format
4: an object per page and a commit marker per block) and ``per-block``
(format 5, :mod:`vllm_layerwise_patch.pool.backends.mooncake.objects`: one
object per block, layers as byte ranges).  Keys are the pool's own (pages
and markers of attention blocks).  ``master_rpcs`` counts the requests the
master served (its metrics, every ``*_requests_total``) for one hit - the
lookup's existence check of the blocks' markers and the layerwise load of
every page - and for one save of the same blocks.

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
from vllm_layerwise_patch.pool.backends.base import HEADER_SIZE, pack
from vllm_layerwise_patch.pool.keys import ATTN, marker_key, page_key
from vllm_layerwise_patch.pool.worker.pipeline import LayerwisePipeline
from vllm_layerwise_patch.pool.worker.send_thread import PackArena

import _results

NS = b"B" * 16
TITLE = ("pool backends: loads (LayerwisePipeline, into KV pages), fetches (into the "
         "backend's registered buffer) and saves (put_many) vs one thread's memcpy, same "
         "run; Mooncake in both key layouts with the master's requests per hit and save")


class _Layout:
    """What the Mooncake backend needs of a pool layout (set_layout)."""

    def __init__(self, order: list[str], page: int) -> None:
        self.order, self.page_bytes, self.drafter_layers = order, page, frozenset()

    def layers(self, kind: str) -> tuple[str, ...]:
        return tuple(self.order) if kind == ATTN else ()


def master_requests(cluster) -> float:
    """Requests the master has served (its Prometheus metrics)."""
    import urllib.request

    url = f"http://127.0.0.1:{cluster.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("master_") and "_requests_total" in line.split()[0]
               and "ping" not in line)


def _open(kind: str, cluster, tmp: str, capacity: int, staging: int = 128 << 20):
    from vllm_layerwise_patch.pool.config import PoolConfig

    if kind == "lmdb":
        from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend

        return LmdbBackend(os.path.join(tmp, "lmdb"), capacity, pin_seconds=0)
    from vllm_layerwise_patch.pool.backends.mooncake.backend import MooncakeBackend

    mc = {"master_address": cluster.master_address, "local_buffer_size": staging,
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


def run_case(kind: str, cluster, page: int, total: int, repeats: int, tmp: str,
             layers: int, layout: str) -> dict:
    blocks = max(1, total // (layers * page))
    nbytes = layers * blocks * page
    # (a staging region - a quarter of the buffer - holds one block object;
    # every pass is deleted before the next: the machine's memory is shared)
    be = _open(kind, cluster, tmp, max(nbytes * 3, 256 << 20),
               max(128 << 20, 5 * layers * page + (8 << 20)))
    src = {f"model.layers.{i}.x": torch.randint(0, 256, (blocks, page), dtype=torch.uint8)
           for i in range(layers)}
    dest = {n: torch.zeros_like(t) for n, t in src.items()}
    order = list(src)
    if layout == "per-block":
        be.set_layout(NS, _Layout(order, page))
    # packed as the worker's send thread packs them (the pack memory offered
    # to the backend: Mooncake block objects are put straight from it)
    arena = PackArena(NS, lambda ptr, size: be.register_memory(ptr, size, saves=True))
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
            be.read_many(keys, lambda *_: None, [HEADER_SIZE + page] * len(keys))

    fetches = kind.startswith("mooncake")
    rpcs: dict[str, float] = {}

    def counted(what: str, fn) -> None:  # master requests of one call (first pass)
        before = master_requests(cluster) if fetches and not rpcs.get(what) else None
        fn()
        if before is not None:
            rpcs[what] = master_requests(cluster) - before

    for r in range(repeats):
        hashes = [f"{kind}/{layers}/{page}/{r}/{b}".encode() for b in range(blocks)]
        arena.reset()  # (each pass's values name its keys: packed again, not timed)
        items = [(k, arena.pack(k, src[n][b])) for i, n in enumerate(order)
                 for b in range(blocks) for k in (page_key(NS, ATTN, hashes[b], 0, str(i)),)]
        markers = [marker_key(NS, ATTN, h, 0) for h in hashes]
        items += [(m, pack(NS, m, b"")) for m in markers]
        timed("save", lambda: counted("save", lambda: be.put_many(items)))
        tasks = {n: [(page_key(NS, ATTN, hashes[b], 0, str(i)), [dest[n][b]])
                     for b in range(blocks)] for i, n in enumerate(order)}
        for phase in ("load_first", "load"):  # right after the put, then warm
            for t in dest.values():
                t.zero_()
            timed(phase, lambda: counted(
                "hit", lambda: (be.exists_many(markers), pipe.load_all(tasks))))
            assert all(torch.equal(dest[n], src[n]) for n in order), (kind, phase)
        if fetches:
            timed("fetch", lambda: fetch([[k for k, _ in tasks[n]] for n in order]))
        be.delete_groups([m.rpartition(b"/")[0] for m in markers])
    pipe.close()
    be.close()
    out = summarize(kind, page, blocks, nbytes, repeats, times, layers)
    out["layout"] = layout
    if rpcs:
        out["master_rpcs"] = {"per_hit": rpcs["hit"], "per_hit_block": rpcs["hit"] / blocks,
                              "per_save": rpcs["save"]}
    return out


def summarize(kind: str, page: int, blocks: int, nbytes: int, repeats: int,
              times: dict[str, list[tuple[float, float]]], layers: int) -> dict:
    """One result row from each phase's (seconds, memcpy seconds) passes."""
    times = {k: v for k, v in times.items() if v}
    med = {k: statistics.median(t for t, _ in v) for k, v in times.items()}
    med["memcpy"] = statistics.median(m for v in times.values() for _, m in v)
    gb = nbytes / 1e9
    return {"backend": kind, "page_bytes": page, "pages_per_layer": blocks, "layers": layers,
            "bytes_per_pass": nbytes, "repeats": repeats,
            "median_seconds": {k: round(v, 5) for k, v in med.items()},
            "GB_per_s": {k: round(gb / v, 3) for k, v in med.items()},
            "ratio_to_memcpy": {k: round(statistics.median(m / t for t, m in v), 3)
                                for k, v in times.items()}}


def socket_case(page: int, total: int, repeats: int, layers: int) -> dict:
    """The same bytes through one loopback TCP stream (a sender thread, the
    receiver ``recv_into`` the destination pages): the kernel's ceiling."""
    import socket
    import threading

    blocks = max(1, total // (layers * page))
    src = torch.randint(0, 256, (layers, blocks * page), dtype=torch.uint8)
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
    return summarize("tcp-socket", page, blocks, src.numel(), repeats, {"load": times},
                     layers)


def copies_case(page: int, total: int, repeats: int, layers: int) -> dict:
    """The same bytes copied by two threads at once, half each (numpy's copy
    releases the GIL): the ceiling of any load that writes every byte once
    on this machine, whatever its threads - memory bandwidth, not one core."""
    import concurrent.futures as cf

    blocks = max(1, total // (layers * page))
    src = torch.randint(0, 256, (layers, blocks * page), dtype=torch.uint8)
    dest = torch.zeros_like(src)
    half = layers // 2 if layers > 1 else 1
    parts = [[(dest[:half], src[:half])], [(dest[half:], src[half:])]]
    times = []
    with cf.ThreadPoolExecutor(2) as pool:
        for _ in range(repeats):
            dest.zero_()
            t0 = time.perf_counter()
            list(pool.map(memcpy_seconds, parts))
            times.append((time.perf_counter() - t0, memcpy_seconds([(dest, src)])))
    return summarize("memcpy-2threads", page, blocks, src.numel(), repeats, {"load": times},
                     layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                   "backends.json"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mib-per-pass", type=int, default=64)
    ap.add_argument("--backends",
                    default="lmdb,mooncake-tcp,mooncake-shm,mooncake-own,tcp-socket,"
                            "memcpy-2threads")
    ap.add_argument("--layers", default="8,48")
    ap.add_argument("--pages-kib", default="160,2048", help="per-layer page sizes (KiB)")
    ap.add_argument("--layouts", default="per-layer,per-block",
                    help="Mooncake key layouts (LMDB keeps per-layer entries)")
    args = ap.parse_args()
    kinds = args.backends.split(",")
    from vllm_layerwise_patch.mooncake_local import LocalMooncake, free_port

    tmp = tempfile.mkdtemp(prefix="vlp-bench-",
                           dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    cluster = None
    if any(k.startswith("mooncake") for k in kinds):
        cluster = LocalMooncake(os.path.join(tmp, "mc"), rpc_port=free_port(),
                                metrics_port=free_port(), holder=512 << 20,
                                holder_port=free_port()).start()
    results = []
    try:
        cases = [(layers, page, kind, layout)
                 for layers in map(int, args.layers.split(","))
                 for page in (int(p) << 10 for p in args.pages_kib.split(","))
                 for kind in kinds
                 for layout in (args.layouts.split(",") if kind.startswith("mooncake")
                                else ["-"])]
        for layers, page, kind, layout in cases:
            total = args.mib_per_pass << 20
            ceiling = {"tcp-socket": socket_case, "memcpy-2threads": copies_case}.get(kind)
            r = (ceiling(page, total, args.repeats, layers) if ceiling else
                 run_case(kind, cluster, page, total, args.repeats, tmp, layers, layout))
            results.append(r)
            parts = ", ".join(f"{k} {r['ratio_to_memcpy'][k]:.2f}x"
                              for k in r["ratio_to_memcpy"])
            rpc = r.get("master_rpcs")
            rpc = (f"; master RPCs per hit {rpc['per_hit']:.0f}, per save "
                   f"{rpc['per_save']:.0f}") if rpc else ""
            print(f"L{layers:<3}{kind:>13} {layout:>9} {page >> 10:>5} KiB: {parts}; memcpy "
                  f"{r['GB_per_s']['memcpy']:.2f} GB/s{rpc}", flush=True)
            _results.write(args.out, TITLE, results)  # (after each case: a partial run counts)
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    _results.write(args.out, TITLE, results)


if __name__ == "__main__":
    main()
