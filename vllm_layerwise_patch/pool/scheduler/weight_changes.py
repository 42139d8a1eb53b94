"""The weights the scheduler's namespace names, and their changes while the
engine runs (engine-core process).

vLLM changes a running engine's weights through ``collective_rpc``, which
passes through the engine core: ``reload_weights`` (from files, or from
tensors given as ``weights_iterator``) and the weight-transfer session of its
RL API (``start_weight_update`` / ``start_draft_weight_update``,
``update_weights``, ``finish_weight_update``: ``LLM``, ``AsyncLLM``, the
``/update_weights`` routes).  The ``weight-update-namespace`` patch tells the
connector before and after each such call (``on_weights_change``); vLLM
itself calls the connector's ``reset_cache`` from
``reset_prefix_cache(reset_connector=True)``, which ``pause_generation(
clear_cache=True)`` and ``sleep`` also run.

The rule: no page is ever looked up or saved under a namespace that does not
name the weights it is computed with.

* Before a change the pool goes off (no lookup, no save) and every request
  the scheduler knows is retired: it never loads or saves again (its pages
  may mix the old and the new weights).  Requests that arrive later are
  computed with the new weights only.
* After ``reload_weights`` from files that succeeded, the namespace is
  derived again from those files (``weights_path``, else the files last
  loaded) by the configured ``weights_identity`` rule, on the digest thread
  (started when the reload starts: the digest reads the files while vLLM
  does); the pool stays off until it is done, then new requests use the new
  namespace (the workers take it from the step's metadata).  Not with a
  drafter (MTP/EAGLE): ``reload_weights`` reloads the target model only, so
  no files name the drafter's pages.
* After weights from tensors (``weights_iterator``, a weight-transfer
  session), a drafter's update, a call that failed, or ``reset_cache``, the
  pool stays off until a reload from files or a restart (logged).  The
  tensors' content is not known here, and ``set_weight_version``'s label
  names nothing: two training runs that both call their weights "step-100"
  would share pages under it.  (A digest of the loaded tensors could name
  them; not done.)
* ``reset_cache`` is the only signal vLLM gives of a change made another
  way (a custom ``collective_rpc`` method, the model changed in place), so
  it counts as weights from tensors.  A ``sleep``/``wake_up`` cycle stops the
  pool too (its reset cannot tell): ``reload_weights()`` afterwards reads the
  files again and resumes it.
* Weights the namespace cannot see at start (:func:`.identity.weights.unresolved`)
  keep the pool off unless ``namespace_salt`` names them.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

from ..identity import weights
from ..identity.namespace import namespace_of

logger = logging.getLogger("vllm.layerwise_patch")

_RELOAD_PARAMS = ("weights_iterator", "weights_path", "is_checkpoint_format")


def reload_params(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``reload_weights``' parameters, given by position or by name."""
    out = dict(zip(_RELOAD_PARAMS, args))
    out.update(kwargs)
    return out


