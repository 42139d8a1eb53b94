"""The tiered backend against Mooncake alone, at the backend (no engine): one
loopback master and segment holder, a working set of blocks saved into
Mooncake by "another node", and a skewed trace of hits replayed by this
node - each hit as the connector makes it: the scheduler side looks up the
markers and reads and checks every page of the block (the lookup's
verification: it promotes), then the worker side reads every page again one
layer at a time (the load), each side with its own backend as in an
engine.  Configurations, in
one run on the same master: Mooncake alone, and the tiered backend with a
near tier (LMDB on /dev/shm) holding about 25 % and 50 % of the working set
(its LRU evicts the rest), promoting a block on its first far hit, and on
its second (``tiered.promote_after_far_hits: 2``).

Per configuration: hit latency p50/p90/p99, the near tier's share of the
pages read, master requests per hit (the master's own counters, without
the clients' pings and task polls) and blocks promoted; and the ratios of
the tiered runs' latencies to Mooncake alone's side by side.

    python benchmarks/bench_tiered.py [--blocks 160] [--hits 1200] [--out benchmarks/results/tiered.json]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
import urllib.request
from types import SimpleNamespace

import _results

from vllm_layerwise_patch.mooncake_local import LocalMooncake, free_port
from vllm_layerwise_patch.pool.backends.base import HEADER_SIZE, pack, unpack
from vllm_layerwise_patch.pool.config import PoolConfig
from vllm_layerwise_patch.pool.keys import ATTN, STATE, marker_key, page_key

NS = b"T" * 16
PAGE = 64 << 10
ATTN_LAYERS = [f"model.layers.{i}.self_attn" for i in range(6)]
STATE_LAYERS = [f"model.layers.{i}.linear_attn" for i in range(6, 8)]


class Layout(SimpleNamespace):
    def layers(self, kind):
        return tuple(ATTN_LAYERS) if kind == ATTN else tuple(STATE_LAYERS)


LAYOUT = Layout(drafter_layers=frozenset(), page_bytes=PAGE)
IDS = {ATTN: [str(i) for i in range(6)], STATE: ["6", "7"]}


def block(h: bytes) -> list[tuple[bytes, bytes]]:
    items = [(page_key(NS, kind, h, 0, i), os.urandom(16) * (PAGE // 16))
             for kind in (ATTN, STATE) for i in IDS[kind]]
    items += [(marker_key(NS, ATTN, h, 0), b""), (marker_key(NS, STATE, h, 0), b"")]
    return [(k, pack(NS, k, v)) for k, v in items]


def data_requests(lm: LocalMooncake) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{lm.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("master_") and "_requests_total" in line.split()[0]
               and "ping" not in line and "fetch_tasks" not in line)


def open_backend(lm: LocalMooncake, near: str | None, capacity: int, after: int = 1,
                 role: str | None = None):
    from vllm_layerwise_patch.pool.opening import open_backend as open_configured

    mc = {"master_address": lm.master_address, "global_segment_size": 0,
          "local_buffer_size": "32MiB"}
    cfg = {"backend": "mooncake", "mooncake": mc}
    if near is not None:
        cfg = dict(cfg, backend="tiered", path=near, capacity=capacity,
                   tiered={"promote_after_far_hits": after})
    be = open_configured(PoolConfig.from_extra(cfg), role)
    be.set_layout(NS, LAYOUT)
    return be


def hit(sched, worker, h: bytes) -> None:
    """The scheduler's lookup and verification (it promotes), then the
    worker's load a layer at a time (it does not: verify_on_lookup)."""
    markers = [marker_key(NS, ATTN, h, 0), marker_key(NS, STATE, h, 0)]
    assert all(sched.exists_many(markers)), "a block of the working set is missing"
    keys = [page_key(NS, kind, h, 0, i) for kind in (ATTN, STATE) for i in IDS[kind]]
    for k, v in zip(keys, sched.get_many(keys, [HEADER_SIZE + PAGE] * len(keys))):
        unpack(k, v, NS)
    for k in keys:
        unpack(k, worker.get_many([k], [HEADER_SIZE + PAGE])[0], NS)


