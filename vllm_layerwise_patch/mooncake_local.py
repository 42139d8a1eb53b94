"""``python -m vllm_layerwise_patch mooncake-local start|stop|status``: a
Mooncake Store master on loopback (and, with ``--holder SIZE``, a standalone
segment holder) for one machine, for users trying the distributed pool and for
the tests.

* ``mooncake_master`` listens on ``127.0.0.1:<rpc-port>`` only; its metrics
  port is moved off Mooncake's default (9003) so several masters (tests) do not
  collide; the HTTP metadata server is off (clients use the P2P handshake); the
  read-lease TTL is set (``--lease-ttl-ms``).
* ``--holder SIZE`` also starts ``mooncake_client``, a process that holds
  SIZE bytes of pool memory (its "global segment") apart from any engine, so
  entries survive engine restarts; engines on the same machine may reach it
  through shared memory (``mooncake.client_address``).

The processes run detached; their pids, ports and logs live in the state
directory (default ``~/.cache/vllm-layerwise-patch/mooncake-local``, private).
Mooncake has no authentication: the master and holder listen on loopback,
but Mooncake's transfer listeners of every segment holder bind all
interfaces (no option changes that) - keep such machines on a trusted
network.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path.home() / ".cache" / "vllm-layerwise-patch" / "mooncake-local"
LOOPBACK = "127.0.0.1"


def _binary(name: str) -> str:
    """The ELF binary shipped in the mooncake wheel (its console scripts are
    Python wrappers that exec it)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("mooncake")
    except Exception:  # noqa: BLE001
        spec = None
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / name
        if path.exists():
            return str(path)
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(
        f"{name} not found: pip install 'vllm-layerwise-patch[mooncake]' (on CPU machines "
        "also: apt-get install libibverbs1)")


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


