"""Command line: ``python -m vllm_layerwise_patch COMMAND [options]``.

One argparse parser with a subcommand each; ``--help`` lists them all.
``doctor`` and ``list`` declare their options here through their modules'
``add_arguments``; ``demo``, ``bench``, ``pool`` and ``mooncake-local`` parse their own (their
arguments are passed on unchanged, so ``demo --help`` is the demo's help).
"""

from __future__ import annotations

import argparse
import os
import sys

PROG = "python -m vllm_layerwise_patch"


def _passthrough(sub, name: str, help: str) -> None:
    # no option of its own ("\0" prefix): every argument goes to the command
    p = sub.add_parser(name, help=help, add_help=False, prefix_chars="\0")
    p.add_argument("args", nargs=argparse.REMAINDER)


def build_parser() -> argparse.ArgumentParser:
    from . import doctor, listing

    ap = argparse.ArgumentParser(prog=PROG, description="vllm-layerwise-patch: an overlay "
                                 "for stock vLLM (hybrid models, layerwise KV pool).")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    doctor.add_arguments(sub.add_parser(
        "doctor", help="report environment, activation, every patch and the "
        "configuration; exit 0 only when all is well", description=doctor.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter))
    listing.add_arguments(sub.add_parser(
        "list", help="each patch's documentation fields", description=listing.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter))
    _passthrough(sub, "demo", "the CPU demo: tiny hybrid model, real vLLM V2 run "
                 "([--model-dir D] [--backend lmdb|mooncake]; see its --help)")
    _passthrough(sub, "bench", "time to first token with the pool vs vLLM's own prefix "
                 "cache, side by side: JSON, Markdown, plots (see its --help)")
    _passthrough(sub, "pool", "look inside a pool, check it, empty it (info|verify|clear "
                 "[PATH] [--config JSON]; see its --help)")
    _passthrough(sub, "mooncake-local", "a Mooncake Store master (and segment holder) on "
                 "loopback, for the mooncake backend (start|stop|status; see its --help)")
    sub.add_parser("sitecustomize-dir", help="print the directory to put on PYTHONPATH for "
                   "the opt-in sitecustomize bootstrap")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["help"]:
        argv = ["--help"]
    ap = build_parser()
    ns = ap.parse_args(argv)
    if ns.command is None:
        ap.print_help()
        return 2
    if ns.command == "doctor":
        # vLLM logs to stdout by default: keep stdout for the report alone.
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        from .doctor import run as doctor_run

        return doctor_run(ns)
    if ns.command == "list":
        from .listing import run as list_run

        return list_run(ns)
    if ns.command == "demo":
        from .demo import run

        return run(ns.args)
    if ns.command == "bench":
        from .bench import main as bench_main

        return bench_main(ns.args)
    if ns.command == "pool":
        from .pool_cli import main as pool_main

        return pool_main(ns.args)
    if ns.command == "mooncake-local":
        from .mooncake_local import main as mooncake_main

        return mooncake_main(ns.args)
    # sitecustomize-dir
    print(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sitecustomize"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
