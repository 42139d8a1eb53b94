"""Benchmark the pool's transfer path alone (torch + LMDB, no vLLM): how fast
pages go pool -> KV cache through LayerwisePipeline, and KV cache -> pool
through the send thread (SaveQueue: pack in place with the checksum, one
transaction per step), against a plain memcpy of the same bytes, side by side
in one run (ratios, medians of repeats).

    python benchmarks/bench_pipeline.py [--out benchmarks/results/pipeline.json]
"""

from __future__ import annotations

import argparse
import os

import _results

from vllm_layerwise_patch.bench.transfer import run, save_parts


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
    parts = save_parts(8, 16, 2 << 20, args.repeats)
    _results.write(args.out, "pool transfer path (LayerwisePipeline + LMDB) vs memcpy",
                   results, save_parts=parts)
    for r in results:
        q = r["ratio_to_memcpy"]
        print(f"{r['layers']} layers x {r['blocks']} blocks x {r['page_bytes']} B "
              f"(load crc {'on' if r['load_checks_crc'] else 'off'}): "
              f"save {r['GB_per_s']['save']} GB/s, load {r['GB_per_s']['load']} GB/s, "
              f"memcpy {r['GB_per_s']['memcpy']} GB/s (save {q['save']:.2f}x of memcpy, "
              f"{q['save_first_pass']:.2f}x on the pool's first pass; load "
              f"{q['load']:.2f}x)")
    for mode in ("default", "writemap"):
        t = parts[mode]["times_memcpy"]
        print(f"save parts, 2 MiB pages, LMDB {mode} mode: packing {t['pack']}x a memcpy's "
              f"time, the write {t['write']}x")


if __name__ == "__main__":
    main()
