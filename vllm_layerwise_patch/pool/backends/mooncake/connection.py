"""The Mooncake backend's connection to its master: setup, the segment this
process holds, and coming back after the master went away.  A mixin of
:class:`.mooncake.MooncakeBackend`.

While the master is down every operation fails at once (BackendUnavailable:
the pool serves no hits and saves nothing, logged once).  A background
thread tries to reach it again every ``reconnect_seconds`` - the setup, or
a probe of a client already set up - until one attempt succeeds or the
backend is closed: an attempt can take seconds (a connect time-out,
Mooncake's RPC time-outs, its setup blocking for about 90 s against a
master that accepts connections and never answers), and the callers are
the engine's scheduler and its workers' loads, which never wait for it.
An idle engine therefore comes back by itself: the first request after
the master returns is served from the pool.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from ..base import BackendError
from .staging import BackendUnavailable, describe, host_port, make_staging

logger = logging.getLogger("vllm.layerwise_patch")

PROBE_KEY = "\0vlp-probe"


class MooncakeConnection:
    REGIONS = 4
    cfg: Any
    log: Any

    def _init_connection(self) -> None:
        self._conn_lock = threading.Lock()  # held by the one connect attempt running
        self._store: Any = None
        self._staging: Any = None
        self._segment_wanted = False
        self._segment_mounted = False
        self._local_segment = ""  # this process's segment, where saves go first
        self._down_until = 0.0
        self._down = False
        self._watch_lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self.attempts = 0  # connect attempts after the first (tests)
        #: moves when the master goes away and when it answers again (what was
        #: known of the pool before may be gone: the hit cache starts afresh)
        self.epoch = 0

    def _connect(self) -> None:
        """Set the client up (master reachable) or raise BackendUnavailable."""
        from mooncake.store import MooncakeDistributedStore

        cfg = self.cfg
        host, port = host_port(cfg.master_address)
        try:
            socket.create_connection((host, port), timeout=2).close()
        except OSError as exc:
            raise BackendUnavailable(
                f"Mooncake master at {cfg.master_address} is unreachable ({exc})") from None
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
        if self._staging is None:
            self._staging = make_staging(store, cfg, self.REGIONS)
        self._store = store
        for memory in (self._memory, self._save_memory):
            for ptr, size in memory.wanted:
                self._register(ptr, size, memory)
        if self._segment_wanted:
            self._mount()

    def _mount(self) -> None:
        size = self.cfg.global_segment_size
        if size and not self._segment_mounted and not self.cfg.client_address:
            res = self._store.allocate_and_mount_segment(size, self.cfg.protocol)
            if res.get("ret", -1) != 0:
                raise BackendError(f"Mooncake could not mount a {size}-byte segment: {res}")
            self._segment_mounted = True
            if self.cfg.prefer_local_segment:
                self._local_segment = self._store.get_hostname()
            logger.info("vllm-layerwise-patch pool: this process holds %d bytes of the "
                        "Mooncake pool (global_segment_size); they leave with it", size)

    def mount_segment(self) -> None:
        """Contribute this process's segment (workers), now or on connect."""
        with self._conn_lock:
            self._segment_wanted = True
            if self._store is not None:
                self._mount()

    def _mark_down(self, why: str) -> None:
        if not self._down:
            self.epoch += 1
        self._down = True
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

    def _ready(self) -> Any:
        """The store, or BackendUnavailable at once while the master is (or
        was recently) down."""
        if not self._down and self._store is not None:
            return self._store
        self._watch()  # (normally running already)
        raise BackendUnavailable(f"Mooncake master at {self.cfg.master_address} "
                                 "is unreachable")

    def _reconnect_until_up(self) -> None:
        """Attempts every ``reconnect_seconds`` while the master is down and
        the backend open (a background thread)."""
        while self._down and not self.closed:
            wait = self._down_until - time.monotonic()
            if wait > 0:
                time.sleep(min(wait, 1.0))
                continue
            with self._conn_lock:
                if self.closed:
                    return
                self.attempts += 1
                self._attempt()

    def _attempt(self) -> None:
        """One attempt to reach the master again (``_conn_lock`` held)."""
        try:
            if self._store is None:
                self._connect()
            elif self._store.batch_is_exist([PROBE_KEY])[0] < 0:
                raise BackendUnavailable(f"Mooncake master at {self.cfg.master_address} "
                                         "still unreachable")
        except Exception:  # noqa: BLE001 - down it stays; tried again later
            self._down_until = time.monotonic() + self.cfg.reconnect_seconds
        else:
            if self._down:
                self.epoch += 1
                self._down = False
                self.log.forget("down")
                logger.warning("vllm-layerwise-patch pool: Mooncake master at %s answers "
                               "again; the pool is back", self.cfg.master_address)
