"""A request ends while its pool load is in flight, at the exact point where
vLLM lets it happen (engine spec ``interrupt_loading``, in-process engine
core only): the test harness drives vLLM's own scheduler code, in its own
order.

``"abort"``: the client aborts the loading requests while their step runs:
``EngineCore`` processes its aborts queue right before each
``Scheduler.update_from_output``, so they are finished (as
``FINISHED_ABORTED``, client side included) before the first output
processed after their step was scheduled - that step's own output with
synchronous scheduling, the step before's with asynchronous scheduling
(the next step is then planned without them, before their output).  ``"preempt"`` (asynchronous scheduling): the scheduling of the
next step preempts them, as it does when it runs out of KV blocks and the
newest running request is the victim: at the start of the next
``Scheduler.schedule`` they leave the running queue through
``Scheduler._preempt_request``, before that step's output is processed.
Both act once, on the first step that loads from the pool.
"""

from __future__ import annotations

import time
from typing import Any


def _loading(scheduler_output: Any) -> list[str]:
    meta = getattr(scheduler_output, "kv_connector_metadata", None)
    return [spec.req_id for spec in getattr(meta, "loads", None) or []]


def install(llm: Any, mode: str) -> dict[str, Any]:
    """Arm ``mode`` on ``llm``'s scheduler; returns what happened (the
    interrupted request ids), filled in as it happens."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    done: dict[str, Any] = {"mode": mode, "requests": []}
    armed: list[str] = []
    schedule, update = scheduler.schedule, scheduler.update_from_output

    def on_schedule(*args: Any, **kwargs: Any):
        if mode == "preempt" and armed and not done["requests"]:
            now = time.monotonic()
            for request in [r for r in scheduler.running if r.request_id in armed]:
                scheduler.running.remove(request)
                scheduler._preempt_request(request, now)
                done["requests"].append(request.request_id)
        out = schedule(*args, **kwargs)
        if not armed:
            armed.extend(_loading(out))
        return out

    def on_update(scheduler_output: Any, model_output: Any):
        # the first output processed after the loading step was scheduled:
        # its own (synchronous scheduling) or the step's before it
        # (asynchronous: step N+1 is planned after this one)
        if mode == "abort" and armed and not done["requests"]:
            loading = [r for r in armed if r in scheduler.requests]
            if loading:  # (as LLM.abort does: the client side forgets them too)
                llm.llm_engine.abort_request(loading, internal=True)
                done["requests"].extend(loading)
        return update(scheduler_output, model_output)

    scheduler.schedule = on_schedule
    scheduler.update_from_output = on_update
    return done
