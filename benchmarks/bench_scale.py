"""How the embedded (LMDB) pool's cost grows: with the entries it holds, the
engines sharing it, and the medium under it - each curve from one run.

* ``entries``: pools pre-filled with N blocks (two groups each, as the tiny
  hybrid: a state group of three layer pages and an attention group of one,
  each with its commit marker; tiny pages, since the count is what matters):
  the scheduler's lookup of a 16-block hit (one stored prompt's blocks,
  named as the scheduler names them) with the hit cache cold (every
  lookup asks the backend and verifies every page) and warm, a save
  transaction of one block, one eviction round, and opening the pool
  (including LMDB's stale-reader check) - median and p99 per operation;
  with ``--entries-shards N`` the same curve again on sharded pools
  (``entries_sharded``; its eviction round is one shard's);
* ``engines``: 1, 2 and 4 processes saving and loading 160 KiB pages
  (``--page-kib``; each save the next 4 blocks of a long prompt, named as
  the scheduler names them), packed in place as the engine's send thread does, at once,
  side by side in one run on three layouts: one unsharded pool (one LMDB
  environment), one sharded pool (``--shards`` environments under one path,
  the default layout) and a pool per process: aggregate and per-process
  GB/s, and the time each process waits for a writer - both the put's wall
  time minus the same put alone (``writer_wait_ms``) and the time spent
  blocked on a writer, measured: the pool's turn among puts (its
  ``writer_wait_seconds``) plus LMDB's write lock, timed around each write
  transaction's begin (``lock_wait_ms_per_put``);
* ``engines_paced``: the same with each process sleeping ``--forward-ms``
  after each save and read (an engine's forward): the processes' CPU demand
  stays under the machine's cores, so what is left is waiting on writers;
* ``shards``: the largest process count of ``--engines`` on one pool of 1,
  2, 4, 8 and 16 shards and on a pool each (what the default count rests on);
* ``medium``: save and load GB/s on /dev/shm and on a disk-backed directory
  (LMDB's default durability as the pool opens it: no fsync per commit);
* ``hit_cache``: the scheduler's hit cache filled to its default size -
  its Python heap, measured with tracemalloc.

    python benchmarks/bench_scale.py [--quick] [--out benchmarks/results/scale]

Writes ``scale.json`` and one PNG per curve (matplotlib, when installed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
import types

import _results

from vllm_layerwise_patch.pool.backends.base import HEADER_SIZE, PoolFull, header, pack
from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
from vllm_layerwise_patch.pool.backends.lmdb.sharded import open_pool
from vllm_layerwise_patch.pool.config import PoolConfig
from vllm_layerwise_patch.pool.keys import ATTN, STATE, marker_key, page_key
from vllm_layerwise_patch.pool.layout import PoolLayout
from vllm_layerwise_patch.pool.scheduler.planner import PoolScheduler

NS = b"S" * 16
BLOCK, HIT = 640, 16
TINY = 64  # bytes per page in the entries curve
PAGE = 160 << 10  # bytes per page in the engines, shards and medium curves
#: the engines and shards curves: every process saves this long, untimed, before
#: its timed window, so a layout's pools are full and evicting when timing
#: starts (a pool's first fill runs several times slower: every page's first
#: touch) - the steady state of a pool in use
WARM_S = 5.0
#: the pool capacity of the engines and shards curves (all layouts alike:
#: a pool each gets its share), small enough for WARM_S to fill it
ENGINES_CAPACITY = 1 << 30


def _hash(i: int) -> bytes:
    """Block ``i``'s prefix hash (uniform bytes, as vLLM's: a sharded pool
    routes a name by its first bytes)."""
    return hashlib.sha256(i.to_bytes(8, "big")).digest()


def _layout(page_bytes: int) -> PoolLayout:
    """The layout of the blocks saved here: 3 state layers, 1 attention layer."""
    return PoolLayout(kinds=("state", "attn"), block_size=BLOCK, hash_block_size=BLOCK,
                      group_layers=(("model.layers.0.x", "model.layers.1.x",
                                     "model.layers.2.x"), ("model.layers.3.x",)),
                      page_bytes=page_bytes)


class _Chain:
    """A long prompt's prefix hashes, made as they are read: ``start + k``
    for block ``k``."""

    def __init__(self, start: int) -> None:
        self.start = start

    def __getitem__(self, k: int) -> bytes:
        return _hash(self.start + k)


def _block(h: bytes, page: bytes) -> list[tuple[bytes, bytes]]:
    """A block's items, each value naming its key (``page``: the payload)."""
    return [(k, pack(NS, k, page if is_page else b"")) for k, is_page in _block_keys(h)]


