"""``python -m vllm_layerwise_patch bench``: time to first token with the pool,
side by side with vLLM's own prefix cache, on a workload modelled on the
reference prefix-cache benchmark (:mod:`.workload`), in the configurations of
:mod:`.runs`; writes JSON, a Markdown summary and PNG plots (:mod:`.report`).

On a CPU-only machine it builds a tiny hybrid Qwen3-Next large enough that
prefill compute dominates the emulation's per-step overhead (``--model
tiny``, the default there) and runs Model Runner V2 under the CPU emulation;
on a GPU machine pass ``--model PATH`` (and ``--gpu``).  ``--server`` drives
``vllm serve`` with vLLM's own client instead (:mod:`.server`); ``--trace
FILE`` replays a Mooncake-format trace through ``vllm serve`` with and without
the pool, sweeping the pool's capacity (:mod:`.trace`, :mod:`.replay`,
:mod:`.trace_report`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Any

from .machine import describe

NOTES_CPU = [
    "On CPU, Model Runner V2 runs under the Triton interpreter: every kernel "
    "launch costs tens of milliseconds, and the layerwise path launches the "
    "mamba pre-copy once per GDN layer in a step that loads from the pool "
    "where vLLM launches it once per step (other steps: once, as vLLM), "
    "and vLLM zeroes a pool hit's blocks (new allocations) where an HBM hit "
    "reuses its own. Read the ratios, not the seconds, and compare runs with "
    "and without `VLLM_LAYERWISE_PATCH_CPU_TORCH_PRECOPY=1` and "
    "`VLLM_LAYERWISE_PATCH_CPU_TORCH_ZEROING=1` (byte-identical host "
    "stand-ins: `+torch-kernels`).",
    "Two cores serve the engine and the pool's load threads: loads compete "
    "with compute here; on a GPU machine they overlap it (see "
    "`benchmarks/bench_gpu_pipeline.py` for the exposed transfer time).",
    "A pool hit also saves the request's new blocks (`saves` in the "
    "breakdown: `pool-layerwise` minus its `pool-layerwise-nosave` twin, "
    "which only loads; `save in forward`: the forward thread's time in the "
    "save hooks per request, `save send cpu`: the send thread's CPU time per "
    "request; `layer precopy`: the time in the layerwise path's mamba "
    "pre-copies per request over all its steps - per layer in the step that "
    "loads, one bulk launch in the others - where an HBM hit runs vLLM's one "
    "pre-copy per step: the hit step's share is in `rest`). With host KV "
    "pages (CPU) the pages are packed in the forward thread: handing each "
    "layer's pages to the send thread cost ~40 ms per request on two cores, "
    "far more than the copy. On a GPU the save is a device-to-host copy on "
    "its own stream, packed by the send thread.",
    "Every TTFT counts from the request's arrival: with concurrency > 1 all "
    "requests arrive at once and at most `concurrency` run together, so later "
    "ones include queueing; with concurrency 1 they are served one after another.",
    "Same tokens as hbm: requests whose greedy tokens equal the HBM run's. "
    "Where a configuration schedules requests differently (no prefix cache, "
    "async loads park requests), batches differ and the tiny random model's "
    "near-tied logits can flip under float batch variance; exactness with the "
    "same hit is what the end-to-end tests check.",
    "Load GB/s divides the bytes loaded by the time loads were in flight; on "
    "the layerwise path that spans the forward they overlap, so it is low by "
    "design - the exposed wait is the number that matters there.",
]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m vllm_layerwise_patch bench",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny",
                    help="'tiny' (built here, CPU) or a model path (GPU)")
    ap.add_argument("--gpu", action="store_true", help="real vLLM on a GPU (no emulation)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=3200)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--repeat-rate", type=float, default=0.9)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--scenarios", default="default,working-set,restart")
    ap.add_argument("--latency-ms", type=float, default=0.0,
                    help="also run the pool configurations with this much added to "
                         "every layer's load (a slow backend)")
    ap.add_argument("--configs", default="",
                    help="comma-separated configurations (default: all; see bench.runs)")
    ap.add_argument("--cpu-kernels", choices=("triton", "torch", "both"), default="both",
                    help="CPU: vLLM's mamba pre-copy and KV-block zeroing kernels in the "
                         "Triton interpreter, as their byte-identical host stand-ins, or "
                         "both side by side")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8, help="tiny model: layers")
    ap.add_argument("--hidden", type=int, default=256, help="tiny model: hidden size")
    ap.add_argument("--no-transfer", action="store_true",
                    help="skip the transfer-path measurement (LMDB vs memcpy)")
    ap.add_argument("--server", action="store_true",
                    help="drive vllm serve with vLLM's own client (vllm bench serve)")
    ap.add_argument("--out", default="bench-results", help="output directory")
    t = ap.add_argument_group("trace replay (--trace FILE, through vllm serve: bench.replay)")
    t.add_argument("--trace", help="a Mooncake-format trace (JSON lines: timestamp, "
                   "input_length, output_length, hash_ids)")
    t.add_argument("--sessions", type=int, help="keep this many whole sessions (first by "
                   "arrival; default: every request)")
    t.add_argument("--session-blocks", type=int, default=2,
                   help="requests sharing their first this-many hash ids form a session")
    t.add_argument("--min-session-requests", type=int, default=2)
    t.add_argument("--max-input-length", type=int,
                   help="drop sessions with a longer request (trace tokens, before --scale)")
    t.add_argument("--scale", type=int, default=1,
                   help="divide lengths and the 512-token block by this (CPU: 4)")
    t.add_argument("--time-scale", type=float, help="open loop: send at the trace's "
                   "timestamps divided by this (default: closed loop at --concurrency)")
    t.add_argument("--output-cap", type=int, help="at most this many output tokens a request")
    t.add_argument("--capacities", default="256MiB,1GiB,4GiB",
                   help="pool capacities to sweep (comma-separated sizes)")
    t.add_argument("--kv-cache-bytes", type=int, default=64 << 20,
                   help="vLLM's KV cache (keep it below the working set)")
    t.add_argument("--max-model-len", type=int, default=8192)
    t.add_argument("--restart", action="store_true",
                   help="also replay hbm and the largest pool with a restart halfway")
    t.add_argument("--admission", default="all",
                   help="pool admission rules to compare at every capacity (comma-separated: "
                        "all,reused; 'all' is the pool@CAP runs)")
    t.add_argument("--cluster", default="",
                   help="also replay on two engines sharing a pool, one run per backend "
                        "(comma-separated: lmdb,mooncake,tiered; bench.cluster)")
    t.add_argument("--cluster-capacity", default="256MiB",
                   help="--cluster: the pool's capacity (lmdb), Mooncake's segment holder "
                        "(mooncake, tiered's far tier)")
    t.add_argument("--near-capacity", default="48MiB",
                   help="--cluster: each engine's near tier (tiered), comma-separated; "
                        "CAP:hot|cold|off also sets its tiered.near_saves")
    t.add_argument("--cluster-routing", default="alternate", choices=("alternate", "session"),
                   help="--cluster: requests alternate between the engines, or each "
                        "session's go to one (session affinity)")
    t.add_argument("--exact-check", type=int, default=0, metavar="M",
                   help="then replay the first M requests at concurrency 1 on hbm and the "
                        "largest pool: their tokens must be equal")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    ns.argv = list(sys.argv[1:] if argv is None else argv)
    from .workload import SCENARIOS, Workload

    workload = Workload(requests=ns.requests, input_len=ns.input_len,
                        output_len=ns.output_len, concurrency=ns.concurrency,
                        repeat_rate=ns.repeat_rate, prefixes=ns.prefixes)
    scenarios = [s for s in ns.scenarios.split(",") if s]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"bench: unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    os.makedirs(ns.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="vlp-bench-")
    try:
        model, description = _model(ns, work)
        if ns.trace:
            doc = _trace(ns, model, work)
            doc["model"] = description
            doc["machine"] = describe()
            _write_trace(doc, ns.out)
            return 0
        if ns.server:
            from .server import run_server

            only = [c for c in ns.configs.split(",") if c] or None
            doc = run_server(model, workload, work, cpu=not ns.gpu, configs=only,
                             modes=_modes(ns))
        else:
            doc = _run_engines(ns, model, workload, scenarios, work)
        doc["model"] = {"path": model if ns.model != "tiny" else "tiny (built in a temporary "
                        "directory)", "description": description,
                        "note": "" if ns.gpu else _size_note(doc, workload)}
        doc["machine"] = describe()
        _write(doc, ns.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _size_note(doc: dict[str, Any], workload: Any) -> str:
    """How the CPU model's prefill compares with the emulation's per-step cost,
    per scenario, from the no-prefix-cache run: a prompt's prefill (input
    throughput) over a decode step (mostly fixed cost: kernel launches,
    scheduling)."""
    parts = []
    for scenario, by_config in (doc.get("results") or {}).items():
        r = by_config.get("no-prefix-cache") or {}
        if r.get("input_tokens_per_s") and r.get("decode_step_s"):
            prefill = workload.input_len / r["input_tokens_per_s"]
            parts.append(f"`{scenario}`: {prefill:.2f} s vs {r['decode_step_s']:.3f} s, "
                         f"{prefill / r['decode_step_s']:.0f}x")
    if not parts:
        return ""
    return (f"Model size: one {workload.input_len}-token prefill without prefix cache "
            "(measured) against a decode step (mostly the emulation's fixed per-step "
            "cost): " + "; ".join(parts) + ".")


def _model(ns: argparse.Namespace, work: str) -> tuple[str, str]:
    if ns.model != "tiny":
        return ns.model, ns.model
    from ..testing.tiny_model import build_tiny_qwen3_next

    if ns.trace:  # 4 KV heads of 128: vLLM's hybrid block is 128 tokens (= 512 / --scale 4)
        path = build_tiny_qwen3_next(os.path.join(work, "model"), num_layers=ns.layers,
                                     num_full_attention_layers=max(1, ns.layers // 4),
                                     hidden_size=ns.hidden, num_attention_heads=4,
                                     num_key_value_heads=4, head_dim=128,
                                     max_position_embeddings=32768)
        return str(path), (f"tiny hybrid Qwen3-Next, {ns.layers} layers "
                           f"({ns.layers - max(1, ns.layers // 4)} GDN), hidden {ns.hidden}, "
                           "4 KV heads of 128")

    path = build_tiny_qwen3_next(os.path.join(work, "model"), num_layers=ns.layers,
                                 num_full_attention_layers=max(1, ns.layers // 4),
                                 hidden_size=ns.hidden)
    return str(path), (f"tiny hybrid Qwen3-Next, {ns.layers} layers "
                       f"({ns.layers - max(1, ns.layers // 4)} GDN), hidden {ns.hidden}")


def _modes(ns: argparse.Namespace) -> tuple[str, ...]:
    """The CPU kernel modes to run (``--cpu-kernels``); a GPU runs vLLM's own."""
    if ns.gpu:
        return ("triton",)
    return ("triton", "torch") if ns.cpu_kernels == "both" else (ns.cpu_kernels,)


