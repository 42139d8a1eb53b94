"""What every benchmark script writes: its results with the machine they were
measured on, as JSON (benchmarks/results/ by default)."""

from __future__ import annotations

import json
import os
import platform
from typing import Any


def machine() -> dict[str, Any]:
    import torch

    from vllm_layerwise_patch.bench.machine import cpu

    c = cpu()
    return {"cpus": os.cpu_count(), "cpu_model": c["model"], "cpu_isa": c["isa"],
            "python": platform.python_version(), "torch": torch.__version__}


def write(path: str, benchmark: str, results: list[dict[str, Any]], **extra: Any) -> None:
    doc = dict({"benchmark": benchmark, "machine": machine(), "results": results}, **extra)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"saved {path}")
