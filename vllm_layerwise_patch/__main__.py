"""Command line: ``python -m vllm_layerwise_patch {doctor,list,sitecustomize-dir}``."""

from __future__ import annotations

import sys


USAGE = """usage: python -m vllm_layerwise_patch COMMAND [options]

commands:
  doctor [--json] [--schema] [--engine-args "ARGS"]
                       report environment, activation, every patch and the
                       configuration; exit 0 only when all is well
  list [--markdown]    each patch's documentation fields
  demo [--model-dir D] [--backend lmdb|mooncake]
                       the CPU demo: tiny hybrid model, real vLLM V2 run
  mooncake-local start|stop|status [--rpc-port P] [--holder SIZE]
                       a Mooncake Store master (and segment holder) on
                       loopback, for the mooncake backend
  sitecustomize-dir    print the directory to put on PYTHONPATH for the
                       opt-in sitecustomize bootstrap
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "doctor":
        import os

        # vLLM logs to stdout by default: keep stdout for the report alone.
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        from .doctor import main as doctor_main

        return doctor_main(rest)
    if cmd == "list":
        from .listing import main as list_main

        return list_main(rest)
    if cmd == "demo":
        from .demo import run

        return run(rest)
    if cmd == "mooncake-local":
        from .mooncake_local import main as mooncake_main

        return mooncake_main(rest)
    if cmd == "sitecustomize-dir":
        import os

        print(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sitecustomize"))
        return 0
    print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
