"""Run a vLLM engine (CPU Model Runner V2 emulation, tiny model) in a fresh
process and return what it served: the one engine driver of the pool tests.

``run_engine(spec)`` (or ``start_engine(spec).result()`` to run several at
the same time) starts ``python -m vllm_layerwise_patch.testing.engines SPEC``
with the overlay and the CPU emulation in its environment; the child builds
``vllm.LLM`` (in-process engine core unless the spec says otherwise), serves
the prompts and prints one ``RESULT {json}`` line.  The spec (a dict, JSON):

``model``        model directory;
``prompts``      prompt specs: ``{"prefix": [n, seed], "suffix": [n, seed]}``
                 (``tiny_prompt`` segments; prompts with one prefix seed share
                 that prefix);
``pool``         ``kv_connector_extra_config`` of the LayerwisePoolConnector,
                 or None for no connector; ``policy``: its
                 ``kv_load_failure_policy``; ``role``: its ``kv_role``
                 (``kv_both``);
``llm``          extra ``vllm.LLM`` keyword arguments (over
                 ``cpu_v2_llm_kwargs(enable_prefix_caching=True,
                 max_num_batched_tokens=640, disable_log_stats=False)``);
``max_tokens``   greedy tokens per prompt (5); ``logprobs`` (True);
``batch``        serve every prompt in one ``generate`` call (concurrently)
                 instead of one after another;
``cold``         reset vLLM's prefix cache before each prompt;
``mtp_probe``    record the MTP drafter's outputs per prompt;
``legacy_block_hash`` negative control: pool block ``i`` named by
                 ``hashes[i]`` (wrong when prefix_match_unit < block);
``legacy_namespace`` negative control: a namespace blind to the weights;
``default_pool_path`` the per-user default pool path stands here (a test
                 that must not touch this user's real default);
``transformers_version`` the version transformers writes into every config
                 it serializes (an upgrade of transformers alone, simulated);
``fill``         ``[path, bytes]``: after the engine started, write a file of
                 that size (or until the filesystem is full) - a pool
                 filesystem filling up at runtime;
``phases``       instead of ``prompts``/``batch``: a list of
                 ``{"prompts", "batch", "announce", "wait_for", "kill"}``, served
                 in order; before a phase the child creates the file
                 ``announce``, then waits until the file ``wait_for`` exists
                 (the test acts in between: kills a process, restarts a
                 server); ``kill: [pid, seconds]`` SIGKILLs ``pid`` that many
                 seconds into the phase (while its requests are in flight);
``base``         ``"cpu"`` (default): ``llm`` goes over the CPU emulation's
                 kwargs; ``"none"``: ``llm`` alone (a GPU machine);
``umask``        the child's umask (e.g. 0: files as permissive as allowed);
``weights_trace`` the result's ``weights_trace``: ``pool.weights.TRACE`` and
                 when vLLM read the weights files (``engine_controls``);
``startup``      instead of prompts, ``{name: kv_connector_extra_config}``:
                 start one engine per config in this process and report each
                 start's error (None when it started).

Each output: ``tokens``, ``logprobs``, ``cached`` (vLLM's
``num_cached_tokens``: local plus external hits), ``prompt_tokens``, ``ttft``
(seconds from arrival to the first token), ``tpot`` (seconds per later token), ``phase``, ``finish``, ``error``
(a request that failed while the engine went on), ``drafts`` (with
``mtp_probe``).  The result: ``out``, ``phase_seconds`` (wall time of each
phase), ``error`` (the engine failed), ``log`` (the child's stdout and
stderr).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from . import engine_controls

__all__ = ["EngineRun", "engine_env", "kv_metrics", "run_engine", "served", "start_engine",
           "toks"]


def engine_env(patches: str = "1", **extra: str) -> dict[str, str]:
    """The child's environment: this one without overlay variables, plus the
    overlay selection, the CPU emulation and an in-process engine core."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LAYERWISE_PATCH")}
    env.update(VLLM_LAYERWISE_PATCH=patches, VLLM_LAYERWISE_PATCH_CPU_V2="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.update(extra)
    return env


class EngineRun:
    """An engine process started by :func:`start_engine`."""

    def __init__(self, spec: dict[str, Any], *, env: dict[str, str] | None = None,
                 cwd: str | None = None, timeout: float = 900) -> None:
        self.spec = spec
        self.timeout = timeout
        # files, not pipes: readable while the engine runs, and never full
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_layerwise_patch.testing.engines", json.dumps(spec)],
            env=engine_env() if env is None else env, cwd=cwd, text=True,
            stdout=self._out, stderr=self._err)

    @staticmethod
    def _read(f: Any) -> str:
        f.seek(0)
        return f.read()

    def log(self) -> str:
        """What the engine wrote so far (stdout, where vLLM logs, and stderr)."""
        return self._read(self._out) + self._read(self._err)

    def wait_for_log(self, done: Callable[[str], bool], timeout: float = 120.0) -> str:
        """The engine's log, once ``done(log)`` holds (or AssertionError)."""
        deadline = time.monotonic() + timeout
        while not done(log := self.log()):
            assert self.proc.poll() is None, f"engine exited:\n{log[-3000:]}"
            assert time.monotonic() < deadline, f"timed out waiting; log:\n{log[-3000:]}"
            time.sleep(0.2)
        return log

    def result(self) -> dict[str, Any]:
        try:
            self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        out, err = self._read(self._out), self._read(self._err)
        lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
        log = out + err
        if not lines:
            raise AssertionError(f"engine died (exit {self.proc.returncode}):\n"
                                 f"{out[-2000:]}\n{err[-6000:]}")
        res = json.loads(lines[-1][len("RESULT "):])
        res["log"] = log
        return res


