"""``bench --trace FILE``: replay a Mooncake-format trace (:mod:`.trace`)
through ``vllm serve``, side by side in one run:

* ``no-prefix-cache``: vLLM with prefix caching off (everything computed);
* ``hbm``: vLLM's own prefix cache only, its KV cache (``--kv-cache-bytes``)
  smaller than the selection's working set - the no-pool replay the others'
  tokens are compared with;
* ``pool@CAP``: the same server with the pool at capacity ``CAP``, one run per
  capacity of the sweep (``--capacities``), each on an empty pool;
* with ``--restart``: ``hbm+restart`` and ``pool@CAP+restart`` (the largest
  capacity) restart the server halfway through the replay (vLLM's cache
  starts empty again, the pool does not);
* with ``--admission all,reused``: ``pool@CAP/reused`` at every capacity,
  the pool with that ``admission`` rule (``pool@CAP`` is ``all``), compared
  by :mod:`.admission` (hit rate against bytes saved).

Requests are sent as token ids (vLLM's OpenAI completions, streamed, greedy,
``ignore_eos``): closed loop at ``--concurrency``, or open loop at the trace's
timestamps divided by ``--time-scale``. TTFT counts from the request's send
(closed loop) or its scheduled arrival (open loop). Hits by source come from
the server's ``vllm:prompt_tokens_by_source_total`` (``local_cache_hit``:
HBM, ``external_kv_transfer``: the pool). With ``--exact-check M`` the ``hbm``
server and the largest-capacity pool server then replay the first ``M``
requests again one at a time (concurrency 1, no batch variance): their
tokens must be equal, request for request.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import re
import shutil
import time
import urllib.request
from pathlib import Path
from typing import Any

from . import trace as tr
from .server import SOURCES, _port

POOL_COUNTERS = ("vllm:layerwise_pool_evictions_total", "vllm:layerwise_pool_skipped_saves_total",
                 "vllm:layerwise_pool_failed_loads_total",
                 "vllm:layerwise_pool_hit_tokens_total", "vllm:layerwise_pool_save_bytes_sum",
                 "vllm:layerwise_pool_blocks_saved_total",
                 "vllm:layerwise_pool_blocks_not_admitted_total",
                 "vllm:layerwise_pool_near_pages_loaded_total",
                 "vllm:layerwise_pool_far_pages_loaded_total",
                 "vllm:layerwise_pool_promoted_blocks_total",
                 "vllm:layerwise_pool_near_pages_verified_total",
                 "vllm:layerwise_pool_far_pages_verified_total")


@dataclasses.dataclass
class ReplaySetup:
    model: str
    work: Path
    requests: list[tr.TraceRequest]
    scale: int = 1
    output_cap: int | None = None
    concurrency: int = 4
    time_scale: float | None = None  # open loop when set
    kv_cache_bytes: int = 64 << 20
    max_model_len: int = 8192
    max_num_batched_tokens: int = 2048
    torch_kernels: bool = True  # CPU: vLLM's pre-copy and zeroing kernels on the host
    vocab: tuple[int, int] = (3, 1024)
    logs: Path | None = None  # where a failed configuration's server logs are kept

    def prompts(self) -> list[list[int]]:
        return [tr.prompt(r, self.scale, vocab=self.vocab) for r in self.requests]

    def max_tokens(self) -> list[int]:
        return [tr.output_length(r, self.scale, self.output_cap) for r in self.requests]


def send(url: str, model: str, prompt: list[int], max_tokens: int,
         arrival: float | None = None) -> dict[str, Any]:
    """One streamed greedy completion: TTFT (from ``arrival``, default now),
    latency and the output token ids."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter() if arrival is None else arrival
    ttft, tokens = None, []
    with urllib.request.urlopen(req, timeout=3600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.perf_counter() - start
                tokens += ids
    return {"ttft": ttft, "latency": time.perf_counter() - start, "tokens": tokens}


def replay(url: str | list[str], model: str, prompts: list[list[int]],
           max_tokens: list[int], *, concurrency: int = 1,
           timestamps_s: list[float] | None = None,
           route: list[int] | None = None) -> list[dict]:
    """Send every prompt (request ``i`` to ``url[route[i]]``, by default
    ``url[i mod len(url)]``, when a list); closed loop at ``concurrency``
    (in order), or open loop at ``timestamps_s`` (seconds from the replay's
    start)."""
    urls = [url] if isinstance(url, str) else list(url)
    if route is not None:
        urls = [urls[e] for e in route]
    if timestamps_s is None:
        with cf.ThreadPoolExecutor(concurrency) as ex:
            return list(ex.map(lambda i: send(urls[i % len(urls)], model, prompts[i],
                                              max_tokens[i]), range(len(prompts))))
    t0 = time.perf_counter()

    def at(i: int) -> dict[str, Any]:
        arrival = t0 + timestamps_s[i]
        time.sleep(max(0.0, arrival - time.perf_counter()))
        return send(urls[i % len(urls)], model, prompts[i], max_tokens[i], arrival)

    with cf.ThreadPoolExecutor(min(256, len(prompts)) or 1) as ex:
        return list(ex.map(at, range(len(prompts))))


def sample_sum(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples (in ``text``) whose labels
    include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? ([0-9.eE+-]+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _counters(server: Any) -> dict[str, float]:
    text = server.metrics()
    out = {s: sample_sum(text, "vllm:prompt_tokens_by_source_total", source=s)
           for s in SOURCES}
    out.update({name: sample_sum(text, name) for name in POOL_COUNTERS})
    return out


def _server(s: ReplaySetup, config: str, tag: str, pool: dict[str, Any] | None) -> Any:
    from ..envvars import CPU_TORCH_KERNELS
    from ..testing.server import VllmServer

    extra = ["--kv-cache-memory-bytes", str(s.kv_cache_bytes), "--max-model-len",
             str(s.max_model_len), "--max-num-batched-tokens", str(s.max_num_batched_tokens)]
    if config == "no-prefix-cache":
        extra.append("--no-enable-prefix-caching")
    log = s.work / f"{config.replace('/', '-')}-{tag}.log"
    return VllmServer(s.model, port=_port(), log=log, pool=pool,
                      patches="1" if pool else "0", extra=extra,
                      env=CPU_TORCH_KERNELS if s.torch_kernels else None)


def run_config(s: ReplaySetup, config: str, capacity: str | None = None, *,
               restart: bool = False, exact: int = 0,
               pool_extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Replay the selection with one configuration: client numbers, hits by
    source, pool counters; ``exact``: then the first ``exact`` requests again
    at concurrency 1 on the same server; ``pool_extra``: more pool settings."""
    pool = None
    if capacity is not None:
        path = s.work / f"pool-{config.replace('/', '-')}"
        shutil.rmtree(path, ignore_errors=True)
        pool = {"path": str(path), "capacity": capacity, **(pool_extra or {})}
    prompts, max_tokens = s.prompts(), s.max_tokens()
    ts = None
    if s.time_scale:
        base = s.requests[0].timestamp_ms
        ts = [(r.timestamp_ms - base) / 1e3 / s.time_scale for r in s.requests]
    parts = [(0, len(prompts))]
    if restart:
        half = len(prompts) // 2
        parts = [(0, half), (half, len(prompts))]
    outs: list[dict[str, Any]] = []
    totals = {k: 0.0 for k in (*SOURCES, *POOL_COUNTERS)}
    extra: dict[str, Any] = {}
    seconds = 0.0
    for n, (a, b) in enumerate(parts):
        with _server(s, config, f"part{n}", pool) as server:
            before = _counters(server)
            t = time.perf_counter()
            part_ts = None if ts is None else [x - ts[a] for x in ts[a:b]]
            outs += replay(server.url, s.model, prompts[a:b], max_tokens[a:b],
                           concurrency=s.concurrency, timestamps_s=part_ts)
            seconds += time.perf_counter() - t
            after = _counters(server)
            totals = {k: totals[k] + after[k] - before[k] for k in totals}
            if pool is not None:
                extra["pool_used_bytes"] = server.counter("vllm:layerwise_pool_used_bytes")
            if exact and n == len(parts) - 1:
                before = _counters(server)
                check = replay(server.url, s.model, prompts[:exact], max_tokens[:exact])
                after = _counters(server)
                extra["exact_check"] = {
                    "tokens": [o["tokens"] for o in check],
                    "hit_tokens": {k: after[k] - before[k] for k in SOURCES}}
    return summarize(outs, totals, seconds) | extra


def pct(values: list[float], p: float) -> float | None:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))] if v else None


def summarize(outs: list[dict[str, Any]], counters: dict[str, float],
              seconds: float) -> dict[str, Any]:
    ttft = [o["ttft"] for o in outs if o["ttft"] is not None]
    by_source = {k: counters[k] for k in SOURCES}
    total = sum(by_source.values()) or 1.0
    return {"requests": len(outs), "seconds": seconds,
            "ttft_s": {"avg": sum(ttft) / len(ttft) if ttft else None,
                       **{f"p{p}": pct(ttft, p) for p in (50, 90, 99)}},
            "prompt_tokens_by_source": by_source,
            "hit_rate": {"hbm": by_source["local_cache_hit"] / total,
                         "pool": by_source["external_kv_transfer"] / total},
            "pool": {k.removeprefix("vllm:layerwise_pool_").removesuffix("_total"):
                     counters[k] for k in POOL_COUNTERS},
            "tokens": [o["tokens"] for o in outs]}


def equal_fraction(mine: list[list[int]], ref: list[list[int]]) -> dict[str, Any]:
    same = sum(a == b for a, b in zip(mine, ref))
    return {"equal": same, "of": len(ref), "fraction": same / len(ref) if ref else None}


def run_all(s: ReplaySetup, capacities: list[str], *, restart: bool = False,
            exact: int = 0, configs: list[str] | None = None,
            admission: list[str] | None = None,
            cluster: tuple[list[str], str, str] | None = None,
            routing: str = "alternate") -> dict[str, Any]:
    """Every configuration; token equality against ``hbm`` (the no-pool
    replay); the capacity sweep; the exact check's verdict; with
    ``admission``, the admission rules side by side; with ``cluster``
    (backends, capacity, near-tier capacity), two engines per backend
    (:mod:`.cluster`)."""
    from . import cluster as two
    from .admission import compare
    from tqdm import tqdm

    from ..pool.config import parse_size

    caps = sorted(capacities, key=parse_size)
    todo: list[tuple[str, str | None, bool, int]] = [
        ("no-prefix-cache", None, False, 0), ("hbm", None, False, exact)]
    todo += [(f"pool@{c}", c, False, exact if c == caps[-1] else 0) for c in caps]
    if restart and caps:
        todo += [("hbm+restart", None, True, 0), (f"pool@{caps[-1]}+restart", caps[-1], True, 0)]
    rules = [a for a in admission or () if a != "all"]
    todo += [(f"pool@{c}/{a}", c, False, 0) for a in rules for c in caps]
    pairs = {n: (b, near) for n, b, near in two.names(*cluster)} if cluster else {}
    todo += [(name, cluster[1], False, 0) for name in pairs]
    if configs:
        todo = [t for t in todo if t[0] in configs]
    results: dict[str, dict[str, Any]] = {}
    for name, cap, rs, ex in tqdm(todo, desc="bench --trace", unit="config"):
        rule = name.partition("/")[2]
        try:
            if name in pairs:
                backend, near = pairs[name]
                results[name] = two.run_cluster(s, name, backend, cap, near, routing)
                continue
            results[name] = run_config(s, name, cap, restart=rs, exact=ex,
                                       pool_extra={"admission": rule} if rule else None)
        except Exception as exc:  # noqa: BLE001 - reported in the summary
            kept = keep_logs(s, name)
            results[name] = {**kept, "error": with_cause(f"{type(exc).__name__}: {exc}",
                                                         kept.get("cause"))}
        if cap is not None:
            results[name]["capacity_bytes"] = parse_size(cap)
        shutil.rmtree(s.work / f"pool-{name.replace('/', '-')}", ignore_errors=True)
    doc = finish(results, caps, exact)
    if pairs:
        doc["cluster"] = two.verdict(doc["results"])
    if rules:
        doc["admission"] = compare(doc["results"], caps, ["all", *rules])
    return doc


def keep_logs(s: ReplaySetup, config: str) -> dict[str, Any]:
    """A failed configuration's server logs copied to ``s.logs`` (the work
    directory goes with the run): ``{"logs": [their paths], "cause": the
    first exception one of them shows}`` (an engine's own before another's
    "engine dead"), or nothing."""
    from ..testing.server import root_cause

    if s.logs is None:
        return {}
    kept, causes = [], []
    for log in sorted(s.work.glob(f"{config.replace('/', '-')}-*.log")):
        s.logs.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, s.logs / log.name)
        kept.append(str(s.logs / log.name))
        causes.append(root_cause(log.read_text(errors="replace")))
    if not kept:
        return {}
    named = [c for c in causes if not c.startswith("(")]
    return {"logs": kept, "cause": next((c for c in named if "EngineDeadError" not in c),
                                        named[0] if named else None)}


def with_cause(error: str, cause: str | None) -> str:
    """``error`` with the server log's ``cause`` on its first line (an HTTP
    500 names none), unless it says it already."""
    if not cause or cause in error:
        return error
    first, sep, rest = error.partition("\n")
    return f"{first} (server log: {cause}){sep}{rest}"


def finish(results: dict[str, dict[str, Any]], caps: list[str], exact: int = 0
           ) -> dict[str, Any]:
    """Token equality against ``hbm``, the exact check's verdict and the
    capacity sweep from the configurations' results (``caps`` sorted by size);
    the output tokens are dropped."""
    ref = (results.get("hbm") or {}).get("tokens")
    for r in results.values():
        if "tokens" in r and ref is not None:
            r["same_tokens_as_hbm"] = equal_fraction(r["tokens"], ref)
    exact_doc = None
    mine = (results.get(f"pool@{caps[-1]}") or {}).get("exact_check") if caps else None
    theirs = (results.get("hbm") or {}).get("exact_check")
    if mine and theirs:
        exact_doc = {"requests": exact, "capacity": caps[-1],
                     "same_tokens": equal_fraction(mine["tokens"], theirs["tokens"]),
                     "pool_hit_tokens": mine["hit_tokens"]["external_kv_transfer"],
                     "hbm_hit_tokens": mine["hit_tokens"]["local_cache_hit"]}
    for r in results.values():
        r.pop("tokens", None)
        (r.get("exact_check") or {}).pop("tokens", None)
    sweep = [{"capacity": name.removeprefix("pool@"), "capacity_bytes": r["capacity_bytes"],
              "hit_rate": r["hit_rate"], "pool_used_bytes": r.get("pool_used_bytes"),
              "evictions": r["pool"]["evictions"], "ttft_p50_s": r["ttft_s"]["p50"]}
             for name, r in results.items()
             if name.startswith("pool@") and not name.endswith("+restart")
             and "/" not in name and not r.get("error")]
    return {"results": results, "capacity_sweep": sweep, "exact_check": exact_doc}
