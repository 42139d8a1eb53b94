"""The registry: the patches known to this process and what happened to each.

:class:`Registry` ties the other modules together.  It holds one
:class:`PatchStatus` per declared patch (selected or not, its
:class:`State`, the reason, the release it verified on, the self-check),
and :meth:`Registry.apply` runs resolution (:mod:`.resolution`) on the live
vLLM and, when the decision says so, installation (:mod:`.installation`).
Apply is idempotent (a patch applies once, also across registry instances:
our own objects in place count as applied), never raises (one failing patch
never stops the others), and :meth:`Registry.revert` undoes it.  Listeners
hear of every status change (activation writes the per-process report).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from ..envvars import FORCE_ENV, parse_selection
from .declaration import Environment, Patch
from .fingerprints import live_fingerprints
from .installation import Installer, installed_by, own_attribute, patch_marker
from .resolution import Decision, Verdict, detect_environment, resolve_declared, resolve_source

logger = logging.getLogger("vllm.layerwise_patch")


class State(str, enum.Enum):
    DISABLED = "disabled"  # not selected by VLLM_LAYERWISE_PATCH
    PENDING = "pending"  # selected; target module not imported yet
    APPLIED = "applied"
    CARRIED = "carried"  # a platform plugin already implements it (vllm-ascend)
    NOT_NEEDED = "not-needed"  # upstream already behaves correctly here
    OPT_IN = "opt-in"  # selected by "all" but off by default on this platform
    SKIPPED = "skipped"  # fail closed: unverified source, wrong platform, ...
    FAILED = "failed"  # installing raised


@dataclasses.dataclass
class PatchStatus:
    """What happened to one patch in this process."""

    id: str
    enabled: bool
    state: State = State.PENDING
    reason: str = ""
    verified_release: str | None = None
    forced: bool = False
    fingerprints: dict[str, str | None] = dataclasses.field(default_factory=dict)
    self_check: str | None = None  # "ok" / "failed" / None (not run)
    self_check_detail: str = ""

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["state"] = self.state.value
        return d


def _outcome(patch: Patch, env: Environment, decision: Decision) -> tuple[State, str]:
    """The status a decision that installs nothing leaves, and its reason."""
    v = decision.verdict
    if v is Verdict.OPT_IN:
        return State.OPT_IN, decision.detail
    if v is Verdict.NOT_NEEDED:
        return State.NOT_NEEDED, decision.detail
    if v is Verdict.CARRIED:
        return State.CARRIED, decision.detail
    if v is Verdict.NOT_APPLICABLE:
        if decision.detail.startswith("bypassed by "):  # a platform plugin's rule
            return State.SKIPPED, decision.detail
        return State.SKIPPED, f"not applicable on {env.release}: {decision.detail}"
    if v is Verdict.DRIFT:
        return State.SKIPPED, (f"unverified source ({decision.detail}); set "
                               f"{FORCE_ENV}={patch.id} to apply anyway")
    return State.SKIPPED, decision.detail  # platform, absent


class Registry:
    """The patches known to this process and what happened to each."""

    def __init__(self, patches: list[Patch]) -> None:
        ids = [p.id for p in patches]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise ValueError(f"duplicate patch ids: {sorted(dup)}")
        self.patches: dict[str, Patch] = {p.id: p for p in patches}
        self.status: dict[str, PatchStatus] = {
            p.id: PatchStatus(p.id, enabled=False, state=State.DISABLED)
            for p in patches
        }
        self._installers: dict[str, Installer] = {}
        self._lock = threading.RLock()
        self._env: Environment | None = None
        #: ids named explicitly in the selection (opt-in patches need this)
        self.explicit: set[str] = set()
        self.listeners: list[Callable[[PatchStatus], None]] = []

    # -- selection -------------------------------------------------------
    def enable(self, ids: set[str], explicit: set[str] | None = None) -> None:
        self.explicit = set(ids if explicit is None else explicit)
        for pid, st in self.status.items():
            if pid in ids and not st.enabled:
                st.enabled, st.state, st.reason = True, State.PENDING, ""
            elif pid not in ids and st.state is not State.APPLIED:
                st.enabled, st.state = False, State.DISABLED

    def environment(self) -> Environment:
        if self._env is None:
            self._env = detect_environment()
        return self._env

    # -- apply / revert --------------------------------------------------
    def is_applied(self, pid: str) -> bool:
        return self.status[pid].state is State.APPLIED

    def apply(self, pid: str, *, force: bool | None = None) -> PatchStatus:
        """Resolve and install one patch.  Idempotent; never raises."""
        patch, st = self.patches[pid], self.status[pid]
        with self._lock:
            if st.state is State.APPLIED:
                return st
            try:
                self._apply_locked(patch, st, force)
            except Exception as exc:  # one patch failing never stops the others
                st.state, st.reason = State.FAILED, f"{type(exc).__name__}: {exc}"
                logger.warning("vllm-layerwise-patch: %s failed: %s", pid, st.reason)
            self._notify(st)
            return st

    def _apply_locked(self, patch: Patch, st: PatchStatus, force: bool | None) -> None:
        st.reason, st.forced, st.verified_release = "", False, None
        if force is None:  # VLLM_LAYERWISE_PATCH_FORCE; an unknown id fails the patch
            force = patch.id in parse_selection(os.environ.get(FORCE_ENV), list(self.patches),
                                                list(self.patches), FORCE_ENV)
        env = self.environment()
        decision = resolve_declared(patch, env, explicit=patch.id in self.explicit)
        if decision is None:
            # Our own objects already in place (e.g. a second registry
            # instance or a reload): do not install twice.
            if installed_by(patch):
                st.state, st.reason = State.APPLIED, "already installed"
                return
            st.fingerprints = live_fingerprints(patch)
            decision = resolve_source(patch, st.fingerprints, env, force=force)
        if not decision.installs:
            st.state, st.reason = _outcome(patch, env, decision)
            if decision.verdict in (Verdict.NOT_APPLICABLE, Verdict.DRIFT):
                logger.warning("vllm-layerwise-patch: skipping %s: %s", patch.id, st.reason)
            return
        if decision.verdict is Verdict.FORCED:
            st.forced = True
            st.reason = f"FORCED over unverified source ({decision.detail})"
            logger.warning("vllm-layerwise-patch: %s %s", patch.id, st.reason)
        else:
            st.verified_release = decision.detail
        installer = Installer(patch, decision.release.release if decision.release else None)
        try:
            patch.install(installer)
        except Exception:
            installer.revert()
            raise
        self._installers[patch.id] = installer
        st.state = State.APPLIED
        logger.debug(
            "vllm-layerwise-patch: applied %s (%s) in pid %d",
            patch.id, st.verified_release or "forced", os.getpid(),
        )

    def revert(self, pid: str) -> None:
        with self._lock:
            inst = self._installers.pop(pid, None)
            if inst is not None:
                inst.revert()
            st = self.status[pid]
            if st.state is State.APPLIED:
                st.state = State.PENDING if st.enabled else State.DISABLED
                st.reason, st.verified_release, st.forced = "reverted", None, False
                st.self_check = None
                self._notify(st)

    def revert_all(self) -> None:
        for pid in list(self._installers):
            self.revert(pid)

    def verify_installed(self, pid: str) -> PatchStatus:
        """Check that an applied patch's objects are still the live ones (someone
        may have replaced a target after us); mark it failed if not."""
        st = self.status[pid]
        inst = self._installers.get(pid)
        if st.state is not State.APPLIED or inst is None:
            return st
        for rec in inst.installed:
            live = own_attribute(rec.parent, rec.attr)
            if patch_marker(live) != pid:
                owner = getattr(live, "__module__", "?")
                st.state = State.FAILED
                st.reason = (f"{getattr(rec.parent, '__qualname__', rec.parent)}.{rec.attr} "
                             f"was replaced after apply (now from {owner})")
                self._notify(st)
                break
        return st

    def run_self_check(self, pid: str) -> PatchStatus:
        st = self.status[pid]
        try:
            st.self_check_detail = self.patches[pid].self_check()
            st.self_check = "ok"
        except Exception as exc:
            st.self_check = "failed"
            st.self_check_detail = f"{type(exc).__name__}: {exc}"
        self._notify(st)
        return st

    def _notify(self, st: PatchStatus) -> None:
        for fn in self.listeners:
            try:
                fn(st)
            except Exception:
                logger.debug("status listener failed", exc_info=True)


#: the registry of this process's overlay, once activation built it; parts of
#: the overlay that only ask "is patch X applied here?" (the pool) read it
#: through :func:`process_is_applied`, so they need not import activation,
#: which imports every patch module
_process_registry: Registry | None = None


def set_process_registry(reg: Registry) -> None:
    global _process_registry
    _process_registry = reg


def process_is_applied(pid: str) -> bool:
    """Whether patch ``pid`` is applied in this process (False before the
    overlay's registry exists, as no patch can be applied then)."""
    reg = _process_registry
    return reg is not None and pid in reg.status and reg.is_applied(pid)

