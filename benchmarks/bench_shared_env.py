"""Does sharing LMDB environments between processes cost CPU by itself?
Plain py-lmdb, none of the pool's code: 4 processes saving 160 KiB values
flat out (16 values per write transaction, then reading them back), full
and evicting their oldest keys, into an environment each or into 8
environments all of them share (a process picks one per save); CPU seconds
per GB saved, two rounds of each.  The pool's engines curve
(``bench_scale.py``) shows shared environments costing about 1.33x the CPU
per GB of private ones at 160 KiB pages; this says whether LMDB does.

    python benchmarks/bench_shared_env.py [--out benchmarks/results/scale/shared_env.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import resource
import shutil
import tempfile
import time

import _results

PAGE, PER_PUT, PROCESSES, SHARED = 160 << 10, 16, 4, 8
CAPACITY = 1 << 30  # in all, as bench_scale.py's engines curve
WARM_S = 4.0


def _worker(paths: list[str], cap: int, start: float, seconds: float, q) -> None:
    import lmdb

    envs = [lmdb.open(p, map_size=cap, writemap=True, sync=False, metasync=False)
            for p in paths]
    pid, payload = os.getpid(), os.urandom(PAGE)
    rng = random.Random(pid)

    def save(i: int) -> int:
        env = envs[rng.randrange(len(envs))]
        keys = [f"{pid}-{i}-{k}".encode() for k in range(PER_PUT)]
        while True:
            try:
                with env.begin(write=True) as txn:
                    for k in keys:
                        txn.put(k, payload)
                break
            except lmdb.MapFullError:  # evict a tenth of the environment: its first keys
                with env.begin(write=True) as txn:
                    cur, n = txn.cursor(), 0
                    cur.first()
                    while n < cap // PAGE // 10 and cur.delete():
                        n += 1
        with env.begin() as txn:
            for k in keys:
                txn.get(k)
        return PER_PUT * PAGE

    while time.time() < start:
        time.sleep(0.001)
    i = 0
    while time.time() < start + WARM_S:  # full and evicting when timing starts
        save(i)
        i += 1
    r0, saved, end = resource.getrusage(resource.RUSAGE_SELF), 0, time.time() + seconds
    while time.time() < end:
        saved += save(i)
        i += 1
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    q.put((saved, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime))


def run(layout: str, tmp: str, seconds: float) -> dict:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    if layout == "separate":
        args = [([os.path.join(tmp, f"sep{i}")], CAPACITY // PROCESSES) for i in range(PROCESSES)]
    else:
        args = [([os.path.join(tmp, f"shared{j}") for j in range(SHARED)],
                 CAPACITY // SHARED)] * PROCESSES
    for paths, _ in args:
        for p in paths:
            os.makedirs(p, exist_ok=True)
    start = time.time() + 1.0
    procs = [ctx.Process(target=_worker, args=(paths, cap, start, seconds, q))
             for paths, cap in args]
    for p in procs:
        p.start()
    res = [q.get(timeout=seconds + WARM_S + 120) for _ in procs]
    for p in procs:
        p.join()
    for name in os.listdir(tmp):
        shutil.rmtree(os.path.join(tmp, name))
    gb = sum(r[0] for r in res) / 1e9
    return {"layout": layout, "processes": PROCESSES, "save_GBps_total": round(gb / seconds, 3),
            "cpu_s_per_GB": round(sum(r[1] for r in res) / gb, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "scale", "shared_env.json"))
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="vlp-bench-shared-", dir="/dev/shm")
    out = []
    try:
        for _ in range(args.rounds):  # (the layouts in turn: noise falls on both)
            for layout in ("separate", f"shared{SHARED}"):
                out.append(run(layout, tmp, args.seconds))
                print(out[-1], flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _results.write(args.out, "plain py-lmdb: 4 processes saving 160 KiB values into an "
                   "environment each or 8 shared environments, CPU per GB", out)


if __name__ == "__main__":
    main()
