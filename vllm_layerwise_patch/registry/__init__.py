"""Patch declarations and their version-keyed resolution.

A patch is a declaration (:class:`Patch`): an id, the objects it targets, the
upstream releases whose target source it was verified against, and the code
that installs it.  Declaring a patch does nothing; :meth:`Registry.apply`
resolves it against the live vLLM and installs it only when every target's
source fingerprint matches a verified release (fail closed).  Everything
applied can be reverted (:meth:`Registry.revert`), which puts the original
objects back.  One module per concern, each readable on its own:

* :mod:`.declaration` - what a patch is (target, kind, documentation fields);
* :mod:`.fingerprints` - the per-release table and the live source digest;
* :mod:`.resolution` - which release a source matches, drift, opt-in, not
  applicable, FORCE; shared by the live apply and the version matrix;
* :mod:`.installation` - wrap, replace, kernel override, add; revert;
* :mod:`.plugins` - what a platform plugin (vllm-ascend) carries or bypasses,
  read from its source;
* :mod:`.patch_registry` - the registry: state per patch, idempotent apply.

The names below are this package's interface; import them from here.
"""

from ..envvars import FORCE_ENV
from .declaration import DOC_FIELDS, Environment, Kind, Patch, Target, Verified, parse_doc_fields
from .fingerprints import (
    RELEASES,
    TABLE_PATH,
    fingerprint,
    live_fingerprints,
    live_object,
    release_fingerprints,
    release_table,
    verified_on,
)
from .installation import Installer, mark, patch_marker, unwrap_ours
from .patch_registry import PatchStatus, Registry, State, process_is_applied, set_process_registry
from .resolution import (
    VLLM_DISTRIBUTIONS,
    Decision,
    Verdict,
    describe_drift,
    detect_environment,
    evaluate,
    evaluate_row,
    matching_release,
    nearest_release,
    release_environment,
    resolve_declared,
    resolve_source,
)

__all__ = [
    "DOC_FIELDS", "FORCE_ENV", "RELEASES", "TABLE_PATH", "VLLM_DISTRIBUTIONS",
    "Decision", "Environment", "Installer", "Kind", "Patch", "PatchStatus", "Registry",
    "State", "Target", "Verdict", "Verified",
    "describe_drift", "detect_environment", "evaluate", "evaluate_row", "fingerprint",
    "live_fingerprints", "live_object", "mark", "matching_release", "nearest_release",
    "process_is_applied", "set_process_registry",
    "parse_doc_fields", "patch_marker", "release_environment", "unwrap_ours",
    "release_fingerprints", "release_table", "resolve_declared", "resolve_source",
    "verified_on",
]