def _run_engines(ns: argparse.Namespace, model: str, workload: Any, scenarios: list[str],
                 work: str) -> dict[str, Any]:
    from tqdm import tqdm

    from .report import breakdown, mode_suffix, ratios
    from .runs import Setup, configs, measure, serve

    modes = _modes(ns)
    only = [c for c in ns.configs.split(",") if c] or None
    todo = [(s, m, c) for s in scenarios for m in modes for c in configs(ns.latency_ms, only)]
    results: dict[str, dict[str, Any]] = {}
    for scenario, mode, config in tqdm(todo, desc="bench", unit="config"):
        setup = Setup(model=model, work=work, workload=workload, cpu=not ns.gpu,
                      max_num_batched_tokens=ns.max_num_batched_tokens,
                      torch_kernels=mode == "torch")
        key = scenario + mode_suffix(mode)
        results.setdefault(key, {})[config.name] = measure(serve(setup, config, scenario),
                                                           workload)
    for by_config in results.values():  # outputs: the same tokens as vLLM's own cache?
        ref = (by_config.get("hbm") or {}).get("tokens")
        for r in by_config.values():
            if "tokens" in r:
                mine = r.pop("tokens")
                r["same_tokens_as_hbm"] = (None if ref is None else
                                           sum(a == b for a, b in zip(mine, ref)))
        (by_config.get("hbm") or {}).pop("tokens", None)
    doc: dict[str, Any] = {"workload": workload.__dict__, "results": results,
                           "ratios": ratios(results), "breakdown": breakdown(results),
                           "notes": [] if ns.gpu else NOTES_CPU}
    if not ns.no_transfer:
        from .transfer import run as transfer

        doc["transfer"] = transfer(8, 16, 2 << 20, 5, prefetch=2, threads=2, check_crc=False)
    return doc


