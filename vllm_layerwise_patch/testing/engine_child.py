"""The child process of :mod:`.engines`: builds ``vllm.LLM`` from the spec
(documented there), serves its prompts or phases and prints one
``RESULT {json}`` line.  Kept apart from the driver, which runs in the
test's process and never imports vLLM."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Any

from . import engine_controls

def length(n: Any, block: int) -> int:
    """A length in tokens: an int, or ``{"blocks": x, "plus": n}`` - x of the
    engine's blocks (its hybrid block size, known once it started) plus n."""
    if isinstance(n, dict):
        return round(n["blocks"] * block) + int(n.get("plus", 0))
    return int(n)


def _prompt(spec: dict[str, Any], block: int, earlier: list[dict[str, Any]]) -> list[int]:
    from .tiny_model import tiny_prompt

    seg = lambda s: tiny_prompt(length(s[0], block), *s[1:])  # noqa: E731
    p = seg(spec["prefix"]) if spec.get("prefix") else []
    p = p + list(spec.get("tokens") or [])  # (e.g. a reply, for the next turn)
    if spec.get("reply_of") is not None:  # an earlier output's tokens (its next turn)
        p = p + list(earlier[spec["reply_of"]]["tokens"])
    if spec.get("suffix"):
        p = p + seg(spec["suffix"])
    return p


def _install_mtp_probe() -> list | None:
    """Record the MTP drafter's outputs: argmax, max logit and a digest of
    the whole logits row of every single-row draft (a stale draft page moves
    the logits by less than the rounding of the max, not by less than a bit
    of the row).  The engine core and worker run in this process."""
    import hashlib

    probe: list = []
    try:
        from vllm.model_executor.models import qwen3_next_mtp as mtp
    except Exception as exc:  # noqa: BLE001
        print(f"no draft probe: {exc}")
        return None
    compute_logits = mtp.Qwen3NextMTP.compute_logits

    def recording(self, hidden_states, *a, **k):
        out = compute_logits(self, hidden_states, *a, **k)
        if out is not None and out.dim() == 2 and out.shape[0] == 1:
            row = out.float()
            m = row.max(-1)
            probe.append([int(m.indices[0]), round(float(m.values[0]), 4),
                          hashlib.sha1(row.cpu().numpy().tobytes()).hexdigest()[:16]])
        return out

    mtp.Qwen3NextMTP.compute_logits = recording
    return probe


def _output(o: Any, probe: list | None, max_tokens: int) -> dict[str, Any]:
    c = o.outputs[0]
    metrics = getattr(o, "metrics", None)
    return {"tokens": list(c.token_ids), "cached": o.num_cached_tokens,
            "prompt_tokens": len(o.prompt_token_ids or []),
            "ttft": getattr(metrics, "first_token_latency", None),
            # engine-core time from queued to first scheduled, and from
            # first scheduled to the first token
            "waited": (metrics.scheduled_ts - metrics.queued_ts
                       if metrics is not None and getattr(metrics, "scheduled_ts", 0) else None),
            "prefill": (metrics.first_token_ts - metrics.scheduled_ts
                        if metrics is not None and getattr(metrics, "scheduled_ts", 0) else None),
            # mean time per output token after the first (the per-step cost)
            "tpot": ((metrics.last_token_ts - metrics.first_token_ts) / (len(c.token_ids) - 1)
                     if metrics is not None and len(c.token_ids) > 1
                     and getattr(metrics, "last_token_ts", 0) else None),
            "finish": c.finish_reason,
            "logprobs": [round(next(iter(d.values())).logprob, 4) for d in c.logprobs or []],
            # one draft per step from the prompt's last chunk on
            "drafts": None if probe is None else probe[-max_tokens:]}


def _before_phase(phase: dict[str, Any]) -> None:
    import signal
    import threading
    import time

    if phase.get("announce"):
        open(phase["announce"], "w").close()
    if phase.get("wait_for"):
        deadline = time.monotonic() + 600
        while not os.path.exists(phase["wait_for"]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"nobody created {phase['wait_for']}")
            time.sleep(0.05)
    if phase.get("kill"):
        pid, seconds = phase["kill"]

        def kill() -> None:
            try:
                os.kill(int(pid), signal.SIGKILL)
                print(f"killed {pid}", flush=True)
            except ProcessLookupError:
                pass

        threading.Timer(float(seconds), kill).start()


