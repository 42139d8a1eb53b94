"""Installing a patch's objects into vLLM and taking them out again.

An :class:`Installer` is handed to a patch's ``install`` and is the only way
patches change vLLM: :meth:`~Installer.wrap` (a wrapt ``FunctionWrapper``),
:meth:`~Installer.replace` (another object for the attribute),
:meth:`~Installer.override_kernel` (a Triton kernel swapped wherever the
module global was copied), :meth:`~Installer.add` (a new attribute).  Each
records exactly what the attribute held before, so :meth:`~Installer.revert`
puts the original objects back (descriptors included) or removes what was
added.  Everything installed carries a marker naming its patch
(:func:`patch_marker`): that is how a second apply recognises its own work
and how fingerprinting sees through our wrappers to the source below.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .declaration import Patch, Target

# Attribute set on every wrapper/replacement we install, so that apply can
# recognise its own work (idempotence) and fingerprinting can see through it.
# A wrapt proxy keeps its own attributes under the "_self_" prefix.
_MARKER = "_vlp_patch_id"


def mark(obj: Any, patch_id: str) -> None:
    """Mark ``obj`` as installed by ``patch_id`` (objects that take no
    attributes, e.g. builtins, stay unmarked: the status table then decides)."""
    try:
        setattr(obj, _MARKER, patch_id)
    except (AttributeError, TypeError):
        pass


def patch_marker(obj: Any) -> str | None:
    """The id of the patch that installed ``obj``, or None if it is not ours."""
    try:
        return getattr(obj, "_self" + _MARKER, None) or getattr(obj, _MARKER, None)
    except Exception:
        return None


def unwrap_ours(obj: Any) -> Any:
    """``obj`` with our own wrappers peeled off.  vLLM's own decorators
    (functools.wraps) stay: they are part of what is fingerprinted."""
    while patch_marker(obj) is not None and hasattr(obj, "__wrapped__"):
        obj = obj.__wrapped__
    return obj


def resolve_object(module: str, path: list[str]) -> Any:
    """The object reached from the imported ``module`` through ``path``."""
    obj: Any = importlib.import_module(module)
    for part in path:
        obj = getattr(obj, part)
    return obj


def resolve_parent(target: Target) -> tuple[Any, str]:
    """(the object holding the target, the target's attribute name)."""
    *path, attr = target.qualname.split(".")
    return resolve_object(target.module, path), attr


def own_attribute(parent: Any, attr: str) -> Any:
    """What ``parent`` itself holds under ``attr`` (None when inherited or absent)."""
    return vars(parent).get(attr) if hasattr(parent, "__dict__") else None


def globals_holding(obj: Any, besides: Any = None) -> list[tuple[Any, str]]:
    """``(module, name)`` of every loaded module's global that is ``obj``
    itself (a ``from ... import`` copy), leaving out module ``besides``."""
    found = []
    for mod_name, module in list(sys.modules.items()):
        ns = getattr(module, "__dict__", None)
        if not ns or module is besides or ns.get("__name__") != mod_name:
            continue
        found += [(module, name) for name, value in list(ns.items()) if value is obj]
    return found


def installed_by(patch: Patch) -> bool:
    """True when one of ``patch``'s targets already holds its own object
    (another registry instance, or a reload, installed it)."""
    for t in patch.targets:
        try:
            own = own_attribute(*resolve_parent(t))
        except Exception:
            continue
        if patch_marker(own) == patch.id:
            return True
    return False


@dataclasses.dataclass
class _Installed:
    parent: Any
    attr: str
    original: Any  # exactly what parent.__dict__[attr] held (descriptors kept)
    had_own: bool  # False when the attribute was inherited / absent on parent


class Installer:
    """Installs a patch's objects and remembers every original for revert."""

    resolve_parent = staticmethod(resolve_parent)

    def __init__(self, patch: Patch, release: str | None = None) -> None:
        self.patch = patch
        #: the verified release whose sources the live ones matched (None
        #: when forced): a patch whose replacement differs per release
        #: (bytewise-precopy-kernel) chooses by it
        self.release = release
        self.installed: list[_Installed] = []

    def _record(self, parent: Any, attr: str) -> None:
        own = vars(parent) if hasattr(parent, "__dict__") else {}
        self.installed.append(_Installed(parent, attr, own.get(attr), attr in own))

    def _set(self, parent: Any, attr: str, new: Any) -> None:
        self._record(parent, attr)
        mark(new, self.patch.id)
        setattr(parent, attr, new)

    def wrap(self, target: Target, wrapper: Callable[..., Any]) -> Any:
        """Wrap ``target`` with a wrapt ``FunctionWrapper(wrapped, instance, args,
        kwargs)``.  Signatures, ``__wrapped__`` and descriptors keep working."""
        import wrapt

        parent, attr = resolve_parent(target)
        self._record(parent, attr)
        proxy = wrapt.wrap_function_wrapper(parent, attr, wrapper)
        # on the proxy itself: a plain setattr would reach the wrapped original
        setattr(proxy, "_self" + _MARKER, self.patch.id)
        return proxy

    def replace(self, target: Target, new: Any) -> None:
        """Replace the attribute ``target`` with ``new`` (marked as ours)."""
        self._set(*resolve_parent(target), new)

    def override_kernel(self, target: Target, new: Any) -> None:
        """Replace the kernel ``target`` with ``new``, and every module global
        that holds the same kernel object (a ``from ... import`` copy), by
        identity; all recorded for revert."""
        parent, attr = resolve_parent(target)
        for module, name in globals_holding(getattr(parent, attr), besides=parent):
            self._set(module, name, new)
        self._set(parent, attr, new)

    def add(self, owner: Target, attr: str, obj: Any) -> None:
        """Add a new attribute ``attr`` to the object named by ``owner`` (which
        must not have it yet); removed again on revert.  Not a fingerprinted
        target: the patch's targets are what it changes."""
        parent = resolve_object(owner.module, owner.qualname.split("."))
        if hasattr(parent, attr):
            raise RuntimeError(f"{owner.qualname}.{attr} already exists upstream")
        self._set(parent, attr, obj)

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
