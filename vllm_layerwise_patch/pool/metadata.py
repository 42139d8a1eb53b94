"""What the scheduler side tells the workers each step (the connector
metadata): the loads and saves it planned (the loads of this step's forward,
and the asynchronous loads of requests vLLM parks until their KV has
arrived), the namespace they are named in, and whether a failed load may be
reported to vLLM; and the names both sides give a load's pins."""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

try:  # worker -> scheduler metadata, vLLM 0.30 on
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM: adapters do not use the pool
    KVConnectorWorkerMetadata = object

from .keys import ATTN, STATE, group_key


@dataclasses.dataclass
class LoadSpec:
    req_id: str
    start: int  # first block to load (the block-aligned local hit)
    end: int  # blocks [start, end) are loaded; the state at end-1
    hashes: list[bytes]  # pool block hashes of [start, end)
    attn_blocks: dict[int, list[int]]  # attention group -> block ids of [start, end)
    mamba_blocks: dict[int, int]  # state group -> block id of column end-1
    running_blocks: dict[int, int]  # state group -> block id of this step's running column
    # the token after each block of [start, end): its drafter pages' key (MTP/EAGLE)
    next_tokens: list = dataclasses.field(default_factory=list)
    # (vLLM's adapter id, the digest the blocks are named by): the worker
    # checks it is the copy it computes with (identity.adapters)
    adapter: tuple[int, bytes] | None = None


@dataclasses.dataclass
class AttnSave:
    """One block's attention pages to store: target layers (unless
    ``draft_only``: they are in the pool already) and, when ``token`` is
    known, the drafter's pages keyed by it."""
    hash: bytes
    ids: dict[int, int]  # attention group -> block id
    token: int | str | None = None
    draft_only: bool = False


@dataclasses.dataclass
class SaveSpec:
    req_id: str
    attn: list[AttnSave]
    mamba: list[tuple[bytes, dict[int, int]]]  # (block hash, state group -> block id)
    # every block id the request holds (all groups, null block left out): what
    # its forward reads, so a worker can tell it read a page of a failed load
    reads: list[int] = dataclasses.field(default_factory=list)
    adapter: tuple[int, bytes] | None = None  # (as LoadSpec.adapter)


class PoolMetadata(KVConnectorMetadata):
    def __init__(self, loads: list[LoadSpec], saves: list[SaveSpec],
                 report_load_errors: bool = False,
                 async_loads: list[LoadSpec] | None = None,
                 failures_seen: list[str] | None = None,
                 namespace: bytes | None = None) -> None:
        self.loads = loads
        self.saves = saves
        # load_async: loads that run in the background, outside any forward;
        # the worker reports each request once all its layers are in place
        self.async_loads = async_loads or []
        # the scheduler can take block load errors for this layout: a failed
        # load is reported (the request recomputes) instead of raised
        self.report_load_errors = report_load_errors
        # requests whose failed loads the scheduler learnt of since the last
        # step: they are out of the running (recompute) or finished, and their
        # blocks left vLLM's prefix cache (see worker.quarantine.Quarantine)
        self.failures_seen = failures_seen or []
        # the namespace of this step's loads and saves: the scheduler's, which
        # changes when the weights do (scheduler.weight_changes); None: no
        # change (the pool is off, or the metadata was built elsewhere)
        self.namespace = namespace


class AdapterReport(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler after a step (vLLM's worker
    connector metadata): whether each takes the digest of the LoRA adapters
    it loads (``checked``) and, per adapter it holds, the digest of its copy
    (``held``; None: not known).  vLLM merges the ranks' reports
    (:meth:`aggregate`): checked only if every rank checks, a digest only
    where the ranks agree."""

    def __init__(self, checked: bool, held: dict[int, bytes | None]) -> None:
        self.checked, self.held = checked, held

    def aggregate(self, other: AdapterReport) -> AdapterReport:
        ids = set(self.held) | set(other.held)
        return AdapterReport(self.checked and other.checked,
                             {i: self.held.get(i) if self.held.get(i) == other.held.get(i)
                              else None for i in ids})


def owner_of(req_id: str) -> bytes:
    """Pin owner of a request's pending load."""
    return req_id.encode()


def load_groups(ns: bytes, hashes: list[bytes], tp_ranks: range | list[int],
                has_state: bool) -> list[bytes]:
    """Every group a load of ``hashes`` (state at the last one) reads."""
    out = [group_key(ns, ATTN, h, tp) for h in hashes for tp in tp_ranks]
    if has_state and hashes:
        out += [group_key(ns, STATE, hashes[-1], tp) for tp in tp_ranks]
    return out