class LocalMooncake:
    """A loopback master (and optional holder) whose state lives in ``state_dir``."""

    def __init__(self, state_dir: str | os.PathLike = DEFAULT_DIR, *, rpc_port: int = 50051,
                 metrics_port: int | None = None, lease_ttl_ms: int = 10000,
                 client_ttl_s: int = 10, holder: int = 0, holder_port: int | None = None,
                 eviction_high_watermark: float = 0.9) -> None:
        self.dir = Path(state_dir)
        self.rpc_port = rpc_port
        self.metrics_port = metrics_port or rpc_port + 1
        self.lease_ttl_ms = lease_ttl_ms
        self.client_ttl_s = client_ttl_s
        self.holder = holder
        self.holder_port = holder_port or rpc_port + 2
        self.eviction_high_watermark = eviction_high_watermark
        self._load()

    # -- state -------------------------------------------------------------------
    @property
    def _state_file(self) -> Path:
        return self.dir / "state.json"

    def _load(self) -> None:
        self.pids: dict[str, int] = {}
        if self._state_file.exists():
            st = json.loads(self._state_file.read_text())
            self.pids = st.get("pids", {})
            for k in ("rpc_port", "metrics_port", "holder", "holder_port", "lease_ttl_ms"):
                if k in st:
                    setattr(self, k, st[k])

    def _save(self) -> None:
        self._state_file.write_text(json.dumps({
            "pids": self.pids, "rpc_port": self.rpc_port, "metrics_port": self.metrics_port,
            "holder": self.holder, "holder_port": self.holder_port,
            "lease_ttl_ms": self.lease_ttl_ms}, indent=1))

    @property
    def master_address(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def holder_address(self) -> str | None:
        return f"{LOOPBACK}:{self.holder_port}" if self.holder else None

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(MC_TCP_BIND_ADDRESS=LOOPBACK, MC_FORCE_TCP="1")
        return env

    # -- processes -----------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> int:
        log = open(self.dir / f"{name}.log", "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.pids[name] = proc.pid
        self._save()
        return proc.pid

    def _wait_port(self, name: str, port: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if port_open(LOOPBACK, port):
                return
            if not _alive(self.pids.get(name)):
                break
            time.sleep(0.1)
        tail = (self.dir / f"{name}.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"mooncake-local: {name} did not listen on {LOOPBACK}:{port}:\n{tail}")

    def start_master(self) -> None:
        if _alive(self.pids.get("master")):
            return
        self._spawn("master", [
            _binary("mooncake_master"), f"-rpc_address={LOOPBACK}", f"-rpc_port={self.rpc_port}",
            f"-metrics_host={LOOPBACK}", f"-metrics_port={self.metrics_port}",
            "-enable_http_metadata_server=false",
            f"-default_kv_lease_ttl={self.lease_ttl_ms}", f"-client_ttl={self.client_ttl_s}",
            f"-eviction_high_watermark_ratio={self.eviction_high_watermark}", "-logtostderr"])
        self._wait_port("master", self.rpc_port)

    def start_holder(self) -> None:
        if not self.holder or _alive(self.pids.get("holder")):
            return
        self._spawn("holder", [
            _binary("mooncake_client"), f"-host={LOOPBACK}", f"-port={self.holder_port}",
            f"-global_segment_size={self.holder}", "-local_buffer_size=67108864",
            f"-master_server_address={self.master_address}", "-metadata_server=P2PHANDSHAKE",
            "-protocol=tcp", "-threads=2", "-logtostderr"])
        self._wait_port("holder", self.holder_port)

    def start(self) -> LocalMooncake:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)
        self.start_master()
        self.start_holder()
        return self

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        pid = self.pids.get(name)
        if pid and _alive(pid):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 10
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
        self.pids.pop(name, None)
        if self.dir.exists():
            self._save()

    def stop(self) -> None:
        for name in ("holder", "master"):
            self.kill(name, signal.SIGTERM)
            self.kill(name, signal.SIGKILL)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state_dir": str(self.dir)}
        out["master"] = {"address": self.master_address, "pid": self.pids.get("master"),
                         "running": _alive(self.pids.get("master")),
                         "listening": port_open(LOOPBACK, self.rpc_port)}
        if self.holder:
            out["holder"] = {"address": self.holder_address, "segment_bytes": self.holder,
                             "pid": self.pids.get("holder"),
                             "running": _alive(self.pids.get("holder")),
                             "listening": port_open(LOOPBACK, self.holder_port)}
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_layerwise_patch mooncake-local",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("start", "stop", "status"))
    ap.add_argument("--dir", default=str(DEFAULT_DIR), help="state directory (pids, logs)")
    ap.add_argument("--rpc-port", type=int, default=50051, help="master RPC port (loopback)")
    ap.add_argument("--metrics-port", type=int, default=None,
                    help="master metrics port (default: rpc port + 1, off Mooncake's 9003)")
    ap.add_argument("--lease-ttl-ms", type=int, default=10000, help="read-lease TTL")
    ap.add_argument("--holder", default="0", metavar="SIZE",
                    help="also start a segment holder of SIZE (e.g. 4GiB)")
    ap.add_argument("--holder-port", type=int, default=None,
                    help="holder port (default: rpc port + 2)")
    ns = ap.parse_args(argv)
    from .pool.config import parse_size

    holder = parse_size(ns.holder) if ns.holder not in ("0", "") else 0
    local = LocalMooncake(ns.dir, rpc_port=ns.rpc_port, metrics_port=ns.metrics_port,
                          lease_ttl_ms=ns.lease_ttl_ms, holder=holder,
                          holder_port=ns.holder_port)
    if ns.action == "start":
        local.holder = holder or local.holder
        local.start()
        print(json.dumps(local.status(), indent=1))
        print(f"master at {local.master_address}: set kv_connector_extra_config "
              f'"backend": "mooncake", "mooncake": {{"master_address": '
              f'"{local.master_address}"}}', file=sys.stderr)
    elif ns.action == "stop":
        local.stop()
        print(json.dumps(local.status(), indent=1))
    else:
        st = local.status()
        print(json.dumps(st, indent=1))
        return 0 if st["master"]["running"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
