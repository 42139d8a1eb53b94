"""``python -m vllm_layerwise_patch pool info|verify|clear [PATH] [--config JSON]``:
look inside a pool, check it, empty it.

* ``info``: backend, capacity, bytes used, and per namespace its entries,
  blocks, bytes, TP ranks, oldest/newest access and description (model,
  vLLM release, dtypes, TP size, block size) - and who holds the pool open;
* ``verify``: read every entry, check its header, length, namespace, key
  (the digest in its header: a value stored under another key) and
  checksum (a progress bar on stderr), list the damaged groups (a block's
  pages of one kind on one rank and their marker); ``--drop`` removes them,
  so those blocks are recomputed and saved again;
* ``clear``: remove every entry, or one namespace's (``--namespace``); refused
  while an engine holds the pool - each one is named - unless ``--force``
  (an engine's loads of removed entries then fail and recompute).

PATH is the pool directory (the LMDB backend); ``--config`` takes the
connector's ``kv_connector_extra_config`` (or a whole ``--kv-transfer-config``)
as JSON text or a file, for ``shared_group`` or the Mooncake backend.  On
Mooncake only ``info`` works, and only partly: its client cannot list keys.
On the tiered backend every action works on its near tier (the lmdb pool of
``path``); ``info`` also says whether the far tier's master answers.

Exit status: 0 done; 1 damage found and not dropped, or the command refused
or failed; 2 usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

PROG = "python -m vllm_layerwise_patch pool"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="action", metavar="ACTION", required=True)
    helps = {"info": "what the pool holds, per namespace, and who holds it open",
             "verify": "check every entry (header, length, namespace, key, checksum)",
             "clear": "remove every entry, or one namespace's"}
    for name, text in helps.items():
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("path", nargs="?", help="the pool directory (default: the config's "
                       "path, else the per-user default)")
        p.add_argument("--config", metavar="JSON", help="kv_connector_extra_config (or a "
                       "whole kv-transfer-config) as JSON text or a file name")
        p.add_argument("--json", action="store_true", help="print a JSON document")
        if name == "verify":
            p.add_argument("--drop", action="store_true", help="remove the damaged groups")
            p.add_argument("--no-progress", action="store_true", help="no progress bar")
        if name in ("clear", "info"):
            p.add_argument("--namespace", metavar="HEX", help="one namespace (a unique "
                           "prefix is enough); on Mooncake, the namespace to look up")
        if name == "clear":
            p.add_argument("--force", action="store_true", help="clear even while engines "
                           "hold the pool (their loads of removed entries fail and recompute)")
    return ap


def load_config(text: str | None, path: str | None):
    """The pool configuration from ``--config`` and PATH (PATH wins)."""
    import os

    from .pool.config import PoolConfig

    raw: dict[str, Any] = {}
    if text:
        if os.path.isfile(text):
            with open(text) as f:
                text = f.read()
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise SystemExit(f"{PROG}: --config is neither JSON nor a file: {exc}") from None
        if not isinstance(raw, dict):
            raise SystemExit(f"{PROG}: --config: a JSON object is expected")
        raw = dict(raw.get("kv_connector_extra_config", raw))
    if path:
        raw["path"] = path
    return PoolConfig.from_extra(raw)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _print_info(doc: dict[str, Any]) -> None:
    from .pool.admin import summary
    from .pool.directory.holders import describe

    used, cap = doc["used_bytes"], doc["capacity_bytes"]
    n = doc.get("shards", 1)
    shards = f", {n} shards" if n > 1 else ""
    print(f"pool {doc['path']} (lmdb{shards})" if "far" not in doc else
          f"pool {doc['path']} (tiered: this lmdb pool is the near tier){shards}")
    if "far" in doc:
        far = doc["far"]
        print(f"  far tier  Mooncake master {far['master_address']} ("
              + ("reachable" if far["reachable"] else f"not reachable: it {far['why']}")
              + "); hits, far hits and promotions by tier: the engines' metrics")
    print(f"  capacity  {_size(cap)} (map size; data file {_size(doc['file_bytes'])})")
    print(f"  used      {_size(used)} in pages ({100 * used / cap if cap else 0:.1f} %), "
          f"{doc['entries']} entries")
    holders = doc.get("holders", [])
    print("  holders   " + ("none" if not holders else f"{len(holders)} engine process(es)"))
    for h in holders:
        print(f"    {describe(h)}")
    if not doc["namespaces"]:
        print("  (empty)")
    for ns, s in sorted(doc["namespaces"].items()):
        print(f"namespace {ns}")
        desc = summary(s["description"])
        if desc:
            print("  " + ", ".join(f"{k} {v}" for k, v in desc.items()))
        else:
            print("  (no description stored)")
        groups = ", ".join(f"{k} {v}" for k, v in sorted(s["groups"].items()))
        print(f"  {s['entries']} entries, {s['blocks']} blocks ({groups} groups; "
              f"{s['commit_markers']} commit markers; ranks {' '.join(s['ranks']) or '-'}), "
              f"{_size(s['bytes'])}")
        print(f"  access    oldest {_when(s['oldest_access'])}, newest "
              f"{_when(s['newest_access'])}")


def _mooncake_info(config, namespace: str | None, as_json: bool) -> int:
    from .pool.admin import describe_namespace, summary
    from .pool.backends.mooncake.backend import MooncakeBackend

    cannot = ("the Mooncake Store client cannot list keys, so entries, blocks, bytes and "
              "access times per namespace are not known here (the master's own metrics "
              "report the store's use); verify and clear need a key listing: not "
              "supported on Mooncake")
    backend = MooncakeBackend(config.mooncake, on_unavailable="fail")
    try:
        desc = describe_namespace(backend, namespace) if namespace else None
    finally:
        backend.close()
    doc = {"backend": "mooncake", "master_address": config.mooncake.master_address,
           "reachable": True, "namespace": namespace, "description": desc, "cannot": cannot}
    if as_json:
        print(json.dumps(doc, indent=1, sort_keys=True))
        return 0
    print(f"pool on Mooncake master {config.mooncake.master_address} (reachable)")
    if namespace:
        found = summary(desc)
        print(f"namespace {namespace}: " + (", ".join(f"{k} {v}" for k, v in found.items())
                                            if found else "no description stored"))
    else:
        print("  give --namespace HEX (an engine logs its namespace at startup) to read "
              "its description")
    print(f"  note: {cannot}")
    return 0


def _far_tier(mc) -> dict[str, Any]:
    """The far tier of a tiered pool: its master and whether it answers."""
    from .pool.backends.mooncake.connection import master_answers

    host, _, port = mc.master_address.rpartition(":")
    why = master_answers(host, int(port), mc.connect_timeout_seconds)
    return {"backend": "mooncake", "master_address": mc.master_address,
            "reachable": why is None, **({"why": why} if why else {})}


def _progress(total: int, enabled: bool):
    if not enabled:
        return None, lambda: None
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="entry", desc="verify", file=sys.stderr,
                   mininterval=0.5)
        return bar.update, bar.close
    except ImportError:  # tqdm comes with vLLM; a plain counter otherwise
        state = {"n": 0}

        def update(n: int) -> None:
            state["n"] += n
            if state["n"] % 1000 == 0 or state["n"] == total:
                print(f"verify: {state['n']}/{total} entries", file=sys.stderr)
        return update, lambda: None


def run(ns: argparse.Namespace) -> int:
    from .pool import admin
    from .pool.directory import holders
    from .pool.config import PoolConfigError

    try:
        config = load_config(ns.config, ns.path)
    except PoolConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if config.backend == "mooncake":
        if ns.action != "info":
            print(f"{PROG} {ns.action}: not supported on the Mooncake backend (its client "
                  "cannot list keys)", file=sys.stderr)
            return 1
        try:
            return _mooncake_info(config, ns.namespace, ns.json)
        except PoolConfigError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 1
    # tiered: the near tier is the lmdb pool of path; the far tier is Mooncake,
    # whose client cannot list keys (info says whether its master answers)
    ns.far = config.mooncake if config.backend == "tiered" else None
    path = config.path
    if path is None:  # the default (a fallback when another user holds it: name it)
        from .pool.directory.paths import default_path

        path = default_path()
    if ns.action == "clear":  # before the pool is even opened
        held = holders.holders(path)
        if held and not ns.force:
            print(f"{PROG} clear: refused: {len(held)} engine process(es) hold the pool at "
                  f"{path}:", file=sys.stderr)
            for h in held:
                print(f"  {holders.describe(h)}", file=sys.stderr)
            print("stop them first, or pass --force (their loads of removed entries then "
                  "fail and recompute)", file=sys.stderr)
            return 1
    try:
        backend = admin.open_pool(path, config.shared_group)
    except (admin.AdminError, PoolConfigError) as exc:
        print(f"{PROG} {ns.action}: {exc}", file=sys.stderr)
        return 1
    try:
        return _act(ns, backend, admin, holders)
    except admin.AdminError as exc:
        print(f"{PROG} {ns.action}: {exc}", file=sys.stderr)
        return 1
    finally:
        backend.close()


def _act(ns: argparse.Namespace, backend: Any, admin: Any, holders: Any) -> int:
    if ns.action == "info":
        doc = admin.info(backend)
        if ns.namespace:
            doc["namespaces"] = {k: v for k, v in doc["namespaces"].items()
                                 if k.startswith(ns.namespace)}
        doc["holders"] = holders.holders(backend.path)
        if getattr(ns, "far", None):  # (backend tiered: this is its near tier)
            doc.update(backend="tiered", tier="near", far=_far_tier(ns.far))
        if ns.json:
            print(json.dumps(doc, indent=1, sort_keys=True))
        else:
            _print_info(doc)
        return 0
    if ns.action == "verify":
        update, close = _progress(admin.count_entries(backend), not ns.no_progress)
        try:
            doc = admin.verify(backend, drop=ns.drop, progress=update)
        finally:
            close()
        if ns.json:
            print(json.dumps(doc, indent=1, sort_keys=True))
        else:
            print(f"checked {doc['checked']} entries: {doc['damaged_groups']} damaged group(s)"
                  + (" - dropped" if doc["dropped"] else ""))
            for group, bad in doc["damaged"].items():
                kinds = sorted({b["kind"] for b in bad})
                print(f"  {group}: {len(bad)} entr{'y' if len(bad) == 1 else 'ies'} "
                      f"({', '.join(kinds)})")
            if doc["damaged_groups"] and not doc["dropped"]:
                print("run again with --drop to remove them (those blocks are recomputed)")
        return 1 if doc["damaged_groups"] and not doc["dropped"] else 0
    doc = admin.clear(backend, ns.namespace)
    if ns.json:
        print(json.dumps(doc, indent=1, sort_keys=True))
    else:
        what = f"namespace {doc['namespace']}" if doc["namespace"] else "every namespace"
        print(f"cleared {what}: {doc['entries']} entries in {doc['groups']} groups removed "
              "(the data file keeps its size; LMDB reuses the pages)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    ns = ap.parse_args(sys.argv[1:] if argv is None else argv)
    return run(ns)
