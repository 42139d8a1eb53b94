"""The scheduler's cost per request: how long the engine core's
``get_num_new_matched_tokens`` takes for a 16-block hit, with the hit cache
and without it (every lookup reads the markers and verifies every page),
side by side in one run, on a real LMDB pool with the tiny model's page
layout (one attention layer, three GDN layers, 160 KiB pages) - and the
backend calls each makes, from the backend's own counters.

    python benchmarks/bench_lookup.py [--out benchmarks/results/lookup.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import types

import _results

from vllm_layerwise_patch.pool.backends.base import pack
from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
from vllm_layerwise_patch.pool.config import PoolConfig
from vllm_layerwise_patch.pool.keys import ATTN, STATE, marker_key, page_key
from vllm_layerwise_patch.pool.layout import PoolLayout
from vllm_layerwise_patch.pool.scheduler.planner import PoolScheduler

NS = b"L" * 16
BLOCKS, PAGE, BLOCK = 16, 160 << 10, 640


def scheduler(path: str, ttl: float) -> PoolScheduler:
    layout = PoolLayout(kinds=("state", "attn"), block_size=BLOCK, hash_block_size=BLOCK,
                        group_layers=(("model.layers.0.x", "model.layers.1.x",
                                       "model.layers.2.x"), ("model.layers.3.x",)),
                        page_bytes=PAGE)
    return PoolScheduler(vllm_config=types.SimpleNamespace(kv_transfer_config=None),
                         layout=layout, backend=LmdbBackend(path, 1 << 30, pin_seconds=0),
                         namespace=NS, config=PoolConfig.from_extra({"hit_cache_ttl": ttl}))


def fill(sched: PoolScheduler, hashes: list[bytes]) -> None:
    page = os.urandom(PAGE)
    items = []
    for h in hashes:
        items += [(page_key(NS, ATTN, h, 0, "3"), page), (marker_key(NS, ATTN, h, 0), b"")]
        items += [(page_key(NS, STATE, h, 0, str(i)), page) for i in range(3)]
        items += [(marker_key(NS, STATE, h, 0), b"")]
    sched.hits.backend.put_many([(k, pack(NS, k, v)) for k, v in items])


def run(ttl: float, requests: int, tmp: str) -> dict:
    sched = scheduler(os.path.join(tmp, f"ttl{ttl}"), ttl)
    hashes = [bytes([i]) * 32 for i in range(BLOCKS)]
    fill(sched, hashes)
    per_request, calls = [], []
    for r in range(requests):
        req = types.SimpleNamespace(block_hashes=hashes, num_tokens=BLOCKS * BLOCK + 1,
                                    request_id=f"r{r}", all_token_ids=[])
        before = sum(sched.hits.backend.calls.values())
        t0 = time.perf_counter()
        hit, _ = sched.get_num_new_matched_tokens(req, 0)
        per_request.append(time.perf_counter() - t0)
        calls.append(sum(sched.hits.backend.calls.values()) - before)
        assert hit == BLOCKS * BLOCK
        sched.request_finished(req)
    sched.hits.backend.close()
    steady = per_request[1:]
    return {"hit_cache_ttl": ttl, "requests": requests, "hit_blocks": BLOCKS,
            "first_request_ms": round(per_request[0] * 1e3, 3),
            "median_ms": round(statistics.median(steady) * 1e3, 3),
            "p90_ms": round(sorted(steady)[int(len(steady) * 0.9)] * 1e3, 3),
            "backend_calls_first": calls[0],
            "backend_calls_median": statistics.median(calls[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                   "lookup.json"))
    ap.add_argument("--requests", type=int, default=50)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="vlp-bench-lookup-")
    try:
        results = [run(ttl, args.requests, tmp) for ttl in (30.0, 0.0)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cached, uncached = results
    for r in results:
        print(f"hit cache {'on ' if r['hit_cache_ttl'] else 'off'}: first {r['first_request_ms']} ms, "
              f"then median {r['median_ms']} ms (p90 {r['p90_ms']} ms), backend calls "
              f"{r['backend_calls_first']} then {r['backend_calls_median']} per request")
    print(f"ratio (cache off / on, median): {uncached['median_ms'] / cached['median_ms']:.1f}x")
    _results.write(args.out, "scheduler lookup cost per request, 16-block hit, hit cache "
                   "on vs off", results)


if __name__ == "__main__":
    main()
