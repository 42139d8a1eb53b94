"""A deep tiny hybrid through Mooncake: a 48-layer tiny Qwen3-Next (36 Gated
DeltaNet and 12 full-attention layers, each tiny) served by two engine
processes sharing one loopback Mooncake pool - engine A computes and saves
the prompt, engine B hits it - checked against a cold run without the pool
(identical tokens and logprobs), with the master's requests counted
(its metrics, every ``*_requests_total``) during each engine's run, and of
them the requests for the pool's data (not the clients' pings and task
polls, which grow with how long an engine runs).

Both key layouts run side by side: ``per-block`` (key format 5, the
default: one object per block, kind and rank, layers as ranges) and
``per-layer`` (``mooncake.block_objects: false``, the format-4 layout: an
object per page plus commit markers), each against a fresh master.

    python benchmarks/bench_mooncake_layers.py [--out benchmarks/results/mooncake-layers.json]

Slow (six engine runs of a 48-layer model: several minutes on 2 cores), so
it is a benchmark, not a test of the default suite.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import urllib.request

from vllm_layerwise_patch.mooncake_local import LocalMooncake, free_port
from vllm_layerwise_patch.testing.engines import engine_env, run_engine, served, toks
from vllm_layerwise_patch.testing.tiny_model import build_tiny_qwen3_next

import _results

BLOCK_TOKENS = 640  # (the tiny model's hybrid block)
PROMPT = {"prefix": [2000, 5]}


def master_requests(lm: LocalMooncake) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{lm.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return {line.split()[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("master_") and "_requests_total" in line.split()[0]}


def data_requests(by_request: dict[str, float]) -> float:
    """Requests for the pool's data: not the clients' periodic pings and
    task polls (which count with how long the engine ran)."""
    return sum(v for k, v in by_request.items() if "ping" not in k and "fetch_tasks" not in k)


def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a.get(k, 0) for k in b if b[k] != a.get(k, 0)}


def engine(model, cwd, pool=None, **kw):
    return served(run_engine(dict({"model": str(model), "pool": pool, "prompts": [PROMPT]},
                                  **kw), env=engine_env("1" if pool else "0"), cwd=cwd,
                             timeout=900))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                   "mooncake-layers.json"))
    ap.add_argument("--layers", type=int, default=48)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="vlp-deep-")
    results = []
    try:
        model = build_tiny_qwen3_next(os.path.join(tmp, "model"), num_layers=args.layers,
                                      num_full_attention_layers=args.layers // 4,
                                      hidden_size=64)
        cold = toks(engine(model, tmp, cold=True))
        for layout in ("per-block", "per-layer"):
            lm = LocalMooncake(os.path.join(tmp, f"mc-{layout}"), rpc_port=free_port(),
                               metrics_port=free_port(), holder=1 << 30,
                               holder_port=free_port()).start()
            try:
                pool = {"backend": "mooncake", "mooncake": {
                    "master_address": lm.master_address, "global_segment_size": 0,
                    "local_buffer_size": "256MiB", "block_objects": layout == "per-block"}}
                m0 = master_requests(lm)
                a = engine(model, tmp, pool)
                m1 = master_requests(lm)
                b = engine(model, tmp, pool)
                m2 = master_requests(lm)
            finally:
                lm.stop()
            hit = b["out"][0]["cached"]
            same = toks(a) == toks(b) == cold
            rpcs_a, rpcs_b = delta(m0, m1), delta(m1, m2)
            row = {"layout": layout, "layers": args.layers, "hit_tokens": hit,
                   "hit_blocks": hit // BLOCK_TOKENS, "tokens_identical_to_cold": same,
                   "master_requests_engine_a": sum(rpcs_a.values()),
                   "master_requests_engine_b": sum(rpcs_b.values()),
                   "engine_b_by_request": rpcs_b,
                   "engine_b_data_requests": data_requests(rpcs_b)}
            results.append(row)
            print(f"{layout:>9}: {args.layers} layers, engine B hit {hit} tokens, tokens "
                  f"identical to cold: {same}; master requests: engine A (saves) "
                  f"{row['master_requests_engine_a']:.0f}, engine B (hit) "
                  f"{row['master_requests_engine_b']:.0f}, of them lookups and loads "
                  f"{row['engine_b_data_requests']:.0f}", flush=True)
            assert same and hit > 0, row
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _results.write(args.out, "a 48-layer tiny hybrid through Mooncake: two engines, "
                   "one hit, master requests per engine run, per key layout", results)


if __name__ == "__main__":
    main()
