"""One warning per kind of event: the pool's faults are logged the first
time each kind happens (then counted in vLLM's KV Transfer metrics), so a
pool in trouble says so once instead of on every step.  An error the
backend has logged itself (``BackendError.announced``: a Mooncake master
down) is not logged again by whichever part it reached."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllm.layerwise_patch")


class LogOnce:
    def __init__(self) -> None:
        self.seen: set[str] = set()

    def warning(self, kind: str, msg: str, *args: Any) -> None:
        if any(isinstance(a, BaseException) and getattr(a, "announced", False) for a in args):
            return  # (said once already, where it happened)
        if kind not in self.seen:
            self.seen.add(kind)
            logger.warning(msg, *args)

    def forget(self, kind: str) -> None:
        """Log ``kind`` again next time (the condition ended)."""
        self.seen.discard(kind)
