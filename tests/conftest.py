"""Shared fixtures.  Tests run against the *installed* package (the .pth hook
and the entry point exist only in an installed wheel)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Engine processes (testing.engines) fork from one pre-imported server per
# test process instead of a fresh interpreter each: 5-10 s of CPU less per
# engine, the same start from vLLM's import on (testing/fork_server.py).  Set
# it to 0 to start every engine fresh.
os.environ.setdefault("VLP_ENGINE_FORK_SERVER", "1")

OVERLAY_VARS = (
    "VLLM_LAYERWISE_PATCH",
    "VLLM_LAYERWISE_PATCH_FORCE",
    "VLLM_LAYERWISE_PATCH_CPU_V2",
    "VLLM_LAYERWISE_PATCH_CPU_TORCH_PRECOPY",
    "VLLM_LAYERWISE_PATCH_CPU_TORCH_ZEROING",
    "VLLM_LAYERWISE_PATCH_REPORT_DIR",
)


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without any overlay variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in OVERLAY_VARS}
    env.update(extra)
    return env


def run_py(code: str, *, env: dict[str, str] | None = None, timeout: float = 600,
           check: bool = True, cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (site enabled, so .pth hooks run)."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=clean_env() if env is None else env,
        capture_output=True, text=True, timeout=timeout, cwd=cwd,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"subprocess failed ({proc.returncode})\nstdout:\n{proc.stdout[-4000:]}"
            f"\nstderr:\n{proc.stderr[-6000:]}"
        )
    return proc


def read_reports(directory: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


#: The default set's files by measured time, longest first (a stop's
#: ``--durations``; files not named follow in their own order).  With
#: ``--no-loadscope-reorder`` (scripts/test.sh) the two workers take files in
#: this order, so each ends on short ones instead of one worker running a
#: long file alone at the end.
LONGEST_FIRST = (
    "test_pool_e2e.py", "test_pool_failed_loads_e2e.py", "test_pool_faults.py",
    "test_doctor.py", "test_pool_mooncake.py", "test_pool_async_sched.py",
    "test_pool_weight_changes.py", "test_server.py", "test_torch_precopy.py",
    "test_hybrid_patches_e2e.py", "test_bytewise_precopy_kernel.py",
    "test_pool_admission_e2e.py", "test_pool_security.py", "test_pool_ops_server.py",
    "test_e2e_overlay.py", "test_pool_weights_during_load.py", "test_torch_postprocess.py",
    "test_patch_units.py", "test_activation.py", "test_pool_mooncake_objects.py",
    "test_torch_zeroing.py", "test_bench.py", "test_cpu_emulation.py", "test_pool_races.py",
    "test_e2e_release.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable)


@pytest.fixture(autouse=True)
def _no_overlay_env(monkeypatch):
    for k in OVERLAY_VARS:
        monkeypatch.delenv(k, raising=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from vllm_layerwise_patch.testing.tiny_model import build_tiny_qwen3_next

    return build_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-qwen3-next"))
