"""``bench --trace FILE --cluster lmdb,mooncake,tiered``: the replay on two
engines (two ``vllm serve`` processes) sharing one pool, requests routed
by ``--cluster-routing``: ``alternate`` (request ``i`` to engine ``i mod
2``: a session's turns move between engines, so reuse crosses them) or
``session`` (a session's requests to one engine, sessions alternating: what
a router with session affinity does; only what sessions share crosses):

* ``2x lmdb@CAP``: one embedded pool both engines open (one node's pool);
* ``2x mooncake@CAP``: Mooncake Store alone - a loopback master and a
  segment holder of ``CAP`` bytes; every hit is read through the transfer
  engine;
* ``2x tiered@NEAR/CAP``: each engine with an embedded near tier of its own
  (``NEAR`` bytes: two nodes) in front of that Mooncake - a hit is read
  near when the near tier holds it, else far (then promoted);
  ``--near-capacity NEAR:POLICY`` sets its ``tiered.near_saves`` (the
  configuration is then named ``... near_saves=POLICY``).

Each configuration starts on an empty pool and a fresh master.  Hit tokens
by tier: the pool's hit tokens split as the pages the scheduler's lookups
found - and verified - in each tier (``near_pages_verified`` /
``far_pages_verified``: a block found only far crosses the network there,
and is promoted, so its load then reads it near; every block has the same
pages, so pages split as tokens do).  The pages the workers loaded from
each tier (``near_pages_loaded`` / ``far_pages_loaded``) are reported
beside it.
"""

from __future__ import annotations

import shutil
import time
from typing import Any, get_args

from ..pool.config_tiered import TieredConfig
from .replay import POOL_COUNTERS, ReplaySetup, _counters, _server, replay, summarize
from .server import SOURCES

BACKENDS = ("lmdb", "mooncake", "tiered")
#: the values of ``tiered.near_saves``, from its field
NEAR_SAVES: tuple[str, ...] = get_args(TieredConfig.model_fields["near_saves"].annotation)
HEADER = ("| config | HBM hit | pool hit | of it found near | pages loaded near | TTFT p50 "
          "| p90 (s) | replay s | promoted blocks | same tokens as hbm |")
ENGINES = 2


def routes(s: ReplaySetup, routing: str, session_blocks: int = 2) -> list[int]:
    """The engine of each request of the selection."""
    if routing == "alternate":
        return [i % ENGINES for i in range(len(s.requests))]
    first: dict[tuple[int, ...], int] = {}
    for r in s.requests:
        first.setdefault(r.hash_ids[:session_blocks], len(first))
    return [first[r.hash_ids[:session_blocks]] % ENGINES for r in s.requests]


def near_spec(near: str) -> tuple[str, str]:
    """``CAP`` or ``CAP:POLICY`` of ``--near-capacity``: the near tier's
    capacity and its ``tiered.near_saves`` ("" for the default)."""
    cap, _, policy = near.partition(":")
    if policy not in ("", *NEAR_SAVES):
        raise ValueError(f"--near-capacity {near!r}: near_saves {policy!r} is not one of "
                         f"{', '.join(NEAR_SAVES)}")
    return cap, policy


def names(backends: list[str], capacity: str, near: str) -> list[tuple[str, str, str]]:
    """(configuration name, backend, near-tier spec) for each of
    ``backends`` - for ``tiered``, one per near-tier spec of ``near``
    (comma-separated, :func:`near_spec`)."""
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        raise ValueError(f"--cluster: unknown backend {bad[0]!r} (one of {', '.join(BACKENDS)})")
    out = []
    for b in backends:
        for n in ([x for x in near.split(",") if x] if b == "tiered" else [""]):
            cap, policy = near_spec(n)
            out.append((f"{ENGINES}x tiered@{cap}/{capacity}"
                        + (f" near_saves={policy}" if policy else "") if b == "tiered"
                        else f"{ENGINES}x {b}@{capacity}", b, n))
    return out


