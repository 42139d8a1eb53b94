"""Where a sharded pool's save time goes, in one process (no other writer,
so no waiting): the same blocks saved through one shard and spread over
four, the pool's fixed work per transaction (the writer's turn, the
transaction context, the generation file's begin and end) beside LMDB's own
transaction, and plain py-lmdb writing the same 160 KiB pages into one
environment or eight.  The flat-out engines curve of ``bench_scale.py``
(four processes on two cores) is CPU-bound, so each shard a save touches
adds this fixed work to it.

    python benchmarks/bench_shard_txn.py [--out benchmarks/results/scale/shard_txn.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import timeit

import _results
from bench_scale import PAGE, _block, _hash

from vllm_layerwise_patch.pool.backends.lmdb.sharded import open_pool
from vllm_layerwise_patch.pool.backends.lmdb.shards import shard_of


WARM = 600  # puts per variant before timing (the first ones run slower)
ROUNDS = 5  # the variants timed in turn, so the machine's noise falls on each alike


def _us(fn, n: int) -> float:
    return round(timeit.timeit(fn, number=n) / n * 1e6, 2)


def raw_lmdb(tmp: str, envs: int, seconds: float) -> dict:
    """py-lmdb alone: puts of 4 blocks x 4 pages of ``PAGE`` bytes, a
    block's pages in the environment its name picks, one transaction per
    environment touched; a tenth of an environment deleted when it is half
    full or a put finds no room (then a tick commit); timed once every
    environment has been full (a page's first touch is slow)."""
    import lmdb

    cap = 256 << 20
    dbs = [lmdb.open(os.path.join(tmp, f"raw{envs}-{i}"), map_size=cap // envs,
                     writemap=True, sync=False, metasync=False) for i in range(envs)]
    page, live, limit = os.urandom(PAGE), [[] for _ in dbs], int(cap / envs * 0.5 / PAGE)
    times, i, end, evicted = [], 0, None, set()

    def drop(e: int) -> None:
        old, live[e] = live[e][:len(live[e]) // 10 + 1], live[e][len(live[e]) // 10 + 1:]
        with dbs[e].begin(write=True) as txn:
            for k in old:
                txn.delete(k)
        with dbs[e].begin(write=True) as txn:  # freed pages are reused after a later commit
            txn.put(b"tick", b"")
        evicted.add(e)

    while end is None or time.time() < end:
        if end is None and len(evicted) == envs:  # every environment full: time from here
            end, times = time.time() + seconds, []
        t0 = time.perf_counter()
        batches: dict[int, list[bytes]] = {}  # one transaction per environment touched
        for b in range(4):
            batches.setdefault(hash((i, b)) % envs, []).extend(
                f"{i}-{b}-{p}".encode() for p in range(4))
        for e, keys in batches.items():
            while True:
                if len(live[e]) > limit:
                    drop(e)
                try:
                    with dbs[e].begin(write=True) as txn:
                        for k in keys:
                            txn.put(k, page)
                    break
                except lmdb.MapFullError:  # (freed runs too short for a value: more)
                    drop(e)
            live[e] += keys
        times.append(time.perf_counter() - t0)
        i += 1
    for d in dbs:
        d.close()
    return {"environments": envs, "capacity_bytes": cap,
            "put_4_blocks_median_us": round(statistics.median(times) * 1e6, 1)}


def pool_puts(tmp: str, n: int) -> dict:
    """The pool's put_many of tiny pages (the fixed work shows): 4 blocks
    routed to one shard, 4 blocks on 4 shards, 1 block, and 1 block put on
    its shard directly; an unsharded pool's 4 blocks beside them."""
    sharded = open_pool(os.path.join(tmp, "sharded"), 1 << 30, 8, pin_seconds=0)
    single = open_pool(os.path.join(tmp, "single"), 1 << 30, 1, pin_seconds=0)
    tiny = os.urandom(64)
    by: dict[int, list] = {}
    i = 0
    while min((len(by.get(s, ())) for s in range(8)), default=0) < 4 * (n + WARM):
        items = _block(_hash(i), tiny)
        by.setdefault(shard_of(items[0][0], sharded.n), []).append(items)
        i += 1

    def join(blocks):
        return [kv for b in blocks for kv in b]

    def fours(s: int) -> list:  # puts of 4 blocks, all of shard ``s``
        return [join(by[s][4 * k:4 * k + 4]) for k in range(n + WARM)]

    variants = {  # name: (pool, its batches), each timed in turn, round by round
        "sharded_4_blocks_one_shard_us": (sharded, fours(0)),
        "sharded_4_blocks_4_shards_us": (sharded, [join(by[s][k] for s in (1, 2, 3, 4))
                                                   for k in range(n + WARM)]),
        "sharded_1_block_us": (sharded, by[5][:n + WARM]),
        "shard_direct_1_block_us": (sharded.shards[6], by[6][:n + WARM]),
        "unsharded_4_blocks_us": (single, fours(7)),
    }
    its = {name: iter(batches) for name, (_, batches) in variants.items()}
    for name, (pool, _) in variants.items():
        for _ in range(WARM):
            pool.put_many(next(its[name]))
    rounds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(ROUNDS):
        for name, (pool, _) in variants.items():
            rounds[name].append(_us(lambda p=pool, it=its[name]: p.put_many(next(it)),
                                    n // ROUNDS))
    out: dict = {name: statistics.median(r) for name, r in rounds.items()}
    out["rounds"] = rounds
    shard = sharded.shards[0]

    def raw_read():
        with shard.env.begin(buffers=True):
            pass

    def raw_write():
        with shard.env.begin(write=True, buffers=True):
            pass

    def our_read():
        with shard._txn():
            pass

    def turn():
        if shard._turn.acquire(False):
            shard._turn.release()

    out["fixed_us"] = {"lmdb_read_txn": _us(raw_read, 5 * n), "lmdb_empty_write_txn":
                       _us(raw_write, 5 * n), "pool_txn_context": _us(our_read, 5 * n),
                       "writer_turn": _us(turn, 5 * n),
                       "generation_begin_end": _us(lambda: shard._gen.end(
                           1, shard._gen.begin(1)), 5 * n)}
    sharded.close()
    single.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "scale", "shard_txn.json"))
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--n", type=int, default=1000)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="vlp-bench-txn-", dir="/dev/shm")
    try:
        puts = pool_puts(tmp, args.n)
        raw = [raw_lmdb(tmp, e, args.seconds) for e in (1, 8, 1, 8)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for k, v in puts.items():
        print(f"{k}: {v}")
    for r in raw:
        print(f"py-lmdb, {r['environments']} environment(s): 4 blocks of 4 x 160 KiB pages "
              f"{r['put_4_blocks_median_us']} us")
    _results.write(args.out, "sharded pool: time per save by shards touched, fixed work per "
                   "transaction, py-lmdb alone", [{"pool": puts, "py_lmdb": raw}])


if __name__ == "__main__":
    main()