def start_engine(spec: dict[str, Any], **kw: Any) -> EngineRun:
    return EngineRun(spec, **kw)


def run_engine(spec: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return EngineRun(spec, **kw).result()


def served(res: dict[str, Any]) -> dict[str, Any]:
    """``res`` after checking the engine ran and served every prompt (tokens,
    no request error)."""
    assert res["error"] is None, res["error"] + "\n" + res["log"][-3000:]
    assert all(o["tokens"] and not o.get("error") for o in res["out"]), res["out"]
    return res


def toks(res: dict[str, Any]) -> list[tuple[list[int], list[float]]]:
    """(tokens, logprobs) of each output."""
    return [(o["tokens"], o["logprobs"]) for o in res["out"]]


def kv_metrics(log: str) -> list[dict[str, str]]:
    """vLLM's "KV Transfer metrics" log lines (the pool's stats), parsed."""
    import re

    return [dict(kv.split("=", 1) for kv in m.split(", "))
            for m in re.findall(r"KV Transfer metrics: (.*)", log)]


# -- the child -----------------------------------------------------------------

def _prompt(spec: dict[str, Any]) -> list[int]:
    from .tiny_model import tiny_prompt

    p = tiny_prompt(*spec["prefix"]) if spec.get("prefix") else []
    if spec.get("suffix"):
        p = p + tiny_prompt(*spec["suffix"])
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
           max_tokens: int) -> list[dict[str, Any]]:
    prompts = [{"prompt_token_ids": _prompt(p)} for p in phase["prompts"]]
    if phase.get("batch"):
        return [_output(o, None, max_tokens) for o in llm.generate(prompts, sp, use_tqdm=False)]
    out = []
    for prompt in prompts:
        if spec.get("cold"):
            llm.reset_prefix_cache()
        if probe is not None:
            probe.clear()
        try:
            o = llm.generate([prompt], sp, use_tqdm=False)[0]
        except Exception as exc:  # noqa: BLE001 - does the engine go on?
            out.append({"tokens": [], "cached": 0, "logprobs": [], "drafts": None,
                        "error": f"{type(exc).__name__}: {exc}"})
            continue
        out.append(_output(o, probe, max_tokens))
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
    from .cpu_v2 import cpu_v2_llm_kwargs

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
    phases = spec.get("phases") or [{"prompts": spec["prompts"], "batch": spec.get("batch")}]
    seconds = []
    for i, phase in enumerate(phases):
        _before_phase(phase)
        t0 = time.perf_counter()
        served_now = _serve(llm, phase, sp, spec, probe, max_tokens)
        seconds.append(time.perf_counter() - t0)
        for o in served_now:
            o["phase"] = i
        out += served_now
    try:
        llm.llm_engine.do_log_stats()  # flush vLLM's stats log (KV Transfer metrics)
    except Exception:  # noqa: BLE001
        pass
    return engine_controls.report(spec, {"out": out, "phase_seconds": seconds, "error": None})


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    try:
        _res = main(_spec)
    except Exception as _exc:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        _res = {"out": [], "error": f"{type(_exc).__name__}: {_exc}"}
    print("RESULT " + json.dumps(_res), flush=True)
