"""Run a vLLM engine (CPU Model Runner V2 emulation, tiny model) in a fresh
process and return what it served: the one engine driver of the pool tests.

``run_engine(spec)`` (or ``start_engine(spec).result()`` to run several at
the same time) starts ``python -m vllm_layerwise_patch.testing.engine_child
SPEC``
with the overlay and the CPU emulation in its environment; the child builds
``vllm.LLM`` (in-process engine core unless the spec says otherwise), serves
the prompts and prints one ``RESULT {json}`` line.  The spec (a dict, JSON):

``model``        model directory;
``prompts``      prompt specs: ``{"prefix": [n, seed], "tokens": [ids],
                 "reply_of": i, "suffix": [n, seed]}`` (``tiny_prompt``
                 segments around literal token ids and the tokens of this
                 engine's i-th output so far - a next turn; prompts with
                 one prefix seed share that prefix); a length ``n`` (and a
                 phase's ``max_tokens``) may be ``{"blocks": x, "plus": k}``:
                 x of the engine's hybrid blocks plus k tokens;
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
                 ``{"prompts", "batch", "max_tokens", "announce", "wait_for",
                 "kill"}``, served
                 in order; before a phase the child creates the file
                 ``announce``, then waits until the file ``wait_for`` exists
                 (the test acts in between: kills a process, restarts a
                 server); ``kill: [pid, seconds]`` SIGKILLs ``pid`` that many
                 seconds into the phase (while its requests are in flight);
                 ``weights``: before the phase, change the engine's weights
                 (``engine_controls.change_weights``: ``reload``,
                 ``reload_tensors``, ``update`` from a path, then
                 ``reset_connector``; vLLM's own prefix cache is reset);
``base``         ``"cpu"`` (default): ``llm`` goes over the CPU emulation's
                 kwargs; ``"none"``: ``llm`` alone (a GPU machine);
``umask``        the child's umask (e.g. 0: files as permissive as allowed);
``exact_load_bytes`` vLLM's "KV Transfer metrics" lines also give
                 ``Loaded (bytes)``, the bytes the workers loaded, unrounded;
``weights_trace`` the result's ``weights_trace``: ``pool.identity.weights.TRACE`` and
                 when vLLM read the weights files (``engine_controls``);
``interrupt_loading`` ``"abort"`` / ``"preempt"``: the requests of the
                 first step that loads from the pool end before that step's
                 output is processed (:mod:`.engine_interrupts`; the
                 result's ``interrupted`` names them);
``dense_mlp``    a Qwen3-Next without MoE layer on a vLLM whose
                 ``set_moe_parameters`` refuses one: zero MoE parameters
                 instead (what the GPU bundle's ``dense_qwen3_next`` edit does);
``startup``      instead of prompts, ``{name: kv_connector_extra_config}``:
                 start one engine per config in this process and report each
                 start's error (None when it started).

Each output: ``tokens``, ``logprobs``, ``cached`` (vLLM's
``num_cached_tokens``: local plus external hits), ``prompt_tokens``, ``ttft``
(seconds from arrival to the first token), ``tpot`` (seconds per later token), ``phase``, ``finish``, ``error``
(a request that failed while the engine went on), ``drafts`` (with
``mtp_probe``).  The result: ``out``, ``phase_seconds`` (wall time of each
phase), ``block_size``, ``async_scheduling`` and ``max_num_batched_tokens``
(the engine's), ``error`` (the engine failed), ``log`` (the child's stdout
and stderr).
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

from . import fork_server

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
        env = engine_env() if env is None else env
        module, args = "vllm_layerwise_patch.testing.engine_child", [json.dumps(spec)]
        # (the suite's fork server when enabled: the same start, 5-10 s of CPU less)
        self.proc = fork_server.spawn(module, args, env, cwd, self._out, self._err) \
            or subprocess.Popen([sys.executable, "-m", module, *args], env=env, cwd=cwd,
                                text=True, stdout=self._out, stderr=self._err)

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
