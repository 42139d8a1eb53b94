"""What the ``check_*.py`` scripts of ``run_gpu_checks.sh`` share: the device
(CUDA, or CPU for the dry run), timing, the environment record, PASS/FAIL
lines and the JSON they write."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if os.environ.get("VLP_GPU_IMAGE_GUARD") == "1":  # dry runs: fail where the GPU would
    import gpu_image_guard

    gpu_image_guard.install()


class Checks:
    """PASS/FAIL lines and their record; ``exit_code()`` 0 (all passed) or 1."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def error(self, name: str, exc: BaseException) -> None:
        """A step that raised: a failed check with the error (the run goes on)."""
        import traceback

        traceback.print_exc()
        self.check(name, False, f"raised {type(exc).__name__}: {str(exc)[:500]}")

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        print(f"  {'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""),
              flush=True)
        self.rows.append({"check": name, "passed": bool(ok), "detail": detail})
        return ok

    @property
    def passed(self) -> bool:
        return all(r["passed"] for r in self.rows) and bool(self.rows)

    def exit_code(self) -> int:
        return 0 if self.passed else 1


def device(dry_run: bool):
    """CUDA, or CPU in a dry run; None (a setup error) otherwise."""
    import torch

    if torch.cuda.is_available() and not dry_run:
        return torch.device("cuda")
    if dry_run:
        return torch.device("cpu")
    return None


def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def environment() -> dict:
    """Python, torch, Triton, the device and the driver."""
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "host_cpus": os.cpu_count(),
           "machine": platform.machine()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, capability=f"{p.major}.{p.minor}",
                   multiprocessors=p.multi_processor_count,
                   device_memory_gib=round(p.total_memory / 2**30, 1))
    else:
        env["device"] = "cpu"
    return env


def pool_root(preferred: str | None, need_bytes: int) -> str | None:
    """``preferred`` (/dev/shm) when it has ``need_bytes`` free, else None
    (the temporary directory), saying so."""
    import shutil

    if preferred and os.path.isdir(preferred):
        free = shutil.disk_usage(preferred).free
        if free >= need_bytes:
            return preferred
        print(f"  note: {preferred} has {free >> 20} MiB free (< {need_bytes >> 20} MiB "
              "needed); the pool goes to the temporary directory instead", flush=True)
    return None


def median_seconds(fn, repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time of ``fn()`` (which must synchronise), after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def write_json(path: str | None, name: str, payload: dict) -> None:
    if not path:
        return
    out = {"check": name, "argv": sys.argv[1:], "environment": environment(), **payload}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1, sort_keys=False, default=str) + "\n")
    print(f"  (JSON: {path})", flush=True)
