"""The weights' content digest started when vLLM starts loading the model
(the ``weights-digest-during-load`` patch calls :func:`begin` and, once the
load returned or raised, :meth:`Preload.loading_ended`).

vLLM builds the KV connector only after the weights are loaded (the worker's
``ensure_kv_transfer_initialized`` follows ``load_model``; the scheduler's
connector follows the executor), so a digest started by the connector adds
its whole time to the start-up.  Started here it reads the files while vLLM
reads them (the page cache serves the second reader); the connector's own
job (:func:`.weights.start`) queues behind it on the digest thread and finds
every digest in this process's memo, and a connector in another process
finds them in the digest cache or waits on the file's lock.

Only for a ``kv_transfer_config`` that selects the pool connector (alone or
inside a MultiConnector) with ``weights_identity: "content"``, only for the
model itself (not a draft model at another path) and not for
``load_format="dummy"``.  Nothing here delays or breaks loading: a failure
to start is logged once and loading goes on; a digest that fails is logged
once and the connector digests the weights itself, as without the patch.
One line per process says how much of the digest overlapped the load.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

from . import weights

logger = logging.getLogger("vllm.layerwise_patch")

POOL_CONNECTOR = "LayerwisePoolConnector"
_said: set[str] = set()  # what this process already logged (once each)


def _once(key: str) -> bool:
    if key in _said:
        return False
    _said.add(key)
    return True


def pool_extras(kv_transfer_config: Any) -> list[dict]:
    """The ``kv_connector_extra_config`` of every pool connector the config
    selects (itself, or the children of a MultiConnector)."""
    if kv_transfer_config is None:
        return []
    name = getattr(kv_transfer_config, "kv_connector", None)
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    if name == POOL_CONNECTOR:
        return [extra]
    if name == "MultiConnector":
        return [c.get("kv_connector_extra_config") or {} for c in extra.get("connectors") or []
                if isinstance(c, dict) and c.get("kv_connector") == POOL_CONNECTOR]
    return []


def wanted(vllm_config: Any, model_config: Any = None) -> bool:
    """Whether loading ``model_config`` (None: the model) for ``vllm_config``
    should start the pool's content digest."""
    from ..config import PoolConfig

    model = getattr(vllm_config, "model_config", None)
    if model is None or (model_config is not None and model_config is not model
                         and str(model_config.model) != str(model.model)):
        return False  # a draft model elsewhere: not in the pool's identity
    load = getattr(vllm_config, "load_config", None)
    if str(getattr(load, "load_format", None)) == "dummy":
        return False
    for extra in pool_extras(getattr(vllm_config, "kv_transfer_config", None)):
        try:
            if PoolConfig.from_extra(extra).weights_identity == "content":
                return True
        except Exception:  # noqa: BLE001 - the connector names the bad field
            continue
    return False


class Preload:
    """One digest started with a load."""

    def __init__(self, future: concurrent.futures.Future, entry: dict, load: dict) -> None:
        self.future, self.entry, self.load = future, entry, load

    def loading_ended(self) -> None:
        self.load["end"] = time.monotonic()
        self.future.add_done_callback(self._report)

    def _report(self, future: concurrent.futures.Future) -> None:
        exc = future.exception()
        if exc is not None:
            if _once("failed"):
                logger.warning("vllm-layerwise-patch pool: the weights digest started with "
                               "loading failed (%s: %s); the connector digests the weights "
                               "itself", type(exc).__name__, exc)
            return
        if _once("overlap"):
            logger.info("vllm-layerwise-patch pool: %s", overlap_summary(self.entry, self.load))


def overlap_summary(entry: dict, load: dict) -> str:
    """``weights digest: N GB in X s, Y s of it after loading ended`` and
    where it started, from a digest entry and a load entry of the trace."""
    took = entry["end"] - entry["start"]
    after = max(0.0, entry["end"] - load["end"])
    return (f"weights digest: {entry['bytes_read'] / 1e9:.3f} GB read in {took:.2f} s, "
            f"{after:.2f} s of it after loading ended (started {entry['start'] - load['start']:.2f}"
            f" s after loading began, which took {load['end'] - load['start']:.2f} s; "
            f"{entry['hashed']} files hashed, {entry['cached']} from the digest cache, "
            f"{entry['named']} named by their Hugging Face blob)")


def begin(vllm_config: Any, model_config: Any = None) -> Preload | None:
    """Start the digest if :func:`wanted` (None otherwise, or when starting
    failed: logged once).  Never raises."""
    try:
        if not wanted(vllm_config, model_config):
            return None
        load = weights.note({"event": "load", "start": time.monotonic(), "end": None})
        future, entry = weights.submit(vllm_config, "content", origin="load")
        return Preload(future, entry, load)
    except Exception as exc:  # noqa: BLE001 - loading goes on without it
        if _once("begin"):
            logger.warning("vllm-layerwise-patch pool: could not start the weights digest "
                           "with loading (%s: %s); the connector digests the weights itself",
                           type(exc).__name__, exc)
        return None

