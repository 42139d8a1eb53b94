"""Which of a step's planned saves reach the workers (scheduler side):
the admission rule (``admission``) and the per-step save budget
(``save_budget_blocks``).

``all`` admits every block the planner (:mod:`.saves`) would save - the
behaviour before these fields.  ``reused`` admits a block only when its
prefix has been *seen* by at least two requests: a request sees each of its
pool blocks once - its prompt's blocks when it is looked up, blocks that
its decode completes when a step first knows their hash.  The counts live
in this (the scheduler's) process, for the ``admission_window`` most
recently seen block hashes (least recently seen forgotten first); a
forgotten block counts from zero again.  What the rule skips is a later
miss, never a wrong token: the lookup walks a request's blocks and stops at
the first one whose pages or boundary state the pool lacks (:mod:`.lookup`),
so a block stored without its predecessors is never part of a hit.

The budget bounds the blocks (distinct block hashes: a block's attention
pages and its boundary state count once) one step hands to the workers.
Requests are taken in the step's order.  On a hybrid layout a request's
save of the step is kept whole or not at all: a hit needs the boundary
state at its last block, and the step saves only the state at the end of
what it computed, so a cut save stores pages no lookup can use.  On an
attention-only layout a request's save is cut to the prefix that fits.
Blocks over the budget are skipped, not deferred: vLLM's align mode keeps a
block's boundary state only for a step or two (:mod:`.saves`), and a
request's pages may be freed once it ends.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..metadata import SaveSpec

logger = logging.getLogger("vllm.layerwise_patch")


class Admission:
    def __init__(self, layout: Any, policy: str = "all", window: int = 64_000) -> None:
        self.layout = layout  # (.layout.PoolLayout: a request's pool blocks)
        self.policy = policy
        self.window = max(1, int(window))
        self.counts: OrderedDict[bytes, int] = OrderedDict()  # hash -> requests seen
        self._seen_to: dict[str, int] = {}  # req_id -> its blocks [0, n) counted
        self._warned = False

    @property
    def counting(self) -> bool:
        return self.policy == "reused"

    def see(self, request: Any) -> None:
        """Count the pool blocks of ``request`` (a vLLM request: its prefix
        hashes so far) that it had not shown before, once each."""
        if not self.counting:
            return
        req_id, L = request.request_id, self.layout
        done = self._seen_to.get(req_id, 0)
        try:
            n = L.num_blocks(request.block_hashes)
            hashes = L.block_hashes(request.block_hashes, done, n)
        except Exception as exc:  # noqa: BLE001 - uncounted: at most a save not made
            if not self._warned:
                self._warned = True
                logger.warning("vllm-layerwise-patch pool: admission cannot count request "
                               "%s's blocks (%s: %s); they are not counted (further errors "
                               "are not logged)", req_id, type(exc).__name__, exc)
            return
        for h in hashes:
            self.counts[h] = self.counts.get(h, 0) + 1
            self.counts.move_to_end(h)
        self._seen_to[req_id] = max(done, n)
        while len(self.counts) > self.window:
            self.counts.popitem(last=False)

    def forget(self, req_id: str) -> None:
        self._seen_to.pop(req_id, None)

    def admitted(self, h: bytes) -> bool:
        return not self.counting or self.counts.get(h, 0) >= 2

    def filter(self, saves: list[SaveSpec]) -> tuple[list[SaveSpec], int]:
        """``saves`` less the blocks the rule does not admit (a block's
        pages and state alike); and how many blocks that left out."""
        if not self.counting:
            return saves, 0
        out, dropped = [], 0
        for s in saves:
            keep = {h for h in _hashes(s) if self.admitted(h)}
            dropped += len(_hashes(s)) - len(keep)
            s = _only(s, keep.__contains__)
            if s is not None:
                out.append(s)
        return out, dropped


def within_budget(saves: list[SaveSpec], budget: int, has_state: bool
                  ) -> tuple[list[SaveSpec], int]:
    """At most ``budget`` blocks of ``saves`` (``0``: no limit), taken in
    order (see the module's docstring); and how many blocks were left out."""
    if budget <= 0:
        return saves, 0
    out, left, dropped = [], budget, 0
    for s in saves:
        blocks = _hashes(s)
        if len(blocks) <= left:
            out.append(s)
            left -= len(blocks)
            continue
        if has_state or left == 0:
            dropped += len(blocks)
            continue
        order = list(dict.fromkeys([a.hash for a in s.attn] + [h for h, _ in s.mamba]))
        keep = set(order[:left])
        out.append(_only(s, keep.__contains__))
        dropped += len(blocks) - left
        left = 0
    return out, dropped


def _hashes(s: SaveSpec) -> set[bytes]:
    return {a.hash for a in s.attn} | {h for h, _ in s.mamba}


def _only(s: SaveSpec, keep: Callable[[bytes], bool]) -> SaveSpec | None:
    attn = [a for a in s.attn if keep(a.hash)]
    mamba = [(h, ids) for h, ids in s.mamba if keep(h)]
    if not attn and not mamba:
        return None
    return SaveSpec(s.req_id, attn, mamba, s.reads, s.adapter)


def policy_of(config: Any, layout: Any) -> Admission:
    return Admission(layout, getattr(config, "admission", "all"),
                     getattr(config, "admission_window", 64_000))