def _serve(llm: Any, phase: dict[str, Any], sp: Any, spec: dict[str, Any], probe: list | None,
           max_tokens: int, block: int, earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    prompts = [{"prompt_token_ids": _prompt(p, block, earlier)} for p in phase["prompts"]]
    if phase.get("batch"):
        return [_output(o, None, max_tokens) for o in llm.generate(prompts, sp, use_tqdm=False)]
    out = []
    for prompt in prompts:
        if spec.get("cold"):
            llm.reset_prefix_cache()
        if probe is not None:
            probe.clear()
        try:
            got = llm.generate([prompt], sp, use_tqdm=False)
            if not got:
                raise RuntimeError("no output: the request was aborted")
        except Exception as exc:  # noqa: BLE001 - does the engine go on?
            out.append({"tokens": [], "cached": 0, "logprobs": [], "drafts": None,
                        "error": f"{type(exc).__name__}: {exc}"})
            continue
        out.append(_output(got[0], probe, max_tokens))
    return out


def _fill(path: str, size: int) -> None:
    chunk = bytes(1 << 20)
    with open(path, "wb") as f:
        try:
            while size > 0:
                f.write(chunk[:min(size, len(chunk))])
                f.flush()
                size -= len(chunk)
        except OSError:
            pass  # the filesystem is full


def _llm_kwargs(spec: dict[str, Any], pool: dict[str, Any] | None) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments; the pool config's ``debug_*`` keys (the
    tests' fault injection, no user setting) go to this process's
    ``VLLM_LAYERWISE_PATCH_TEST_FAULTS`` instead."""
    from ..pool.faults import FAULTS_ENV, split
    from ..cpu_emulation.cpu_v2 import cpu_v2_llm_kwargs

    pool, faults = split(pool)
    if faults:
        os.environ[FAULTS_ENV] = json.dumps(faults)
    else:
        os.environ.pop(FAULTS_ENV, None)

    kw = (cpu_v2_llm_kwargs(enable_prefix_caching=True, max_num_batched_tokens=640,
                            disable_log_stats=False)
          if spec.get("base", "cpu") == "cpu" else {"disable_log_stats": False})
    kw.update(spec.get("llm") or {})
    if pool is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "LayerwisePoolConnector",
            "kv_connector_module_path": "vllm_layerwise_patch.pool",
            "kv_role": spec.get("role", "kv_both"),
            "kv_connector_extra_config": pool}
        if spec.get("policy"):
            kw["kv_transfer_config"]["kv_load_failure_policy"] = spec["policy"]
    return kw


def _startup(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM

    errors: dict[str, str | None] = {}
    for name, pool in spec["startup"].items():  # one process, one engine start each
        try:
            llm = LLM(model=spec["model"], **_llm_kwargs(spec, pool))
            errors[name] = None
            llm.llm_engine.engine_core.shutdown()
            del llm
        except Exception as exc:  # noqa: BLE001
            errors[name] = f"{type(exc).__name__}: {exc}"
    return {"out": [], "errors": errors, "error": None}


def main(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("umask") is not None:
        os.umask(spec["umask"])
    probe = _install_mtp_probe() if spec.get("mtp_probe") else None
    engine_controls.apply(spec)  # (legacy_*, transformers_version, default_pool_path)
    if spec.get("startup"):
        return _startup(spec)
    from vllm import LLM, SamplingParams

    # What the imports left is never garbage: frozen, vLLM's own gc.collect()
    # calls (model loading, memory profiling: about 2 s of an engine's start
    # with every object of the imports to walk) skip it.  vLLM freezes the
    # heap likewise once a server started (vllm.utils.gc_utils).
    gc.freeze()
    kw = _llm_kwargs(spec, spec.get("pool"))
    max_tokens = spec.get("max_tokens", 5)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                        logprobs=1 if spec.get("logprobs", True) else None)
    out: list[dict[str, Any]] = []
    try:
        llm = LLM(model=spec["model"], **kw)
    except Exception as exc:  # noqa: BLE001 - reported, the test decides
        return {"out": out, "error": f"{type(exc).__name__}: {exc}"}
    if spec.get("fill"):
        _fill(*spec["fill"])
    interrupted = None
    if spec.get("interrupt_loading"):  # (in-process engine core)
        from .engine_interrupts import install

        interrupted = install(llm, spec["interrupt_loading"])
    phases = spec.get("phases") or [{"prompts": spec["prompts"], "batch": spec.get("batch")}]
    seconds = []
    block = llm.llm_engine.vllm_config.cache_config.block_size
    for i, phase in enumerate(phases):
        _before_phase(phase)
        if phase.get("weights"):
            engine_controls.change_weights(llm, phase["weights"])
        t0 = time.perf_counter()
        n = length(phase.get("max_tokens", max_tokens), block)  # (a phase may ask for more)
        phase_sp = sp if n == max_tokens else SamplingParams(
            temperature=0, max_tokens=n, ignore_eos=True, logprobs=sp.logprobs)
        served_now = _serve(llm, phase, phase_sp, spec, probe, n, block, out)
        seconds.append(time.perf_counter() - t0)
        for o in served_now:
            o["phase"] = i
        out += served_now
    try:
        llm.llm_engine.do_log_stats()  # flush vLLM's stats log (KV Transfer metrics)
    except Exception:  # noqa: BLE001
        pass
    sched = llm.llm_engine.vllm_config.scheduler_config
    return engine_controls.report(spec, {
        "out": out, "phase_seconds": seconds, "error": None, "interrupted": interrupted,
        "block_size": block, "async_scheduling": sched.async_scheduling,
        "max_num_batched_tokens": sched.max_num_batched_tokens})


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    try:
        _res = main(_spec)
    except Exception as _exc:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        _res = {"out": [], "error": f"{type(_exc).__name__}: {_exc}"}
    print("RESULT " + json.dumps(_res), flush=True)