def _trace(ns: argparse.Namespace, model: str, work: str) -> dict[str, Any]:
    import re
    from pathlib import Path

    from . import trace as tr
    from .replay import ReplaySetup, run_all
    from .trace_report import NOTES

    try:
        reqs = tr.select(tr.load(ns.trace), sessions_n=ns.sessions,
                         session_blocks=ns.session_blocks,
                         min_session_requests=ns.min_session_requests,
                         max_input_length=ns.max_input_length)
        block = tr.block_tokens(ns.scale)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"bench --trace: {exc}") from None
    if not reqs:
        raise SystemExit("bench --trace: the selection is empty")
    from .cluster import from_args

    cluster = from_args(ns)
    setup = ReplaySetup(model=model, work=Path(work), requests=reqs, scale=ns.scale,
                        output_cap=ns.output_cap, concurrency=ns.concurrency,
                        time_scale=ns.time_scale, kv_cache_bytes=ns.kv_cache_bytes,
                        max_model_len=ns.max_model_len,
                        max_num_batched_tokens=ns.max_num_batched_tokens,
                        torch_kernels=not ns.gpu and ns.cpu_kernels != "triton",
                        logs=Path(ns.out) / "failed-logs")
    doc = run_all(setup, [c for c in ns.capacities.split(",") if c], restart=ns.restart,
                  exact=ns.exact_check, configs=[c for c in ns.configs.split(",") if c],
                  admission=[a for a in ns.admission.split(",") if a],
                  cluster=cluster, routing=ns.cluster_routing)
    hbm_tokens = None
    log = Path(work) / "hbm-part0.log"
    if log.exists():
        m = re.search(r"KV cache size: ([0-9,]+) tokens", log.read_text(errors="replace"))
        hbm_tokens = int(m.group(1).replace(",", "")) if m else None
    doc["trace"] = {"file": os.path.basename(ns.trace), "stats": tr.stats(reqs, ns.scale),
                    "selection": {"sessions": ns.sessions, "session_blocks": ns.session_blocks,
                                  "min_session_requests": ns.min_session_requests,
                                  "max_input_length": ns.max_input_length},
                    "lines": [r.line for r in reqs]}
    doc["setup"] = {"scale": ns.scale, "block_tokens": block, "concurrency": ns.concurrency,
                    "time_scale": ns.time_scale, "kv_cache_bytes": ns.kv_cache_bytes,
                    "hbm_tokens": hbm_tokens, "max_num_batched_tokens":
                    ns.max_num_batched_tokens, "capacities": ns.capacities,
                    "output": (f"output_length / {ns.scale}" + (
                        f", at most {ns.output_cap}" if ns.output_cap else "")),
                    "torch_kernels": setup.torch_kernels, "admission": ns.admission,
                    "cluster": ns.cluster or None, "cluster_capacity": ns.cluster_capacity,
                    "near_capacity": ns.near_capacity, "cluster_routing": ns.cluster_routing}
    doc["notes"] = NOTES
    doc["command"] = "python -m vllm_layerwise_patch bench " + " ".join(ns.argv)
    return doc


def _write_trace(doc: dict[str, Any], out: str) -> None:
    from .trace_report import markdown, plot

    with open(os.path.join(out, "trace.json"), "w") as f:
        json.dump(doc, f, indent=2)
    summary = markdown(doc)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary)
    from .admission import plot as admission_plot

    made = plot(doc, out) + admission_plot(doc.get("admission") or [], out)
    print(summary)
    print(f"\nwrote {out}/trace.json, {out}/summary.md" + "".join(f", {p}" for p in made))


def _write(doc: dict[str, Any], out: str) -> None:
    from .report import markdown, plots

    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(doc, f, indent=2)
    summary = markdown(doc) if "results" in doc else doc.get("summary", "")
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary)
    made = plots(doc if "results" in doc else {"results": {"server": doc["server_results"]}},
                 out)
    print(summary)
    print(f"\nwrote {out}/bench.json, {out}/summary.md" + "".join(f", {p}" for p in made))
