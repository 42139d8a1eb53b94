"""The pool's transfer path alone (torch + LMDB, no vLLM), against a memcpy
of the same bytes in the same run: pool -> KV pages through
``LayerwisePipeline``, KV pages -> pool through the send thread
(``SaveQueue``: pack in place with the checksum, one transaction per step).
Used by ``benchmarks/bench_pipeline.py`` and ``bench``'s summary."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import torch

from ..pool.backends.lmdb import LmdbBackend
from ..pool.pipeline import LayerwisePipeline
from ..pool.saving import SaveQueue

NS = b"B" * 16


def run(layers: int, blocks: int, page: int, repeats: int, prefetch: int, threads: int,
        check_crc: bool) -> dict:
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix="vlp-bench-", dir=shm)
    total = layers * blocks * page
    be = LmdbBackend(path, max(total * (repeats + 2), 64 << 20), pin_seconds=0)
    caches = {f"model.layers.{i}.x": torch.randint(0, 256, (blocks, page), dtype=torch.uint8)
              for i in range(layers)}
    order = list(caches)
    # save path: the send thread packs each layer's pages as they are
    # submitted, then one transaction per "step"
    saver = SaveQueue(be, NS)
    save_s = []
    for r in range(repeats):
        t0 = time.perf_counter()
        for n in order:
            saver.submit([(f"{r}/{n}/{b}".encode(), caches[n][b]) for b in range(blocks)])
        assert saver.commit([])
        save_s.append(time.perf_counter() - t0)
    saver.close()
    # load path: LayerwisePipeline into fresh pages, all layers
    dest = {n: torch.zeros_like(t) for n, t in caches.items()}
    load_s = []
    pipe = LayerwisePipeline(order, be, NS, prefetch=prefetch, threads=threads,
                             check_crc=check_crc)
    for r in range(repeats):
        tasks = {n: [(f"{r}/{n}/{b}".encode(), [dest[n][b]]) for b in range(blocks)]
                 for n in order}
        t0 = time.perf_counter()
        pipe.load_all(tasks)
        load_s.append(time.perf_counter() - t0)
    assert all(torch.equal(dest[n], caches[n]) for n in order)
    # reference: one memcpy of the same bytes
    memcpy_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for n in order:
            dest[n].copy_(caches[n])
        memcpy_s.append(time.perf_counter() - t0)
    pipe.close()
    be.close()
    shutil.rmtree(path, ignore_errors=True)
    gb = total / 1e9
    med = {k: statistics.median(v) for k, v in
           (("save", save_s), ("load", load_s), ("memcpy", memcpy_s))}
    return {
        "bytes_per_pass": total, "layers": layers, "blocks": blocks, "page_bytes": page,
        "repeats": repeats, "prefetch": prefetch, "threads": threads,
        "load_checks_crc": check_crc,
        "median_seconds": med,
        "GB_per_s": {k: round(gb / v, 3) for k, v in med.items()},
        "ratio_to_memcpy": {k: round(med["memcpy"] / med[k], 3) for k in ("save", "load")},
    }