def replay(lm, name, trace, near, capacity, after=1) -> dict:
    sched = open_backend(lm, near, capacity, after, "scheduler")
    worker = open_backend(lm, near, capacity, after, "worker")
    lat = []
    asked = data_requests(lm)
    for h in trace:
        t0 = time.perf_counter()
        hit(sched, worker, h)
        lat.append(time.perf_counter() - t0)
    asked = data_requests(lm) - asked
    counts = getattr(sched, "tier_counts", {})
    loads = getattr(worker, "tier_counts", {})
    near_pages = counts.get("near_pages_loaded", 0) + loads.get("near_pages_loaded", 0)
    far_pages = counts.get("far_pages_loaded", 0) + loads.get("far_pages_loaded", 0)
    lat.sort()
    pct = lambda p: lat[min(len(lat) - 1, int(p / 100 * len(lat)))]  # noqa: E731
    out = {"config": name, "hits": len(trace), "near_capacity_bytes": capacity if near else 0,
           "hit_ms": {"p50": pct(50) * 1e3, "p90": pct(90) * 1e3, "p99": pct(99) * 1e3,
                      "mean": statistics.mean(lat) * 1e3},
           "near_share_of_pages": near_pages / (near_pages + far_pages)
           if near_pages + far_pages else 0.0,
           "master_requests_per_hit": asked / len(trace),
           "promoted_blocks": counts.get("promoted_blocks", 0),
           "near_evicted_groups": getattr(sched, "evicted_groups", 0)}
    sched.close()
    worker.close()
    print(f"{name:>12}: p50 {out['hit_ms']['p50']:.2f} ms, p99 {out['hit_ms']['p99']:.2f} ms, "
          f"near share {out['near_share_of_pages']:.2f}, master requests/hit "
          f"{out['master_requests_per_hit']:.2f}, promoted {out['promoted_blocks']}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=160, help="working set, in blocks")
    ap.add_argument("--hits", type=int, default=1200)
    ap.add_argument("--zipf", type=float, default=1.0, help="skew of the trace")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "tiered.json"))
    ns = ap.parse_args()
    rng = random.Random(7)
    hashes = [rng.randbytes(32) for _ in range(ns.blocks)]
    weights = [1 / (i + 1) ** ns.zipf for i in range(ns.blocks)]
    trace = rng.choices(hashes, weights, k=ns.hits)
    block_bytes = len(b"".join(v for _, v in block(hashes[0])))
    work = tempfile.mkdtemp(prefix="bench-tiered-")
    lm = LocalMooncake(os.path.join(work, "mc"), rpc_port=free_port(), metrics_port=free_port(),
                       holder=max(256 << 20, 2 * ns.blocks * block_bytes),
                       holder_port=free_port()).start()
    try:
        seed = open_backend(lm, None, 0, role="worker")
        for h in hashes:  # another node saved the working set
            seed.put_many(block(h))
        seed.close()
        working_set = ns.blocks * block_bytes
        results = [replay(lm, "mooncake", trace, None, 0)]
        for share, after in ((0.25, 1), (0.25, 2), (0.5, 1), (0.5, 2)):
            name = f"tiered-{int(share * 100)}%" + (f"-after{after}" if after > 1 else "")
            near = os.path.join("/dev/shm", f"bench-{name}-{os.getpid()}")
            try:
                # an LMDB pool evicts before it is full: its map holds the share
                results.append(replay(lm, name, trace, near, int(working_set * share), after))
            finally:
                shutil.rmtree(near, ignore_errors=True)
    finally:
        lm.stop()
        shutil.rmtree(work, ignore_errors=True)
    base = results[0]["hit_ms"]
    ratios = {r["config"]: {k: r["hit_ms"][k] / base[k] for k in base} for r in results[1:]}
    print("hit latency, tiered / mooncake:", {k: round(v["p50"], 3) for k, v in ratios.items()})
    _results.write(ns.out, "tiered", results, working_set_bytes=working_set,
                   block_bytes=block_bytes, zipf=ns.zipf, latency_ratio_to_mooncake=ratios)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
