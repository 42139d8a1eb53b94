"""The worker's saves: which pages of this rank each layer's save covers,
the commit markers of what a step saved completely (a block whose layers
were not all saved gets none, so lookups never see it), and the send
thread (:class:`.send_thread.SaveQueue`) that copies pages out while later layers
compute and writes them with their markers at the end of the step.
:class:`.forward.PoolWorker` holds one and decides, per step, which saves are
healthy (:mod:`.worker.quarantine`)."""

from __future__ import annotations

import json

import torch

from ..keys import ATTN, STATE, draft_marker_key, draft_page_key, layer_id, marker_key, page_key
from ..metadata import PoolMetadata, SaveSpec
from .device import device_ops
from .send_thread import SaveQueue
from ..side import PoolSide
from .pages import RankPages


class WorkerSaves:
    def __init__(self, side: PoolSide, pages: RankPages) -> None:
        self.backend = side.backend
        self.ns = side.ns
        self.layout = side.layout
        self.defer_last_save = side.config.defer_last_save
        self.event_log = side.faults.event_log  # tests: the send thread's events
        self.pages = pages
        self.saver: SaveQueue | None = None  # once the caches are registered
        self.saved_layers: set[str] = set()  # this step's
        self.events: list | None = None
        self._flushed = 0  # events already written to event_log

    def open(self, reserve: bool) -> None:
        """The send thread; ``reserve``: pre-fault the pack memory now, not in
        the first request."""
        self.events = [] if self.event_log else None
        self._flushed = 0
        self.saver = SaveQueue(self.backend, self.ns, events=self.events,
                               device=device_ops(self.pages.device))
        if reserve:
            self.saver.reserve()

    def set_namespace(self, ns: bytes) -> None:
        """Key pages, markers and value headers by ``ns`` from now on (between
        steps, with nothing queued: :meth:`begin_step` drained the queue)."""
        self.ns = ns
        if self.saver is not None:
            self.saver.ns = self.saver._arena.ns = ns

    def begin_step(self) -> None:
        # a deferred final-layer save of the previous step completes before
        # this step loads or saves anything (and before its forward may
        # overwrite pages that save still reads)
        self.saver.drain()
        if self.events is not None:
            self.events.append(("step-begin", self.saver._step))
        self.saved_layers = set()

    def pages_of(self, layer: str, specs: list[SaveSpec]) -> list[tuple[bytes, torch.Tensor]]:
        """(key, page) of every page of ``layer`` that ``specs`` save."""
        pages, ns, rank = self.pages, self.ns, self.pages.tp_rank
        g, kind = pages.group[layer], pages.kind[layer]
        idx, draft = layer_id(layer), layer in self.layout.drafter_layers
        out = []
        for spec in specs:
            if kind == STATE:
                out += [(page_key(ns, STATE, h, rank, idx), pages.page(layer, ids[g]))
                        for h, ids in spec.mamba if g in ids]
                continue
            for a in spec.attn:
                if g not in a.ids:
                    continue
                if draft and a.token is not None:
                    out.append((draft_page_key(ns, a.hash, rank, idx, a.token),
                                pages.page(layer, a.ids[g])))
                elif not draft and not a.draft_only:
                    out.append((page_key(ns, ATTN, a.hash, rank, idx),
                                pages.page(layer, a.ids[g])))
        return out

    def save_layer(self, layer: str, specs: list[SaveSpec]) -> None:
        """Layerwise: the send thread copies the pages once the compute
        stream wrote them."""
        self.saver.submit(self.pages_of(layer, specs), self.pages.device)
        self.saved_layers.add(layer)

    def markers(self, saves: list[SaveSpec]) -> tuple[list[bytes], int]:
        """Commit markers of what this step saved completely (every layer of
        the kind), and the number of blocks they commit."""
        done = lambda names: all(n in self.saved_layers for n in names)  # noqa: E731
        drafter = self.layout.drafter_layers
        target = [n for n in self.layout.layers(ATTN) if n not in drafter]
        attn = [a for s in saves for a in s.attn]
        state = [b for s in saves for b in s.mamba]
        rank, markers, blocks = self.pages.tp_rank, [], 0
        if attn and done(target):
            full = [a for a in attn if not a.draft_only]
            markers += [marker_key(self.ns, ATTN, a.hash, rank) for a in full]
            blocks += len(full)
        if attn and drafter and done(drafter):
            markers += [draft_marker_key(self.ns, a.hash, rank, a.token)
                        for a in attn if a.token is not None]
        if state and done(self.layout.layers(STATE)):
            markers += [marker_key(self.ns, STATE, h, rank) for h, _ in state]
            blocks += len(state)
        return markers, blocks

    def finish_step(self, meta: PoolMetadata, saves: list[SaveSpec],
                    tainted: list[SaveSpec], bulk: bool) -> None:
        """Write the step's healthy ``saves`` with their markers; no page of
        ``tainted`` is written.  ``bulk``: the pages were not saved layer by
        layer, they are submitted now."""
        order = self.pages.order
        exclude = {key for layer in order for key, _ in self.pages_of(layer, tainted)}
        if bulk:
            for layer in order:
                self.saver.submit(self.pages_of(layer, saves), self.pages.device)
            self.saved_layers = set(order)
        if meta.saves:
            # incomplete kinds get no marker: lookups never see them
            markers, blocks_saved = self.markers(saves)
            # final-layer drain: every queued page is written with its markers
            # (now, or - deferred - before the next step's loads and saves)
            step = self.saver._step
            self.saver.commit(markers, exclude=exclude, blocks=blocks_saved,
                              wait=not self.defer_last_save)
            if self.events is not None:  # the forward thread goes on from here
                n = len({a.hash for s in saves for a in s.attn}
                        | {h for s in saves for h, _ in s.mamba})
                self.events += [(f"blocks={n}", step), ("committed", step)]

    def flush_events(self) -> None:
        if self.events is None:
            return
        new = self.events[self._flushed:]  # (the send thread only appends)
        self._flushed += len(new)
        with open(self.event_log, "a") as f:
            f.writelines(json.dumps(e) + "\n" for e in new)

    def totals(self) -> dict[str, float]:
        """Running totals of the send thread (for the worker's stats)."""
        q = self.saver
        return {"bytes_saved": q.bytes_saved, "blocks_saved": q.blocks_saved,
                "save_seconds": q.seconds, "saves_skipped": q.skipped,
                "save_failures": q.failures, "save_write_seconds": q.write_seconds,
                "save_cpu_seconds": q.cpu_seconds}

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()
            self.flush_events()