def from_args(ns: Any) -> tuple[list[str], str, str] | None:
    """(backends, capacity, near-tier capacity) of ``--cluster``, checked."""
    from ..pool.config import parse_size

    if not ns.cluster:
        return None
    cluster = ([b for b in ns.cluster.split(",") if b], ns.cluster_capacity, ns.near_capacity)
    try:
        names(*cluster)
        [parse_size(x) for x in [ns.cluster_capacity, *(near_spec(n)[0] for n in
                                                        ns.near_capacity.split(",") if n)]]
    except ValueError as exc:
        raise SystemExit(f"bench --trace: {exc}") from None
    return cluster


def _pool(s: ReplaySetup, backend: str, engine: int, capacity: str, near: str,
          master: str | None) -> dict[str, Any]:
    if backend == "lmdb":
        return {"path": str(s.work / "pool-2x-lmdb"), "capacity": capacity}
    mooncake = {"master_address": master, "global_segment_size": 0,
                "local_buffer_size": "32MiB"}
    if backend == "mooncake":
        return {"backend": "mooncake", "mooncake": mooncake}
    cap, policy = near_spec(near)
    return {"backend": "tiered", "path": str(s.work / f"pool-2x-near-{engine}"),
            "capacity": cap, "mooncake": mooncake,
            **({"tiered": {"near_saves": policy}} if policy else {})}


def run_cluster(s: ReplaySetup, name: str, backend: str, capacity: str,
                near: str, routing: str = "alternate") -> dict[str, Any]:
    """Replay the selection on two engines of ``backend``: the replay's
    figures (both engines' counters summed) and the hit tokens by tier."""
    from ..mooncake_local import LocalMooncake, free_port
    from ..pool.config import parse_size

    for i in range(ENGINES):
        shutil.rmtree(s.work / f"pool-2x-near-{i}", ignore_errors=True)
    shutil.rmtree(s.work / "pool-2x-lmdb", ignore_errors=True)
    mc = None
    if backend != "lmdb":
        mc = LocalMooncake(s.work / f"mooncake-{backend}", rpc_port=free_port(),
                           metrics_port=free_port(), holder=parse_size(capacity),
                           holder_port=free_port()).start()
    try:
        servers = [_server(s, name, f"engine{i}", _pool(
            s, backend, i, capacity, near, mc.master_address if mc else None))
            for i in range(ENGINES)]
        try:
            for server in servers:
                server.wait_ready()
            before = [_counters(x) for x in servers]
            t = time.perf_counter()
            outs = replay([x.url for x in servers], s.model, s.prompts(), s.max_tokens(),
                          concurrency=s.concurrency, route=routes(s, routing))
            seconds = time.perf_counter() - t
            after = [_counters(x) for x in servers]
            used = (sum(x.counter("vllm:layerwise_pool_used_bytes") for x in servers[:1])
                    if backend == "lmdb" else None)
        finally:
            for server in servers:
                server.stop()
    finally:
        if mc is not None:
            mc.stop()
    totals = {k: sum(a[k] - b[k] for a, b in zip(after, before))
              for k in (*SOURCES, *POOL_COUNTERS)}
    out = summarize(outs, totals, seconds)
    pool_tokens = out["prompt_tokens_by_source"]["external_kv_transfer"]
    near_pages, far_pages = out["pool"]["near_pages_verified"], out["pool"]["far_pages_verified"]
    share = near_pages / (near_pages + far_pages) if near_pages + far_pages else None
    loaded = out["pool"]["near_pages_loaded"] + out["pool"]["far_pages_loaded"]
    out.update(engines=ENGINES, backend=backend, capacity_bytes=parse_size(capacity),
               pool_used_bytes=used, routing=routing)
    if backend == "tiered":
        cap, policy = near_spec(near)
        out["near_capacity_bytes"] = parse_size(cap)
        out["near_saves"] = policy or TieredConfig.model_fields["near_saves"].default
        out["near_share"] = share
        out["near_share_of_loads"] = out["pool"]["near_pages_loaded"] / loaded if loaded else None
        out["hit_tokens_by_tier"] = (None if share is None else {
            "near": pool_tokens * share, "far": pool_tokens * (1 - share)})
    for i in range(ENGINES):
        shutil.rmtree(s.work / f"pool-2x-near-{i}", ignore_errors=True)
    shutil.rmtree(s.work / "pool-2x-lmdb", ignore_errors=True)
    return out


