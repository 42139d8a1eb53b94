"""``bench --server``: the same comparison through ``vllm serve`` and vLLM's own
client (``vllm bench serve``, its ``prefix_repetition`` dataset), the way an
operator would measure a deployment.

Per configuration the trace runs twice with one seed (the same prompts):

* ``hbm``: one server, no pool; the second pass hits vLLM's own cache;
* ``pool-layerwise`` / ``pool-bulk``: a server with the pool serves the
  first pass (and fills the pool), is stopped, and a fresh server on the
  same pool serves the second pass (its hits come from the pool);
* ``no-prefix-cache``: one server with prefix caching off.

The numbers are the client's (TTFT mean/P50/P90/P99 of the second pass) and
the server's ``/metrics``: ``vllm:prompt_tokens_by_source_total`` (tokens
computed, hit in HBM, loaded from the pool).  On CPU the servers run under
the Model Runner V2 emulation (``testing.server``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..envvars import CPU_TORCH_KERNELS
from .report import error_row
from .workload import Workload

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CONFIGS = ("no-prefix-cache", "hbm", "pool-layerwise", "pool-bulk")
HEADER = "| config | TTFT avg | p50 | p90 | p99 (s) | HBM hit | external hit | input tok/s |"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_args(url: str, model: str, w: Workload, result: Path) -> list[str]:
    """``vllm bench serve`` arguments for ``w`` (prefix-repetition dataset)."""
    return ["bench", "serve", "--backend", "openai", "--base-url", url, "--model", model,
            "--tokenizer", model, "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(w.prefix_len),
            "--prefix-repetition-suffix-len", str(w.input_len - w.prefix_len),
            "--prefix-repetition-num-prefixes", str(w.prefixes),
            "--prefix-repetition-output-len", str(w.output_len),
            "--num-prompts", str(w.requests), "--max-concurrency", str(w.concurrency),
            "--seed", str(w.seed), "--ignore-eos", "--disable-tqdm",
            "--percentile-metrics", "ttft", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name]


def _client(server: Any, model: str, w: Workload, result: Path, env: dict[str, str]) -> dict:
    vllm = Path(sys.executable).with_name("vllm")
    proc = subprocess.run([str(vllm)] + client_args(server.url, model, w, result), env=env,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n"
                           + (proc.stdout + proc.stderr)[-3000:])
    return json.loads(result.read_text())


def _sources(server: Any) -> dict[str, float]:
    return {s: server.counter("vllm:prompt_tokens_by_source_total", source=s)
            for s in SOURCES}


def _one(config: str, model: str, w: Workload, work: Path, cpu: bool,
         torch_kernels: bool = False) -> dict[str, Any]:
    from ..testing.server import VllmServer

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LAYERWISE_PATCH")}
    if cpu:
        env["VLLM_LAYERWISE_PATCH_CPU_V2"] = "1"
    pool = ({"path": str(work / f"pool-{config}"), "capacity": "1GiB"}
            if config.startswith("pool") else None)
    patches = "1" if config == "pool-layerwise" else "0"
    extra = ["--no-enable-prefix-caching"] if config == "no-prefix-cache" else []

    def server(tag: str) -> VllmServer:
        return VllmServer(model, port=_port(), log=work / f"{config}-{tag}.log", pool=pool,
                          patches=patches, extra=extra,
                          env=CPU_TORCH_KERNELS if torch_kernels else None)

    with server("first") as s:
        _client(s, model, w, work / f"{config}-first.json", env)
        before = _sources(s)
        if pool is None:  # the same server serves the repeat
            second = _client(s, model, w, work / f"{config}-second.json", env)
            after = _sources(s)
            tokens = {k: after[k] - before[k] for k in SOURCES}
    if pool is not None:  # a restart: the repeat's hits can only come from the pool
        with server("second") as s:
            second = _client(s, model, w, work / f"{config}-second.json", env)
            tokens = _sources(s)
    total = sum(tokens.values()) or 1.0
    return {"ttft_s": {"avg": second["mean_ttft_ms"] / 1e3,
                       "p50": second["median_ttft_ms"] / 1e3,
                       "p90": second["p90_ttft_ms"] / 1e3,
                       "p99": second["p99_ttft_ms"] / 1e3},
            "prompt_tokens_by_source": tokens,
            "hit_rate": {"hbm": tokens["local_cache_hit"] / total,
                         "external": tokens["external_kv_transfer"] / total},
            "input_tokens_per_s": second.get("total_input_tokens", 0) / second["duration"]
            if second.get("duration") else None,
            "requests": second.get("completed")}


def run_server(model: str, workload: Workload, work: str, *, cpu: bool = True,
               configs: list[str] | None = None,
               modes: tuple[str, ...] = ("triton",)) -> dict[str, Any]:
    """``modes``: on CPU, ``triton`` (vLLM's kernels interpreted) and/or
    ``torch`` (their byte-identical host stand-ins, ``+torch-kernels``)."""
    from tqdm import tqdm

    from .report import _fmt, _ratio, mode_suffix

    todo = [(c, m) for m in modes for c in configs or CONFIGS]
    results = {}
    for config, mode in tqdm(todo, desc="bench --server", unit="config"):
        name = config + mode_suffix(mode)
        try:
            results[name] = _one(config, model, workload, Path(work), cpu, mode == "torch")
        except Exception as exc:  # noqa: BLE001 - reported in the summary
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    p50 = {c: (r.get("ttft_s") or {}).get("p50") for c, r in results.items()}
    ratios = {}
    for sfx in map(mode_suffix, modes):
        lw = p50.get("pool-layerwise" + sfx)
        ratios.update({f"layerwise_vs_hbm{sfx}": _ratio(lw, p50.get("hbm" + sfx)),
                       f"layerwise_vs_no_prefix_cache{sfx}":
                           _ratio(lw, p50.get("no-prefix-cache" + sfx)),
                       f"layerwise_vs_bulk{sfx}": _ratio(lw, p50.get("pool-bulk" + sfx))})
    w = workload
    lines = ["# vllm-layerwise-patch bench --server", "",
             f"`vllm serve` driven by `vllm bench serve` (prefix_repetition: {w.requests} "
             f"prompts, prefix {w.prefix_len} + suffix {w.input_len - w.prefix_len} tokens, "
             f"{w.prefixes} prefixes, {w.output_len} output tokens, concurrency "
             f"{w.concurrency}); second pass of the same prompts (pool configurations: "
             "after a server restart).", "",
             HEADER, "|---|---|---|---|---|---|---|---|"]
    for config, r in results.items():
        if r.get("error"):
            lines.append(error_row(config, r["error"], HEADER, 120))
            continue
        t, h = r["ttft_s"], r["hit_rate"]
        lines.append(f"| {config} | {_fmt(t['avg'])} | {_fmt(t['p50'])} | {_fmt(t['p90'])} | "
                     f"{_fmt(t['p99'])} | {h['hbm']:.1%} | {h['external']:.1%} | "
                     f"{_fmt(r['input_tokens_per_s'], 0)} |")
    lines += ["", "Ratios (TTFT p50): " + ", ".join(
        f"{k.replace('_', ' ')} {_fmt(v)}" for k, v in ratios.items() if v is not None), ""]
    return {"workload": w.__dict__, "server_results": results, "ratios": ratios,
            "summary": "\n".join(lines)}
