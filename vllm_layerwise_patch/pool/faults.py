"""Fault injection and negative controls for the tests - outside the user's
configuration.

A user's ``kv_connector_extra_config`` cannot reach any of these: they come
from one environment variable, ``VLLM_LAYERWISE_PATCH_TEST_FAULTS`` (a JSON
object), that only the test drivers set (``testing.engines``,
``testing.server``: they move a spec's ``debug_*`` keys into it).  Each knob
makes an engine do something wrong on purpose, to show that a test catches
it.  When the variable is set, every process that reads it says so once in
its log, with the knobs in effect.  A malformed value is an error naming the
key; an unset variable costs nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from ..envvars import TEST_FAULTS_ENV as FAULTS_ENV

logger = logging.getLogger("vllm.layerwise_patch")


@dataclasses.dataclass(frozen=True)
class Faults:
    #: leave the state pages out of loads (a wrong state changes tokens)
    skip_mamba_load: bool = False
    #: this layer's first load fails (a failed load recomputes)
    fail_load_layer: str = ""
    #: zero failed loads without reporting them (a missed recompute changes tokens)
    hide_load_errors: bool = False
    #: every layer's load takes this long (loads in flight when the forward arrives)
    load_delay_ms: float = 0.0
    #: run a layer's deferred state copy before its load completes
    copy_before_wait: bool = False
    #: a step that loads nothing skips its bulk state pre-copy
    skip_bulk_precopy: bool = False
    #: this backend operation raises: "lookup", "load" or "save"
    backend_fault: str = ""
    #: every TP rank loads this rank's pages (ranks' pages differ)
    load_tp_rank: int = -1
    #: drafter pages ignore the token after their block
    draft_token_blind: bool = False
    #: append the send thread's events to this file, one JSON line each
    #: (``[what, step]``; ``blocks=N``: the step's saves hold N blocks)
    event_log: str = ""
    #: the rule before the async-scheduling fix: a failed load taints only the
    #: step of the failure (later steps of that request, and requests that
    #: read its blocks, save again)
    forget_failures: bool = False
    #: pin a hit's groups after verifying them (the order before the fix)
    pin_after_verify: bool = False
    #: the scheduler stops (SIGSTOP to itself) after verifying a hit, before
    #: pinning it, until this file exists (a test evicts meanwhile)
    pause_before_pin: str = ""
    #: this layer's deferred state copy is never launched (a missed copy)
    skip_copy_layer: str = ""
    #: the state-copy check runs only at the next step (the order before the fix)
    late_copy_check: bool = False
    #: a process that removes pool entries SIGKILLs itself right after the
    #: removal commits, before it settles the pool's generation
    kill_after_removal_commit: bool = False
    #: a removal moves the pool's generation only after its commit (the order
    #: before the fix)
    late_removal_bump: bool = False
    #: fault injection: the Mooncake backend's first this many block-object
    #: puts of a process report a transfer failure (-800) without writing
    mooncake_put_transfer_fails: int = 0
    #: an asynchronous load reported done leaves the scheduler's record of its
    #: pins as it was (the rule before the fix: a re-lookup within
    #: pin_seconds/2, after a preemption, skips the backend pin)
    async_pins_kept: bool = False
    #: a layer's load time counts from its submission, the wait for compute to
    #: reach the layer (the fence) included (the rule before the fix)
    load_seconds_with_fence: bool = False
    #: every TP rank's worker reports the figures per request (hit tokens,
    #: blocks saved, failed loads) and the scheduler does not count failed
    #: loads (the rule before the fix: vLLM sums them over the ranks)
    stats_every_rank: bool = False
    #: the directories above the pool are checked only before the missing ones
    #: are created, by name (the rule before the fix: not once created and
    #: resolved, not through the descriptor the pool is made in)
    parents_checked_first_only: bool = False
    #: Mooncake's client setup is attempted once the master's port accepts a
    #: connection, without a request answered first (the rule before the fix)
    mooncake_setup_unprobed: bool = False
    #: the hybrid-block-size guard holds only where alignment ran (the rule
    #: before the engine-core fix: the engine core's block size is reset)
    block_size_guard_alignment_only: bool = False
    #: saves cover only the blocks a step completes whose hash is known then
    #: (the planning before the fix: decode blocks are lost under async scheduling)
    save_step_blocks_only: bool = False
    #: a failed load's blocks leave vLLM's prefix cache only when a running
    #: request holds them (the rule before the fix)
    evict_running_holders_only: bool = False
    #: the scheduler forgets an ended request at its next step (the rule
    #: before the fix: a failure reported later maps to nobody)
    forget_ended_at_once: bool = False
    #: values are checked without their key digest (the rule before value
    #: format 4: a sound value of another key of the namespace passes)
    value_key_blind: bool = False
    #: the connector ignores weight changes and reset_cache (the rule before
    #: the fix: one namespace for the engine's life, whatever its weights)
    weights_change_blind: bool = False
    #: a worker runs loads and saves whatever adapter copy it holds (the rule
    #: before the fix: the scheduler's digest of the files names the blocks)
    adapter_digest_at_lookup: bool = False
    #: the tiered backend's lookups and reads skip the near tier (every hit
    #: is read from the far tier: master requests on near-tier hits)
    tiered_near_blind: bool = False
    #: a promotion into the near tier leaves a block's last page out and
    #: writes its commit marker all the same (a torn promoted copy)
    tiered_promote_torn: bool = False
    #: ``backend_fault`` hits only this tier of the tiered backend: "near" or "far"
    tiered_fault_tier: str = ""
    #: the scheduler hands every admitted block to the workers whatever
    #: ``save_budget_blocks`` says (a budget that is not enforced)
    save_budget_ignored: bool = False
    #: a sharded LMDB pool routes each key by the whole key, not by its block
    #: hash: a block's groups, and a group's pages and commit marker, spread
    #: over shards (and are evicted apart)
    shard_by_key: bool = False

    @property
    def active(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default]


_BACKEND_FAULTS = ("", "lookup", "load", "save")


def parse(text: str | None) -> Faults:
    """``Faults`` from the variable's value (unset or empty: none)."""
    if not text:
        return Faults()
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{FAULTS_ENV}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{FAULTS_ENV}: a JSON object is expected")
    fields = {f.name: f for f in dataclasses.fields(Faults)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key[len("debug_"):] if key.startswith("debug_") else key
        if name not in fields:
            raise ValueError(f"{FAULTS_ENV}.{key}: unknown fault (known: "
                             f"{', '.join(fields)})")
        want = type(fields[name].default)
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not want:
            raise ValueError(f"{FAULTS_ENV}.{key}: {want.__name__} expected, got {value!r}")
        values[name] = value
    faults = Faults(**values)
    if faults.backend_fault not in _BACKEND_FAULTS:
        raise ValueError(f"{FAULTS_ENV}.backend_fault: one of {_BACKEND_FAULTS[1:]}")
    if faults.tiered_fault_tier not in ("", "near", "far"):
        raise ValueError(f"{FAULTS_ENV}.tiered_fault_tier: 'near' or 'far'")
    return faults


_cached: tuple[str | None, Faults] | None = None


def faults() -> Faults:
    """This process's test faults (read once per value of the variable)."""
    global _cached
    text = os.environ.get(FAULTS_ENV)
    if _cached is None or _cached[0] != text:
        parsed = parse(text)
        if parsed.active:
            logger.warning("vllm-layerwise-patch pool: TEST FAULTS ACTIVE (%s=%s): this "
                           "engine may produce wrong tokens on purpose", FAULTS_ENV,
                           ",".join(parsed.active))
        _cached = (text, parsed)
    return _cached[1]


def split(pool: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """A test spec's pool config without its ``debug_*`` keys, and those keys
    (what the test drivers put in :data:`FAULTS_ENV`)."""
    if pool is None:
        return None, {}
    faults_ = {k: v for k, v in pool.items() if k.startswith("debug_")}
    return {k: v for k, v in pool.items() if not k.startswith("debug_")}, faults_


_paused: set[str] = set()


def pause_here(directory: str) -> None:
    """A test's deterministic race: the first time this point is reached,
    create ``directory/paused`` and wait (at most two minutes) until the test
    creates ``directory/resume`` - it acts on the pool meanwhile."""
    if not directory or directory in _paused:
        return
    import time

    _paused.add(directory)
    os.makedirs(directory, exist_ok=True)
    open(os.path.join(directory, "paused"), "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(directory, "resume")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{FAULTS_ENV}: nobody created {directory}/resume")
        time.sleep(0.02)
