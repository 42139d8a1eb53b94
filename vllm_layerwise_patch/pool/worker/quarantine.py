"""What a failed load keeps out of the pool, on one worker.

A load that fails leaves zeroed pages behind (vLLM takes the failure and the
request recomputes).  Until the scheduler has acted on it, anything computed
from those pages is wrong, and with vLLM's asynchronous scheduling (the GPU
default) the scheduler plans step N+1 - including its saves - before it
learns that a load of step N failed.  So the worker, which learns it at the
end of step N, keeps its own account, across steps:

* the requests whose load failed are *tainted*: none of their pages or
  markers is written, from the step of the failure on;
* the block ids those loads wrote are *poisoned*: a request holding any of
  them (another request that hit them in vLLM's prefix cache, in the same
  step or the next) read a wrong page, so it is tainted too - and so, in
  turn, are the blocks it holds;
* once the scheduler reports (``PoolMetadata.failures_seen``) every failed
  request this worker saw, vLLM has taken them and every request holding
  their blocks out of the running (recompute: preempted, restarted from
  token 0; or failed) and evicted those blocks from its prefix cache: the
  account is cleared, and the block ids, reused by new requests, are clean.

Over-matching only costs saves; a request is never tainted by a step that
started after the account was cleared.
"""

from __future__ import annotations

import logging
from typing import Any

from ..keys import ATTN, STATE
from ..metadata import AttnSave, LoadSpec, PoolMetadata, SaveSpec

logger = logging.getLogger("vllm.layerwise_patch")


def agree_on_failures(meta: PoolMetadata, failed: set[str], tp_size: int,
                      log: Any) -> set[str]:
    """Every TP rank computed the step with every rank's pages: a load that
    failed on one rank taints the request on all of them (one small
    all-reduce over the TP group's CPU group, only in steps that load)."""
    if tp_size <= 1 or not meta.loads:
        return failed
    try:
        import torch
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group

        flags = torch.tensor([s.req_id in failed for s in meta.loads], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
    except Exception as exc:  # noqa: BLE001 - then no save of a loading step
        log.warning("tp-failures", "vllm-layerwise-patch pool: the TP ranks could not "
                    "compare their failed loads (%s: %s); the saves of steps that load "
                    "are skipped", type(exc).__name__, exc)
        return failed | {s.req_id for s in meta.loads}
    return failed | {s.req_id for s, f in zip(meta.loads, flags.tolist()) if f}


class Quarantine:
    def __init__(self) -> None:
        self.requests: set[str] = set()
        self.blocks: set[int] = set()
        self._unseen: set[str] = set()  # failed here, not yet seen by the scheduler

    def __bool__(self) -> bool:
        return bool(self.requests or self.blocks)

    def failed(self, loads: list[LoadSpec], req_ids: set[str]) -> None:
        """Loads of ``req_ids`` failed in this step."""
        for spec in loads:
            if spec.req_id in req_ids:
                self.requests.add(spec.req_id)
                self._unseen.add(spec.req_id)
                for ids in spec.attn_blocks.values():
                    self.blocks.update(ids)
                self.blocks.update(spec.mamba_blocks.values())
                self.blocks.update(spec.running_blocks.values())
        self.blocks.discard(0)

    def seen(self, req_ids: list[str]) -> None:
        """The scheduler has acted on these failures; when it has on every
        one, nothing stays tainted."""
        self._unseen.difference_update(req_ids)
        if not self._unseen and self:
            logger.info("vllm-layerwise-patch pool: the scheduler has taken every failed "
                        "load; %d request(s) and %d block id(s) are no longer kept out "
                        "of the pool", len(self.requests), len(self.blocks))
            self.requests.clear()
            self.blocks.clear()

    def split(self, saves: list[SaveSpec]) -> tuple[list[SaveSpec], list[SaveSpec]]:
        """(healthy, tainted) saves of a step; a tainted request's blocks are
        poisoned from now on.  A healthy save of a block that a tainted one
        also saves loses that block: the pages share their keys, and a
        marker must never be written without every page it covers."""
        if not self:
            return saves, []
        changed = True
        while changed:  # until no newly tainted request's blocks taint another
            changed = False
            for spec in saves:
                if spec.req_id not in self.requests and self.blocks.intersection(spec.reads):
                    self.requests.add(spec.req_id)
                    changed = True
                if spec.req_id in self.requests and not self.blocks.issuperset(spec.reads):
                    self.blocks.update(spec.reads)
                    changed = True
        bad = [s for s in saves if s.req_id in self.requests]
        if not bad:
            return saves, []
        gone = {(ATTN, a.hash) for s in bad for a in s.attn}
        gone |= {(STATE, h) for s in bad for h, _ in s.mamba}
        healthy = []
        for s in saves:
            if s.req_id in self.requests:
                continue
            attn: list[AttnSave] = [a for a in s.attn if (ATTN, a.hash) not in gone]
            mamba = [(h, ids) for h, ids in s.mamba if (STATE, h) not in gone]
            if attn or mamba:
                healthy.append(SaveSpec(s.req_id, attn, mamba, s.reads))
        return healthy, bad
