"""The suite's fork server (``testing/fork_server.py``): a child starts as
``python -m MODULE`` would from the caller's environment, directory and
umask, with the overlay's start-up hook run under the child's own variables;
an environment the server's imports may have read differently is refused;
the child's exit status (a kill included) reaches the caller."""

from __future__ import annotations

import json
import os
import signal
import tempfile

import pytest

from vllm_layerwise_patch.testing import fork_server

PROBE = """
import json, os, sys
print("PROBE " + json.dumps({
    "argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0],
    "marker": os.environ.get("VLLM_PROBE_MARKER"), "umask": os.umask(0),
    "booted": "vllm_layerwise_patch.bootstrap" in sys.modules,
    "activated": "vllm_layerwise_patch.activation" in sys.modules,
    "torch_preimported": "torch" in sys.modules, "parent": os.getppid(),
    "path": sys.path,
    "main": __name__}), flush=True)
if sys.argv[1:] == ["sleep"]:
    import time
    time.sleep(600)
sys.exit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
"""


@pytest.fixture
def probe(tmp_path, monkeypatch):
    (tmp_path / "vlp_probe_mod.py").write_text(PROBE)
    monkeypatch.setenv(fork_server.ENABLE_ENV, "1")

    def run(args, env, *, wait=True):
        out = tempfile.TemporaryFile("w+")
        err = tempfile.TemporaryFile("w+")
        proc = fork_server.spawn("vlp_probe_mod", args, env, str(tmp_path), out, err)
        if proc is None or not wait:
            return proc, None
        rc = proc.wait(timeout=120)
        out.seek(0)
        err.seek(0)
        text = out.read()
        lines = [x for x in text.splitlines() if x.startswith("PROBE ")]
        assert lines, f"rc {rc}\n{text}\n{err.read()}"
        return proc, json.loads(lines[-1][len("PROBE "):])

    return run


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LAYERWISE_PATCH")}
    env.update(extra)
    return env


def test_a_child_starts_from_the_callers_state_and_runs_the_start_up_hook(probe, tmp_path):
    old = os.umask(0o027)
    try:
        proc, got = probe(["3"], _env(VLLM_PROBE_MARKER="m1", VLLM_LAYERWISE_PATCH="1",
                                       VLLM_LAYERWISE_PATCH_CPU_V2="1"))
    finally:
        os.umask(old)
    assert proc.returncode == 3 and proc.pid != os.getpid()
    assert got["argv"] == ["3"] and got["main"] == "__main__" and got["marker"] == "m1"
    assert got["cwd"] == str(tmp_path) and got["path0"] == str(tmp_path)
    assert got["umask"] == 0o027
    assert got["booted"] and got["activated"], got  # the .pth line ran, in the child
    assert got["torch_preimported"]  # (what the server's imports save)


def test_the_hook_follows_the_childs_variables_not_the_servers(probe):
    # negative control: the same server, a child without the overlay
    # variables runs no overlay code at all
    _, on = probe([], _env(VLLM_LAYERWISE_PATCH="1", VLLM_LAYERWISE_PATCH_CPU_V2="1"))
    _, off = probe([], _env())
    assert on["booted"] and not off["booted"] and not off["activated"], (on, off)


def test_another_environment_gets_a_server_started_under_it(probe, tmp_path):
    # what the server's imports read (PYTHONPATH here) is the child's: a
    # request whose environment differs forks from a server of its own
    extra = str(tmp_path / "extra")
    _, a = probe([], _env(VLLM_PROBE_MARKER="a"))
    _, b = probe([], _env(VLLM_PROBE_MARKER="b"))  # (VLLM* variables: the same server)
    _, c = probe([], _env(PYTHONPATH=extra))
    assert a["parent"] == b["parent"] != os.getpid()
    assert c["parent"] not in (a["parent"], os.getpid())
    assert extra in c["path"] and extra not in a["path"]


def test_a_killed_child_reports_its_signal(probe):
    proc, _ = probe(["sleep"], _env(), wait=False)
    assert proc is not None and proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert proc.poll() == -signal.SIGKILL


def test_disabled_means_no_server(probe, monkeypatch):
    monkeypatch.setenv(fork_server.ENABLE_ENV, "0")
    proc, _ = probe([], _env())
    assert proc is None  # (engines then start a fresh interpreter)
