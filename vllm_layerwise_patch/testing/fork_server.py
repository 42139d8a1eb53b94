"""A fork server for the test suite's engine processes: one process per test
process imports what vLLM imports and the overlay never patches (torch,
transformers, numpy, pydantic, safetensors, the tokenizers and, where
installed, openai and fastapi), then forks a child for each
``python -m MODULE ARGS`` an :class:`~.engines.EngineRun` asks for.  On a
2-core machine that saves 5-10 s of CPU per engine start (measured:
``from vllm import LLM`` 16 s in a fresh interpreter, 5.4 s in a child).

What the child does is what a fresh interpreter does from the point the
server's imports end: it takes the caller's environment, working directory,
umask, stdout and stderr, runs the installed ``vllm_layerwise_patch.pth``
line (the overlay's start-up hook, with the caller's ``VLLM_LAYERWISE_PATCH*``
variables) and then the module as ``__main__``; vLLM itself is imported only
there.  A server starts with the caller's environment less its ``VLLM*``
variables (so its start-up ran no overlay code, and its imports read the
same ``PYTHONPATH``, ``HF_*``, ``OMP_*``, ... as the child's); a request whose
environment differs in any other variable (but pytest's
``PYTEST_CURRENT_TEST``) gets a server of its own (two are kept).  Opt in
with ``VLP_ENGINE_FORK_SERVER=1`` (the suite's ``conftest.py`` does); tests
of the interpreter start itself (``.pth``, ``sitecustomize``, ``vllm serve``)
start their own processes.

Run as a script (``python fork_server.py SOCKET``), never imported by it: the
children then start with no module of this package imported.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
from typing import Any

ENABLE_ENV = "VLP_ENGINE_FORK_SERVER"
_LEN = struct.Struct("!I")


def _strip(env: dict[str, str]) -> dict[str, str]:
    """What must equal the server's: all but ``VLLM*`` (read by no module
    the server imported) and pytest's ``PYTEST_CURRENT_TEST`` (changes with
    every test)."""
    return {k: v for k, v in env.items()
            if not k.startswith("VLLM") and k != "PYTEST_CURRENT_TEST"}


# -- the server (this file run as a script) -------------------------------------------------
def _preimport() -> None:
    import gc

    import numpy  # noqa: F401
    import pydantic  # noqa: F401
    import safetensors  # noqa: F401
    import tokenizers  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import transformers.configuration_utils  # noqa: F401
    import transformers.tokenization_utils_base  # noqa: F401

    for name in ("openai", "fastapi"):  # (vLLM's server side; optional)
        try:
            __import__(name)
        except ImportError:
            pass
    gc.collect()
    gc.freeze()  # (children share these pages instead of touching them)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            raise EOFError
        buf += part
    return buf


def _serve(path: str) -> dict[str, Any] | None:
    """Accept requests until the caller goes; returns the request in a
    forked child (which then runs it), None in the server when done."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    parent = os.getppid()
    pth = _pth_line()  # (read once: every child runs it)
    print("ready" if pth else "no vllm_layerwise_patch.pth installed", flush=True)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:  # (the caller gone: so is the server)
        for _key, _ in sel.select(timeout=0.05):
            conn, _ = listener.accept()
            try:
                head, fds, _, _ = socket.recv_fds(conn, _LEN.size, 2)
                if len(head) < _LEN.size:
                    head += _recv_exact(conn, _LEN.size - len(head))
                req = json.loads(_recv_exact(conn, _LEN.unpack(head)[0]))
            except (EOFError, OSError, ValueError):
                conn.close()
                continue
            if req.get("stop"):
                return None
            pid = os.fork()
            if pid == 0:
                sel.close()
                listener.close()
                for c in children.values():
                    c.close()
                conn.close()
                req["fds"], req["pth"] = fds, pth
                return req
            for fd in fds:
                os.close(fd)
            conn.sendall(f"pid {pid}\n".encode())
            children[pid] = conn
        while children:  # reap: each exit status goes to its caller
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"rc {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()
    return None


def _pth_line() -> str | None:
    import site

    for d in site.getsitepackages() + [site.getusersitepackages()]:
        p = os.path.join(d, "vllm_layerwise_patch.pth")
        if os.path.exists(p):
            with open(p) as f:
                return next((x for x in f if x.startswith(("import ", "import\t"))), None)
    return None


