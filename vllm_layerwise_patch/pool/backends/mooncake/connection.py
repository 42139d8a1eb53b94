"""The Mooncake backend's connection to its master (:class:`MooncakeConnection`,
built first; every other piece of :class:`.mooncake.MooncakeBackend` is
given it): setup, the registered staging buffer, the segment this process
holds, the host memory registered with the store, the check of every
answer for an unreachable master, and coming back after the master went
away.

While the master is down every operation fails at once (BackendUnavailable:
the pool serves no hits and saves nothing, logged once).  A background
thread tries to reach it again every ``reconnect_seconds`` - the setup, or
a probe of a client already set up - until one attempt succeeds or the
backend is closed: an attempt can take seconds (a connect time-out,
Mooncake's RPC time-outs), and the callers are the engine's scheduler and
its workers' loads, which never wait for it.  An idle engine therefore
comes back by itself: the first request after the master returns is
served from the pool.

Mooncake's client setup cannot be bounded from Python: it holds the
interpreter's lock while it waits, and against a master that accepts
connections and never answers it retries for about ten minutes (20 tries
of 30 s, measured on 0.3.13) - every thread of the process stops meanwhile,
the engine's start-up with them.  So setup is attempted only once the
master has answered a request (:func:`master_answers`: an RPC header naming
no function, which a master answers at once with an error) within
``connect_timeout_seconds``; a master that does not is unreachable (the
engine starts without the pool, one log line; ``on_backend_unavailable=
'fail'``: it does not start) and is asked again every ``reconnect_seconds``.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterable
from typing import Any

from ...faults import faults
from ..base import BackendError
from .staging import (MISSING, UNREACHABLE, BackendUnavailable, Registered, describe,
                      host_port, make_staging)

logger = logging.getLogger("vllm.layerwise_patch")

PROBE_KEY = "\0vlp-probe"
#: a coro_rpc request header (magic 21, version 0, struct_pack, request,
#: sequence 1) calling function id 0, which no master registers
RPC_PROBE = struct.pack("<BBBBIIII", 21, 0, 0, 0, 1, 0, 0, 0)


def master_answers(host: str, port: int, timeout: float) -> str | None:
    """None when the master at ``host:port`` answers a request within
    ``timeout`` seconds, else why not (the rest of a sentence)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(RPC_PROBE)
            if sock.recv(1):
                return None
            return "closed the connection without answering a request"
    except socket.timeout:
        return (f"accepts connections but did not answer a request within {timeout:g} s "
                "(connect_timeout_seconds)")
    except OSError as exc:
        return f"is unreachable ({exc})"


