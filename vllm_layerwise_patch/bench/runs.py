"""The benchmark's configurations and how each is served, side by side in one
run; every engine is its own process (``testing.engines``).

* ``no-prefix-cache``: vLLM without prefix caching or pool;
* ``hbm``: vLLM's own prefix cache - the same engine serves the fill and
  then the trace (its repeats hit HBM);
* ``pool-layerwise``: a fresh engine on a pool that a fill engine filled:
  per-layer loads overlap compute (the overlay's patches on);
* ``pool-layerwise-nosave``: the same as a ``kv_consumer`` (loads only): what
  saving the trace's new blocks costs the TTFT;
* ``pool-layerwise-defer``: the same with ``defer_last_save``: the step's
  write completes at the next step instead of before the first token;
* ``pool-bulk``: the same, patches off: everything is loaded before the
  forward;
* ``pool-async``: vLLM's asynchronous external load (``load_async``: the
  request waits, outside the forward, until all its layers are loaded; then
  it computes like an HBM hit);
* with ``latency_ms``: ``pool-layerwise+latency``, ``pool-bulk+latency``
  add that much to every layer's load (a slow backend): the layerwise path
  hides it behind compute, the bulk path waits for all of it.

On CPU each configuration also runs with vLLM's mamba pre-copy and KV-block
zeroing kernels on the host (``torch_kernels``: the byte-identical stand-ins
of ``cpu_emulation.torch_precopy`` and ``cpu_emulation.torch_zeroing``): the Triton
interpreter's cost per kernel launch is an artifact of the emulation, the
layerwise path launches the pre-copy once per linear-attention layer in a
step that loads from the pool where vLLM launches it once, and a pool hit's
blocks are new allocations that vLLM zeroes (~65 ms a block interpreted)
where an HBM hit's are not.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any

from ..envvars import CPU_TORCH_KERNELS
from ..testing.engines import EngineRun, engine_env, kv_metrics
from .workload import Workload



@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    pool: bool = False
    patches: str = "0"
    prefix_caching: bool = True
    latency_ms: float = 0.0
    role: str = "kv_both"
    load_async: bool = False
    defer_last_save: bool = False


def configs(latency_ms: float, only: list[str] | None = None) -> list[Config]:
    out = [Config("no-prefix-cache", prefix_caching=False), Config("hbm"),
           Config("pool-layerwise", pool=True, patches="1"),
           Config("pool-layerwise-nosave", pool=True, patches="1", role="kv_consumer"),
           Config("pool-layerwise-defer", pool=True, patches="1", defer_last_save=True),
           Config("pool-bulk", pool=True),
           Config("pool-async", pool=True, patches="1", load_async=True)]
    if latency_ms:
        out += [Config("pool-layerwise+latency", pool=True, patches="1", latency_ms=latency_ms),
                Config("pool-bulk+latency", pool=True, latency_ms=latency_ms)]
    if only:
        unknown = sorted(set(only) - {c.name for c in out})
        if unknown:
            raise SystemExit(f"bench: unknown config(s) {unknown}; known: "
                             f"{', '.join(c.name for c in out)}")
        out = [c for c in out if c.name in only]
    return out


@dataclasses.dataclass
class Setup:
    model: str
    work: str  # scratch directory (pools)
    workload: Workload
    cpu: bool = True  # the CPU Model Runner V2 emulation
    max_num_batched_tokens: int = 2048
    kv_cache_bytes: int | None = None  # None: the emulation's 512 MiB (or vLLM's own)
    working_set_kv_bytes: int = 64 << 20
    pool_capacity: str = "1GiB"
    torch_kernels: bool = False  # CPU: vLLM's pre-copy and zeroing kernels on the host

    def llm(self, config: Config, scenario: str) -> dict[str, Any]:
        kw: dict[str, Any] = {"enable_prefix_caching": config.prefix_caching,
                              "max_num_seqs": self.workload.concurrency,
                              "max_num_batched_tokens": self.max_num_batched_tokens}
        kv = self.working_set_kv_bytes if scenario == "working-set" else self.kv_cache_bytes
        if kv:
            kw["kv_cache_memory_bytes"] = kv
        return kw

    def pool(self, config: Config, path: str) -> dict[str, Any] | None:
        if not config.pool:
            return None
        pool = {"path": path, "capacity": self.pool_capacity}
        if config.latency_ms:
            pool["debug_load_delay_ms"] = config.latency_ms
        if config.load_async:
            pool["load_async"] = True
        if config.defer_last_save:
            pool["defer_last_save"] = True
        return pool

    def engine(self, config: Config, scenario: str, phases: list[dict[str, Any]],
               pool_path: str | None = None) -> EngineRun:
        spec = {"model": self.model, "pool": self.pool(config, pool_path or ""),
                "llm": self.llm(config, scenario), "max_tokens": self.workload.output_len,
                "logprobs": False, "base": "cpu" if self.cpu else "none",
                "role": config.role,
                "phases": [{"prompts": self.workload.warmup(), "batch": True}] + phases}
        env = engine_env(config.patches)
        if self.cpu and self.torch_kernels:
            env.update(CPU_TORCH_KERNELS)
        if not self.cpu:
            env.pop("VLLM_LAYERWISE_PATCH_CPU_V2", None)
            env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        return EngineRun(spec, env=env, cwd=self.work, timeout=3600)


def _fill_pool(setup: Setup, scenario: str, path: str) -> None:
    fill = setup.engine(Config("fill", pool=True, patches="1"), scenario,
                        [{"prompts": setup.workload.fill(), "batch": True}], path).result()
    if fill["error"]:
        raise RuntimeError(f"bench: the fill engine failed: {fill['error']}")


def serve(setup: Setup, config: Config, scenario: str) -> list[dict[str, Any]]:
    """Serve ``scenario`` with ``config``; the engine results whose trace
    phases count (phase numbers > 0 in their outputs)."""
    w = setup.workload
    trace = w.trace()
    # concurrency 1: one request after another, so each TTFT is its own
    # (with more, all arrive at once and queue)
    batch = w.concurrency > 1
    pool = os.path.join(setup.work, f"pool-{scenario}-{config.name}-{setup.torch_kernels}")
    if scenario == "restart":
        half = len(trace) // 2
        results = []
        for part in (trace[:half], trace[half:]):  # a new process: the restart
            results.append(setup.engine(config, scenario, [{"prompts": part, "batch": batch}],
                                        pool).result())
        return results
    phases = [{"prompts": trace, "batch": batch}]
    if config.pool:
        filled = os.path.join(setup.work, f"filled-{scenario}")
        if not os.path.exists(filled):
            _fill_pool(setup, scenario, filled)
        shutil.rmtree(pool, ignore_errors=True)
        shutil.copytree(filled, pool)
        os.chmod(pool, 0o700)
    elif config.prefix_caching:  # hbm: the same engine served the prefixes before
        phases = [{"prompts": w.fill(), "batch": True}] + phases
    return [setup.engine(config, scenario, phases, pool).result()]


def measure(results: list[dict[str, Any]], workload: Workload) -> dict[str, Any]:
    """One configuration's numbers from its engine results: the trace phase
    is the last phase of each engine."""
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        return {"error": errors[0]}
    outs, seconds, metrics = [], 0.0, []
    for r in results:
        last = max(o["phase"] for o in r["out"])
        outs += [o for o in r["out"] if o["phase"] == last]
        seconds += r["phase_seconds"][last]
        metrics += kv_metrics(r["log"])
    ttft = sorted(o["ttft"] for o in outs)
    tpots = sorted(o["tpot"] for o in outs if o.get("tpot"))

    def pct(p: float) -> float:
        return ttft[min(len(ttft) - 1, int(round(p / 100 * (len(ttft) - 1))))]

    total = sum(o["prompt_tokens"] for o in outs)
    cached = sum(o["cached"] for o in outs)
    m = {k: sum(float(x.get(k, 0)) for x in metrics) for k in (
        "External hit tokens loaded", "Loaded (GB)", "Load time (ms)",
        "Forward wait on loads (ms)", "Saved (GB)", "Save time (ms)",
        "Save write time (ms)", "Send thread CPU (ms)", "Forward time in save hooks (ms)",
        "State pre-copy (ms)", "Pages loaded from the near tier",
        "Pages loaded from the far tier")}
    external = min(m["External hit tokens loaded"], cached)
    pages = m["Pages loaded from the near tier"] + m["Pages loaded from the far tier"]
    # backend tiered: the pool's hit tokens split by the tier their pages came from
    tiers = {"hit_rate_by_tier": {
        "near": external / total * m["Pages loaded from the near tier"] / pages,
        "far": external / total * m["Pages loaded from the far tier"] / pages}} if pages else {}
    load_s = m["Load time (ms)"] / 1e3
    return {
        "requests": len(outs), "prompt_tokens": total,
        "ttft_s": {"avg": sum(ttft) / len(ttft), "p50": pct(50), "p90": pct(90),
                   "p99": pct(99)},
        "hit_rate": {"hbm": (cached - external) / total, "external": external / total},
        "input_tokens_per_s": total / seconds if seconds else None,
        "decode_step_s": tpots[len(tpots) // 2] if tpots else None,
        "load": {"GB": m["Loaded (GB)"], "seconds": load_s,
                 "GB_per_s": m["Loaded (GB)"] / load_s if load_s else None,
                 "exposed_wait_fraction": (m["Forward wait on loads (ms)"] / 1e3 / load_s
                                           if load_s else None)},
        "forward_wait_s": m["Forward wait on loads (ms)"] / 1e3,
        "layer_precopy_s": m["State pre-copy (ms)"] / 1e3,
        "save": {"GB": m["Saved (GB)"], "seconds": m["Save time (ms)"] / 1e3,
                 "write_seconds": m["Save write time (ms)"] / 1e3,
                 "send_thread_cpu_s": m["Send thread CPU (ms)"] / 1e3,
                 "forward_hooks_s": m["Forward time in save hooks (ms)"] / 1e3},
        "tokens": [o["tokens"] for o in outs],
    } | tiers
