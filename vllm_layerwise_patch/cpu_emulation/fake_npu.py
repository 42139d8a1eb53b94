"""NPU stand-in (a fake, named as such): run ``doctor`` as an NPU host with
vllm-ascend installed would, on a machine that has neither.

What is faked is only what cannot run here: the platform the registry
sees is ``npu``, and the vllm-ascend build is read from a wheel or an
unpacked tree (``--plugin vllm-ascend=PATH``; never imported, never
installed: importing vllm_ascend needs torch_npu and an NPU).  Everything
else is real: the installed vLLM (its target sources fingerprinted, the
patches that apply installed and self-checked), the plugin's own source (the
rules of :mod:`vllm_layerwise_patch.registry.plugins` read it as they read
an installed vllm-ascend's files).

    python -m vllm_layerwise_patch.cpu_emulation.fake_npu \\
        --plugin "vllm-ascend=vllm_ascend-0.26.0rc1-...whl" doctor --json

The plugin's version comes from its metadata (``*.dist-info/METADATA``).
"""

from __future__ import annotations

import argparse
import os
import sys


def plugin_build(name: str, path: str):
    """A ``PluginBuild`` for the wheel or tree at ``path``."""
    from ..registry.plugins import PluginBuild, TreeSource, WheelSource

    source = WheelSource(path) if os.path.isfile(path) else TreeSource(path)
    version = "unknown"
    for entry in source.names():
        if entry.endswith(".dist-info/METADATA"):
            for line in (source.read(entry) or "").splitlines():
                if line.startswith("Version:"):
                    version = line.split(":", 1)[1].strip()
            break
    return PluginBuild(name, version, source)


def install(plugins: list[tuple[str, str]]) -> None:
    """Make this process's registry see platform ``npu`` and ``plugins``."""
    import dataclasses

    from ..activation import registry

    reg = registry()
    env = reg.environment()  # the installed vLLM, detected as usual
    builds = tuple(plugin_build(name, path) for name, path in plugins)
    reg._env = dataclasses.replace(env, platform="npu", plugins=builds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_layerwise_patch.cpu_emulation.fake_npu",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--plugin", action="append", default=[], metavar="NAME=PATH",
                    help="a platform plugin's wheel or unpacked tree, e.g. vllm-ascend=X.whl")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="doctor and its options")
    args = ap.parse_args(argv)
    if args.rest[:1] != ["doctor"]:
        ap.error(f"the command after the options must be doctor, not {args.rest[:1]}")
    install([tuple(p.split("=", 1)) for p in args.plugin])
    # doctor itself, not the command line (``__main__``): that one dispatches
    # to the demo and bench too, which drive engines through ``testing``
    from .. import doctor

    dp = argparse.ArgumentParser(prog="doctor")
    doctor.add_arguments(dp)
    # as the command line does: vLLM logs to stdout, keep it for the report
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    return doctor.run(dp.parse_args(args.rest[1:]))


if __name__ == "__main__":
    sys.exit(main())
