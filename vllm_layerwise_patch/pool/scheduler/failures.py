"""What the scheduler side remembers of the steps whose outputs are still to
come: which block ids each step's loads fill, and the block tables of
requests that ended meanwhile - so that a failed load reported with a
step's output is always mapped to its request and to every block computed
from it, whether or not that request still runs.

vLLM plans step N+1 before it processes step N's output (asynchronous
scheduling, the GPU default: a batch queue of two; pipeline parallelism
keeps more steps in flight), and a request can end in between - aborted by
its client (``EngineCore`` processes aborts right before
``update_from_output``) or preempted by the scheduling of N+1, whose newest
request is the usual victim.  What a step issued is therefore kept until
the output of that step has certainly been processed: ``depth`` more
scheduling steps (the steps in flight at most, plus one).  Forgetting
earlier made the report of an ended request's failure map to nobody: its
zeroed blocks stayed in vLLM's prefix cache (the next request with that
prefix hit them) and the workers' quarantine never cleared (they stopped
saving).
"""

from __future__ import annotations

from typing import Any


def steps_in_flight(vllm_config: Any) -> int:
    """How many scheduled steps can await their output at once: vLLM's batch
    queue (2 with asynchronous scheduling) times pipeline stages."""
    sched = getattr(vllm_config, "scheduler_config", None)
    par = getattr(vllm_config, "parallel_config", None)
    pp = int(getattr(par, "pipeline_parallel_size", 1) or 1)
    return max(pp, 2 if getattr(sched, "async_scheduling", False) else 1)


class StepRecords:
    """The loads each step issued and the tables of requests that ended, each
    kept until the output that can report on them has been processed."""

    def __init__(self, depth: int, forget_ended_at_once: bool = False) -> None:
        self.depth = depth + 1  # (one more: a margin costs only memory)
        self.step = 0  # scheduling steps so far
        # req_id -> (step issued, block ids its synchronous load fills)
        self.issued: dict[str, tuple[int, set[int]]] = {}
        # req_id -> (step it ended, its block table: per group, per column)
        self.ended: dict[str, tuple[int, list[list[int]]]] = {}
        # the rule before the fix (tests): an ended request is forgotten at
        # the next scheduling step
        self._at_once = forget_ended_at_once

    def next_step(self) -> None:
        """A scheduling step begins: forget what no pending output can name."""
        self.step += 1
        horizon = self.step - self.depth
        for book in (self.issued, self.ended):
            for rid in [r for r, (s, _) in book.items() if s <= horizon]:
                del book[rid]
        if self._at_once:
            for rid in list(self.ended):
                self.issued.pop(rid, None)
            self.ended.clear()

    def load_issued(self, rid: str, block_ids: set[int]) -> None:
        self.issued[rid] = (self.step, set(block_ids) - {0})

    def still_loading(self, rid: str) -> None:
        """An asynchronous load in flight: its failure can come any step."""
        if rid in self.issued:
            self.issued[rid] = (self.step, self.issued[rid][1])

    def request_ended(self, rid: str, table: list[list[int]]) -> None:
        self.ended[rid] = (self.step, [list(ids) for ids in table])

    def failed_requests(self, invalid: set[int]) -> set[str]:
        """Requests whose issued loads fill any of ``invalid``."""
        return {rid for rid, (_, ids) in self.issued.items() if ids & invalid}

    def derived_blocks(self, invalid: set[int], live: dict[str, list[list[int]]]) -> set[int]:
        """Every block computed from the pages of a failed load: in each block
        table (running requests', ``live``, and ended ones') holding a bad
        block, that column and every later one of every group - the blocks
        computed after it - and so on for tables holding those (a request
        that read them after a hit in vLLM's prefix cache).  Earlier columns
        (a healthy prefix shared with others) stay.  Over-matching costs
        only cache hits."""
        tables = dict(live)
        tables.update({rid: table for rid, (_, table) in self.ended.items()})
        bad = set(invalid) - {0}
        changed = True
        while changed:
            changed = False
            for table in tables.values():
                cols = [c for ids in table for c, b in enumerate(ids) if b in bad]
                if not cols:
                    continue
                later = {b for ids in table for b in ids[min(cols):]} - {0}
                if not later <= bad:
                    bad |= later
                    changed = True
        return bad