def _child(req: dict[str, Any]) -> None:
    """Become ``python -m MODULE ARGS`` started with the caller's state."""
    import runpy

    out, err = req["fds"]
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    os.umask(req["umask"])
    sys.path[0] = os.getcwd()  # (what -m puts first)
    exec(req["pth"], {})  # noqa: S102 - the installed start-up hook, as site runs it
    sys.argv = ["-m", *req["args"]]
    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)


# -- the caller ------------------------------------------------------------------------------
class ForkedProcess:
    """What :class:`subprocess.Popen` offers the engine driver, for a child
    of the fork server: ``pid``, ``returncode``, ``poll``, ``wait``,
    ``kill``, ``terminate``, ``send_signal``."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str]) -> None:
        self._conn, self.pid, self.args = conn, pid, args
        self.returncode: int | None = None
        self._buf = b""

    def _read(self, timeout: float | None) -> None:
        self._conn.settimeout(timeout)
        try:
            while b"\n" not in self._buf:
                part = self._conn.recv(64)
                if not part:  # the server went away: the child was orphaned
                    self.returncode = self._orphan_rc()
                    return
                self._buf += part
        except (TimeoutError, BlockingIOError):
            return
        self.returncode = int(self._buf.split()[1])
        self._conn.close()

    def _orphan_rc(self) -> int | None:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return -1
        return None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        import tempfile

        self.env = env
        self.dir = tempfile.mkdtemp(prefix="vlp-fork-")
        self.path = os.path.join(self.dir, "s")
        self.proc = subprocess.Popen([sys.executable, __file__, self.path], env=self.env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        ready = self.proc.stdout.readline()
        self.proc.stdout.close()
        if ready.strip() != b"ready":
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"fork server did not start: {ready.decode().strip()!r}")

    def _send(self, req: dict[str, Any], fds: list[int]) -> socket.socket:
        """A connection to the server that carried ``req`` and ``fds``."""
        body = json.dumps(req).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        socket.send_fds(conn, [_LEN.pack(len(body))], fds)
        conn.sendall(body)
        return conn

    def spawn(self, module: str, args: list[str], env: dict[str, str], cwd: str | None,
              stdout, stderr) -> ForkedProcess:
        umask = os.umask(0o022)
        os.umask(umask)
        conn = self._send({"module": module, "args": args, "env": env,
                           "cwd": os.path.abspath(cwd or os.getcwd()), "umask": umask},
                          [stdout.fileno(), stderr.fileno()])
        line = b""
        while not line.endswith(b"\n"):
            part = conn.recv(64)
            if not part:
                raise RuntimeError("fork server closed the connection")
            line += part
        return ForkedProcess(conn, int(line.split()[1]), [module, *args])

    def stop(self) -> None:
        try:
            self._send({"stop": True}, []).close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


#: servers by environment (``_strip``ped), the most recently used last
_servers: dict[frozenset, _Server] = {}
_KEPT = 2  # (each holds torch & co in memory: a third environment stops the oldest)
_failed = False
_lock = threading.Lock()


@atexit.register
def _stop_all() -> None:
    while _servers:
        _servers.popitem()[1].stop()


def _server_for(env: dict[str, str]) -> _Server:
    key = frozenset(env.items())
    server = _servers.pop(key, None)
    if server is None:
        server = _Server(env)
        while len(_servers) >= _KEPT:
            _servers.pop(next(iter(_servers))).stop()
    _servers[key] = server
    return server


def spawn(module: str, args: list[str], env: dict[str, str], cwd: str | None,
          stdout, stderr) -> ForkedProcess | None:
    """A child of the fork server started with ``env`` (see module doc)
    running ``python -m module *args``, or None: not enabled, or a server
    failed (the caller starts a fresh interpreter)."""
    global _failed
    if os.environ.get(ENABLE_ENV) != "1" or _failed:
        return None
    try:
        with _lock:
            server = _server_for(_strip(env))
        return server.spawn(module, args, env, cwd, stdout, stderr)
    except (OSError, RuntimeError) as exc:
        print(f"fork server off: {exc}", file=sys.stderr)
        _failed = True
        return None


if __name__ == "__main__":
    _preimport()
    _job = _serve(sys.argv[1])
    if _job is not None:
        _child(_job)