class WeightChanges:
    """The namespace that names the loaded weights (``ns``; None: the pool
    is off, ``why_off`` says why); ``version`` counts its changes, and
    :meth:`follow` hands each to ``apply(ns, description)`` (the connector).
    ``blind``: the rule before the fix (tests): changes are not seen."""

    def __init__(self, description: dict[str, Any], vllm_config: Any, config: Any, *,
                 drafter: bool, apply: Callable[[bytes | None, dict], None],
                 blind: bool = False) -> None:
        self.description, self.vllm_config = description, vllm_config
        self.rule, self.salt = config.weights_identity, config.namespace_salt
        self.drafter, self._apply, self.blind = drafter, apply, blind
        self.version = self._applied = 0
        self._deriving: tuple[concurrent.futures.Future, str] | None = None
        self.ns: bytes | None = None
        self.why_off: str | None = None
        self._said: set[tuple[str, str]] = set()
        self._changing = False  # between "before" and "after": nothing is adopted
        self._adopt(description)
        self.follow()

    def follow(self) -> None:
        """Adopt a finished derivation; hand a change to ``apply``."""
        self.poll()
        if self.version != self._applied:
            self._applied = self.version
            self._apply(self.ns, self.description)

    def on_change(self, phase: str, method: str, args: Any, kwargs: Any, ok: bool) -> None:
        """What the patch reports (the connector's ``on_weights_change``)."""
        if self.blind:
            return
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        if phase == "before":
            self.before(method, args, kwargs)
        else:
            self.after(method, args, kwargs, ok)
        self.follow()

    def _adopt(self, description: dict[str, Any]) -> None:
        w = description["weights"]
        if w.get("resolved") or self.salt:
            self.description, self.ns, self.why_off = description, namespace_of(description), None
        else:
            self._off(f"the pool cannot name these weights ({w.get('why')}); set "
                      "namespace_salt to a name that changes whenever they change, or "
                      "serve weights files")

    def _off(self, why: str) -> None:
        self.ns, self.why_off = None, why
        self.version += 1

    # -- what changes them --------------------------------------------------------
    def _from_files(self, method: str, params: dict[str, Any]) -> str | None:
        """Where ``method`` reloads the weights from, when that is files that
        name every page (not tensors; no drafter, which keeps its own)."""
        if method != "reload_weights" or params.get("weights_iterator") is not None \
                or self.drafter:
            return None
        return str(params.get("weights_path") or self.description["model"])

    def before(self, method: str, args: tuple, kwargs: dict[str, Any]) -> None:
        """``method`` is about to change the weights.  A reload from files:
        their digest starts now, while vLLM reads them (as at start-up)."""
        self._deriving, self._changing = None, True
        self._off(f"{method} is changing the weights")
        path = self._from_files(method, reload_params(args, kwargs))
        if path is not None:
            future, _ = weights.submit(self.vllm_config, self.rule, origin="reload", model=path)
            self._deriving = (future, path)

    def after(self, method: str, args: tuple, kwargs: dict[str, Any], ok: bool) -> None:
        """``method`` returned (``ok``) or raised."""
        self._changing = False
        params = reload_params(args, kwargs) if method == "reload_weights" else {}
        path = self._from_files(method, params)
        if ok and path is not None and self._deriving is not None:
            self.why_off = f"deriving the namespace of the weights reloaded from {path}"
            logger.info("vllm-layerwise-patch pool: weights reloaded from the files at %s: "
                        "the namespace is derived again (the pool is off until then)", path)
            return
        self._deriving = None
        why = ("failed: the weights are unknown" if not ok else
               "reloaded the target model only: the drafter keeps its own weights"
               if method == "reload_weights" and self.drafter and
               params.get("weights_iterator") is None
               else "changed the weights from tensors: their content is not known here")
        self._off(f"{method} {why}")
        if (method, why) not in self._said:  # (an RL loop updates every few minutes)
            self._said.add((method, why))
            logger.warning("vllm-layerwise-patch pool: %s; the pool is not used by this "
                           "engine until it reloads weights from files (reload_weights) or "
                           "restarts (said once)", self.why_off)

    def reset(self) -> bool | None:
        """vLLM's ``reset_cache``: the weights may have changed unseen."""
        if self.blind:
            return None  # (the base connector's answer: nothing reset)
        if self.ns is not None or self._deriving is not None:
            self._reset()
            self.follow()
        return True

    def _reset(self) -> None:
        self._deriving, self._changing = None, False
        self._off("reset_cache (vLLM's reset_prefix_cache(reset_connector=True), run "
                  "around weight updates, by pause_generation and sleep): the weights may "
                  "have changed in a way the pool cannot see")
        logger.warning("vllm-layerwise-patch pool: %s; the pool is not used by this engine "
                       "until it reloads weights from files (reload_weights) or restarts",
                       self.why_off)

    def poll(self) -> None:
        """Adopt a finished derivation (cheap when none is running) - not
        while the weights are being changed: the files may be digested
        before vLLM has loaded them."""
        if self._changing or self._deriving is None or not self._deriving[0].done():
            return
        (future, path), self._deriving = self._deriving, None
        try:
            identity = future.result()
        except Exception as exc:  # noqa: BLE001 - the pool stays off
            self._off(f"the weights reloaded from {path} could not be digested ({exc})")
            logger.warning("vllm-layerwise-patch pool: %s; the pool is not used",
                           self.why_off)
            return
        description = dict(self.description, model=path, revision=None, weights=identity)
        self.version += 1
        self._adopt(description)
        if self.ns is not None:
            logger.info("vllm-layerwise-patch pool: namespace %s for the weights reloaded "
                        "from %s; requests from before the change never use the pool",
                        self.ns.hex(), path)
        else:
            logger.warning("vllm-layerwise-patch pool: %s", self.why_off)
