"""The pool's transfer path alone (torch + LMDB, no vLLM), against a memcpy
of the same bytes in the same run: pool -> KV pages through
``LayerwisePipeline``, KV pages -> pool through ``SaveQueue`` (pack in place with the
checksum, one transaction per step, written by the send thread);
memcpy is one thread's copy.
Used by ``benchmarks/bench_pipeline.py`` and ``bench``'s summary."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

from ..pool.backends.lmdb.backend import LmdbBackend
from ..pool.worker.pipeline import LayerwisePipeline
from ..pool.worker.send_thread import SaveQueue

NS = b"B" * 16


def memcpy_seconds(pairs) -> float:
    """Seconds of one thread's memcpy of each (destination, source) pair
    (numpy's copy: torch's spreads over the cores and collapses when another
    process holds one)."""
    t0 = time.perf_counter()
    for dest, src in pairs:
        np.copyto(dest.numpy(), src.numpy())
    return time.perf_counter() - t0


def run(layers: int, blocks: int, page: int, repeats: int, prefetch: int, threads: int,
        check_crc: bool) -> dict:
    """Each pass is followed by a memcpy of the same bytes; the ratios are
    the medians of the per-pass ratios (robust to a noisy machine)."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix="vlp-bench-", dir=shm)
    total = layers * blocks * page
    be = LmdbBackend(path, max(total * (repeats + 4), 64 << 20), pin_seconds=0)
    caches = {f"model.layers.{i}.x": torch.randint(0, 256, (blocks, page), dtype=torch.uint8)
              for i in range(layers)}
    dest = {n: torch.zeros_like(t) for n, t in caches.items()}
    pairs = [(dest[n], t) for n, t in caches.items()]  # the memcpy reference
    order = list(caches)
    times: dict[str, list[tuple[float, float]]] = {  # (seconds, memcpy seconds)
        "save_first_pass": [], "save": [], "load": []}
    # save path: each layer's pages are packed as they are submitted (host
    # pages: in the submitting thread, as the worker does on CPU), then the
    # send thread writes one transaction per "step".  First pass: new keys, the
    # pool's pages touched for the first time by this process; steady state
    # ("save"): the same keys again, the pages the last pass freed reused (a
    # pool at capacity recycles evicted pages the same way; LMDB reuses a
    # freed page two transactions later, so three passes come first, untimed)
    saver = SaveQueue(be, NS)
    for phase in ("save_first_pass", "save"):
        for r in range(-3 if phase == "save" else 0, repeats):
            t0 = time.perf_counter()
            for n in order:
                saver.submit([(f"{r if phase == 'save_first_pass' else 's'}/{n}/{b}".encode(),
                               caches[n][b]) for b in range(blocks)])
            assert saver.commit([])
            if r >= 0:
                times[phase].append((time.perf_counter() - t0, memcpy_seconds(pairs)))
    saver.close()
    # load path: LayerwisePipeline into fresh pages, all layers
    pipe = LayerwisePipeline(order, be, NS, prefetch=prefetch, threads=threads,
                             check_crc=check_crc)
    for r in range(repeats):
        for t in dest.values():
            t.zero_()
        tasks = {n: [(f"{r}/{n}/{b}".encode(), [dest[n][b]]) for b in range(blocks)]
                 for n in order}
        t0 = time.perf_counter()
        pipe.load_all(tasks)
        took = time.perf_counter() - t0
        assert all(torch.equal(dest[n], caches[n]) for n in order)
        times["load"].append((took, memcpy_seconds(pairs)))
    pipe.close()
    be_writemap = be.writemap
    be.close()
    shutil.rmtree(path, ignore_errors=True)
    gb = total / 1e9
    med = {k: statistics.median(t for t, _ in v) for k, v in times.items()}
    med["memcpy"] = statistics.median(m for v in times.values() for _, m in v)
    return {
        "bytes_per_pass": total, "layers": layers, "blocks": blocks, "page_bytes": page,
        "repeats": repeats, "prefetch": prefetch, "threads": threads,
        "load_checks_crc": check_crc,
        "median_seconds": med,
        "GB_per_s": {k: round(gb / v, 3) for k, v in med.items()},
        "lmdb_writemap": be_writemap,
        "ratio_to_memcpy": {k: round(statistics.median(m / t for t, m in v), 3)
                            for k, v in times.items()},
    }


def save_parts(layers: int, blocks: int, page: int, repeats: int) -> dict:
    """Where the save path's time goes, on the caller's thread: packing the
    pages (one copy into the arena and the checksum) and the backend write
    (one LMDB transaction, steady state: the same keys each round), each
    against a memcpy of the same bytes, with LMDB's default mode (the file
    not preallocated) and with ``writemap`` (the pool's default: the file
    preallocated, values copied straight into the mapped file)."""
    from ..pool.worker.send_thread import PackArena

    pages = [torch.randint(0, 256, (blocks, page), dtype=torch.uint8) for _ in range(layers)]
    dest = [torch.empty_like(p) for p in pages]
    out: dict = {"bytes_per_pass": layers * blocks * page, "page_bytes": page}
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    for writemap in (False, True):
        path = tempfile.mkdtemp(prefix="vlp-bench-", dir=shm)
        be = LmdbBackend(path, layers * blocks * page * 4, pin_seconds=0,
                         preallocate=writemap)
        assert be.writemap is writemap
        arena = PackArena(NS)
        times: dict[str, list[float]] = {"memcpy": [], "pack": [], "write": []}
        for r in range(repeats + 2):  # the first two rounds warm up
            copy_s = memcpy_seconds(zip(dest, pages))
            t1 = time.perf_counter()
            items = [(k, arena.pack(k, p[b])) for i, p in enumerate(pages)
                     for b in range(blocks) for k in (f"{i}/{b}".encode(),)]
            t2 = time.perf_counter()
            be.put_many(items)
            t3 = time.perf_counter()
            arena.reset()
            if r >= 2:
                for k, v in zip(times, (copy_s, t2 - t1, t3 - t2)):
                    times[k].append(v)
        be.close()
        shutil.rmtree(path, ignore_errors=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        out["writemap" if writemap else "default"] = {
            "median_seconds": med,
            "times_memcpy": {k: round(med[k] / med["memcpy"], 2) for k in ("pack", "write")}}
    return out