class _Arena:
    """A process's values packed in place: the memory work of the engine's
    send thread (:class:`...worker.send_thread.PackArena`) - header and
    payload copied into one buffer reused by every put, so a put allocates
    no page-sized objects (at 2 MiB pages, fresh ``bytes`` cost as much
    system time in page faults as the saves themselves).  Not PackArena
    itself: its torch and numpy calls cost about 0.2-0.4 s per GB more at
    160 KiB pages here, the same for every layout, which would hide the
    pool's own cost this bench compares."""

    def __init__(self, page: int, values: int) -> None:
        self.stride = (HEADER_SIZE + page + 63) & ~63
        self.buf = memoryview(bytearray(self.stride * values))
        self.off = 0

    def block(self, h: bytes, page: bytes) -> list[tuple[bytes, bytes]]:
        """:func:`_block`'s items, the page values in the arena."""
        items = []
        for k, v in _block_keys(h):
            if v:
                view = self.buf[self.off:self.off + HEADER_SIZE + len(page)]
                view[HEADER_SIZE:] = page
                view[:HEADER_SIZE] = header(NS, k, view[HEADER_SIZE:])
                self.off += self.stride
                items.append((k, view))
            else:
                items.append((k, pack(NS, k, b"")))
        return items


def _block_keys(h: bytes) -> list[tuple[bytes, bool]]:
    """A block's keys (True: a page, False: a commit marker)."""
    return ([(page_key(NS, ATTN, h, 0, "3"), True), (marker_key(NS, ATTN, h, 0), False)]
            + [(page_key(NS, STATE, h, 0, str(i)), True) for i in range(3)]
            + [(marker_key(NS, STATE, h, 0), False)])


def _scheduler(backend: LmdbBackend, page_bytes: int, ttl: float) -> PoolScheduler:
    layout = _layout(page_bytes)
    return PoolScheduler(vllm_config=types.SimpleNamespace(kv_transfer_config=None),
                         layout=layout, backend=backend, namespace=NS,
                         config=PoolConfig.from_extra({"hit_cache_ttl": ttl}))


def _stats(seconds: list[float]) -> dict[str, float]:
    s = sorted(seconds)
    return {"median_us": round(statistics.median(s) * 1e6, 1),
            "p99_us": round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6, 1), "n": len(s)}


