"""Benchmark the pool's transfer path alone (torch + LMDB, no vLLM): how fast
pages go pool -> KV cache through LayerwisePipeline, and KV cache -> pool
through the send thread (SaveQueue: pack in place with the checksum, one
transaction per step), against a plain memcpy of the same bytes, side by side
in one run (ratios, medians of repeats).

    python benchmarks/bench_pipeline.py [--out benchmarks/results/pipeline.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time

import torch

from vllm_layerwise_patch.pool.backends.lmdb import LmdbBackend
from vllm_layerwise_patch.pool.pipeline import LayerwisePipeline, SaveQueue

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                   "pipeline.json"))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cases = [
        # (layers, blocks, page bytes): tiny-model pages, and 2 MiB pages
        (4, 16, 163840),
        (8, 16, 2 << 20),
    ]
    # the worker skips the checksum when the lookup verified it (the default)
    results = [run(l, b, p, args.repeats, prefetch=2, threads=2, check_crc=crc)
               for l, b, p in cases for crc in (False, True)]
    doc = {"benchmark": "pool transfer path (LayerwisePipeline + LMDB) vs memcpy",
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "torch": torch.__version__},
           "results": results}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    for r in results:
        print(f"{r['layers']} layers x {r['blocks']} blocks x {r['page_bytes']} B "
              f"(load crc {'on' if r['load_checks_crc'] else 'off'}): "
              f"save {r['GB_per_s']['save']} GB/s, load {r['GB_per_s']['load']} GB/s, "
              f"memcpy {r['GB_per_s']['memcpy']} GB/s "
              f"(save {r['ratio_to_memcpy']['save']:.2f}x, load "
              f"{r['ratio_to_memcpy']['load']:.2f}x of memcpy)")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