def verdict(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Each tiered run against Mooncake alone: the near tier's share of the
    pool's hit tokens, its size against the saved working set (what ``2x
    lmdb`` held, when it evicted nothing), and the TTFT p50 ratio."""
    runs = [(n, r) for n, r in results.items()
            if r.get("engines") == ENGINES and not r.get("error")]
    pick = {r.get("backend"): r for _, r in runs if r.get("backend") != "tiered"}
    mooncake, lmdb = pick.get("mooncake"), pick.get("lmdb") or {}
    tiered = [(n, r) for n, r in runs if r.get("backend") == "tiered"]
    if not tiered or not mooncake:
        return None
    working = lmdb.get("pool_used_bytes") if not lmdb.get("pool", {}).get("evictions") else None
    out = []
    for name, t in tiered:
        p50 = t["ttft_s"]["p50"], mooncake["ttft_s"]["p50"]
        out.append({"config": name, "near_share": t.get("near_share"),
                    "near_capacity_bytes": t["near_capacity_bytes"],
                    "working_set_bytes": working,
                    "near_fraction_of_working_set": (t["near_capacity_bytes"] / working
                                                     if working else None),
                    "ttft_p50_ratio_tiered_to_mooncake": (p50[0] / p50[1] if all(p50)
                                                          else None)})
    return out


def markdown(doc: dict[str, Any]) -> list[str]:
    rows = {n: r for n, r in doc["results"].items() if r.get("engines") == ENGINES}
    if not rows:
        return []
    from .report import _fmt, error_row

    routing = next(iter(rows.values())).get("routing", "alternate")
    lines = [f"## {ENGINES} engines sharing a pool", "",
             ("Requests alternate between two `vllm serve` engines (a session's turns move "
              "between them)" if routing == "alternate" else
              "Each session's requests go to one of two `vllm serve` engines, sessions "
              "alternating (session affinity)") + ". `tiered`: each engine its own near "
             "tier in front of one "
             "Mooncake (two nodes); `mooncake`: every hit read from Mooncake; `lmdb`: one "
             "embedded pool for both (one node).", "",
             HEADER, "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if r.get("error"):
            lines.append(error_row(name, r["error"], HEADER))
            continue
        h, eq = r["hit_rate"], r.get("same_tokens_as_hbm") or {}
        near, loads = r.get("near_share"), r.get("near_share_of_loads")
        lines.append(f"| {name} | {h['hbm']:.1%} | {h['pool']:.1%} | "
                     f"{'-' if near is None else f'{near:.1%}'} | "
                     f"{'-' if loads is None else f'{loads:.1%}'} | {_fmt(r['ttft_s']['p50'])} | "
                     f"{_fmt(r['ttft_s']['p90'])} | {_fmt(r['seconds'], 1)} | "
                     f"{_fmt(r['pool'].get('promoted_blocks', 0), 0)} | "
                     f"{eq.get('equal', '-')}/{eq.get('of', '-')} |")
    for v in doc.get("cluster") or []:
        if v.get("near_share") is None:
            continue
        ws = v.get("near_fraction_of_working_set")
        ratio = v.get("ttft_p50_ratio_tiered_to_mooncake")
        lines += ["", f"`{v['config']}` against Mooncake alone: the lookups found "
                  f"**{v['near_share']:.1%}** of the pool's hit tokens in the near tier "
                  "(the rest crossed from Mooncake once, at the lookup, and was promoted), "
                  "holding "
                  f"{v['near_capacity_bytes'] / (1 << 20):.0f} MiB"
                  + (f" = {ws:.0%} of the saved working set (what `2x lmdb` held)"
                     if ws else "") + "; TTFT p50 tiered / Mooncake "
                  + ("-" if ratio is None else f"**{ratio:.2f}**") + "."]
    return lines + [""]
