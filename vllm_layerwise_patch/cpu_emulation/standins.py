"""Stand-ins for vLLM's Triton kernels in the CPU emulation, and their
installation.

On CPU, vLLM's Triton kernels run in the Triton interpreter, which costs tens
to hundreds of milliseconds a launch: timings then measure the interpreter,
not the pool.  A stand-in does the same thing with host code and is proven
byte-identical to the kernel by a test (``tests/test_torch_precopy.py``,
``tests/test_torch_postprocess.py``,
``tests/test_torch_zeroing.py``).  :class:`KernelStandIn` is launched like a
Triton kernel (``kernel[grid](*args, **constexprs)``, or called without a
grid); :class:`Installer` replaces the kernel's module global (and any other
module global holding the same object), only when the live kernel's sources
are the verified ones, and puts the originals back on :meth:`uninstall`.
vLLM's ``triton_utils.dispatcher.register_kernels`` is not used: its
``KernelOverride`` discards the launch grid and cannot be unregistered.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import time
from typing import Any, Callable


class KernelStandIn:
    """Launched like the Triton kernel it replaces.  Subclasses set
    ``KERNEL_MODULE``, ``KERNEL_NAME``, ``STATS`` (launches, bytes written,
    seconds) and ``default_impl``; ``impl(*args, grid=grid, **kwargs)``
    returns the bytes it wrote.  ``original`` is the replaced kernel; tests
    pass mutated ``impl``\\ s."""

    KERNEL_MODULE = ""
    KERNEL_NAME = ""
    STATS: dict[str, float] = {}

    @staticmethod
    def default_impl(*args: Any, grid: Any = None, **kwargs: Any) -> int:
        raise NotImplementedError

    def __init__(self, original: Any = None, impl: Callable[..., int] | None = None) -> None:
        self.original = original
        self.impl = impl or type(self).default_impl
        self._signature = inspect.signature(type(self).default_impl)
        self.__name__ = self.KERNEL_NAME
        self.__module__ = self.KERNEL_MODULE

    def __getitem__(self, grid: Any):
        return functools.partial(self._launch, grid)

    def __call__(self, *args: Any, **kwargs: Any) -> int:
        return self._launch(None, *args, **kwargs)

    def _launch(self, grid: Any, *args: Any, **kwargs: Any) -> int:
        bound = self._signature.bind(*args, **kwargs)
        t0 = time.perf_counter()
        moved = self.impl(*bound.args, grid=grid, **bound.kwargs)
        stats = self.STATS
        stats["seconds"] += time.perf_counter() - t0
        stats["launches"] += 1
        stats["bytes"] += moved
        return moved

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} standing in for "
                f"{self.KERNEL_MODULE}.{self.KERNEL_NAME}>")


def on_cpu(label: str, meta: dict[str, Any]) -> None:
    """Refuse a launch with a tensor off the CPU (this stand-in addresses
    host memory)."""
    import torch

    for name, value in meta.items():
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            raise RuntimeError(f"{label}: {name} is on {value.device}; this "
                               "stand-in addresses host memory (CPU emulation only)")


def grid3(grid: Any, meta: dict[str, Any]) -> tuple[int, int, int]:
    """A launch grid (1-3 ints, or a callable of the launch arguments as
    Triton takes it) as three ints."""
    if callable(grid):
        grid = grid(meta)
    grid = tuple(int(g) for g in grid)
    if not 1 <= len(grid) <= 3:
        raise ValueError(f"grid must have 1 to 3 dimensions, got {grid}")
    return grid + (1,) * (3 - len(grid))  # type: ignore[return-value]


def _attr(root: Any, dotted: str) -> Any:
    return functools.reduce(getattr, dotted.split("."), root)


class Installer:
    """Installs ``standin`` (a :class:`KernelStandIn` subclass) over its
    kernel when every object named in one entry of ``verified`` (release ->
    {dotted name in the kernel's module: sha256 of its source}) has that
    source; ``label`` names it in log lines, ``env`` is the variable that
    asks for it."""

    def __init__(self, standin: type[KernelStandIn], verified: dict[str, dict[str, str]],
                 label: str, env: str) -> None:
        self.standin, self.verified, self.label, self.env = standin, verified, label, env
        self._replaced: list[tuple[Any, str, Any]] = []  # (module, attribute, original)
        self._hooked = False

    def stats(self) -> dict[str, float]:
        """Launches of the stand-in in this process, bytes it wrote, seconds."""
        return dict(self.standin.STATS)

    def unverified(self, module: Any) -> str | None:
        """Why the live kernel is not one the stand-in reproduces (None: it is)."""
        from ..registry import fingerprint

        live = {}
        for name in next(iter(self.verified.values())):
            try:
                live[name] = fingerprint(_attr(module, name))
            except Exception as exc:  # noqa: BLE001 - absent or no source
                live[name] = f"unreadable ({type(exc).__name__})"
        if any(live == want for want in self.verified.values()):
            return None
        bad = [n for n, d in live.items()
               if all(want.get(n) != d for want in self.verified.values())]
        return (f"{', '.join(bad) or 'the combination'} not the verified source "
                f"(verified: {', '.join(self.verified)})")

    def install(self, module: Any = None) -> bool:
        """Replace the kernel in ``module`` (the kernel's own module by
        default) and in every other module global holding the same object.
        Idempotent; True when it installed.  Refuses, with one line on
        stderr, when the live kernel is not the verified one (the
        interpreted kernel then keeps running)."""
        name = self.standin.KERNEL_NAME
        mod = importlib.import_module(self.standin.KERNEL_MODULE) if module is None else module
        current = getattr(mod, name)
        if isinstance(current, self.standin):
            return False
        why = self.unverified(mod)
        if why is not None:
            print(f"vllm-layerwise-patch: {self.label} not installed: {why}", file=sys.stderr)
            return False
        from ..registry.installation import globals_holding

        standin = self.standin(original=current)
        for other, attr in globals_holding(current, besides=mod):
            self._replaced.append((other, attr, current))
            setattr(other, attr, standin)
        self._replaced.append((mod, name, current))
        setattr(mod, name, standin)
        return True

    def uninstall(self) -> None:
        """Put every replaced kernel object back."""
        while self._replaced:
            mod, attr, original = self._replaced.pop()
            setattr(mod, attr, original)

    def _summary(self) -> None:
        s = self.stats()
        if s["launches"]:
            print(f"vllm-layerwise-patch: {self.label}: {s['launches']} launches, "
                  f"{s['bytes']} bytes written, {s['seconds'] * 1e3:.1f} ms", file=sys.stderr)

    def install_on_import(self) -> None:
        """Install when the kernel's module is imported (at once if it
        already is) and print a one-line summary at exit: what the bootstrap
        calls when ``env`` asks for it."""
        if self._hooked:
            return
        self._hooked = True
        import atexit

        import wrapt

        def on_import(module: Any) -> None:
            if self.install(module):
                print(f"vllm-layerwise-patch: CPU emulation: {self.standin.KERNEL_NAME} "
                      f"runs as {self.label} ({self.env})", file=sys.stderr)

        atexit.register(self._summary)
        wrapt.register_post_import_hook(on_import, self.standin.KERNEL_MODULE)