def _timed(fn, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


# -- entries ----------------------------------------------------------------------
class _Point:
    """One pre-filled pool of the entries curve."""

    def __init__(self, n: int, tmp: str, reps: int, shards: int = 1) -> None:
        self.n, self.path, self.shards = n, os.path.join(tmp, f"n{n}-s{shards}"), shards
        # about 2.5 KB per block of tiny pages: no eviction (nor in any shard)
        self.cap = ((64 << 20) + n * 3200) * (1 if shards == 1 else 2)
        self.be = open_pool(self.path, self.cap, shards, pin_seconds=0)
        self.page = os.urandom(TINY)
        # the pool holds prompts of HIT blocks (block i: prompt i // HIT, its
        # hash _hash(i)), named as the scheduler names them
        layout = _layout(TINY)

        def name(i: int) -> bytes:
            return layout.block_hash(_Chain(i - i % HIT), i % HIT)

        t0 = time.perf_counter()
        for start in range(0, n, 2000):  # steps of 2000 blocks, as engines save them
            self.be.put_many([kv for i in range(start, min(n, start + 2000))
                              for kv in _block(name(i), self.page)])
        st = self.be.stats()
        self.out = {"blocks": n, "groups": st["groups"], "entries": st["entries"],
                    "fill_s": round(time.perf_counter() - t0, 2)}
        rng = __import__("random").Random(n)
        # a hit: a random prompt's blocks
        self.hits = [[_hash(p + k) for k in range(HIT)]
                     for p in (rng.randrange(n // HIT) * HIT for _ in range(reps))]
        self.scheds = {"lookup_cold": _scheduler(self.be, TINY, 0.0),
                       "lookup_warm": _scheduler(self.be, TINY, 30.0)}
        # (packed before the timing, as the send thread packs before its write)
        self.saves = {i: _block(name(n + HIT * (20 + i)), self.page) for i in range(-20, reps)}

    def lookup(self, label: str, i: int) -> None:
        req = types.SimpleNamespace(
            block_hashes=self.hits[i % len(self.hits)] if label == "lookup_cold" else self.hits[0],
            num_tokens=HIT * BLOCK + 1, request_id=f"r{i}", all_token_ids=[])
        hit, _ = self.scheds[label].get_num_new_matched_tokens(req, 0)
        assert hit == HIT * BLOCK, hit
        self.scheds[label].request_finished(req)

    def save(self, i: int) -> None:
        self.be.put_many(self.saves[i])

    def open_once(self, i: int) -> None:
        open_pool(self.path, self.cap, self.shards, pin_seconds=0).close()

    def evict_round(self) -> None:
        # one round as a full pool of this many entries runs it: a tenth
        # (the default evict_fraction) of what the pool holds (a sharded
        # pool: of what its first shard holds - a round is one shard's)
        be = getattr(self.be, "shards", [self.be])[0]
        be.eviction.fraction = 0.1 * be.stats()["used_bytes"] / be.map_size
        t0 = time.perf_counter()
        freed = be.eviction.evict(1)
        ms = (time.perf_counter() - t0) * 1e3
        self.out["evict_round"] = {"ms": round(ms, 1), "groups_dropped": be.evicted_groups,
                                   "bytes_freed": freed,
                                   "us_per_group": round(ms * 1e3 / max(1, be.evicted_groups),
                                                         2)}


def entries_curve(sizes: tuple[int, ...], tmp: str, reps: int, shards: int = 1) -> list[dict]:
    """Every pool filled first, then each operation timed on the pools in
    turn (round robin), so the machine's noise falls on every size alike."""
    points = []
    for n in sizes:
        points.append(_Point(n, tmp, reps, shards))
        print(f"filled {n:,} blocks in {points[-1].out['fill_s']} s", flush=True)
    ops = [("lookup_cold", lambda p, i: p.lookup("lookup_cold", i), reps),
           ("lookup_warm", lambda p, i: p.lookup("lookup_warm", i), reps),
           ("save_block", lambda p, i: p.save(i), reps),
           ("close", None, 0),  # (LMDB opens an environment once per process)
           ("open", lambda p, i: p.open_once(i), max(5, reps // 10))]
    for label, op, count in ops:
        if op is None:
            for p in points:
                p.evict_round()
                p.be.close()
            continue
        times: dict[int, list[float]] = {p.n: [] for p in points}
        for i in range(-20, count):  # 20 warm-up rounds (first touches; the warm cache)
            for p in points:
                t0 = time.perf_counter()
                op(p, i)
                if i >= 0:
                    times[p.n].append(time.perf_counter() - t0)
        for p in points:
            p.out[label] = _stats(times[p.n])
    for p in points:
        shutil.rmtree(p.path, ignore_errors=True)
    return [p.out for p in points]


# -- engines and medium ---------------------------------------------------------------
class _TimedEnv:
    """An LMDB environment whose write transactions' begin - the wait for
    the environment's one writer - is timed into ``acc[0]``."""

    def __init__(self, env, acc: list[float]) -> None:
        self._env, self._acc = env, acc

    def begin(self, *a, **kw):
        t0 = time.perf_counter()
        txn = self._env.begin(*a, **kw)
        if kw.get("write"):
            self._acc[0] += time.perf_counter() - t0
        return txn

    def __getattr__(self, name):
        return getattr(self._env, name)


def _worker(path: str, cap: int, shards: int, seconds: float, start: float, q,
            forward_s: float = 0.0) -> None:
    be = open_pool(path, cap, shards, pin_seconds=0)
    lock_wait = [0.0]
    for env_owner in getattr(be, "shards", [be]):
        env_owner.env = _TimedEnv(env_owner.env, lock_wait)
    payload = os.urandom(PAGE)
    pid = os.getpid()
    arena = _Arena(PAGE, 16)

    # (a save: the next 4 blocks of one long prompt, named as the scheduler
    # names them - small blocks in runs that share a shard)
    layout, chain = _layout(PAGE), _Chain(pid * 10**7)

    def put_items(i: int) -> list[tuple[bytes, bytes]]:  # (4 blocks, 16 pages)
        arena.off = 0
        return [kv for b in range(4)
                for kv in arena.block(layout.block_hash(chain, i * 4 + b), payload)]

    while time.time() < start:
        time.sleep(0.001)
    i = 0
    while time.time() < start + WARM_S:  # fill (first touch of every page) and evict
        try:
            be.put_many(put_items(i))
        except PoolFull:
            pass
        i += 1
    saved = loaded = skipped = missed = puts = 0
    put_s, waits = [], []
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    end = time.time() + seconds
    while time.time() < end:
        items = put_items(i)
        t0, w0 = time.perf_counter(), lock_wait[0] + be.writer_wait_seconds
        try:
            be.put_many(items)
        except PoolFull:  # (an engine skips that save and counts it)
            skipped += 1
            i += 1
            continue
        put_s.append(time.perf_counter() - t0)
        waits.append(lock_wait[0] + be.writer_wait_seconds - w0)
        saved += sum(len(v) for _, v in items)
        got = [0]  # (a block another process's eviction took first reads as a miss)
        be.read_many([k for k, _ in items],
                     lambda j, k, v: got.__setitem__(0, got[0] + (0 if v is None else len(v))))
        missed += sum(len(v) for _, v in items) - got[0]
        loaded += got[0]
        i += 1
        puts += 1
        if forward_s:  # (the engine's forward between saves: the CPU is free)
            time.sleep(forward_s)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    be.close()
    put_s, waits = put_s or [0.0], waits or [0.0]
    q.put({"saved_bytes": saved, "loaded_bytes": loaded, "missed_bytes": missed,
           "seconds": seconds,
           "put_median_ms": statistics.median(put_s) * 1e3, "skipped_puts": skipped,
           "lock_wait_ms_per_put": statistics.fmean(waits) * 1e3,
           "lock_wait_p99_ms": sorted(waits)[int(len(waits) * 0.99)] * 1e3,
           # where a round trip's CPU goes (the processes' own accounting)
           "user_s": r1.ru_utime - r0.ru_utime, "sys_s": r1.ru_stime - r0.ru_stime,
           "minor_faults": r1.ru_minflt - r0.ru_minflt,
           "switches": (r1.ru_nvcsw - r0.ru_nvcsw) + (r1.ru_nivcsw - r0.ru_nivcsw),
           "puts": puts})


def _concurrent(paths: list[str], cap: int, seconds: float, shards: int = 1,
                forward_s: float = 0.0) -> dict:
    ctx = mp.get_context("fork")  # (the parent holds no LMDB environment open here)
    q = ctx.Queue()
    start = time.time() + 3.0  # every process opened its pool by then
    procs = [ctx.Process(target=_worker, args=(p, cap, shards, seconds, start, q, forward_s))
             for p in paths]
    for p in procs:
        p.start()
    res = [q.get(timeout=seconds + WARM_S + 120) for _ in procs]
    for p in procs:
        p.join()
    for p in set(paths):
        shutil.rmtree(p, ignore_errors=True)
    gb = 1e9
    return {"processes": len(paths), "pools": len(set(paths)), "shards": shards,
            "save_GBps_total": round(sum(r["saved_bytes"] for r in res) / seconds / gb, 3),
            "load_GBps_total": round(sum(r["loaded_bytes"] for r in res) / seconds / gb, 3),
            "missed_fraction": round(sum(r["missed_bytes"] for r in res)
                                     / max(1, sum(r["saved_bytes"] for r in res)), 4),
            "save_GBps_per_process": round(min(r["saved_bytes"] for r in res) / seconds / gb, 3),
            "put_median_ms": round(statistics.median(r["put_median_ms"] for r in res), 2),
            "skipped_puts": sum(r["skipped_puts"] for r in res),
            "lock_wait_ms_per_put": round(statistics.fmean(
                r["lock_wait_ms_per_put"] for r in res), 3),
            "lock_wait_p99_ms": round(max(r["lock_wait_p99_ms"] for r in res), 3),
            **_cpu_cost(res)}


def _cpu_cost(res: list[dict]) -> dict:
    """CPU seconds (user, system) and minor page faults per GB saved (and
    read back), and context switches per put, over every process."""
    gb = max(1, sum(r["saved_bytes"] for r in res)) / 1e9
    puts = max(1, sum(r["puts"] for r in res))
    return {"user_s_per_GB": round(sum(r["user_s"] for r in res) / gb, 3),
            "sys_s_per_GB": round(sum(r["sys_s"] for r in res) / gb, 3),
            "minor_faults_per_GB": round(sum(r["minor_faults"] for r in res) / gb),
            "switches_per_put": round(sum(r["switches"] for r in res) / puts, 2)}


#: the keys of scale.json each curve writes (``--update`` keeps the others)
CURVE_KEYS = ("entries", "ratios_largest_to_smallest", "shards_entries", "entries_sharded",
              "ratios_largest_to_smallest_sharded", "engines", "engines_paced", "forward_ms",
              "page_kib", "shards_curve", "medium", "hit_cache")

#: the three layouts of the engines curve
LAYOUTS = ("one_pool", "sharded_pool", "separate_pools")


def _median_run(runs: list[dict]) -> dict:
    """The run of median save rate (its own figures, whole), with every
    round's save rate beside it."""
    pick = sorted(runs, key=lambda r: r["save_GBps_total"])[len(runs) // 2]
    return {**pick, "rounds_save_GBps": [r["save_GBps_total"] for r in runs]}


def engines_curve(tmp: str, seconds: float, counts: tuple[int, ...], shards: int,
                  rounds: int = 1, forward_s: float = 0.0) -> list[dict]:
    """Each point ``rounds`` times, the layouts and process counts in turn
    within a round (the machine's noise falls on every layout alike); each
    figure from the round of median save rate.  ``forward_s``: each process
    sleeps that long after each save and read (an engine's forward)."""
    cap = ENGINES_CAPACITY
    layouts = {"one_pool": lambda k: ([os.path.join(tmp, f"shared{k}")] * k, cap, 1),
               "sharded_pool": lambda k: ([os.path.join(tmp, f"sharded{k}")] * k, cap, shards),
               "separate_pools": lambda k: ([os.path.join(tmp, f"sep{k}-{i}")
                                            for i in range(k)], cap // k, 1)}
    raw: dict[tuple[int, str], list[dict]] = {}
    for _ in range(rounds):
        for k in counts:
            for name, args in layouts.items():
                paths, c, n = args(k)
                raw.setdefault((k, name), []).append(
                    _concurrent(paths, c, seconds, n, forward_s))
    out = []
    for k in counts:
        runs = {name: _median_run(raw[(k, name)]) for name in LAYOUTS}
        point = {"processes": k, **runs}
        for name in ("one_pool", "sharded_pool"):
            alone = out[0][name]["put_median_ms"] if out else runs[name]["put_median_ms"]
            key = "writer_wait_ms" if name == "one_pool" else "sharded_writer_wait_ms"
            point[key] = round(max(0.0, runs[name]["put_median_ms"] - alone), 2)
        sep = runs["separate_pools"]["save_GBps_total"]
        point["save_ratio_to_separate"] = {
            name: round(runs[name]["save_GBps_total"] / sep, 2) for name in LAYOUTS}
        out.append(point)
    return out


def shards_curve(tmp: str, seconds: float, processes: int,
                 counts: tuple[int, ...] = (1, 2, 4, 8, 16)) -> list[dict]:
    """``processes`` saving at once on one pool of each shard count (the
    default's choice), and on a pool each for the reference."""
    cap = ENGINES_CAPACITY
    sep = _concurrent([os.path.join(tmp, f"ref-{i}") for i in range(processes)],
                      cap // processes, seconds)
    out = []
    for n in counts:
        r = _concurrent([os.path.join(tmp, f"shards{n}")] * processes, cap, seconds, n)
        out.append({"shards": n, **r,
                    "save_ratio_to_separate": round(r["save_GBps_total"]
                                                    / sep["save_GBps_total"], 2)})
    out.append({**sep, "shards": "separate pools", "save_ratio_to_separate": 1.0})
    return out


def medium_curve(disk_dir: str, seconds: float) -> list[dict]:
    out = []
    for label, root in (("/dev/shm", "/dev/shm"), ("disk", disk_dir)):
        tmp = tempfile.mkdtemp(prefix="vlp-bench-medium-", dir=root)
        try:
            r = _concurrent([os.path.join(tmp, "pool")], 2 << 30, seconds)
            out.append({"medium": label, **r})
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# -- hit cache --------------------------------------------------------------------------
def hit_cache_memory() -> dict:
    from vllm_layerwise_patch.pool.backends.generation import Generation
    from vllm_layerwise_patch.pool.scheduler.hit_cache import HitCache

    size = PoolConfig.from_extra({}).hit_cache_size
    tracemalloc.start()
    cache = HitCache(ttl=30.0, size=size)
    gen = Generation(epoch=1, stores=1, removals=0)
    keys = [marker_key(NS, STATE, _hash(i), 0) for i in range(size * 2)]
    before = tracemalloc.get_traced_memory()[0]
    for i in range(0, len(keys), 1000):
        cache.presence(keys[i:i + 1000], gen, lambda ks: [True] * len(ks))
        cache.mark_verified(keys[i:i + 1000], gen)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return {"hit_cache_size": size, "entries_kept": len(cache._present) + len(cache._verified),
            "heap_MB": round(used / 1e6, 1), "bytes_per_entry": round(used / max(
                1, len(cache._present) + len(cache._verified)))}


def _plot(out_dir: str, doc: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    pts = doc["entries"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for op in ("lookup_cold", "lookup_warm", "save_block", "open"):
        ax.plot([p["blocks"] for p in pts], [p[op]["p99_us"] for p in pts], "o-", label=op)
    if doc.get("entries_sharded"):
        sp = doc["entries_sharded"]
        ax.plot([p["blocks"] for p in sp], [p["lookup_cold"]["p99_us"] for p in sp], "s--",
                label=f"lookup_cold, {doc.get('shards_entries')} shards")
    ax.set(xscale="log", yscale="log", xlabel="blocks in the pool", ylabel="p99 (µs)",
           title="LMDB pool: cost per operation vs entries")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "entries.png"))
    if doc.get("engines"):
        fig, ax = plt.subplots(figsize=(6, 4))
        e = doc["engines"]
        for kind in LAYOUTS:
            ax.plot([p["processes"] for p in e], [p[kind]["save_GBps_total"] for p in e],
                    "o-", label=f"save, {kind}")
            ax.plot([p["processes"] for p in e], [p[kind]["load_GBps_total"] for p in e],
                    "s--", label=f"load, {kind}")
        ax.set(xlabel="processes", ylabel="GB/s (all processes)",
               title=f"LMDB pool: engines per pool ({doc.get('page_kib', 160)} KiB pages)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "engines.png"))


def _engines_table(doc: dict, curve: str) -> list[str]:
    paced = curve == "engines_paced"
    lines = [f"## Engines per pool{', paced' if paced else ''} ({doc.get('page_kib', 160)} "
             "KiB pages; each process "
             "saves 4 blocks, then reads them back, in a loop"
             + (f", sleeping {doc['forward_ms']} ms after each (an engine's forward: the "
                "processes' CPU demand stays under the machine's cores)" if paced else
                ", flat out: the save's CPU cost counts, and processes beyond the "
                "CPUs share cores") + ")", "",
             f"Three layouts in one run: one unsharded pool, one pool of {doc.get('shards')} "
             "shards, a pool per process; every layout and process count in turn, "
             f"{len(doc[curve][0]['one_pool'].get('rounds_save_GBps', [0]))} rounds, "
             "each figure from the round of median save rate. Writer wait: the put's median "
             "minus the same layout's put alone (1 process); lock wait: time blocked on a "
             "writer per put (the pool's turn among puts and LMDB's write lock), measured "
             "(mean; p99 of the worst process). CPU per GB: the processes' own "
             "accounting (getrusage) over the timed window, per GB saved and read back; "
             "times the GB/s, the cores the layout kept busy.", "",
             "| processes | GB/s saved (= read): one pool / sharded / separate | sharded "
             "/ separate | one pool / separate | slowest process: one pool / sharded | "
             "writer wait per put: one pool / sharded | lock wait per put (mean / p99): "
             "one pool / sharded | CPU s per GB saved (user + system, every process): "
             "one pool / sharded / separate |", "|---|---|---|---|---|---|---|---|"]
    for e in doc[curve]:
        o, s, p = (e[k] for k in LAYOUTS)
        r = e["save_ratio_to_separate"]
        lines.append(f"| {e['processes']} | {o['save_GBps_total']} / {s['save_GBps_total']}"
                     f" / {p['save_GBps_total']} | {r['sharded_pool']} | {r['one_pool']} | "
                     f"{o['save_GBps_per_process']} / {s['save_GBps_per_process']} | "
                     f"{e['writer_wait_ms']} / {e['sharded_writer_wait_ms']} ms | "
                     f"{o['lock_wait_ms_per_put']} / {o['lock_wait_p99_ms']} ms; "
                     f"{s['lock_wait_ms_per_put']} / {s['lock_wait_p99_ms']} ms | "
                     + " / ".join(_cpu_per_gb(x) for x in (o, s, p)) + " |")
    return lines + [""]


def _cpu_per_gb(run: dict) -> str:
    """A layout's CPU seconds per GB saved (runs before the figure: -)."""
    if "user_s_per_GB" not in run:
        return "-"
    return f"{run['user_s_per_GB'] + run['sys_s_per_GB']:.2f}"


def _summary(out_dir: str, doc: dict) -> None:
    """summary.md: the tables a reader wants, from the JSON."""
    lines = ["# How the LMDB pool's cost grows (benchmarks/bench_scale.py)", "",
             f"One run on {os.cpu_count()} CPUs (other work on the machine: read medians; "
             "p99s carry its noise).", ""]
    if len(doc.get("runs", [])) > 1:
        lines += ["Curves from more than one run (`--update`): " + "; ".join(
            f"`{' '.join(r['argv'] or [])}`: {', '.join(r['curves'])}" for r in doc["runs"]),
            ""]
    for curve, title in (("entries", "Entries"),
                         ("entries_sharded", f"Entries, sharded pool "
                          f"({doc.get('shards')} shards; eviction: one shard's round)")):
        if not doc.get(curve):
            continue
        lines += [f"## {title}", "", "| blocks (2 groups, 6 entries each) | lookup cold "
                  "median / p99 (µs) | lookup warm | save of a block | open | eviction round "
                  "(a tenth of the pool) |", "|---|---|---|---|---|---|"]
        for p in doc[curve]:
            e = p["evict_round"]
            lines.append(
                f"| {p['blocks']:,} | " + " | ".join(
                    f"{p[op]['median_us']:.0f} / {p[op]['p99_us']:.0f}"
                    for op in ("lookup_cold", "lookup_warm", "save_block", "open"))
                + f" | {e['ms']:.0f} ms, {e['groups_dropped']:,} groups "
                  f"({e['us_per_group']} µs each) |")
        lines.append("")
    for curve in ("engines", "engines_paced"):
        if doc.get(curve):
            lines += _engines_table(doc, curve)
    if doc.get("shards_curve"):
        k = doc["shards_curve"][0]["processes"]
        lines += [f"## Shards per pool ({k} processes saving at once, as above)", "",
                  "| shards | GB/s saved | / separate pools | lock wait per put (mean / p99) | "
                  "puts skipped (pool full) |", "|---|---|---|---|---|"]
        lines += [f"| {r['shards']} | {r['save_GBps_total']} | {r['save_ratio_to_separate']} | "
                  f"{r['lock_wait_ms_per_put']} / {r['lock_wait_p99_ms']} ms | "
                  f"{r['skipped_puts']} |"
                  for r in doc["shards_curve"]]
        lines.append("")
    if doc.get("medium"):
        lines += ["## Medium", "", "| pool directory | GB/s saved (= read) |", "|---|---|"]
        lines += [f"| {m['medium']} | {m['save_GBps_total']} |" for m in doc["medium"]]
        lines.append("")
    if doc.get("hit_cache"):
        h = doc["hit_cache"]
        lines += ["## Hit cache", "", f"At its default size ({h['hit_cache_size']:,} answers "
                  f"and as many verifications kept): {h['heap_MB']} MB of Python heap "
                  f"({h['bytes_per_entry']} bytes each).", ""]
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write("\n".join(lines))


def main() -> None:
    global PAGE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "scale"))
    ap.add_argument("--quick", action="store_true", help="10^3 and 10^4 blocks, short runs")
    ap.add_argument("--disk-dir", default="/var/tmp", help="a disk-backed directory")
    ap.add_argument("--curves", default="entries,engines,shards,medium,hit_cache")
    ap.add_argument("--engines", default="1,2,4", help="processes per point of the engines curve")
    ap.add_argument("--shards", type=int, default=PoolConfig.from_extra({}).shards,
                    help="shards of the sharded layout (engines curve)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of the engines curve (each figure: the median round's)")
    ap.add_argument("--forward-ms", type=float, default=8.0,
                    help="the paced engines curve: each process sleeps this long after each "
                         "save and read (0: no paced curve)")
    ap.add_argument("--update", action="store_true",
                    help="keep the curves not run now from the scale.json already in --out "
                         "(its 'runs' say which run measured which curve)")
    ap.add_argument("--page-kib", type=int, default=PAGE >> 10,
                    help="bytes per page (KiB) of the engines, shards and medium curves")
    ap.add_argument("--entries-shards", type=int, default=0,
                    help="also run the entries curve on pools of this many shards")
    args = ap.parse_args()
    PAGE = args.page_kib << 10  # (the workers are forked: they see it)
    curves = set(args.curves.split(","))
    sizes = (10**3, 10**4) if args.quick else (10**3, 10**4, 10**5, 10**6)
    seconds = 2.0 if args.quick else 6.0
    doc: dict = {"shards": args.shards}
    if curves & {"engines", "shards", "medium"}:  # (the curves --page-kib sizes)
        doc["page_kib"] = args.page_kib
    tmp = tempfile.mkdtemp(prefix="vlp-bench-scale-", dir="/dev/shm")
    try:
        if "entries" in curves:
            doc["entries"] = entries_curve(sizes, tmp, 200 if args.quick else 1000)
            for p in doc["entries"]:
                print(f"{p['blocks']:>8} blocks: lookup cold median/p99 "
                      f"{p['lookup_cold']['median_us']}/{p['lookup_cold']['p99_us']} us, warm "
                      f"{p['lookup_warm']['median_us']}/{p['lookup_warm']['p99_us']} us, save "
                      f"{p['save_block']['median_us']}/{p['save_block']['p99_us']} us, evict "
                      f"{p['evict_round']['ms']} ms ({p['evict_round']['groups_dropped']} "
                      f"groups), open {p['open']['median_us']}/{p['open']['p99_us']} us",
                      flush=True)
            first, last = doc["entries"][0], doc["entries"][-1]
            doc["ratios_largest_to_smallest"] = {
                f"{op}_{q}": round(last[op][f"{q}_us"] / first[op][f"{q}_us"], 2)
                for op in ("lookup_cold", "lookup_warm", "save_block", "open")
                for q in ("median", "p99")}
            print("largest / smallest pool:", doc["ratios_largest_to_smallest"])
        if "entries" in curves and args.entries_shards > 1:
            doc["shards_entries"] = args.entries_shards
            doc["entries_sharded"] = entries_curve(sizes, tmp, 200 if args.quick else 1000,
                                                   args.entries_shards)
            first, last = doc["entries_sharded"][0], doc["entries_sharded"][-1]
            doc["ratios_largest_to_smallest_sharded"] = {
                f"{op}_{q}": round(last[op][f"{q}_us"] / first[op][f"{q}_us"], 2)
                for op in ("lookup_cold", "lookup_warm", "save_block", "open")
                for q in ("median", "p99")}
            print("sharded, largest / smallest pool:",
                  doc["ratios_largest_to_smallest_sharded"])
        if "engines" in curves:
            counts = tuple(int(k) for k in args.engines.split(","))
            doc["forward_ms"] = args.forward_ms
            for curve, fwd in (("engines", 0.0), ("engines_paced", args.forward_ms / 1e3)):
                if curve == "engines_paced" and not fwd:
                    continue
                doc[curve] = engines_curve(tmp, seconds, counts, args.shards, args.rounds, fwd)
                for e in doc[curve]:
                    print(f"{curve}, {e['processes']} processes: save GB/s one pool "
                          f"{e['one_pool']['save_GBps_total']}, sharded "
                          f"{e['sharded_pool']['save_GBps_total']}, separate "
                          f"{e['separate_pools']['save_GBps_total']} (ratios to separate "
                          f"{e['save_ratio_to_separate']}); writer wait one pool "
                          f"{e['writer_wait_ms']} ms, sharded {e['sharded_writer_wait_ms']} ms;"
                          f" lock wait per put one pool "
                          f"{e['one_pool']['lock_wait_ms_per_put']} ms, sharded "
                          f"{e['sharded_pool']['lock_wait_ms_per_put']} ms", flush=True)
        if "shards" in curves:
            k = max(int(k) for k in args.engines.split(","))
            doc["shards_curve"] = shards_curve(tmp, seconds, k)
            for r in doc["shards_curve"]:
                print(f"{k} processes, {r['shards']} shards: save {r['save_GBps_total']} GB/s "
                      f"({r['save_ratio_to_separate']} of separate pools), lock wait per put "
                      f"{r['lock_wait_ms_per_put']} ms", flush=True)
        if "medium" in curves:
            doc["medium"] = medium_curve(args.disk_dir, seconds)
            for m in doc["medium"]:
                print(f"{m['medium']}: save {m['save_GBps_total']} GB/s, load "
                      f"{m['load_GBps_total']} GB/s", flush=True)
        if "hit_cache" in curves:
            doc["hit_cache"] = hit_cache_memory()
            print(f"hit cache at its default size: {doc['hit_cache']}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    ran = sorted(k for k in CURVE_KEYS if k in doc)
    runs = [{"argv": sys.argv[1:], "curves": ran}]
    if args.update and os.path.exists(os.path.join(args.out, "scale.json")):
        with open(os.path.join(args.out, "scale.json")) as f:
            old = json.load(f)
        kept = {k: v for k, v in old.items() if k in CURVE_KEYS and k not in doc}
        runs = [*old.get("runs", [{"argv": old.get("argv"), "curves": sorted(
            k for k in CURVE_KEYS if k in old)}]), *runs]
        for r in runs[:-1]:
            r["curves"] = [c for c in r["curves"] if c in kept]
        doc = {**kept, **doc}
    doc["runs"] = [r for r in runs if r["curves"]]
    _results.write(os.path.join(args.out, "scale.json"), "LMDB pool cost vs entries, "
                   "engines per pool, medium; hit cache memory", [], cpus_note=(
                       f"{os.cpu_count()} CPUs: processes beyond that share cores"),
                   argv=sys.argv[1:], **doc)
    if "entries" in doc:
        _plot(args.out, doc)
    _summary(args.out, doc)


if __name__ == "__main__":
    main()
