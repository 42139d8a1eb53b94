"""A block-level model of ``bench --trace``'s replay, to read the measured
admission rules against what any rule could do on the same trace.

The selection of the committed Mooncake trace slice (the same arguments as
the measured runs) is replayed one request at a time through two LRU caches
of whole blocks: vLLM's HBM prefix cache (``--hbm-blocks``, the measured
server's KV cache in 128-token blocks) and the pool (``--pool-blocks``,
each measured capacity in blocks).  A request hits the longest prefix of its
blocks in HBM, then the longest run after it in the pool (its last token is
always computed); the blocks it computes are saved into the pool when the
rule admits them; all its blocks enter HBM.  Rules:

* ``all``: every computed block (the default);
* ``reused``: a computed block whose prefix at least two requests held (the
  pool's ``admission: reused``, counted at lookup);
* ``used-again`` (an oracle): a computed block that some later request
  holds - the most any rule can cut while it keeps every block that comes
  back;
* ``pool-hit-later`` (an oracle): a computed block that ``all``'s replay
  later serves from the pool - it knows which blocks vLLM's HBM cache will
  have evicted when they come back.

The model ignores concurrency, linear-attention states (a hit ends at any
block here, not only at a stored boundary state) and output blocks; its
absolute hit rates differ from the replay's, the comparison between rules
is what it is for.

    python benchmarks/bench_admission_model.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import OrderedDict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from vllm_layerwise_patch.bench import trace as tr  # noqa: E402

RULES = ("all", "reused", "used-again", "pool-hit-later")


class LRU:
    def __init__(self, cap: int) -> None:
        self.cap, self.d = cap, OrderedDict()

    def __contains__(self, h: int) -> bool:
        return h in self.d

    def touch(self, h: int) -> None:
        if h in self.d:
            self.d.move_to_end(h)

    def put(self, h: int) -> None:
        self.d[h] = True
        self.d.move_to_end(h)
        while len(self.d) > self.cap:
            self.d.popitem(last=False)


def replay(reqs: list[tr.TraceRequest], scale: int, hbm_blocks: int, pool_blocks: int,
           rule: str, hit_later: set[int] | None = None) -> dict[str, object]:
    n = tr.block_tokens(scale)
    prompts = []
    for r in reqs:
        length = max(1, r.input_length // scale)
        prompts.append((length, r.hash_ids[:-(-length // n)]))
    later: dict[int, int] = {}  # block -> index of its last request
    for i, (_, used) in enumerate(prompts):
        for h in used:
            later[h] = i
    hbm, pool, seen, from_pool = LRU(hbm_blocks), LRU(pool_blocks), {}, set()
    tokens = hbm_hit = pool_hit = saved = not_admitted = 0
    for i, (length, used) in enumerate(prompts):
        tokens += length
        for h in used:
            seen[h] = seen.get(h, 0) + 1
        can = min((length - 1) // n, len(used))
        k = 0
        while k < can and used[k] in hbm:
            k += 1
        j = k
        while j < can and used[j] in pool:
            j += 1
        hbm_hit, pool_hit = hbm_hit + k * n, pool_hit + (j - k) * n
        from_pool.update(used[k:j])
        for h in used[:j]:
            hbm.touch(h)
            pool.touch(h)
        for b, h in enumerate(used):
            if b >= j and (b + 1) * n <= length and h not in pool:
                ok = (rule == "all" or (rule == "reused" and seen[h] >= 2)
                      or (rule == "used-again" and later[h] > i)
                      or (rule == "pool-hit-later" and h in (hit_later or ())))
                if ok:
                    pool.put(h)
                    saved += 1
                else:
                    not_admitted += 1
            hbm.put(h)
    return {"hit_rate": (hbm_hit + pool_hit) / tokens, "hbm_hit_rate": hbm_hit / tokens,
            "pool_hit_rate": pool_hit / tokens, "blocks_saved": saved,
            "blocks_not_admitted": not_admitted, "served_from_pool": from_pool}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=os.path.join(
        HERE, "data", "trace", "conversation_trace_slice.jsonl"))
    ap.add_argument("--sessions", type=int, default=15)
    ap.add_argument("--max-input-length", type=int, default=16384)
    ap.add_argument("--scale", type=int, default=4)
    ap.add_argument("--hbm-blocks", type=int, default=117,
                    help="vLLM's KV cache in blocks (the measured server: 14979 tokens)")
    ap.add_argument("--pool-blocks", default="112,224,448",
                    help="pool capacities in blocks (64, 128 and 256 MiB at the measured "
                         "0.57 MiB a block)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "trace",
                                                  "admission-model.json"))
    ns = ap.parse_args()
    reqs = tr.select(tr.load(ns.trace), sessions_n=ns.sessions,
                     max_input_length=ns.max_input_length)
    rows = []
    for cap in (int(c) for c in ns.pool_blocks.split(",")):
        base = None
        for rule in RULES:
            r = {"pool_blocks": cap, "rule": rule,
                 **replay(reqs, ns.scale, ns.hbm_blocks, cap, rule,
                          base and base["served_from_pool"])}
            r["served_from_pool"] = sorted(r["served_from_pool"])
            if rule == "all":
                base = dict(r, served_from_pool=set(r["served_from_pool"]))
            else:
                r["hit_points_lost"] = base["hit_rate"] - r["hit_rate"]
                r["bytes_saved_cut"] = 1 - r["blocks_saved"] / base["blocks_saved"]
            rows.append(r)
            print(f"pool {cap:4d} blocks  {rule:10s}  hit {r['hit_rate']:.1%} "
                  f"(pool {r['pool_hit_rate']:.1%})  saved {r['blocks_saved']:3d}  "
                  + (f"points lost {100 * r['hit_points_lost']:.1f}  bytes cut "
                     f"{r['bytes_saved_cut']:.0%}" if rule != "all" else ""))
    for r in rows:
        r.pop("served_from_pool", None)
    n = tr.block_tokens(ns.scale)
    uses: dict[int, int] = {}
    for r in reqs:  # the requests that hold each full block
        length = max(1, r.input_length // ns.scale)
        for h in r.hash_ids[:length // n]:
            uses[h] = uses.get(h, 0) + 1
    spread = {str(k): sum(1 for v in uses.values() if v == k) for k in sorted(set(uses.values()))}
    print("full blocks by the number of requests holding them:", spread)
    doc = {"trace": os.path.basename(ns.trace), "stats": tr.stats(reqs, ns.scale),
           "hbm_blocks": ns.hbm_blocks, "rows": rows, "blocks_by_requests_holding": spread,
           "command": "python benchmarks/bench_admission_model.py " + " ".join(sys.argv[1:]),
           "model": __doc__.split("\n\n")[1]}
    os.makedirs(os.path.dirname(ns.out), exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