class MooncakeConnection:
    """The client of one master, with what hangs on it: ``store`` (None
    until set up), ``staging``, the segment, ``memory`` (the KV cache
    registered for zero-copy loads) and ``save_memory`` (pack memory saves
    are put from), ``down`` / ``epoch`` / ``attempts``."""

    REGIONS = 4

    def __init__(self, cfg: Any, log: Any) -> None:
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", cfg.local_hostname)
        if cfg.protocol == "tcp":
            os.environ.setdefault("MC_FORCE_TCP", "1")
        self.cfg = cfg
        self.log = log
        self.memory = Registered()  # host memory for zero-copy loads
        self.save_memory = Registered()  # pack memory saves put from directly
        self._offered: list[tuple[int, int]] = []  # pack memory not registered yet
        self._offered_lock = threading.Lock()
        self.lock = threading.Lock()  # held by the one connect attempt running
        self.store: Any = None
        self.staging: Any = None
        self._segment_wanted = False
        self.segment_mounted = False
        self.local_segment = ""  # this process's segment, where saves go first
        self._down_until = 0.0
        self.down = False
        self._watch_lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self.closed = False
        self.attempts = 0  # connect attempts after the first (tests)
        #: moves when the master goes away and when it answers again (what was
        #: known of the pool before may be gone: the hit cache starts afresh)
        self.epoch = 0

    def connect(self) -> None:
        """Set the client up (master reachable) or raise BackendUnavailable."""
        from mooncake.store import MooncakeDistributedStore

        cfg = self.cfg
        why = self.why_not_answering()
        if why is not None:  # (never a setup that would stop this process for minutes)
            raise BackendUnavailable(f"Mooncake master at {cfg.master_address} {why}")
        store = MooncakeDistributedStore()
        if cfg.client_address:  # same-node shared memory through a mooncake_client
            rc = store.setup_dummy(cfg.local_buffer_size, cfg.local_buffer_size,
                                   cfg.client_address)
        else:
            rc = store.setup(cfg.local_hostname, cfg.metadata_server, 0,
                             cfg.local_buffer_size, cfg.protocol, cfg.rdma_devices,
                             cfg.master_address)
        if rc != 0:
            raise BackendUnavailable(
                f"Mooncake setup against master {cfg.master_address}"
                + (f" via client {cfg.client_address}" if cfg.client_address else "")
                + f" returned {describe(rc)}")
        if self.staging is None:
            self.staging = make_staging(store, cfg, self.REGIONS)
        self.store = store
        for memory in (self.memory, self.save_memory):
            for ptr, size in memory.wanted:
                self._register(ptr, size, memory)
        if self._segment_wanted:
            self._mount()

    def why_not_answering(self) -> str | None:
        """None when the master answers a request in time, else why not."""
        host, port = host_port(self.cfg.master_address)
        if faults().mooncake_setup_unprobed:  # the rule before the fix (tests)
            try:
                socket.create_connection((host, port), timeout=2).close()
            except OSError as exc:
                return f"is unreachable ({exc})"
            return None
        return master_answers(host, port, self.cfg.connect_timeout_seconds)

    def _mount(self) -> None:
        size = self.cfg.global_segment_size
        if size and not self.segment_mounted and not self.cfg.client_address:
            res = self.store.allocate_and_mount_segment(size, self.cfg.protocol)
            if res.get("ret", -1) != 0:
                raise BackendError(f"Mooncake could not mount a {size}-byte segment: {res}")
            self.segment_mounted = True
            if self.cfg.prefer_local_segment:
                self.local_segment = self.store.get_hostname()
            logger.info("vllm-layerwise-patch pool: this process holds %d bytes of the "
                        "Mooncake pool (global_segment_size); they leave with it", size)

    def mount_segment(self) -> None:
        """Contribute this process's segment (workers), now or on connect."""
        with self.lock:
            self._segment_wanted = True
            if self.store is not None:
                self._mount()

    # -- answers -----------------------------------------------------------------
    def ready(self) -> Any:
        """The store, or BackendUnavailable at once while the master is (or
        was recently) down."""
        if not self.down and self.store is not None:
            return self.store
        self._watch()  # (normally running already)
        raise BackendUnavailable(f"Mooncake master at {self.cfg.master_address} "
                                 "is unreachable")

    def check(self, codes: Iterable[int], op: str) -> None:
        """Master unreachable anywhere in a batch: mark down and raise."""
        if any(c == UNREACHABLE for c in codes):
            self.mark_down(f"Mooncake {op}: master at {self.cfg.master_address} "
                           f"unreachable ({describe(UNREACHABLE)})")
            raise BackendUnavailable(f"Mooncake master at {self.cfg.master_address} is "
                                     "unreachable")

    def failed(self, code: int, key: bytes) -> None:
        """A get of ``key`` answered ``code``: logged once per code."""
        if code != MISSING:  # (a missing value is the common, expected case)
            self.log.warning(f"code{code}", "vllm-layerwise-patch pool: Mooncake get of %r: "
                             "%s (further %d codes are not logged)", key, describe(code), code)

    # -- registered memory ---------------------------------------------------------
    def _register(self, ptr: int, size: int, memory: Registered) -> None:
        rc = self.store.register_buffer(ptr, size)
        if rc == 0:
            memory.add(ptr, size)
        else:
            what = "pack memory" if memory is self.save_memory else "KV cache"
            self.log.warning(f"register-{what}", "vllm-layerwise-patch pool: Mooncake "
                             "register_buffer of the %s returned %s; it goes through the "
                             "staging buffer", what, describe(rc))

    def register_memory(self, ptr: int, size: int, saves: bool) -> None:
        """The KV cache: registered now if connected, and on every connect.
        Pack memory (``saves``) is only taken note of: the packing thread
        never waits for a connect attempt (:meth:`register_offered`)."""
        if saves:  # (offered by whoever packs - the forward thread on CPU: never waits)
            with self._offered_lock:
                self._offered.append((ptr, size))
            return
        with self.lock:  # (a connect in the background registers what is wanted)
            self._want(ptr, size, self.memory)

    def _want(self, ptr: int, size: int, memory: Registered) -> None:
        """Register now if connected, and on every connect (``lock`` held)."""
        memory.wanted.append((ptr, size))
        if self.store is not None:
            self._register(ptr, size, memory)

    def register_offered(self) -> None:
        """Register the pack memory offered since the last put (the send
        thread, before a put): not while a connect attempt holds the
        connection - that put goes through the staging buffer."""
        if not self._offered or not self.lock.acquire(blocking=False):
            return
        try:
            with self._offered_lock:
                offered, self._offered = self._offered, []
            for ptr, size in offered:
                self._want(ptr, size, self.save_memory)
        finally:
            self.lock.release()

    # -- down and back -------------------------------------------------------------
    def mark_down(self, why: str) -> None:
        if not self.down:
            self.epoch += 1
        self.down = True
        self._down_until = time.monotonic() + self.cfg.reconnect_seconds
        self.log.warning("down", "vllm-layerwise-patch pool: %s; the pool serves no hits and "
                         "saves nothing until it answers (retrying every %.0f s)", why,
                         self.cfg.reconnect_seconds)
        self._watch()

    def _watch(self) -> None:
        """Start the thread that reconnects, unless it runs already."""
        with self._watch_lock:
            if self._watcher is None or not self._watcher.is_alive():
                self._watcher = threading.Thread(target=self._reconnect_until_up,
                                                 name="vlp-mooncake-reconnect", daemon=True)
                self._watcher.start()

    def _reconnect_until_up(self) -> None:
        """Attempts every ``reconnect_seconds`` while the master is down and
        the connection open (a background thread)."""
        while self.down and not self.closed:
            wait = self._down_until - time.monotonic()
            if wait > 0:
                time.sleep(min(wait, 1.0))
                continue
            with self.lock:
                if self.closed:
                    return
                self.attempts += 1
                self._attempt()

    def _attempt(self) -> None:
        """One attempt to reach the master again (``lock`` held)."""
        try:
            if self.store is None:
                self.connect()
            elif (self.why_not_answering() is not None  # (as for the setup, see the module)
                  or self.store.batch_is_exist([PROBE_KEY])[0] < 0):
                raise BackendUnavailable(f"Mooncake master at {self.cfg.master_address} "
                                         "still unreachable")
        except Exception:  # noqa: BLE001 - down it stays; tried again later
            self._down_until = time.monotonic() + self.cfg.reconnect_seconds
        else:
            if self.down:
                self.epoch += 1
                self.down = False
                self.log.forget("down")
                logger.warning("vllm-layerwise-patch pool: Mooncake master at %s answers "
                               "again; the pool is back", self.cfg.master_address)

    def close(self) -> None:
        """Stop reconnecting and close the client."""
        self.closed = True
        if self.store is not None:
            try:
                self.store.close()
            except Exception:  # noqa: BLE001
                pass
